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

Answer formats (``formats.py``) write the same problems another way, named after the preset:
``tiny-pad-rev`` is ``tiny`` with ``23-9=14`` written ``23-09=410:14``.

    >>> ex = eval_examples(1)[0]
    >>> ex.text      # e.g. 'Q: Max has 19 pens. He finds 18 more. How many pens does Max have? A: 19+18=37'
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum
from itertools import islice

from .formats import PLAIN, SCRATCH_LEN, Equation, Format, parse_options


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

    def equations(self, d: Difficulty) -> list[Equation]:
        """``solution``'s equations as numbers, each with the widest its numbers can be under ``d`` (an
        answer format's ``pad`` fills to them: the same place holds the same width in every problem)."""
        w = _widths(d)
        out, count = [], self.start
        for i, step in enumerate(self.steps):
            after, left = step.apply(count), w["start"] if i == 0 else w["count"]
            if step.kind is StepKind.ADD_GROUPS:
                product = step.a * step.b
                out.append(Equation(step.a, "*", step.b, product, (w["factor"], w["factor"], w["product"])))
                out.append(Equation(count, "+", product, after, (left, w["product"], w["count"])))
            else:
                right = w["operand"] if step.kind in (StepKind.ADD, StepKind.SUB) else w["factor"]
                out.append(Equation(count, SIGN[step.kind], step.a, after, (left, right, w["count"])))
            count = after
        return out

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
    difficulty: Difficulty | None = None   # its answer format and number widths; None: the plain answer

    @property
    def prompt(self) -> str:
        """What the model is given; the worked answer follows it directly."""
        return f"Q: {self.question} A: "

    @property
    def solution(self) -> str:
        """What the model learns to write after the prompt: ``23+15=38`` (``Problem.solution``), or the
        same equations in the difficulty's answer format (``formats.py``)."""
        d = self.difficulty
        if d is None or d.fmt == PLAIN:
            return self.problem.solution
        return d.fmt.solution(self.problem.equations(d))

    def final_answer(self, reply: str | None) -> str | None:
        """The final number of a reply in this example's answer format (what exact match compares)."""
        d = self.difficulty
        return final_answer(reply) if d is None or d.fmt == PLAIN else d.fmt.final_answer(reply)

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
    fmt: Format = PLAIN            # how the answer (and question) is written (formats.py)
    base: Difficulty | None = None  # a format variant's plain preset: its problems, draws and split


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
    """A preset (``tiny``) or a preset in an answer format (``tiny-pad-rev``: ``formats.py``)."""
    if isinstance(spec, Difficulty):
        return spec
    if spec in PRESETS:
        return PRESETS[spec]
    name, *words = str(spec).split("-")
    if name not in PRESETS or not words:
        raise ValueError(f"unknown difficulty {spec!r}; presets: {', '.join(PRESETS)}, each with answer formats "
                         f"after it (tiny-pad-rev; formats.py)")
    return variant(PRESETS[name], parse_options(words, str(spec)))


def variant(base: Difficulty, fmt: Format) -> Difficulty:
    """``base``'s problems written in ``fmt``: the same draws, order and split (every stream is seeded by
    the base's name and keeps what the base keeps), rows as long as the format's longest example."""
    if fmt == PLAIN:
        return base
    v = replace(base, name=base.name + fmt.suffix, fmt=fmt, base=base, seq_len=0)
    return replace(v, seq_len=_longest_tokens(v))


def _widths(d: Difficulty) -> dict[str, int]:
    """The most digits each place of an equation can hold under ``d`` (``Problem.equations``)."""
    count = len(str(d.max_answer))
    return {"start": d.max_digits, "count": count, "operand": d.max_digits, "factor": len(str(d.factor_max)),
            "product": min(count, len(str(d.factor_max ** 2)))}


def _longest_tokens(d: Difficulty) -> int:
    """A bound on the tokens of ``d``'s longest example: the longest wording of the question with every
    number at its widest, then the longest answer, each step of its longest kind."""
    w, fmt = _widths(d), d.fmt
    steps, question = _templates(fmt.short)
    numbers = {"a": "9" * max(w["operand"], w["factor"]), "b": "9" * w["factor"]}
    step_words = max(len(t.format(P="She", **numbers)) for k in d.kinds for t in steps[k])
    words = (len(f"{max(NAMES, key=lambda n: len(n[0]))[0]} has {'9' * w['start']} {max(ITEMS, key=len)}.")
             + d.n_steps[1] * (step_words + 1) + 1
             + max(len(q.format(item=max(ITEMS, key=len), N="Zoe")) for q in question))

    def eq_len(left: int, right: int, result: int, op: str) -> int:
        scratch = SCRATCH_LEN if "carry" in fmt.options and op in "+-" else 0
        return left + right + 2 + scratch + fmt.result_len(result)

    answer = 0
    for i in range(d.n_steps[1]):
        left = w["start"] if i == 0 else w["count"]
        kinds = []
        for k in d.kinds:
            if k is StepKind.ADD_GROUPS:
                kinds.append(eq_len(w["factor"], w["factor"], w["product"], "*") + 2
                             + eq_len(left, w["product"], w["count"], "+"))
            else:
                right = w["operand"] if k in (StepKind.ADD, StepKind.SUB) else w["factor"]
                kinds.append(eq_len(left, right, w["count"], SIGN[k]))
        answer += max(kinds) + (2 if i else 0)
    return len("Q:  A: ") + words + answer + 2


# ---- drawing the arithmetic ------------------------------------------------------------------------

def step_operands(kind: StepKind, count: int, d: Difficulty) -> range | list[int] | None:
    """The first operands a step of ``kind`` may take from ``count`` (a range to draw from, or DIV's list
    of divisors), or None when the kind does not fit.  ADD_GROUPS's second operand: ``group_sizes``."""
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


def group_sizes(count: int, a: int, d: Difficulty) -> range:
    """ADD_GROUPS's second operand (``b`` packs of ``a``... ``a`` packs of ``b``) given the first."""
    return range(2, min(d.factor_max, (d.max_answer - count) // a) + 1)


def _draw_step(rng: random.Random, count: int, d: Difficulty) -> Step:
    options: list[Step] = []  # one candidate per feasible kind, so every kind is equally likely
    for kind in d.kinds:
        ops = step_operands(kind, count, d)
        if ops is None:
            continue
        a = rng.choice(ops) if isinstance(ops, list) else rng.randint(ops.start, ops.stop - 1)
        b = rng.randint(2, group_sizes(count, a, d).stop - 1) if kind is StepKind.ADD_GROUPS else 1
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


#: ``short``'s wording (formats.py): the same choices as the tables above, one for one (so a short
#: question is drawn with the same random numbers as the long one), in fewer words
SHORT_TEMPLATES = {
    StepKind.ADD: ("Buys {a}.", "Finds {a}.", "Gets {a}."),
    StepKind.SUB: ("Gives {a}.", "Loses {a}.", "Sells {a}."),
    StepKind.ADD_GROUPS: ("Buys {a} packs of {b}.", "Gets {a} bags of {b}."),
    StepKind.MUL: ("Then has {a} times as many.",),
    StepKind.DIV: ("Keeps 1/{a}.",),
}
SHORT_QUESTIONS = ("How many now?", "How many?", "How many {item}?")


def _templates(short: bool) -> tuple[dict, tuple[str, ...]]:
    return (SHORT_TEMPLATES, SHORT_QUESTIONS) if short else (STEP_TEMPLATES, QUESTIONS)


def _choose(problem: Problem, rng: random.Random) -> tuple[int, ...]:
    """The wording's random choices (name, item, one template a step, question), as indices into the
    tables: one draw each, whatever the tables hold, so both wordings consume the same random numbers."""
    picks = [rng.choice(range(len(NAMES))), rng.choice(range(len(ITEMS)))]
    picks += [rng.choice(range(len(STEP_TEMPLATES[step.kind]))) for step in problem.steps]
    return (*picks, rng.choice(range(len(QUESTIONS))))


def _words(problem: Problem, picks: tuple[int, ...], short: bool = False) -> str:
    steps, questions = _templates(short)
    name, pronoun = NAMES[picks[0]]
    item = ITEMS[picks[1]]
    sentences = [f"{name} has {problem.start} {item}."]
    for step, i in zip(problem.steps, picks[2:-1]):
        sentences.append(steps[step.kind][i].format(P=pronoun, a=step.a, b=step.b))
    sentences.append(questions[picks[-1]].format(item=item, N=name))
    return " ".join(sentences)


def phrase(problem: Problem, rng: random.Random, *, short: bool = False) -> str:
    return _words(problem, _choose(problem, rng), short)


def n_tokens(ex: Example) -> int:
    """Length under the char tokenizer: one token a character, plus bos and eos."""
    return len(ex.text) + 2


# ---- the two splits --------------------------------------------------------------------------------

def _examples(rng: random.Random, d: Difficulty, want_eval: bool) -> Iterator[Example]:
    """The stream of ``d``: a format variant keeps exactly the draws its plain preset keeps (the plain
    wording and answer fit the preset's rows), so it sees the same problems in the same order."""
    draw = d.base or d
    while True:
        problem = draw_problem(rng, draw)
        if problem.in_eval != want_eval:
            continue
        picks = _choose(problem, rng)
        plain = Example(problem=problem, question=_words(problem, picks), answer=str(problem.answer))
        if n_tokens(plain) > draw.seq_len:
            continue
        if d.base is None and d.fmt == PLAIN:
            yield plain
        else:
            yield Example(problem=problem, question=_words(problem, picks, d.fmt.short), answer=plain.answer,
                          difficulty=d)


def train_examples(difficulty: str | Difficulty = "easy", *, seed: int = 0) -> Iterator[Example]:
    """An endless, seeded stream of train problems (repeats allowed; none is ever an eval problem)."""
    d = get_difficulty(difficulty)
    return _examples(random.Random(f"train/{(d.base or d).name}/{seed}"), d, want_eval=False)


def drill_examples(difficulty: str | Difficulty = "easy", *, seed: int = 0) -> Iterator[Example]:
    """A second train stream, independent of ``train_examples``'s (its own seeded draws), for the bare
    worked answers that fill the rows' padding (``data.Drills``); train problems only, like that one."""
    d = get_difficulty(difficulty)
    return _examples(random.Random(f"drill/{(d.base or d).name}/{seed}"), d, want_eval=False)


def eval_examples(n: int, difficulty: str | Difficulty = "easy", *, seed: int = 0) -> list[Example]:
    """``n`` distinct eval problems (distinct arithmetic), the same list for the same arguments.
    ``check_eval_size`` says whether there are ``n`` (else this would draw for ever)."""
    d = get_difficulty(difficulty)
    seen: set[str] = set()
    out: list[Example] = []
    for ex in _examples(random.Random(f"eval/{(d.base or d).name}/{seed}"), d, want_eval=True):
        if ex.problem.key not in seen:
            seen.add(ex.problem.key)
            out.append(ex)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


def take_train(n: int, difficulty: str | Difficulty = "easy", *, seed: int = 0) -> list[Example]:
    return list(islice(train_examples(difficulty, seed=seed), n))
