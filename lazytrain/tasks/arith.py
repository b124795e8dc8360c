"""Arithmetic word problems, generated: a task of the MetaMathQA kind that needs no download.

A problem is a starting count and a few steps applied in order; its answer is the count after the
last step. The English is templated from the numbers, so the numbers of ``Problem`` are the numbers
of the question, in order::

    problem  ::= start step*                   -- count := start, then each step in order
    step     ::= add a | sub a                 -- count + a | count - a (never below zero)
               | add_groups a b                -- count + a * b   ("buys a packs of b")
               | mul a | div a                 -- count * a | count / a (a divides count exactly)

Train and eval never share a problem: a stable hash of the arithmetic alone (start and steps, not
the names, items or wording) puts every problem in one split, whatever the seed or difficulty. So an
eval problem's arithmetic never appears in train under any wording.

The model writes a worked answer, one equation per operation, as MetaMathQA's answers show their
working before the result; exact match compares the number after the last ``=`` with the answer::

    Q: Mia has 23 pens. She buys 4 packs of 6. She sells 9. How many pens now? A: 4*6=24, 23+24=47, 47-9=38

Why worked: measured with the task GPT (4 layers, d 128) on the "tiny" preset, 2 CPU threads, exact
match on 200 eval problems.  The bare answer (``A: 37``) reached 14.4% after 9 minutes with learned
positions and 9.0% with rotary ones; the worked answer 13.5% after 4 minutes with learned positions
and 84.5% after 5 minutes with rotary ones (plain PyTorch loop, same model and data), every miss
an arithmetic slip, not a misread number.  The equation makes the model first copy the two numbers
and the operation next to each other, each a supervised step, and then do the arithmetic on
neighbours at fixed relative offsets, which rotary positions make the same wherever the sentence
puts them; neither change helps much alone.

    >>> ex = eval_examples(1)[0]
    >>> ex.text      # e.g. 'Q: Max has 19 pens. He finds 18 more. How many pens does Max have? A: 19+18=37'
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from functools import cache
from itertools import islice


class StepKind(Enum):
    # the count grows
    ADD = "add"                # count + a
    ADD_GROUPS = "add_groups"  # count + a * b
    MUL = "mul"                # count * a
    # the count shrinks
    SUB = "sub"                # count - a, a <= count
    DIV = "div"                # count / a, a divides count


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    kind: StepKind
    a: int
    b: int = 1  # only ADD_GROUPS uses it

    def apply(self, count: int) -> int:
        if self.kind is StepKind.ADD:
            return count + self.a
        if self.kind is StepKind.ADD_GROUPS:
            return count + self.a * self.b
        if self.kind is StepKind.MUL:
            return count * self.a
        if self.kind is StepKind.SUB:
            return count - self.a
        assert count % self.a == 0, (count, self)
        return count // self.a

    def __str__(self) -> str:
        operands = f"{self.a} {self.b}" if self.kind is StepKind.ADD_GROUPS else f"{self.a}"
        return f"{self.kind.value} {operands}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    start: int
    steps: tuple[Step, ...]

    @property
    def answer(self) -> int:
        count = self.start
        for step in self.steps:
            count = step.apply(count)
        return count

    @property
    def solution(self) -> str:
        """The worked answer, one equation per operation: ``23+4*6`` is ``4*6=24, 23+24=47``."""
        parts, count = [], self.start
        for step in self.steps:
            after = step.apply(count)
            if step.kind is StepKind.ADD_GROUPS:
                parts.append(f"{step.a}*{step.b}={step.a * step.b}")
                parts.append(f"{count}+{step.a * step.b}={after}")
            else:
                parts.append(f"{count}{SIGN[step.kind]}{step.a}={after}")
            count = after
        return ", ".join(parts)

    @property
    def key(self) -> str:
        """The arithmetic alone, one line: ``37 ; add_groups 4 12 ; sub 19``."""
        return " ; ".join([str(self.start), *map(str, self.steps)])

    @property
    def in_eval(self) -> bool:
        """Which split this problem belongs to; fixed by the arithmetic, never by a seed."""
        digest = hashlib.sha256(f"lazytrain.arith/{self.key}".encode()).digest()
        return int.from_bytes(digest[:8], "little") % 100 < EVAL_PERCENT


EVAL_PERCENT = 10  # share of the problem space reserved for eval
SIGN = {StepKind.ADD: "+", StepKind.SUB: "-", StepKind.MUL: "*", StepKind.DIV: "/"}


def final_answer(solution: str | None) -> str | None:
    """The number a worked answer ends with (after its last ``=``; a bare number is its own answer),
    or None if it ends with something else."""
    last = (solution or "").rsplit("=", 1)[-1]
    return last if last.isascii() and last.isdigit() else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Example:
    problem: Problem
    question: str  # the English
    answer: str    # str(problem.answer): what exact match compares with

    @property
    def prompt(self) -> str:
        """What the model is given; the worked answer follows it directly."""
        return f"Q: {self.question} A: "

    @property
    def solution(self) -> str:
        """What the model learns to write after the prompt: ``23+15=38`` (``Problem.solution``)."""
        return self.problem.solution

    @property
    def text(self) -> str:
        """The training sequence without bos/eos: ``Q: ... A: 23+15=38`` (the tokenizer adds the eos)."""
        return self.prompt + self.solution


@dataclass(frozen=True, slots=True, kw_only=True)
class Difficulty:
    name: str
    n_steps: tuple[int, int]       # inclusive range of steps per problem
    max_digits: int                # start, and ADD/SUB operands, have at most this many digits
    factor_max: int                # ADD_GROUPS, MUL and DIV operands lie in 2..factor_max
    kinds: tuple[StepKind, ...]    # always includes ADD and SUB, so some step always fits
    max_answer: int                # every count along the way stays in 0..max_answer
    seq_len: int                   # tokens (chars + bos + eos) of the longest example; longer draws are redrawn


PRESETS = {
    d.name: d for d in (
        Difficulty(name="tiny", n_steps=(1, 1), max_digits=2, factor_max=9,
                   kinds=(StepKind.ADD, StepKind.SUB), max_answer=198, seq_len=88),
        Difficulty(name="easy", n_steps=(1, 2), max_digits=2, factor_max=9,
                   kinds=(StepKind.ADD, StepKind.SUB, StepKind.ADD_GROUPS), max_answer=999, seq_len=144),
        Difficulty(name="medium", n_steps=(2, 3), max_digits=2, factor_max=9,
                   kinds=(StepKind.ADD, StepKind.SUB, StepKind.ADD_GROUPS, StepKind.MUL, StepKind.DIV),
                   max_answer=999, seq_len=184),
        Difficulty(name="hard", n_steps=(3, 4), max_digits=3, factor_max=12,
                   kinds=(StepKind.ADD, StepKind.SUB, StepKind.ADD_GROUPS, StepKind.MUL, StepKind.DIV),
                   max_answer=9999, seq_len=244),
    )
}


def get_difficulty(spec: str | Difficulty) -> Difficulty:
    if isinstance(spec, Difficulty):
        return spec
    if spec not in PRESETS:
        raise ValueError(f"unknown difficulty {spec!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[spec]


# ---- drawing the arithmetic ------------------------------------------------------------------------

def _operands(kind: StepKind, count: int, d: Difficulty) -> range | list[int] | None:
    """The first operands a step of ``kind`` may take from ``count`` (a range to draw from, or DIV's list
    of divisors), or None when the kind does not fit.  ADD_GROUPS's second operand: ``_groups``."""
    top, room = 10 ** d.max_digits - 1, d.max_answer - count
    if kind is StepKind.ADD:
        return range(1, min(top, room) + 1) if room >= 1 else None
    if kind is StepKind.SUB:
        return range(1, min(top, count) + 1) if count >= 1 else None
    if kind is StepKind.ADD_GROUPS:
        return range(2, min(d.factor_max, room // 2) + 1) if room >= 4 else None
    if kind is StepKind.MUL:
        ok = count >= 1 and count * 2 <= d.max_answer
        return range(2, min(d.factor_max, d.max_answer // max(count, 1)) + 1) if ok else None
    divisors = [a for a in range(2, d.factor_max + 1) if count % a == 0] if count >= 2 else []
    return divisors or None


def _groups(count: int, a: int, d: Difficulty) -> range:
    """ADD_GROUPS's second operand (``b`` packs of ``a``... ``a`` packs of ``b``) given the first."""
    return range(2, min(d.factor_max, (d.max_answer - count) // a) + 1)


def _draw_step(rng: random.Random, count: int, d: Difficulty) -> Step:
    options: list[Step] = []  # one candidate per feasible kind, so every kind is equally likely
    for kind in d.kinds:
        ops = _operands(kind, count, d)
        if ops is None:
            continue
        a = rng.choice(ops) if isinstance(ops, list) else rng.randint(ops.start, ops.stop - 1)
        b = rng.randint(2, _groups(count, a, d).stop - 1) if kind is StepKind.ADD_GROUPS else 1
        options.append(Step(kind=kind, a=a, b=b))
    return rng.choice(options)


def draw_problem(rng: random.Random, d: Difficulty) -> Problem:
    count = start = rng.randint(1, 10 ** d.max_digits - 1)
    steps = []
    for _ in range(rng.randint(*d.n_steps)):
        steps.append(_draw_step(rng, count, d))
        count = steps[-1].apply(count)
    return Problem(start=start, steps=tuple(steps))


# ---- the English -----------------------------------------------------------------------------------

NAMES = (("Tom", "He"), ("Ann", "She"), ("Sam", "He"), ("Mia", "She"), ("Ben", "He"), ("Zoe", "She"),
         ("Leo", "He"), ("Ivy", "She"), ("Max", "He"), ("Eva", "She"))
ITEMS = ("apples", "pens", "coins", "books", "eggs", "cards", "shells", "stamps", "nuts", "beads")
STEP_TEMPLATES = {
    StepKind.ADD: ("{P} buys {a} more.", "{P} finds {a} more.", "{P} gets {a} more."),
    StepKind.SUB: ("{P} gives away {a}.", "{P} loses {a}.", "{P} sells {a}."),
    StepKind.ADD_GROUPS: ("{P} buys {a} packs of {b}.", "{P} gets {a} bags of {b}."),
    StepKind.MUL: ("{P} then has {a} times as many.",),
    StepKind.DIV: ("{P} keeps 1/{a} of them.",),
}
QUESTIONS = ("How many {item} now?", "How many does {N} have?", "How many {item} does {N} have?")


def phrase(problem: Problem, rng: random.Random) -> str:
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    sentences = [f"{name} has {problem.start} {item}."]
    for step in problem.steps:
        sentences.append(rng.choice(STEP_TEMPLATES[step.kind]).format(P=pronoun, a=step.a, b=step.b))
    sentences.append(rng.choice(QUESTIONS).format(item=item, N=name))
    return " ".join(sentences)


def n_tokens(ex: Example) -> int:
    """Length under the char tokenizer: one token a character, plus bos and eos."""
    return len(ex.text) + 2


# ---- the two splits --------------------------------------------------------------------------------

def _examples(rng: random.Random, d: Difficulty, want_eval: bool) -> Iterator[Example]:
    while True:
        problem = draw_problem(rng, d)
        if problem.in_eval != want_eval:
            continue
        ex = Example(problem=problem, question=phrase(problem, rng), answer=str(problem.answer))
        if n_tokens(ex) <= d.seq_len:
            yield ex


def train_examples(difficulty: str | Difficulty = "easy", *, seed: int = 0) -> Iterator[Example]:
    """An endless, seeded stream of train problems (repeats allowed; none is ever an eval problem)."""
    d = get_difficulty(difficulty)
    return _examples(random.Random(f"train/{d.name}/{seed}"), d, want_eval=False)


def drill_examples(difficulty: str | Difficulty = "easy", *, seed: int = 0) -> Iterator[Example]:
    """A second train stream, independent of ``train_examples``'s (its own seeded draws), for the bare
    worked answers that fill the rows' padding (``data.Drills``); train problems only, like that one."""
    d = get_difficulty(difficulty)
    return _examples(random.Random(f"drill/{d.name}/{seed}"), d, want_eval=False)


def eval_examples(n: int, difficulty: str | Difficulty = "easy", *, seed: int = 0) -> list[Example]:
    """``n`` distinct eval problems (distinct arithmetic), the same list for the same arguments.
    ``check_eval_size`` says whether there are ``n`` (else this would draw for ever)."""
    d = get_difficulty(difficulty)
    seen: set[str] = set()
    out: list[Example] = []
    for ex in _examples(random.Random(f"eval/{d.name}/{seed}"), d, want_eval=True):
        if ex.problem.key not in seen:
            seen.add(ex.problem.key)
            out.append(ex)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


# ---- how many eval problems a difficulty has -------------------------------------------------------

#: the largest eval set: exact match's standard error is at most 0.5 / sqrt(n), 0.5% at 10,000 problems,
#: and the task GPT evaluated 500 problems in 12-24 s on the 2-core machine, so 10,000 take 4-8 minutes
MAX_EVAL_SIZE = 10_000


def all_problems(d: Difficulty) -> Iterator[Problem]:
    """Every problem ``draw_problem`` can draw for ``d``, each once, in a fixed order."""
    def steps_from(count: int, left: int) -> Iterator[tuple[Step, ...]]:
        if left == 0:
            yield ()
            return
        for kind in d.kinds:
            for a in _operands(kind, count, d) or ():
                for b in (_groups(count, a, d) if kind is StepKind.ADD_GROUPS else (1,)):
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
        if p.in_eval and _shortest_tokens(p) <= d.seq_len:
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


def take_train(n: int, difficulty: str | Difficulty = "easy", *, seed: int = 0) -> list[Example]:
    return list(islice(train_examples(difficulty, seed=seed), n))
