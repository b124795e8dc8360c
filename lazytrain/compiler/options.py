"""The compile's named choices, one enum each: the names the CLI offers, a plan and ``metrics.json`` record, and a
resumed run checks.  Each member is its own name as a string (``Policy.MILP == "milp"``), so a plan's JSON, a
run folder's settings and a caller's string all read as the member."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A named choice: printed, formatted and written to JSON as its value."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every member's value, in declaration order (argparse's ``choices``, an error's list)."""
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value, unknown: str):
        """``value`` (a member or its name) as the member, or the ``ValueError`` that begins with ``unknown`` (the
        words ``docs/errors.md`` lists, e.g. "unknown policy") and names the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{unknown} {value!r}; choose one of {', '.join(cls.names())}") from None


class Policy(Choice):
    """How the schedule is decided: the MILP, or the fixed heuristic of a system it is compared with."""
    MILP = "milp"
    MEGATRAIN = "megatrain"
    RECOMPUTE_ALL = "recompute-all"
    KEEP_ALL = "keep-all"


class Solver(Choice):
    """The MILP solver tried first (the other is tried where it fails)."""
    HIGHS = "highs"
    CBC = "cbc"


class LossHead(Choice):
    """How the fused LM head + cross-entropy forms its gradients (``frontend/loss_head.py``)."""
    AUTO = "auto"
    SINGLE_PASS = "single_pass"
    RECOMPUTE = "recompute"


class Optimizer(Choice):
    """The host optimizer a plan's host memory is priced for."""
    HYBRID8BIT = "hybrid8bit"
    #: the 8-bit optimizer with a bf16 master rounded stochastically (no master low half: 2 B/param less);
    #: updates on the host only, so the compiler plans no GPU-resident or GPU-updated block for it
    HYBRID8BIT_SR = "hybrid8bit-sr"
    #: the same optimizer with block-wise 4-bit moments (1 B/param less), with the exact master or the
    #: stochastic-rounding one; host updates only, as for hybrid8bit-sr
    HYBRID4BIT = "hybrid4bit"
    HYBRID4BIT_SR = "hybrid4bit-sr"
    ADAMW = "adamw"

    @property
    def eight_bit(self) -> bool:
        """Block-wise quantized moments, 8-bit or 4-bit: the Hybrid 8-bit AdamW (the host update's rate and the
        GPU's state bytes are the 8-bit ones)."""
        return self is not Optimizer.ADAMW

    @property
    def host_only(self) -> bool:
        """Updates only on the host: no GPU-resident or GPU-updated blocks."""
        return self in (Optimizer.HYBRID8BIT_SR, Optimizer.HYBRID4BIT, Optimizer.HYBRID4BIT_SR)

    @property
    def stochastic_rounding(self) -> bool:
        """A bf16 master rounded stochastically (``Hybrid8bitAdamW(stochastic_rounding=True)``)."""
        return self in (Optimizer.HYBRID8BIT_SR, Optimizer.HYBRID4BIT_SR)

    @property
    def moment_bits(self) -> int:
        """The width of the quantized moments' codes (``Hybrid8bitAdamW(moment_bits=)``); 32 for AdamW."""
        return 4 if self in (Optimizer.HYBRID4BIT, Optimizer.HYBRID4BIT_SR) else 8 if self.eight_bit else 32
