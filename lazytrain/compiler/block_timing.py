"""Measured figures of one block program on this machine, the calibration a hardware profile carries.

``lazytrain profile --model`` and ``compile(..., calibrate=True)`` (``lazytrain/measure/calibrate.py``) time a model's
own block programs in LazyTrain's runtime and record their transients; ``HardwareProfile.calibration`` holds
them, and the cost model uses them instead of its modelled figures for every block they match.  A compiled
block's timing also carries its cuts' (``CutTiming``): the forward and backward each cut the compiler may choose
runs, so a cut's backward is priced as measured rather than scaled by its modelled recompute share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class CutTiming:
    """Measured seconds of one cut of a compiled block (``ir.Cut``, ``frontend/cuts.py``) other than the min-cut,
    at the ``BlockTiming``'s micro-batch: ``forward_s`` the forward that saves at this cut (what a kept or
    offloaded block runs), ``backward_s`` the backward that recomputes what the cut did not save.  ``budget`` and
    ``saved_bytes`` (per sample, as ``ir.Cut``) name the cut: a graph whose cut at that budget saves other bytes
    (another partitioner, other cut budgets) does not match and stays modelled."""

    budget: float
    saved_bytes: int
    forward_s: float
    backward_s: float
    samples: int

    @classmethod
    def from_json(cls, d, block: str) -> CutTiming:
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, dict) or set(d) != set(names):
            raise ValueError(f"block timing {block!r}: a cut's timing needs the fields {names}, got {d!r}")
        for k in ("forward_s", "backward_s"):
            if not _positive(d[k]):
                raise ValueError(f"block timing {block!r}: a cut's {k} must be a positive number, got {d[k]!r}")
        if not (_positive(d["budget"]) or d["budget"] == 0) or any(
                isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 0 for k in ("saved_bytes", "samples")):
            raise ValueError(f"block timing {block!r}: a cut's budget must be a number >= 0 and its saved_bytes and "
                             f"samples whole numbers >= 0, got {d!r}")
        return cls(**{**d, **{k: float(d[k]) for k in ("budget", "forward_s", "backward_s")}})


def _positive(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockTiming:
    """Measured seconds of one block program on this machine (``lazytrain profile --model``): forward,
    backward and recompute of one micro-batch, each the median over ``samples`` runs in LazyTrain's own
    runtime.  ``signature`` (``ModelGraph.block_signature``) names the block's structure, sequence length
    and dtype; ``block`` the block it was timed on, for people.  ``workspace_bytes`` and
    ``backward_workspace_bytes``: the largest transient its forward or recompute, and its backward, were
    measured to need at that micro-batch, in the terms of ``Sizes.workspace`` and ``Sizes.backward_workspace``
    (0: not measured; ``compiler/measured_workspace.py`` applies them).  The three seconds are the min-cut's
    for a compiled block; ``cuts``: its other cuts' (``CutTiming``; empty: none measured, or an eager block)."""

    signature: str
    block: str
    micro_batch: int
    seq_len: int
    forward_s: float
    backward_s: float
    recompute_s: float
    samples: int
    workspace_bytes: int = 0
    backward_workspace_bytes: int = 0
    cuts: tuple[CutTiming, ...] = ()

    def cut(self, budget: float, saved_bytes: int) -> CutTiming | None:
        """The measured timing of the cut at ``budget`` that saves ``saved_bytes`` a sample, if there is one."""
        return next((c for c in self.cuts if c.budget == budget and c.saved_bytes == saved_bytes), None)

    def scaled(self, forward: float, backward: float) -> BlockTiming:
        """This timing as a training step runs it (``HardwareProfile.step_forward_scale`` and
        ``step_backward_scale``): the forward programs (``forward_s``, and ``recompute_s``, which also prices a
        kept block's saving forward) times ``forward``, the backward times ``backward``; every cut's the same way."""
        if forward == 1.0 and backward == 1.0:
            return self
        cuts = tuple(dataclasses.replace(c, forward_s=c.forward_s * forward, backward_s=c.backward_s * backward)
                     for c in self.cuts)
        return dataclasses.replace(self, forward_s=self.forward_s * forward, backward_s=self.backward_s * backward,
                                   recompute_s=self.recompute_s * forward, cuts=cuts)

    @classmethod
    def from_json(cls, d) -> BlockTiming:
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        if not isinstance(d, dict) or not required <= set(d) <= names:
            raise ValueError(f"a block timing needs the fields {sorted(required)} (and may have "
                             f"{sorted(names - required)}), got {d!r}")
        for k in ("forward_s", "backward_s", "recompute_s"):
            if not _positive(d[k]):
                raise ValueError(f"block timing {d.get('block')!r}: {k} must be a positive number, got {d[k]!r}")
        for k in ("workspace_bytes", "backward_workspace_bytes"):
            ws = d.get(k, 0)
            if isinstance(ws, bool) or not isinstance(ws, int) or ws < 0:
                raise ValueError(f"block timing {d.get('block')!r}: {k} must be a whole number >= 0, got {ws!r}")
        if not isinstance(d.get("cuts", []), (list, tuple)):
            raise ValueError(f"block timing {d.get('block')!r}: cuts must be a list of cut timings, got {d['cuts']!r}")
        cuts = tuple(CutTiming.from_json(c, d.get("block")) for c in d.get("cuts", []))
        return cls(**{**d, **{k: float(d[k]) for k in ("forward_s", "backward_s", "recompute_s")}, "cuts": cuts})
