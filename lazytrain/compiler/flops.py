"""FLOP counts of a transformer layer and the attention rate's dependence on head dimension: the formulas the
hardware profile prices compute with (``hardware.py``'s module docstring says how), kept apart from the profile's
figures so the trace's counters and the profile share one definition."""

from __future__ import annotations

import math


def attention_flops(batch: int, seq: int, hidden: int, *, causal: bool = True, backward: bool = False) -> float:
    """FLOPs of a fused attention over ``seq`` queries and keys: ``4*batch*seq**2*hidden`` forward, halved if
    causal, 2.5x that backward (``hidden``: the query width, ``n_heads * head_dim``)."""
    forward = 4.0 * batch * seq * seq * hidden / (2 if causal else 1)
    return forward * 2.5 if backward else forward


def layer_flops(params: int, batch: int, seq: int, hidden: int, *, causal: bool = True) -> float:
    """Forward FLOPs of one transformer layer: ``2*params*tokens`` of matmuls + ``attention_flops``."""
    return 2.0 * params * batch * seq + attention_flops(batch, seq, hidden, causal=causal)


#: the attention rate by head dimension relative to 128, (forward, backward), from the same published cuDNN
#: figures on the H100: head dim 64 reaches 413 / 595 TFLOP/s forward and ~0.85 of 128's backward; 256
#: reaches 509 / 539 forward (backward taken equal).  Between the points: linear in log2(head dim).
ATTENTION_HEAD_DIM_FACTOR = {64: (0.69, 0.85), 128: (1.0, 1.0), 256: (0.94, 0.94)}


def head_dim_factor(head_dim: int, backward: bool) -> float:
    """``ATTENTION_HEAD_DIM_FACTOR`` at ``head_dim``: interpolated in log2, held at the ends."""
    points = sorted(ATTENTION_HEAD_DIM_FACTOR.items())
    k = 1 if backward else 0
    if head_dim <= points[0][0]:
        return points[0][1][k]
    for (d0, f0), (d1, f1) in zip(points, points[1:]):
        if head_dim <= d1:
            t = (math.log2(head_dim) - math.log2(d0)) / (math.log2(d1) - math.log2(d0))
            return f0[k] + t * (f1[k] - f0[k])
    return points[-1][1][k]
