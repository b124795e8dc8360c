"""Rows for ``plan.summary()``: decision counts, predicted figures, solver statistics."""

from __future__ import annotations

import textwrap
from collections import Counter

from .decisions import Place, Saved
from .graph import loss_chunk_columns, padded_row
from .ops import GiB, OpKind, TensorId, TensorKind, Tier
from .semantics import Sizes
from .tiers import TIERS

VALUE_WIDTH = 60


def _trainable(graph) -> str:
    """How many parameters train where a frozen base does not (LoRA): "0.21 B trainable, "; else nothing."""
    return f"{graph.trainable_params / 1e9:.2f} B trainable, " if graph.frozen_params else ""


def _resident_text(plan) -> str:
    res = sorted(plan.decisions.resident_blocks)
    if not res:
        return "none"
    # contiguous runs: "0-9, 37" (a prefix and the tied head)
    trained = [j for j in res if plan.graph.blocks[j].trainable_numel]
    how = "updated on the GPU" if len(trained) == len(res) else \
        "frozen" if not trained else f"{_runs(trained)} updated on the GPU, the rest frozen"
    return f"blocks {_runs(res)}: {Sizes.of_plan(plan).resident_bytes() / GiB:.2f} GiB, {how}"


def _gpu_update_text(plan) -> str:
    """The GPU-updated streamed blocks and, where the compiler's rule chose them (``compiler/gpu_update.py``),
    what it compared: the solved plan's step against the one chosen, over how many plans."""
    blocks = sorted(plan.decisions.gpu_updated_blocks)
    note = plan.decisions.notes.get("gpu_update")
    text = "none"
    if blocks:
        kept = Sizes.of_plan(plan).kept_grad_bytes() / GiB
        text = f"blocks {_runs(blocks)}: {kept:.2f} GiB of gradients kept on the GPU into the next step"
    if isinstance(note, dict) and isinstance(note.get("tried"), list):
        built = sum(1 for t in note["tried"] if isinstance(t, list) and len(t) == 3)
        base, step = note.get("baseline_step_s"), plan.predicted.get("step_time_s")
        if isinstance(base, (int, float)) and isinstance(step, (int, float)):
            text += (f"; rule: {len(blocks)} chosen of {built} plans tried (resident blocks given back x first "
                     f"streamed blocks), simulated step {base:.4f} -> {step:.4f} s")
    return text


def _runs(blocks) -> str:
    """[0..9, 37] -> '0-9, 37 (11)'."""
    runs: list[list[int]] = []
    for j in blocks:
        if runs and j == runs[-1][1] + 1:
            runs[-1][1] = j
        else:
            runs.append([j, j])
    names = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return names + (f" ({len(blocks)})" if len(blocks) > 1 else "")


def _timings(plan) -> dict:
    """The hardware profile's ``calibration`` entries by (block signature, micro-batch)."""
    hw = plan.hardware if isinstance(plan.hardware, dict) else {}
    cal = hw.get("calibration")
    return {(t.get("signature"), t.get("micro_batch")): t for t in cal if isinstance(t, dict)} \
        if isinstance(cal, (list, tuple)) else {}


def measured_blocks(plan) -> list[int]:
    """Blocks whose compute times the plan took from measurements of their programs (the hardware
    profile's ``calibration`` at the plan's micro-batch), not from the FLOP model."""
    timed = _timings(plan)
    return [j for j in range(plan.graph.n_blocks) if (plan.graph.block_signature(j), plan.micro_batch) in timed]


def measured_cuts(plan) -> list[int]:
    """Blocks at a cut other than the min-cut whose forward and backward at that cut the plan took from the
    calibration (its ``cuts``, matched by budget and saved bytes as ``BlockTiming.cut`` does)."""
    timed, d, out = _timings(plan), plan.decisions, []
    for j, b in enumerate(plan.graph.blocks):
        if not d.cut_of(j):
            continue
        c = b.cuts[d.cut_of(j)]
        cuts = timed.get((plan.graph.block_signature(j), plan.micro_batch), {}).get("cuts")
        if isinstance(cuts, (list, tuple)) and any(isinstance(t, dict) and t.get("budget") == c.budget
                                          and t.get("saved_bytes") == c.saved_bytes for t in cuts):
            out.append(j)
    return out


def scaled_blocks(plan) -> list[int]:
    """Blocks timed by the calibration at other micro-batches only, whose compute the plan took from the nearest
    of those timings scaled by the FLOP model (``CostModel._from_other_micro_batch``)."""
    sigs = {sig for sig, _ in _timings(plan)}
    exact = set(measured_blocks(plan))
    return [j for j in range(plan.graph.n_blocks) if j not in exact and plan.graph.block_signature(j) in sigs]


def _compute_source_text(plan) -> str:
    measured, scaled, n = measured_blocks(plan), scaled_blocks(plan), plan.graph.n_blocks
    gpu = plan.hardware.get("gpu_name", "?") if isinstance(plan.hardware, dict) else "?"
    if not measured and not scaled:
        return f"modelled from FLOPs (no block of this model timed at micro-batch {plan.micro_batch} on {gpu})"
    parts = [f"measured on {gpu} for {len(measured)} of {n} blocks (forward, backward, recompute)"] if measured \
        else [f"no block timed at micro-batch {plan.micro_batch} on {gpu}"]
    if scaled:
        parts.append(f"{len(scaled)} scaled from their timing at another micro-batch by the FLOP model")
    if len(measured) + len(scaled) < n:
        parts.append("the rest modelled from FLOPs")
    return "; ".join(parts)


#: decisions the compiler explains in the plan's notes, shown with the summary
NOTES = {"batch_search": "batch search", "seq_search": "sequence search", "seq_tile": "why tiled"}
#: the clock of a search deadline that ran out (``SolverStats.deadline_clock``), as the summary says it
CLOCKS = {"cpu": " (its CPU time)", "wall": " (the wall-clock backstop: the machine was too busy)"}


def _search_rows(plan) -> list[list]:
    """Sequence tiles (which layers, how many tokens a chunk) and what the compiler's searches decided."""
    rows = []
    tile = plan.graph.meta.get("seq_tile") if isinstance(plan.graph.meta, dict) else None
    if isinstance(tile, dict) and tile.get("blocks"):
        rows.append(["sequence tiles", f"{len(tile['blocks'])} layers run their position-wise tail (after attention) "
                                       f"in chunks of {tile.get('tokens')} tokens, recomputed in backward"])
    if plan.options.get("compile_blocks") is True:
        rows.append(["compiled blocks", _compiled_text(plan)])
        if any(b.cuts for b in plan.graph.blocks):
            rows.append(["cuts (saved / recomputed)", _cuts_text(plan)])
    head = plan.graph.meta.get("loss_head") if isinstance(plan.graph.meta, dict) else None
    if isinstance(head, dict) and all(type(head.get(k)) is int and head[k] > 0 for k in _LOSS_HEAD_KEYS):
        rows.append(["loss head", _loss_head_text(plan, head)])
    notes = plan.decisions.notes if isinstance(plan.decisions.notes, dict) else {}
    rows += [[label, str(notes[key])] for key, label in NOTES.items() if key in notes]
    return rows


def _compiled_text(plan) -> str:
    """Which blocks run Inductor-compiled (``frontend/compiled.py``), as the trace partitioned them."""
    info = plan.graph.meta.get("compiled_blocks") if isinstance(plan.graph.meta, dict) else None
    blocks = info.get("blocks") if isinstance(info, dict) else None
    n = plan.graph.n_blocks
    if not isinstance(blocks, list):
        return "block programs compiled by Inductor when the trainer starts"
    return (f"{len(blocks)} of {n} blocks compiled by Inductor when the trainer starts (saved bytes: what the "
            f"partition's forward saves at the block's cut, the min-cut unless a cut is named below); the others "
            f"run eager")


def _cuts_text(plan) -> str:
    """How many blocks save each cut (``Decisions.cut``, ``frontend/cuts.py``) and how its time is costed."""
    d, blocks = plan.decisions, plan.graph.blocks
    chosen = Counter(blocks[j].cuts[d.cut_of(j)].budget for j in range(len(blocks))
                     if blocks[j].cuts and d.saved[j] is not Saved.RECOMPUTE)
    parts = []
    for budget, n in sorted(chosen.items(), reverse=True):
        j = next(j for j in range(len(blocks)) if blocks[j].cuts and d.saved[j] is not Saved.RECOMPUTE
                 and blocks[j].cuts[d.cut_of(j)].budget == budget)
        c = blocks[j].cuts[d.cut_of(j)]
        share = c.recompute_flops / blocks[j].fwd_flops if blocks[j].fwd_flops else 0.0
        parts.append(f"{n} at budget {budget:g} ({c.saved_bytes * d.micro_batch / GiB:.2f} GiB/mb, "
                     f"recomputes {share:.0%} of the forward)")
    text = "; ".join(parts) if parts else "none (every compiled block is recomputed)"
    at_cut = [j for j in range(len(blocks)) if d.cut_of(j)]
    timed = len(measured_cuts(plan))
    if at_cut and timed == len(at_cut):
        return text + ". The cuts' forward and backward are measured (calibration)"
    modelled = ("the min-cut backward plus the block's recompute time (measured or modelled) times the cut's "
                "modelled recompute share (FLOPs at the matmul and attention rates)")
    if not timed:
        return text + f". A cut's backward costs {modelled}"
    return text + (f". Measured (calibration) for {timed} of the {len(at_cut)} blocks at a cut other than the "
                   f"min-cut; the others' backward costs {modelled}")


#: the figures of ``graph.meta["loss_head"]`` the summary's row needs (a plan file without them has no row)
_LOSS_HEAD_KEYS = ("chunk_logits", "bytes_per_logit", "seq_len", "vocab")


def _loss_head_text(plan, head: dict) -> str:
    """The fused loss head's chunk and pass (``compiler/loss_chunk.py``): chunks, bytes, and what it costs in
    time."""
    rows = plan.micro_batch * head["seq_len"]
    gib = head["chunk_logits"] * head["bytes_per_logit"] / GiB
    whole = rows * head["vocab"] * 4 / GiB
    if head.get("single_pass") is True:
        per = max(1, head["chunk_logits"] // padded_row(head["vocab"]))
        chunks = -(-rows // per)
        acc = plan.graph.blocks[head["block"]].workspace_fixed_bytes / GiB - gib
        text = (f"lm_head + cross-entropy fused in {chunks} chunk{'s' if chunks > 1 else ''} of {per} rows over the "
                f"whole vocabulary ({gib:.2f} GiB a chunk, instead of {whole:.2f} GiB of fp32 logits a micro-batch), "
                f"in a single pass: the forward forms the gradients (a {acc:.2f} GiB weight-gradient accumulator), "
                "no logits recomputed")
    else:
        cols = loss_chunk_columns(head["chunk_logits"], rows, head["vocab"])
        chunks = -(-head["vocab"] // cols)
        text = (f"lm_head + cross-entropy fused in {chunks} chunk{'s' if chunks > 1 else ''} of {cols} vocabulary "
                f"columns ({gib:.2f} GiB a chunk, instead of {whole:.2f} GiB of fp32 logits a micro-batch); "
                "backward recomputes the logits (one more forward of the head)")
    if plan.options.get("compile_blocks"):
        text += "; each chunk's softmax work is one compiled kernel each way (frontend/loss_kernels.py)"
    return text


def _hardware_text(hw) -> str:
    """The profile's name and where its figures come from (the first clause of its ``source``)."""
    hw = hw if isinstance(hw, dict) else {}
    return f"{hw.get('name', '?')}: {str(hw.get('source', '')).split(';')[0]}"


def model_tflops_text(pred: dict) -> str:
    """Model TFLOPS as ``6 * params * tokens / step`` (the parameters a token uses: a mixture of experts' idle experts
    not counted, ``ModelGraph.active_params``), and, where the model has attention, with its FLOPs
    added (forward plus a backward of twice it, causal as half the square): at long sequences the two differ
    by the attention's quadratic share."""
    text = f"{pred.get('model_tflops', 0):.1f} (6·N·tokens)"
    if pred.get("model_attn_tflops", 0) > pred.get("model_tflops", 0) * 1.0005:
        text += f"; {pred['model_attn_tflops']:.1f} with attention (causal half, backward 2x forward)"
    return text


def _budget_rows(budgets: dict) -> list[list[str]]:
    """The budgets the peaks above are held to: the GPU's after its reserve (and the memory it was given)."""
    if not isinstance(budgets, dict) or not isinstance(budgets.get("gpu_bytes"), (int, float)):
        return []
    total, res = budgets.get("gpu_total_bytes"), budgets.get("gpu_reserve_bytes")
    given = (f" (GPU: {total / GiB:.2f} less a {res / GiB:.2f} reserve)"
             if isinstance(total, (int, float)) and isinstance(res, (int, float)) else "")
    caps = " / ".join(f"{(budgets.get(spec.budget) or 0) / GiB:.2f}" for spec in TIERS.values())
    return [[f"budget {_TIER_LABELS}", f"{caps} GiB{given}"]]


#: the tiers as the summary's rows name them ("GPU / host / NVMe")
_TIER_LABELS = " / ".join(spec.label for spec in TIERS.values())


#: the summary's name of each resource's busy time (``predicted["busy_s"]``)
_RESOURCE_NAMES = {"gpu": "GPU compute", "h2d": "PCIe to the GPU", "d2h": "PCIe from the GPU",
                   "cpu": "host optimizer", "nvme": "NVMe", "net": "collectives"}


def _state_text(plan) -> str:
    """Where the parameters, gradients and optimizer state live: the host store, and what is kept on NVMe."""
    placed = plan.decisions.nvme_state
    if not placed:
        return "all in host memory (the host store)"
    sizes = Sizes.of_plan(plan)
    names = {"ostate": "optimizer state", "grads": "gradients", "params": "parameters"}
    parts = [f"{names[k]} of {len(v)} blocks" for k, v in placed.items() if v]
    on = sum(sizes.of(TensorId(kind=TensorKind(k), index=j), Tier.HOST) for k, v in placed.items() for j in v)
    static = plan.predicted.get("host_static_bytes") if plan.predicted else None
    host = f"; {static / GiB:.2f} GiB stays in host memory" if static is not None else ""
    return f"on NVMe: {', '.join(parts)} ({on / GiB:.2f} GiB in {plan.budgets.get('nvme_dir')}){host}"


def _pace_text(pred: dict) -> str:
    """The resource busiest over the step, against the step: what a faster one would speed up."""
    busy = {r: t for r, t in pred.get("busy_s", {}).items() if t}
    step = pred.get("step_time_s", 0)
    if not busy or not step:
        return "-"
    order = sorted(busy, key=busy.get, reverse=True)
    top = order[0]
    rest = ", ".join(f"{_RESOURCE_NAMES.get(r, r)} {busy[r]:.3g} s" for r in order[1:])
    head = f"{_RESOURCE_NAMES.get(top, top)}: busy {busy[top]:.3g} s of the {step:.3g} s step ({busy[top] / step:.0%})"
    return head + (f"; then {rest}" if rest else "")


def summary_rows(plan) -> list[list]:
    d = plan.decisions
    pred = plan.predicted
    b = Counter(p for p in d.boundary[1:])
    s = Counter(d.saved)
    rows = [
        ["model", f"{plan.graph.name} ({plan.graph.total_params / 1e9:.2f} B params, "
                  f"{_trainable(plan.graph)}{plan.graph.n_blocks} blocks)"],
        ["batch", f"{plan.batch_size} = {d.n_micro} x {d.micro_batch}, seq {plan.seq_len}"],
        ["policy", d.policy],
        ["boundaries kept gpu / host / nvme", f"{b[Place.GPU]} / {b[Place.HOST]} / {b[Place.NVME]}"],
        ["saved kept / host / nvme / recomputed",
         f"{s[Saved.KEEP]} / {s[Saved.HOST]} / {s[Saved.NVME]} / {s[Saved.RECOMPUTE]}"],
        ["resident on the GPU", _resident_text(plan)],
        *([["updated on the GPU (streamed)", _gpu_update_text(plan)]]
          if plan.decisions.gpu_update or "gpu_update" in plan.decisions.notes else []),
        ["training state", _state_text(plan)],
        ["ops", f"{len(plan.ops)} ({', '.join(f'{k.value} {plan.count(k)}' for k in OpKind if plan.count(k))})"],
    ]
    if pred:
        rows += [
            ["predicted step", f"{pred.get('step_time_s', 0):.4f} s"],
            ["block compute times", _compute_source_text(plan)],
            ["hardware figures", _hardware_text(plan.hardware)],
            ["predicted model TFLOPS", model_tflops_text(pred)],
            [f"peak {_TIER_LABELS}", " / ".join(f"{pred.get(spec.peak, 0) / GiB:.2f}" for spec in TIERS.values())
             + " GiB"],
            *_budget_rows(plan.budgets),
            ["busy s (gpu h2d d2h cpu nvme)", " ".join(f"{pred.get('busy_s', {}).get(r, 0):.3f}"
                                                       for r in ("gpu", "h2d", "d2h", "cpu", "nvme"))],
            ["exposed transfer s", f"{pred.get('exposed_transfer_s', 0):.4f}"],
            ["what paces the step", _pace_text(pred)],
        ]
        if plan.world_size > 1:
            rows.append(["world (ranks, collective busy s)", f"{plan.world_size}, "
                                                              f"{pred.get('busy_s', {}).get('net', 0):.3f}"])
        if "megatrain_step_time_s" in pred:
            rows.append(["gain over megatrain", f"{pred['megatrain_step_time_s'] / pred['step_time_s']:.3f}x"])
    rows += _search_rows(plan)
    if plan.solver:
        st = plan.solver
        objective = f"{st.objective:.4f}" if isinstance(st.objective, (int, float)) else st.objective
        gap = f"{st.gap:.2%}" if isinstance(st.gap, (int, float)) else st.gap
        name = f"{st.solver} " if st.solver else ""
        # the objective is the MILP's model of the step it solved (before the GPU-update rule and the loss head's
        # pass): the predicted step above is the simulation of the plan returned
        rows.append(["solver", f"{name}{st.status}, model objective {objective}, gap {gap}, {st.n_vars} vars, "
                               f"{st.n_constraints} constraints, {st.seconds:.2f} s"
                               f"{'; the search deadline ran out' if st.out_of_time else ''}"
                               f"{CLOCKS.get(st.deadline_clock, '') if st.out_of_time else ''}"])
        if st.failures:
            rows.append(["solver failures", "; ".join(st.failures)])
    # a value wraps onto more lines rather than widening the table past a terminal (~100 columns)
    return [[k, textwrap.fill(str(v), VALUE_WIDTH, break_long_words=False)] for k, v in rows]
