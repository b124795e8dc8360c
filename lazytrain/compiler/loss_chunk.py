"""The fused loss head's chunk (``frontend/loss_head.py``): how many logits exist at once, and whether the head
runs in a single pass, from the GPU budget.

The rule: the largest power of two of logits whose bytes stay within ``LOSS_HEAD_SHARE`` of the GPU budget,
and never more than one sample's logits (``seq_len x vocab``: at micro-batch 1 that is the whole head in one
chunk, and a larger chunk would only be priced, never used).  Why a share and not a search: the chunk buys
nothing but fewer, larger GEMMs, and from a few thousand vocabulary columns on a chunk's matmuls already run
at full rate, while every byte it holds is a byte the MILP cannot spend on kept activations.  The chunk's
cost is in the graph the solver sees: its time in the head's backward FLOPs (the recompute of every chunk's
logits, one forward's worth: ``trace``), its memory as the head's fixed workspace, set here.

The single pass (the gradients formed in the forward, the chunk's rows taking the whole vocabulary) saves that
recompute, 2·N·V·d FLOPs, for a ``vocab x hidden`` fp32 weight-gradient accumulator held from the head's
forward to its backward.  The rule: single pass where the accumulator takes at most ``SINGLE_PASS_SHARE`` of
the GPU budget and a chunk holds at least ``SINGLE_PASS_MIN_ROWS`` rows (fewer, and its matmuls shrink).  Its
FLOPs move into the head's forward, its accumulator into the head's fixed workspace: the solver and the
calibration (whose block signature includes the FLOPs) see the head that runs.
"""

from __future__ import annotations

import dataclasses

from ..ir import ModelGraph

#: share of the GPU budget one chunk of logits may take: at 24 GiB (21.3 GiB of budget) that is 2^27 logits,
#: 0.75 GiB in bf16, 4096 vocabulary columns a chunk for 32 x 1024 tokens
LOSS_HEAD_SHARE = 1 / 16
#: share of the GPU budget the single pass's weight-gradient accumulator may take (on top of the chunk's):
#: qwen2.5-7b's (2.0 GiB) at 48 GiB and more, qwen2.5-3b's (1.2 GiB) from 24 GiB
SINGLE_PASS_SHARE = 1 / 16
#: fewest rows a single-pass chunk takes (or one sample's, if fewer): 256 rows of a 152k vocabulary is the
#: recompute's fewest columns' matmul turned around
SINGLE_PASS_MIN_ROWS = 256
#: ``compile_model(loss_head=...)``: the rule, or either way forced
LOSS_HEAD_MODES = ("auto", "single_pass", "recompute")


def chunk_logits(head: dict, gpu_bytes: int) -> int:
    """Logits per chunk for the head figures ``head`` (``graph.meta["loss_head"]``) under ``gpu_bytes``."""
    most = head["seq_len"] * head["vocab"]
    room = max(1, int(gpu_bytes * LOSS_HEAD_SHARE) // head["bytes_per_logit"])
    return min(most, 1 << (room.bit_length() - 1))


def accumulator_bytes(head: dict) -> int | None:
    """Bytes of the single pass's weight-gradient accumulator (fp32, or the weight's dtype where wider), or
    None for figures that do not say the weight's dtype (a trace or plan file from before the single pass)."""
    size = head.get("param_bytes")
    if type(size) is not int or size < 1:
        return None
    return head["vocab"] * head["hidden"] * max(4, size)


def single_pass(head: dict, chunk: int, gpu_bytes: int) -> bool:
    """Whether the head runs in a single pass under ``gpu_bytes`` with ``chunk`` logits a chunk (module
    docstring's rule)."""
    acc = accumulator_bytes(head)
    rows = chunk // head["vocab"]
    return acc is not None and acc <= SINGLE_PASS_SHARE * gpu_bytes \
        and rows >= min(SINGLE_PASS_MIN_ROWS, head["seq_len"])


def with_loss_chunk(graph: ModelGraph, gpu_bytes: int | None, mode: str = "auto", gpu: bool = True) -> ModelGraph:
    """``graph`` with its loss head's chunk chosen for ``gpu_bytes`` (``chunk_logits``): the chunk in
    ``meta["loss_head"]`` (the runtime builds the head with it) and its bytes as the head's fixed workspace;
    where the single pass fits (``single_pass``), ``meta["loss_head"]["single_pass"]``, the recompute's FLOPs
    taken out of the head's backward, the gradient matmuls moved into its forward and the accumulator added to its
    workspace.  ``mode`` (``LOSS_HEAD_MODES``): ``"auto"`` that rule where the profile has a ``gpu`` (on the CPU the
    recompute: it applies the loss's seed before the gradient matmuls, as eager does, where the single pass scales
    their products, ulps apart, and CPU runs are the references the tests hold to eager's gradients),
    ``"single_pass"`` / ``"recompute"`` the one asked for (a single pass still needs a chunk of at least one row).
    A graph without a fused loss head, or without a GPU budget, is returned as it is."""
    head = graph.meta.get("loss_head")
    if not isinstance(head, dict) or not gpu_bytes:
        return graph
    chunk = chunk_logits(head, gpu_bytes)
    j = head["block"]
    b = graph.blocks[j]
    matmul = 2 * head["seq_len"] * head["vocab"] * head["hidden"]     # one head matmul, per sample
    if head.get("single_pass") is True:     # a graph chosen for before (a plan's): back to the traced head first
        b = dataclasses.replace(b, fwd_flops=b.fwd_flops - 2 * matmul, bwd_flops=b.bwd_flops + 3 * matmul)
    if mode == "auto":
        one = gpu and single_pass(head, chunk, gpu_bytes)
    else:
        one = mode == "single_pass" and accumulator_bytes(head) is not None and chunk >= head["vocab"]
    fixed = chunk * head["bytes_per_logit"]
    if one:
        b = dataclasses.replace(b, fwd_flops=b.fwd_flops + 2 * matmul, bwd_flops=b.bwd_flops - 3 * matmul,
                                workspace_fixed_bytes=fixed + accumulator_bytes(head))
    else:
        b = dataclasses.replace(b, workspace_fixed_bytes=fixed)
    blocks = list(graph.blocks)
    blocks[j] = b
    meta = {**graph.meta, "loss_head": {**head, "chunk_logits": chunk, "single_pass": one}}
    return dataclasses.replace(graph, blocks=tuple(blocks), meta=meta)
