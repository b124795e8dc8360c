"""Answer formats of the built-in task (``tasks/formats.py``): each rewrites the worked answer, keeps the
problems, their order and the train/eval split, and exact match reads the final number back."""

import dataclasses
import re

import pytest
from test_tasks import oracle

from lazytrain.tasks import (
    PRESETS,
    CharTokenizer,
    Example,
    Problem,
    Step,
    StepKind,
    encode_example,
    eval_examples,
    exact_match,
    get_difficulty,
    predict,
)
from lazytrain.tasks.arith import drill_examples, n_tokens, take_train
from lazytrain.tasks.eval_size import check_eval_size, eval_problem_count

TOK = CharTokenizer()
#: every format the task sweep screens, and a few on the harder presets (multi-step, products, quotients)
VARIANTS = ("tiny-pad", "tiny-rev", "tiny-lsb", "tiny-carry", "tiny-short", "tiny-pad-rev", "tiny-pad-lsb",
            "tiny-pad-carry", "tiny-pad-lsb-short", "easy-pad-rev-carry", "medium-pad-lsb", "hard-carry-short")


def reverse_read(text: str, fmt: set[str]) -> list[tuple[int, str, int, int]]:
    """The equations of a formatted answer, read by a parser of its own: (left, op, right, result)."""
    out = []
    for eq in text.split(", "):
        m = re.fullmatch(r"(\d+)([-+*/])(\d+)=(\[[^]]*\])?(\d+)(?::(\d+))?", eq)
        assert m, (eq, text)
        left, op, right, scratch, digits, echo = m.groups()
        assert (scratch is not None) == ("carry" in fmt and op in "+-"), eq
        assert (echo is not None) == ("rev" in fmt), eq
        value = int(digits[::-1]) if fmt & {"rev", "lsb"} else int(digits)
        if echo is not None:
            assert int(echo) == value and not echo.startswith("0") or echo == "0", eq
        if scratch:         # the units column: two-digit sum, or the borrowed minuend's units
            a, b = int(left) % 10, int(right) % 10
            assert scratch == (f"[{a}+{b}={a + b:02d}]" if op == "+" else f"[{int(a < b)}{a}-{b}={(a - b) % 10}]"), eq
        out.append((int(left), op, int(right), value))
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_writes_the_same_arithmetic_and_reads_its_answer_back(name):
    d = get_difficulty(name)
    base = PRESETS[name.split("-")[0]]
    fmt = set(name.split("-")[1:])
    assert d.name == name and d.base is base and d.seq_len >= 1
    train, plain = take_train(400, d, seed=1), take_train(400, base, seed=1)
    # the same problems in the same order, written another way
    assert [e.problem for e in train] == [e.problem for e in plain]
    assert [e.answer for e in train] == [e.answer for e in plain]
    widths = set()
    for ex, p in zip(train, plain):
        assert ex.final_answer(ex.solution) == ex.answer
        # the equations are the plain answer's, number for number
        ref = [(int(a), op, int(b), int(c)) for a, op, b, c in re.findall(r"(\d+)([-+*/])(\d+)=(\d+)", p.solution)]
        assert reverse_read(ex.solution, fmt) == ref, (ex.solution, p.solution)
        assert (ex.question == p.question) == ("short" not in fmt)
        assert n_tokens(ex) == len(encode_example(ex, TOK)[0]) <= d.seq_len
        if "pad" in fmt:    # fixed widths: the first equation's numbers always the same width
            widths.add(tuple(len(x) for x in re.match(r"(\d+)[-+*/](\d+)=(?:\[[^]]*\])?(\d+)", ex.solution).groups()))
    assert len(widths) <= (1 if d.kinds == base.kinds == PRESETS["tiny"].kinds else 3)


@pytest.mark.parametrize("name", ["tiny-pad-rev", "tiny-pad-lsb-short", "easy-carry"])
def test_variant_keeps_the_split_and_the_eval_problems(name):
    d, base = get_difficulty(name), PRESETS[name.split("-")[0]]
    evals = eval_examples(200, d, seed=3)
    assert [e.problem for e in evals] == [e.problem for e in eval_examples(200, base, seed=3)]
    train = take_train(3000, d) + list(e for _, e in zip(range(500), drill_examples(d)))
    assert all(e.problem.in_eval for e in evals) and not any(e.problem.in_eval for e in train)
    assert not {e.problem.key for e in evals} & {e.problem.key for e in train}
    assert not {e.prompt for e in evals} & {e.prompt for e in train}
    if name.startswith("tiny"):
        assert eval_problem_count(d, 10_000) == eval_problem_count(base, 10_000)
        with pytest.raises(ValueError, match="distinct eval problems"):
            check_eval_size(eval_problem_count(base, 10_000) + 1, d)


def test_formats_spelled_out():
    """The formats as the docstring shows them, on problems with a borrow and a carry."""
    def first(name, start, op, a):
        problem = Problem(start=start, steps=(Step(kind=StepKind(op), a=a),))
        d = get_difficulty(name)
        return Example(problem=problem, question="", answer=str(problem.answer),
                       difficulty=None if d.base is None else d)
    cases = {"tiny": "23-9=14", "tiny-pad": "23-09=014", "tiny-rev": "23-9=41:14", "tiny-lsb": "23-9=41",
             "tiny-carry": "23-9=[13-9=4]14", "tiny-pad-rev": "23-09=410:14", "tiny-pad-lsb": "23-09=410",
             "tiny-pad-carry": "23-09=[13-9=4]014"}
    for name, want in cases.items():
        assert first(name, 23, "sub", 9).solution == want
    assert first("tiny-carry", 47, "add", 38).solution == "47+38=[7+8=15]85"
    assert first("tiny-rev", 99, "add", 99).solution == "99+99=891:198"
    short = take_train(50, "tiny-short")
    assert all(e.prompt.startswith("Q: ") and e.prompt.endswith("? A: ") for e in short)
    assert max(len(e.question) for e in short) < 50 < max(len(e.question) for e in take_train(50, "tiny"))


@pytest.mark.parametrize("name", ["tiny-rev", "tiny-lsb", "tiny-pad-lsb", "tiny-carry", "easy-pad-rev-carry"])
def test_exact_match_reads_the_format(name):
    examples = eval_examples(6 if name.startswith("easy") else 16, name)     # (the oracle is slow on long rows)
    assert exact_match(oracle(examples), examples, 8) == 1.0
    assert predict(oracle(examples), examples, 8) == [ex.solution for ex in examples]
    # the plain answer: its final number is read reversed under lsb (right only for a palindrome), has no
    # ":" number under rev, and is the number under carry (as a bare answer is under the plain format)
    plain = oracle(examples, lambda ex: ex.problem.solution)
    palindromes = sum(ex.answer == ex.answer[::-1] for ex in examples) / len(examples)
    want = palindromes if "lsb" in name else 0.0 if "rev" in name else 1.0
    assert exact_match(plain, examples, 8) == pytest.approx(want) and (0 < palindromes < 1 or "lsb" not in name)
    off = oracle(examples, _one_more)       # the final number one higher, in the same format
    assert exact_match(off, examples, 8) == 0.0


def _one_more(ex) -> str:
    d = ex.difficulty
    *before, last = ex.problem.equations(d)
    return d.fmt.solution([*before, dataclasses.replace(last, result=last.result + 1)])


@pytest.mark.parametrize("reply, name, want", [
    ("23-9=41:14", "tiny-rev", "14"), ("23-9=41:014", "tiny-rev", "014"), ("23-9=41", "tiny-rev", None),
    ("23-9=41:1:4", "tiny-rev", None), ("23-09=410", "tiny-pad-lsb", "14"), ("23-09=014", "tiny-pad", "14"),
    ("23-9=[13-9=4]14", "tiny-carry", "14"), ("23-9=[13-9=4]", "tiny-carry", None), ("23-9=14", "tiny", "14"),
    ("23-9=014", "tiny", "014"), ("23-9=1x", "tiny-lsb", None), (None, "tiny-rev", None), ("41", "tiny-lsb", "14"),
])
def test_final_answer_of_a_reply(reply, name, want):
    ex = take_train(1, name)[0]
    assert ex.final_answer(reply) == want


@pytest.mark.parametrize("bad, match", [
    ("tiny-upside", "unknown answer format 'upside'"), ("tiny-rev-rev", "twice"), ("tiny-rev-lsb", "choose one"),
    ("huge-rev", "unknown difficulty"), ("tiny-", "unknown answer format ''"), ("rev", "unknown difficulty"),
])
def test_bad_names(bad, match):
    with pytest.raises(ValueError, match=match):
        get_difficulty(bad)


def test_options_in_any_order_name_one_variant():
    d = get_difficulty("tiny-rev-pad")
    assert d.name == "tiny-pad-rev" and d == get_difficulty("tiny-pad-rev")
    assert take_train(5, d)[0].solution == take_train(5, "tiny-pad-rev")[0].solution
