"""Measured figures of one block program on this machine, the calibration a hardware profile carries.

``lazytrain profile --model`` and ``compile(..., calibrate=True)`` (``lazytrain/calibrate.py``) time a model's
own block programs in LazyTrain's runtime and record their transients; ``HardwareProfile.calibration`` holds
them, and the cost model uses them instead of its modelled figures for every block they match.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockTiming:
    """Measured seconds of one block program on this machine (``lazytrain profile --model``): forward,
    backward and recompute of one micro-batch, each the median over ``samples`` runs in LazyTrain's own
    runtime.  ``signature`` (``ModelGraph.block_signature``) names the block's structure, sequence length
    and dtype; ``block`` the block it was timed on, for people.  ``workspace_bytes`` and
    ``backward_workspace_bytes``: the largest transient its forward or recompute, and its backward, were
    measured to need at that micro-batch, in the terms of ``Sizes.workspace`` and ``Sizes.backward_workspace``
    (0: not measured; ``compiler/measured_workspace.py`` applies them)."""

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

    @classmethod
    def from_json(cls, d) -> BlockTiming:
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        if not isinstance(d, dict) or not required <= set(d) <= names:
            raise ValueError(f"a block timing needs the fields {sorted(required)} (and may have "
                             f"{sorted(names - required)}), got {d!r}")
        for k in ("forward_s", "backward_s", "recompute_s"):
            if isinstance(d[k], bool) or not isinstance(d[k], (int, float)) or not d[k] > 0:
                raise ValueError(f"block timing {d.get('block')!r}: {k} must be a positive number, got {d[k]!r}")
        for k in ("workspace_bytes", "backward_workspace_bytes"):
            ws = d.get(k, 0)
            if isinstance(ws, bool) or not isinstance(ws, int) or ws < 0:
                raise ValueError(f"block timing {d.get('block')!r}: {k} must be a whole number >= 0, got {ws!r}")
        return cls(**{**d, **{k: float(d[k]) for k in ("forward_s", "backward_s", "recompute_s")}})
