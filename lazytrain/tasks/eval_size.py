"""How many eval problems a difficulty has, and whether ``--eval-size`` asks for more: counted by
enumerating the problem space in a fixed order (never drawn: a draw for a missing problem never ends).

A format variant (``formats.py``) has its plain preset's problems, so it counts those.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

from .arith import (
    ITEMS,
    NAMES,
    QUESTIONS,
    STEP_TEMPLATES,
    Difficulty,
    Problem,
    Step,
    StepKind,
    get_difficulty,
    group_sizes,
    step_operands,
)

#: the largest eval set: exact match's standard error at most 0.5%, in minutes on 2 cores [ledger: eval-size]
MAX_EVAL_SIZE = 10_000


def all_problems(d: Difficulty) -> Iterator[Problem]:
    """Every problem ``draw_problem`` can draw for ``d``, each once, in a fixed order."""
    def steps_from(count: int, left: int) -> Iterator[tuple[Step, ...]]:
        if left == 0:
            yield ()
            return
        for kind in d.kinds:
            for a in step_operands(kind, count, d) or ():
                for b in (group_sizes(count, a, d) if kind is StepKind.ADD_GROUPS else (1,)):
                    step = Step(kind=kind, a=a, b=b)
                    for rest in steps_from(step.apply(count), left - 1):
                        yield (step, *rest)
    for n in range(d.n_steps[0], d.n_steps[1] + 1):
        for start in range(1, 10 ** d.max_digits):
            for steps in steps_from(start, n):
                yield Problem(start=start, steps=steps)


def _shortest_tokens(problem: Problem) -> int:
    """Tokens of the problem's shortest wording (``phrase`` with the shortest name, pronoun, item,
    templates and question): the problem can be drawn for a sequence that long.  Every template names
    each of its step's numbers once, so the numbers add their digits to a floor that depends only on
    the kinds of the steps."""
    numbers = [problem.start, *(x for s in problem.steps for x in ((s.a, s.b) if s.kind is StepKind.ADD_GROUPS
                                                                  else (s.a,)))]
    return (_wording_floor(tuple(s.kind for s in problem.steps)) + sum(len(str(x)) - 1 for x in numbers)
            + len(f"Q:  A: {problem.solution}") + 2)


@cache
def _wording_floor(kinds: tuple[StepKind, ...]) -> int:
    """Characters of the shortest question for steps of these kinds, every number written as one digit."""
    best = None
    for name, pronoun in NAMES:
        steps = sum(min(len(t.format(P=pronoun, a=0, b=0)) for t in STEP_TEMPLATES[k]) for k in kinds)
        for item in ITEMS:
            q = min(len(t.format(item=item, N=name)) for t in QUESTIONS)
            words = len(f"{name} has 0 {item}.") + steps + q + len(kinds) + 1
            best = words if best is None else min(best, words)
    return best


def eval_problem_count(d: Difficulty, at_least: int) -> int:
    """Distinct eval problems of ``d`` that fit its ``seq_len``, counted up to ``at_least`` (the count
    stops there: a large space is never enumerated to its end)."""
    n = 0
    for p in all_problems(d):
        if p.in_eval and _shortest_tokens(p) <= (d.base or d).seq_len:     # a variant keeps its base's
            n += 1
            if n >= at_least:
                break
    return n


def check_eval_size(n: int, difficulty: str | Difficulty) -> None:
    """``eval_examples(n, difficulty)`` ends (there are ``n`` distinct eval problems) and is not absurd."""
    d = get_difficulty(difficulty)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"--eval-size must be a positive whole number, got {n!r}")
    if n > MAX_EVAL_SIZE:
        raise ValueError(f"--eval-size {n:,} is more than an exact match needs (at most {MAX_EVAL_SIZE:,}: a "
                         f"standard error of 0.5%)")
    have = eval_problem_count(d, n)
    if have < n:
        raise ValueError(f"--eval-size {n:,}: the {d.name!r} task has only {have:,} distinct eval problems; ask for "
                         f"at most that, or a harder --difficulty")
