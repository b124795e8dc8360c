"""The fused loss head's chunk (``frontend/loss_head.py``): how many logits exist at once, from the GPU budget, and
whether the head runs in a single pass.

The chunk: the largest power of two of logits whose bytes stay within ``LOSS_HEAD_SHARE`` of the GPU budget,
and never more than one sample's logits (``seq_len x vocab``: at micro-batch 1 that is the whole head in one
chunk, and a larger chunk would only be priced, never used).  Why a share and not a search: the chunk buys
nothing but fewer, larger GEMMs, and from a few thousand vocabulary columns on a chunk's matmuls already run
at full rate, while every byte it holds is a byte the MILP cannot spend on kept activations.  The chunk's
cost is in the graph the solver sees: its time in the head's backward FLOPs (the recompute of every chunk's
logits, one forward's worth: ``trace``), its memory as the head's fixed workspace, set here.

The single pass (the gradients formed in the forward, each chunk of rows taking the whole vocabulary) saves that
recompute, 2·N·V·d FLOPs, for a ``vocab x hidden`` fp32 weight-gradient accumulator held from the head's forward
to its backward, and its chunks read and write that accumulator once each (fewer, larger row chunks: less
traffic, more memory).  Alone the single pass is the faster head, but its accumulator's memory may cost the rest
of the plan more than it saves [ledger: loss-head-single-pass].  So memory decides, and the compiler does not
guess: ``faster_head`` takes the searched plan's decisions with the single-pass head (row chunks from the largest
the share allows down to ``SINGLE_PASS_MIN_ROWS``) where they still fit every budget and the simulated step is
shorter; where no chunk fits beside them (a MILP plan that uses all its memory) and the head alone would save
``LIMITS.head_resolve_gain`` of the step as priced, it solves the MILP once more for the single pass at the plan's
micro-batch and keeps whichever plan is predicted faster [ledger: loss-head-resolve].  Its FLOPs move into
the head's forward, its chunk and accumulator into the head's fixed workspace.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

from ..ir import ModelGraph
from ..ir.graph import padded_row
from ..ir.plan import PlanError
from .progress import log
from .search import Search, milp_size
from .time_limits import LIMITS

#: share of the GPU budget one chunk of logits may take: 1/16 (2^27 bf16 logits at 24 GiB) [ledger: loss-head-share]
LOSS_HEAD_SHARE = 1 / 16
#: fewest rows a single-pass chunk takes (or a micro-batch's, if fewer): 256 [ledger: loss-head-single-pass]
SINGLE_PASS_MIN_ROWS = 256


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


def single_pass_rows(head: dict, gpu_bytes: int, rows: int) -> list[int]:
    """Rows a single-pass chunk may take for a micro-batch of ``rows`` tokens, largest first: powers of two whose
    chunk of the whole vocabulary stays within ``LOSS_HEAD_SHARE`` of ``gpu_bytes``, from the micro-batch's
    (rounded up) down to ``SINGLE_PASS_MIN_ROWS`` (or the micro-batch's, if fewer); empty for figures from before
    the single pass."""
    if accumulator_bytes(head) is None:
        return []
    room = int(gpu_bytes * LOSS_HEAD_SHARE) // (padded_row(head["vocab"]) * head["bytes_per_logit"])
    top = min(room, 1 << max(0, rows - 1).bit_length())
    low = min(SINGLE_PASS_MIN_ROWS, rows)
    out = []
    r = 1 << (top.bit_length() - 1) if top >= 1 else 0
    while r >= low and r >= 1:
        out.append(r)
        r //= 2
    return out


def with_loss_chunk(graph: ModelGraph, gpu_bytes: int | None, single_rows: int | None = None) -> ModelGraph:
    """``graph`` with its loss head's chunk chosen for ``gpu_bytes`` (``chunk_logits``): the chunk in
    ``meta["loss_head"]`` (the runtime builds the head with it) and its bytes as the head's fixed workspace.  With
    ``single_rows``, the single pass in chunks of that many rows: ``meta["loss_head"]["single_pass"]``, the
    recompute's FLOPs taken out of the head's backward, its two gradient matmuls moved into its forward, and the
    chunk and the accumulator as its fixed workspace.  A graph chosen for before (a plan's) is chosen again from
    its traced head.  A graph without a fused loss head, or without a GPU budget, is returned as it is."""
    head = graph.meta.get("loss_head")
    if not isinstance(head, dict) or not gpu_bytes:
        return graph
    j = head["block"]
    b = graph.blocks[j]
    matmul = 2 * head["seq_len"] * head["vocab"] * head["hidden"]     # one head matmul, per sample
    if head.get("single_pass") is True:     # back to the traced head first
        b = dataclasses.replace(b, fwd_flops=b.fwd_flops - 2 * matmul, bwd_flops=b.bwd_flops + 3 * matmul)
    one = single_rows is not None and accumulator_bytes(head) is not None
    if one:
        chunk = max(1, single_rows) * padded_row(head["vocab"])     # rows of the aligned stride the runtime allocates
        b = dataclasses.replace(b, fwd_flops=b.fwd_flops + 2 * matmul, bwd_flops=b.bwd_flops - 3 * matmul,
                                workspace_fixed_bytes=chunk * head["bytes_per_logit"] + accumulator_bytes(head))
    else:
        chunk = chunk_logits(head, gpu_bytes)
        b = dataclasses.replace(b, workspace_fixed_bytes=chunk * head["bytes_per_logit"])
    blocks = list(graph.blocks)
    blocks[j] = b
    meta = {**graph.meta, "loss_head": {**head, "chunk_logits": chunk, "single_pass": one}}
    return dataclasses.replace(graph, blocks=tuple(blocks), meta=meta)


def faster_head(search, plan):
    """``plan`` (found by ``search``, a ``search.Search``), or a plan with the single-pass head where one is predicted
    faster:
    first ``plan``'s decisions with it (the largest row chunk that fits every budget); where none fits and the head's
    priced gain is at least ``LIMITS.head_resolve_gain`` of the step, one MILP solve for it at ``plan``'s micro-batch
    within ``LIMITS.head_resolve_s`` CPU seconds (``short_head_resolve_s`` for a short chain).  What was tried goes
    into the returned plan's history."""
    comp = search.comp
    head = comp.graph.meta.get("loss_head")
    gpu_bytes = comp.budgets.gpu_bytes
    if not isinstance(head, dict) or head.get("single_pass") or not gpu_bytes:
        return plan
    t0 = time.perf_counter()
    best, tried = plan, []
    # one compiler per row chunk, largest first: the first also prices the gain and hosts the re-solve
    heads = [(rows, comp.with_graph(with_loss_chunk(comp.graph, gpu_bytes, rows)))
             for rows in single_pass_rows(head, gpu_bytes, plan.micro_batch * head["seq_len"])]
    deadline = search.deadline
    for rows, other in heads:
        if deadline.after_cpu_left() < deadline.build_cpu:     # no time left for one more build
            tried.append([rows, "deadline"])
            break
        try:
            cand = other.build(plan.decisions, plan.batch_size)
        except PlanError:
            tried.append([rows, None])
            continue
        tried.append([rows, round(cand.predicted["step_time_s"], 4)])
        if cand.predicted["step_time_s"] < best.predicted["step_time_s"]:
            cand.solver = plan.solver
            best = cand
        break       # a smaller chunk only fits where this one did not, and is no faster
    short = milp_size(comp.graph) <= LIMITS.short_chain_blocks
    limit = LIMITS.short_head_resolve_s if short else LIMITS.head_resolve_s
    seconds = min(limit, deadline.after_cpu_left() - deadline.build_cpu)
    if heads and all(t[1] is None for t in tried) and plan.decisions.policy == "milp" \
            and not getattr(plan.solver, "out_of_time", False) and seconds >= LIMITS.min_solve_s \
            and _gain(comp, heads[0][1], plan) >= LIMITS.head_resolve_gain:
        cand = _re_solved(heads[0][1], plan, seconds)
        tried.append(["re-solved", heads[0][0], None if cand is None else round(cand.predicted["step_time_s"], 4)])
        if cand is not None and cand.predicted["step_time_s"] < best.predicted["step_time_s"]:
            best = cand
    if best is not plan:
        log.info("loss head: a single pass, %.3f s a step", best.predicted["step_time_s"])
    entry = {"pass": "loss_head", "seconds": round(time.perf_counter() - t0, 4), "single_pass": best is not plan,
             "tried_rows_step_s": tried}
    # a candidate's own history (the re-solve's entry) after the searched plan's
    own = best.history if best is not plan else []
    return dataclasses.replace(best, history=[*plan.history, *own, entry])


def _gain(comp, single, plan) -> float:
    """Share of ``plan``'s step (built by ``comp``) the head alone saves as ``single`` (a compiler of the
    single-pass head) prices it."""
    j, mb = comp.graph.meta["loss_head"]["block"], plan.micro_batch
    now, one = comp.cost(mb), single.cost(mb)
    saved = (now.saving_fwd_s(j) + now.bwd_s(j)) - (one.saving_fwd_s(j) + one.bwd_s(j))
    return saved * plan.n_micro / plan.predicted["step_time_s"]


def _re_solved(single, plan, seconds: float):
    """The MILP's plan for ``single`` (a compiler of the single-pass head) at ``plan``'s micro-batch, within
    ``seconds`` CPU seconds of a search of its own; or None."""
    other = Search(single.with_gpu_budget(single.budgets.gpu_bytes, deadline=seconds))
    other.deadline.start()
    with warnings.catch_warnings():      # a heuristic standing in at this micro-batch is not the caller's concern
        warnings.simplefilter("ignore", UserWarning)
        return other.milp_at(plan.batch_size, plan.micro_batch, warm=None)
