"""How a task's worked answer is written: the answer formats a difficulty name can ask for.

The plain worked answer (``tasks/arith.py``) writes each equation as a reader would, ``23-9=14``.  A small
transformer learns to copy the equation in a few hundred steps but the arithmetic much later: the
result's first digit is written first, and it depends on the carry (or borrow) of the units column,
which is computed nowhere before it.  Each option below rewrites the answer so that every digit the
model writes depends on digits it has already seen at fixed offsets; exact match still compares the
final number, read back by ``Format.final_answer``::

    option  what it changes                                           23-9 becomes
    pad     every number zero-padded to the widest it can be          23-09=014
    rev     the result least-significant digit first, then the number 23-9=41:14
    lsb     the result least-significant digit first, nothing else    23-9=41
    carry   the units column worked before the result of + and -      23-9=[13-9=4]14   47+38=[7+8=15]85
    short   a shorter question (``arith.SHORT_TEMPLATES``)            Mia has 23 pens. Sells 9. How many?

Options combine in the order above (``tiny-pad-rev``); ``rev`` and ``lsb`` exclude each other.  ``rev``
writes the number after the reversed digits (not padded), so a later equation, or a reader, sees it as
usual; ``lsb`` leaves even that out.  The carry scratch writes a subtraction's units as the borrowed
minuend (``13-9=4``: a borrow; ``09-3=6``: none) and an addition's as its two-digit sum (``7+8=15``, ``3+4=07``),
so the carry is a digit written before the result's own digits.  Products and quotients get no scratch.

Formats change only how an example is written: the problems, their order in every stream and the
train/eval split are the plain difficulty's (``arith.variant``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the options, in the order a difficulty name lists them
OPTIONS = ("pad", "rev", "lsb", "carry", "short")
#: characters of the carry scratch: ``[13-9=4]`` and ``[7+8=15]``
SCRATCH_LEN = 8


@dataclass(frozen=True, slots=True)
class Equation:
    """One equation of a worked answer: ``left op right = result``; ``widths`` are the most digits each
    number can have in its place (what ``pad`` fills to)."""
    left: int
    op: str                         # "+", "-", "*" or "/"
    right: int
    result: int
    widths: tuple[int, int, int]    # left, right, result


@dataclass(frozen=True, slots=True)
class Format:
    options: frozenset[str] = frozenset()

    @property
    def suffix(self) -> str:
        """``-pad-rev``: what the options add to a difficulty's name ("" when plain)."""
        return "".join(f"-{o}" for o in OPTIONS if o in self.options)

    @property
    def short(self) -> bool:
        return "short" in self.options

    def equation(self, eq: Equation) -> str:
        pad = "pad" in self.options
        left, right, result = (str(x).zfill(w) if pad else str(x)
                               for x, w in zip((eq.left, eq.right, eq.result), eq.widths))
        scratch = _scratch(eq) if "carry" in self.options and eq.op in "+-" else ""
        if "rev" in self.options:
            result = f"{result[::-1]}:{eq.result}"
        elif "lsb" in self.options:
            result = result[::-1]
        return f"{left}{eq.op}{right}={scratch}{result}"

    def solution(self, equations: list[Equation]) -> str:
        """The worked answer: the equations, comma-separated, each written in this format."""
        return ", ".join(self.equation(eq) for eq in equations)

    def result_len(self, width: int) -> int:
        """The most characters a result of ``width`` digits takes (``rev`` writes it twice)."""
        return 2 * width + 1 if "rev" in self.options else width

    def final_answer(self, reply: str | None) -> str | None:
        """The final number of a reply written in this format, as ``str(int)`` writes it (the reference
        answer's form), or None when its last equation does not end in a result of this format.  Only
        the final number counts: a ``rev`` reply's reversed digits and a scratch are not checked."""
        tail = (reply or "").rsplit("=", 1)[-1]
        if "carry" in self.options and "]" in tail:         # the scratch's own "=": its result follows "]"
            tail = tail.split("]", 1)[1]
        if "rev" in self.options:
            if tail.count(":") != 1:
                return None
            tail = tail.split(":")[1]
        elif "lsb" in self.options:
            tail = tail[::-1]
        if not (tail.isascii() and tail.isdigit()):
            return None
        if "pad" in self.options:
            return str(int(tail))
        return tail     # a plain reply with leading zeros ("014") does not match the reference's "14"


PLAIN = Format()


def parse_options(words: list[str], name: str) -> Format:
    """The format a difficulty name's words after the preset ask for (``["rev", "pad"]``: pad and rev)."""
    unknown = [w for w in words if w not in OPTIONS]
    if unknown:
        raise ValueError(f"unknown answer format {unknown[0]!r} in {name!r}; formats: {', '.join(OPTIONS)} "
                         f"(e.g. tiny-pad-rev)")
    if len(set(words)) != len(words):
        raise ValueError(f"{name!r} names an answer format twice")
    if {"rev", "lsb"} <= set(words):
        raise ValueError(f"{name!r}: rev and lsb both reverse the result; choose one")
    return Format(frozenset(words))


def _scratch(eq: Equation) -> str:
    """The units column of ``+`` or ``-``: ``[7+8=15]`` (the carry is the first digit), ``[13-9=4]`` (a
    borrow: 1 written before the minuend's units digit)."""
    a, b = eq.left % 10, eq.right % 10
    if eq.op == "+":
        return f"[{a}+{b}={a + b:02d}]"
    borrow = int(a < b)
    return f"[{borrow}{a}-{b}={10 * borrow + a - b}]"
