"""Attention in the cost model: its FLOPs as the fused kernel does them, counted apart from the matmuls.

A block's attention runs as one fused kernel (flash / cuDNN SDPA on the GPU; on ``meta`` the trace runs
the CPU flash kernel's meta function, ``trace_export.sdpa``).  Such a kernel computes ``Q Kᵀ`` and
``P V`` tile by tile and never writes the score matrix:

- forward: ``2 · (2 · b · h · s_q · s_k · d)`` for full attention; with ``is_causal`` the tiles above
  the diagonal are skipped, **half** that (an explicit mask tensor, as sliding-window or ALiBi models
  pass, is computed in full);
- backward: the kernel recomputes the scores from the saved log-sum-exp (one product) and runs four
  more (``dV``, ``dP``, ``dQ``, ``dK``): **2.5x the forward**, the count FlashAttention's and cuDNN's
  published rates use, so their rates apply to it as they are;
- saved for backward: the output and the log-sum-exp (``b · h · s_q`` fp32), never the ``s²`` scores;
  the backward's transient is an fp32 accumulator of ``dQ`` (``DQ_ACCUMULATOR_BYTES`` per element of Q)
  beside the gradients themselves.

``FlopCounterMode``'s own formulas count the full square in both directions and 2x for backward; the
trace counts with ``AttentionCount.mapping()`` instead and keeps the attention share of each block's
FLOPs (``Block.attn_fwd_flops`` / ``attn_bwd_flops``), its head dimension and key length, so the cost
model prices it at the attention rate of the hardware profile (``HardwareProfile.attention_seconds``)
and the rest at the matmul rate.
"""

from __future__ import annotations

import torch

from .trace_export import sdpa

aten = torch.ops.aten

#: the fused kernels' backward keeps dQ in fp32 while it accumulates over key tiles (FlashAttention-2 and
#: cuDNN both): 4 bytes per element of Q, beside the gradients themselves
DQ_ACCUMULATOR_BYTES = 4
#: backward FLOPs per forward FLOP: the scores recomputed, then dV, dP, dQ, dK (5 products against 2)
BACKWARD_RATIO = 2.5


def forward_flops(q_shape, k_shape, v_shape, causal: bool) -> int:
    """``Q Kᵀ`` and ``P V`` of one fused attention call; half for causal (the skipped upper triangle)."""
    b, h, s_q, d = q_shape[-4:] if len(q_shape) >= 4 else (1, *q_shape)
    s_k, d_v = k_shape[-2], v_shape[-1]
    full = 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v
    return full // 2 if causal else full


class AttentionCount:
    """Attention FLOPs and shapes seen while ``FlopCounterMode`` runs with ``mapping()``: per call, the
    forward and backward counted as the kernel does them (module docstring), and the head dimension and
    key length of the longest call (what the rate is looked up by)."""

    def __init__(self) -> None:
        self.fwd_flops = 0
        self.bwd_flops = 0
        self.head_dim = 0
        self.kv_len = 0

    def _forward(self, query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
        n = forward_flops(query, key, value, bool(is_causal) and kwargs.get("attn_mask") is None)
        self.fwd_flops += n
        if key[-2] >= self.kv_len:
            self.kv_len, self.head_dim = key[-2], query[-1]
        return n

    def _backward(self, grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
                  out_shape=None, **kwargs) -> int:
        n = int(BACKWARD_RATIO * forward_flops(query, key, value, bool(is_causal) and kwargs.get("attn_mask") is None))
        self.bwd_flops += n
        return n

    def _efficient_forward(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                           *args, out_shape=None, **kwargs) -> int:
        return self._forward(query, key, value, dropout_p, is_causal, attn_mask=attn_bias)

    def _efficient_backward(self, grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                            dropout_p=0.0, grad_input_mask=None, is_causal=False, *args, out_shape=None,
                            **kwargs) -> int:
        return self._backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_bias)

    def mapping(self) -> dict:
        """``custom_mapping`` for ``FlopCounterMode``: the fused attention ops the trace runs on ``meta`` (the
        memory-efficient kernel where V's head dimension differs from Q's, ``trace_export.sdpa``)."""
        return {aten._scaled_dot_product_flash_attention_for_cpu: self._forward,
                aten._scaled_dot_product_flash_attention_for_cpu_backward: self._backward,
                aten._scaled_dot_product_efficient_attention: self._efficient_forward,
                aten._scaled_dot_product_efficient_attention_backward: self._efficient_backward}


def is_attention(target) -> bool:
    """Is this fx call target a fused attention (``trace_export.sdpa`` or the aten op it stands for)?"""
    return target is sdpa or target is aten.scaled_dot_product_attention.default
