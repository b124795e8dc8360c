"""Measured transients in the memory model: a calibrated block's workspace is at least what it was seen to need.

The trace prices a block's transients on meta tensors (``frontend/trace.py``): the forward's from the live
values' peak and the largest op's footprint, the backward's from twice that footprint (an op's values next to
their gradients).  A GPU kernel can need more than either (workspaces the meta run never allocates, another
algorithm at another shape), and a plan that underestimates a transient runs out of memory where it was
promised to fit [ledger: backward-workspace].

Calibration (``calibrate.measure_blocks``) records each block program's transients in the runtime at the plan's
shape (``BlockTiming.workspace_bytes``, ``backward_workspace_bytes``); this module carries them into the graph
the compiler, the verifier and the runtime read: ``graph.meta["measured_workspace"][j]`` and
``["measured_backward_workspace"][j]`` are block j's per-sample figures where a measurement raised them, and
``Sizes`` takes the larger of each and the traced one.  The block's signature, which names its timings, is
left as it is.
"""

from __future__ import annotations

import dataclasses
import math

from ..ir import ModelGraph
from .hardware import HardwareProfile

#: (BlockTiming field, Block field it raises, graph.meta key it is written to)
FIGURES = (("workspace_bytes", "workspace_bytes", "measured_workspace"),
           ("backward_workspace_bytes", "backward_workspace_bytes", "measured_backward_workspace"))


def with_measured_workspace(graph: ModelGraph, hw: HardwareProfile) -> ModelGraph:
    """``graph`` with ``meta["measured_workspace"]`` / ``["measured_backward_workspace"]`` set where ``hw`` has a
    measured transient above the traced one for a block's signature (per sample: less the block's fixed
    workspace, over the measured micro-batch; the largest over that signature's measurements); the graph as it
    is where none does."""
    meta = dict(graph.meta)
    for timing_field, block_field, key in FIGURES:
        per_sample = [0] * graph.n_blocks
        for j, b in enumerate(graph.blocks):
            sig = graph.block_signature(j)
            traced = max(b.workspace_bytes, getattr(b, block_field))
            for t in hw.calibration:
                measured = getattr(t, timing_field)
                if t.signature == sig and measured:
                    need = math.ceil(max(0, measured - b.workspace_fixed_bytes) / t.micro_batch)
                    if need > traced:
                        per_sample[j] = max(per_sample[j], need)
        if any(per_sample):
            meta[key] = per_sample
    return graph if meta == graph.meta else dataclasses.replace(graph, meta=meta)
