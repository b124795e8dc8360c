"""The MILP policy: choose recomputation, activation placement (GPU / host / NVMe) and so the
overlap of every transfer with compute jointly, minimising the predicted step time.

Formulation (units: milliseconds and GiB, so coefficients are well scaled)::

    windows   w in F_0..F_{L-1}, B_{L-1}..B_0, X        (forward of j, backward of j, between steps)
    T_w >= 0                                            window duration;  objective  min sum_w T_w
    per block j (binaries, one of):   keep[j] + host[j] + nvme[j] + recompute[j] = 1
        keep: saved activations S_j stay on the GPU F_j..B_j;  host/nvme: offloaded in F_j and
        reloaded during B_{j+1};  recompute: forward again in B_j from boundary j
    per boundary j (binaries):  bgpu[j] + bhost[j] + bnvme[j] = recompute[j]
        a recomputed block's input boundary is kept on the GPU, or offloaded in F_j and reloaded
        during B_{j+1}
    compute   T_{F_j} >= M fwd_j                T_{B_j} >= M (bwd_j + fwd_j recompute[j])
    h2d       T_{F_j} >= P_{j+1}/h2d            T_{B_j} >= (P_{j-1} + M S_{j-1} (host+nvme)[j-1]
                                                            + M A_{j-1} (bhost+bnvme)[j-1]) / h2d
              except the head (h = L-1, forward and backward back to back): block h-1's parameters
              load under its forward, the reloads R_{h-1} in its backward:
              T_{B_h} >= R_{h-1}/h2d,  T_{F_h} + T_{B_h} >= (P_{h-1} + R_{h-1}) / h2d
    d2h       T_{F_j} >= M (S_j ((host+nvme)[j] - spill[j]) + S_{j-1} spill[j-1] + A_j (bhost+bnvme)[j]) / d2h
              spill[j] in [0, min(1, 2/M)] <= (host+nvme)[j]: offloads finishing in F_{j+1}
              (h2d in B_j likewise: reload_late[k] <= (M-1)/M (host+nvme)[k] finishes in B_k, not B_{k+1},
              and T_{B_k} >= M S_k reload_late[k] / h2d + bwd_k: the last one precedes the last backward)
              T_{B_j} >= G_{j+1}/d2h            (gradients of the block before leave during B_j)
    nvme      T_{F_j} >= M (S_j nvme[j] + A_j bnvme[j]) / nvme_write,  T_{B_j} likewise for block j-1 / nvme_read
    updates   with exact clipping every update waits for the global norm (end of backward) and is
              lagged into the next step, in block order on the host, each before its block's load:
              T_X >= G_0/d2h + U_0 + P_0/h2d;  for j >= 1:
              T_X + sum_{k<j} T_{F_k} >= G_0/d2h + sum_{i<=j} U_i + P_j/h2d
              (without clipping: T_X >= G_0/d2h + U_0 + P_0/h2d and sum U <= T_X + sum_B T_w)
    memory    per window, GPU bytes of: parameters (current + prefetched), block j's gradient
              accumulator and backward temporaries (B_j), saved activations kept so far, offloaded ones
              in flight (two micro-batches: the lowering throttles compute to that) or
              reloaded, kept boundaries, reloaded boundaries, boundary gradients, and the block's
              workspace  <=  budget.  B_j is checked at three moments: in program order (when the
              runtime allocates; block j-1's reloads, issued before B_j's backward, all held);  at the
              start in time order, without them but with block j+1's gradients still draining (accumulator + cast
              copy D_{j+1}, from the end of B_{j+1} for G_{j+1}/d2h) where B_j starts at once: under
              the first backward of a kept block (D_{j+1} keep[j]), under a recompute from a GPU
              boundary ((S_j + workspace_j) rec[j] + D_{j+1} bgpu[j]), and under its backward when
              the drain outlasts that recompute.  Boundary values: micro-batch k of a window holds
              M - k of one side's and k + 1 of the other's: max(A_j, A_{j+1}) M + min(A_j, A_{j+1}).
              host: static store + M sum_j (S_j host[j] + A_j bhost[j]) <= budget;  NVMe likewise.
    head      the last block neither offloads nor stores its boundary off the GPU (it runs its
              forward and backward back to back).
    resident  blocks the compiler keeps on the GPU (``Decisions.resident``, fixed for one solve; the
              outer search in ``compiler/api.py`` picks how many): their parameter, gradient and host
              update terms are 0 (P_j, G_j, U_j, the accumulator), every memory row's budget is
              lowered by what they hold for the whole run (``Sizes.resident_bytes``), and their GPU
              updates, at the step's start, bound T_X.

Coefficients come from the cost graph (compiler/costgraph.py).  The model is small (7L binaries,
4L+1 continuous), so CBC or HiGHS solve it to a small gap in
seconds even for 80 layers; identical layers are symmetric, so a time limit returns the incumbent
and its gap.  The lowered plan's memory is checked afterwards (``ir.verify`` in program order, the
simulator in time order); a solution over budget is excluded by a no-good cut and the MILP re-solved,
and after a few such cuts the window model's budget is tightened by the excess instead.
"""

from __future__ import annotations

import time

import torch

from ...ir import Decisions, GiB, Place, Saved, SolverStats

MS = 1e3
GAP_TARGET = 0.005


def _mip():
    try:
        import mip
    except ImportError as e:  # pragma: no cover - mip is a core dependency
        raise RuntimeError("the milp policy needs python-mip: pip install mip") from e
    return mip


def solve(comp, micro_batch: int, n_micro: int, warm=None, *, gpu_bytes: int | None = None,
          exclude: tuple = ()):
    """Returns (Decisions, SolverStats).  ``comp`` is a compiler.api.Compiler.  ``exclude`` lists
    decisions the caller found over budget after lowering (the simulator's time-ordered peak): each
    becomes a no-good cut, so the next solve returns the best *other* assignment."""
    mip = _mip()
    t0 = time.perf_counter()
    g = comp.graph
    cost = comp.cost(micro_batch)
    hw = comp.hw
    L, M = g.n_blocks, n_micro
    # resident blocks hold their parameters, optimizer state and accumulators for the whole run
    budget = ((gpu_bytes if gpu_bytes is not None else comp.budgets["gpu_bytes"]) - cost.sizes.resident_bytes()) / GiB
    host_cap = comp.budgets.get("host_bytes")
    nvme_cap = comp.budgets.get("nvme_bytes") or 0
    host_static = g.total_params * comp.options["host_bytes_per_param"] / GiB

    from ..costgraph import block_attr, build_cost_graph
    cg = build_cost_graph(cost)
    P = [b / GiB for b in block_attr(cg, "params_bytes")]
    Gacc = [b / GiB for b in block_attr(cg, "grad_accum_bytes")]
    S = [b / GiB for b in block_attr(cg, "saved_bytes")]
    A = [cg.nodes[("boundary", i)]["bytes"] / GiB for i in range(L + 1)]
    W = [b / GiB for b in block_attr(cg, "workspace_bytes")]
    WB = [b / GiB for b in block_attr(cg, "backward_transient_bytes")]
    D = [b / GiB for b in block_attr(cg, "grad_drain_bytes")]
    fwd = [t * MS for t in block_attr(cg, "fwd_s")]
    bwd = [t * MS for t in block_attr(cg, "bwd_s")]
    U = [t * MS for t in block_attr(cg, "update_s")]
    gpu_updates = sum(block_attr(cg, "gpu_update_s")) * MS   # resident blocks, on the GPU at the step start
    load = [t * MS for t in block_attr(cg, "load_s")]
    gout = [t * MS for t in block_attr(cg, "grad_offload_s")]
    h2d_ms = hw.h2d_seconds(GiB) * MS        # ms per GiB
    d2h_ms = hw.d2h_seconds(GiB) * MS
    nvw_ms = hw.nvme_seconds(GiB, True) * MS
    nvr_ms = hw.nvme_seconds(GiB, False) * MS
    use_nvme = bool(comp.budgets.get("nvme_dir")) and nvme_cap > 0

    m = _model(mip, comp.solver)
    m.verbose = 0
    # one thread: CBC's parallel branch-and-bound aborted the process now and then (SIGABRT in CI,
    # a known CBC weakness), and on this model it found plans as good in the same time; a single
    # thread also makes the plan for a given input reproducible
    m.threads = 1
    if "CBC" in type(m.solver).__name__.upper():
        # moderate cut generation: on qwen2.5-32b's 64 layers (80 GiB, batch 32 / 72) CBC closes the gap to
        # 0.31% / 0.58% within the 10 s limit, where aggressive cuts (3) left 0.67% / 1.04%
        m.cuts = 2
    B = mip.BINARY
    keep = [m.add_var(f"keep_saved[{j}]", var_type=B) for j in range(L)]
    host = [m.add_var(f"saved_on_host[{j}]", var_type=B) for j in range(L)]
    nvme = [m.add_var(f"saved_on_nvme[{j}]", var_type=B, ub=1 if use_nvme else 0) for j in range(L)]
    rec = [m.add_var(f"recompute[{j}]", var_type=B) for j in range(L)]
    bg = [m.add_var(f"boundary_on_gpu[{j}]", var_type=B) for j in range(L)]
    bh = [m.add_var(f"boundary_on_host[{j}]", var_type=B) for j in range(L)]
    bn = [m.add_var(f"boundary_on_nvme[{j}]", var_type=B, ub=1 if use_nvme else 0) for j in range(L)]
    # transfers overlap the next window at micro-batch granularity: offloads of block j may
    # finish during F_{j+1} (at most two micro-batches: the lowering throttles compute), and
    # reloads of block k may finish during B_k (each micro-batch's backward waits only for its own)
    spill = [m.add_var(f"offload_spill[{j}]", ub=min(1.0, 2.0 / M)) for j in range(L)]
    late = [m.add_var(f"reload_late[{j}]", ub=(M - 1) / M) for j in range(L)]   # the first micro-batch is early
    TF = [m.add_var(f"T_F[{j}]") for j in range(L)]
    TB = [m.add_var(f"T_B[{j}]") for j in range(L)]
    TX = m.add_var("T_X")
    step = mip.xsum(TF) + mip.xsum(TB) + TX
    # tie-break: among plans of equal step time prefer the one keeping fewer bytes on the GPU (a
    # margin for the time-ordered peak that the windows cannot see); 1e-4 ms per GiB never
    # outweighs a real time difference at the solver's gap
    gpu_resident = mip.xsum(S[j] * M * keep[j] + A[j] * M * bg[j] for j in range(L))
    m.objective = step + 1e-4 * gpu_resident
    xs = mip.xsum

    # -- choices ------------------------------------------------------------------------
    for j in range(L):
        m += keep[j] + host[j] + nvme[j] + rec[j] == 1, f"one_policy[{j}]"
        m += bg[j] + bh[j] + bn[j] == rec[j], f"boundary_iff_recompute[{j}]"
        m += spill[j] <= host[j] + nvme[j], f"spill_only_offloads[{j}]"
        m += late[j] <= host[j] + nvme[j], f"late_only_reloads[{j}]"
        if j == L - 1:
            m += spill[j] == 0, "nothing_after_the_last_forward"
    h = L - 1
    m += host[h] + nvme[h] + bh[h] + bn[h] == 0, "head_stays_on_gpu"
    m += bg[0] == 0, "batch_is_on_host"     # boundary 0 is the batch: reloaded from the host
    m += bn[0] == 0, "batch_not_on_nvme"

    # -- time per window ----------------------------------------------------------------
    for j in range(L):
        m += TF[j] >= M * fwd[j], f"gpu_F[{j}]"
        if j + 1 < L:
            m += TF[j] >= load[j + 1], f"h2d_F[{j}]"
        spilled_in = S[j - 1] * spill[j - 1] if j >= 1 else 0.0
        m += TF[j] >= M * d2h_ms * (S[j] * (host[j] + nvme[j] - spill[j]) + spilled_in
                                     + A[j] * (bh[j] + bn[j])), f"d2h_F[{j}]"
        if use_nvme:
            m += TF[j] >= M * nvw_ms * (S[j] * nvme[j] + A[j] * bn[j]), f"nvme_F[{j}]"
        m += TB[j] >= M * bwd[j] + M * fwd[j] * rec[j], f"gpu_B[{j}]"
        if j >= 1:
            k = j - 1
            pre = load[k] if k != L - 1 else 0.0
            reloads = M * h2d_ms * (S[k] * (host[k] + nvme[k] - late[k]) + S[j] * late[j] + A[k] * (bh[k] + bn[k]))
            if j == L - 1:
                # the head runs forward and backward back to back: block L-2's parameters load
                # while the head's forward runs (nothing else uses H2D then); its reloads wait
                # for the head's backward window (their offloads may still be draining)
                m += TB[j] >= reloads, f"h2d_B[{j}]"
                m += TF[j] + TB[j] >= pre + reloads, f"h2d_head[{j}]"
            else:
                m += TB[j] >= pre + reloads, f"h2d_B[{j}]"
            if use_nvme:
                m += TB[j] >= M * nvr_ms * (S[k] * nvme[k] + A[k] * bn[k]), f"nvme_B[{j}]"
        if j + 1 < L:
            m += TB[j] >= gout[j + 1], f"d2h_B[{j}]"
        # the last late reload must land before the last micro-batch's backward can run
        m += TB[j] >= M * h2d_ms * S[j] * late[j] + bwd[j], f"late_reload_then_backward[{j}]"
    # block 0's reloads happen before its backward (nothing left to hide them under)
    m += TB[0] >= M * bwd[0] + M * fwd[0] * rec[0] + M * h2d_ms * A[0] * bh[0], "h2d_B_first"
    m += TB[0] >= M * h2d_ms * S[0] * late[0], "h2d_B_0_late"
    m += TX >= gout[0] + U[0] + load[0], "step_boundary_chain"
    if gpu_updates:
        m += TX >= gpu_updates, "resident_updates_on_gpu"
    if comp.clip:
        for j in range(1, L):
            m += TX + xs(TF[k] for k in range(j)) >= gout[0] + sum(U[: j + 1]) + load[j], f"lazy_update[{j}]"
    else:
        m += TX + xs(TB) >= sum(U), "host_updates_fit"

    # -- memory per window (GiB) ---------------------------------------------------------
    for j in range(L):
        # boundary values in flight: micro-batch k of a window holds M - k of one side's values and
        # k + 1 of the other's (activations j -> j+1 forward, their gradients backward)
        flowing = max(A[j], A[j + 1]) * M + min(A[j], A[j + 1])
        kept = xs(S[i] * M * keep[i] for i in range(j + 1)) + xs(A[i] * M * bg[i] for i in range(j + 1))
        nxt = P[j + 1] if j + 1 < L else 0.0
        spilled = min(2, M) * S[j - 1] * (host[j - 1] + nvme[j - 1]) if j >= 1 else 0.0
        m += (P[j] + nxt + kept + flowing + min(2, M) * S[j] * (host[j] + nvme[j]) + spilled
              + W[j] <= budget), f"gpu_memory_F[{j}]"
        prev = j - 1
        pre_p = P[prev] if prev >= 0 else 0.0
        # block j's reloads (saved activations, or the boundary its recompute starts from) are in
        start = P[j] + pre_p + kept + flowing + S[j] * M * (host[j] + nvme[j]) + A[j] * M * (bh[j] + bn[j])
        # in program order (when the runtime allocates) block j-1's reloads are issued before B_j's
        # backward: the allocator holds them all
        reloaded = S[prev] * M * (host[prev] + nvme[prev]) + A[prev] * M * (bh[prev] + bn[prev]) if prev >= 0 else 0
        # a backward follows its micro-batch's recompute, which freed that micro-batch's boundary
        backward = start - A[j] * rec[j] + Gacc[j] + S[j] * rec[j] + WB[j]
        m += backward + reloaded <= budget, f"gpu_memory_B[{j}]"
        if j + 1 < L:
            # early in B_j, before block j-1's reloads, block j+1's gradients are still draining
            # (cast, then D2H, from the end of B_{j+1}).  Certain only where B_j starts at once: a
            # kept block's first backward; a recompute from a GPU boundary (and its backward when
            # the drain outlasts that recompute).  A reload may hold B_j back past the drain.
            overlap = keep[j] + (bg[j] if gout[j + 1] > fwd[j] else 0)
            m += backward + D[j + 1] * overlap <= budget, f"gpu_memory_B_start[{j}]"
            m += start + (S[j] + W[j]) * rec[j] + D[j + 1] * bg[j] <= budget, f"gpu_memory_recompute[{j}]"

    if host_cap:
        m += host_static + M * xs(S[j] * host[j] + A[j] * bh[j] for j in range(L)) <= host_cap / GiB, "host_memory"
    if use_nvme:
        m += M * xs(S[j] * nvme[j] + A[j] * bn[j] for j in range(L)) <= nvme_cap / GiB, "nvme_capacity"

    # -- symmetry breaking: among identical consecutive layers, prefer keeping later ones ----
    for j in range(1, L - 1):
        a, b = g.blocks[j], g.blocks[j + 1]
        if a.kind == b.kind == "layer" and a.saved_bytes == b.saved_bytes and a.fwd_flops == b.fwd_flops:
            m += keep[j] <= keep[j + 1], f"sym_keep[{j}]"

    for n, bad in enumerate(exclude):
        ones = _warm_start(bad, keep, host, nvme, rec, bg, bh, bn) or []
        on = [v for v, x in ones if x > 0.5]
        off = [v for v, x in ones if x <= 0.5]
        if on:
            m += mip.xsum(1 - v for v in on) + mip.xsum(off) >= 1, f"no_good[{n}]"
    if warm is not None:
        start = _warm_start(warm.decisions, keep, host, nvme, rec, bg, bh, bn)
        if start:
            m.start = start
    limit = comp.time_limit if comp.time_limit is not None else _default_limit(L)
    # stop once proven within 0.5% on long chains (identical layers make the last bit slow); a short
    # chain is solved to optimality, which is cheap there
    m.max_mip_gap = GAP_TARGET if L > 12 else 1e-9
    status = _optimize_keeping_threads(m, limit)
    secs = time.perf_counter() - t0
    ok = status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE)
    stats = SolverStats(status=status.name.lower(),
                        objective=(sum(v.x for v in (*TF, *TB, TX)) / MS) if ok else None,
                        gap=float(m.gap) if ok else None, n_vars=m.num_cols, n_constraints=m.num_rows,
                        seconds=round(secs, 3))
    if not ok:
        from ...ir import PlanError
        err = PlanError(f"no feasible plan found at micro-batch {micro_batch} ({status.name.lower()}"
                        f"{f' within the time limit of {limit:.1f} s' if status.name != 'INFEASIBLE' else ''})")
        err.stats = stats
        raise err
    def val(v) -> bool:
        return v.x is not None and v.x > 0.5

    saved, boundary = [], []
    for j in range(L):
        saved.append(Saved.KEEP if val(keep[j]) else Saved.HOST if val(host[j]) else
                     Saved.NVME if val(nvme[j]) else Saved.RECOMPUTE)
        boundary.append(Place.GPU if val(bg[j]) else Place.HOST if val(bh[j]) else
                        Place.NVME if val(bn[j]) else Place.NONE)
    if saved[0] is Saved.RECOMPUTE:
        boundary[0] = Place.HOST
    dec = Decisions(policy="milp", micro_batch=micro_batch, n_micro=n_micro, boundary=tuple(boundary),
                    saved=tuple(saved), notes={"objective_s": stats.objective})
    return dec, stats


def _model(mip, solver: str):
    """A mip.Model on the asked solver; if its library is missing (CBC ships as a separate wheel
    in python-mip 2, HiGHS needs highspy/highsbox), the other one, with a warning."""
    order = [mip.HIGHS, mip.CBC] if solver == "highs" else [mip.CBC, mip.HIGHS]
    errors = []
    for name in order:
        try:
            m = mip.Model(name="lazytrain", sense=mip.MINIMIZE, solver_name=name)
        except Exception as e:  # noqa: BLE001 - mip raises plain exceptions for a missing library
            errors.append(f"{name}: {e}")
            continue
        if name != order[0]:
            import warnings
            warnings.warn(f"MILP solver {order[0]} is not available; using {name}", stacklevel=3)
        return m
    raise RuntimeError("no MILP solver library found (" + "; ".join(errors) + "): pip install mip (CBC) or "
                       "pip install 'lazytrain[highs]'")


def _optimize_keeping_threads(m, limit: float):
    """``m.optimize`` without side effects on torch: CBC's OpenMP runtime is the one torch uses, and a
    solve left it at 1 thread (``lazytrain train`` then trained on 1 of 2 cores)."""
    threads = torch.get_num_threads()
    try:
        return m.optimize(max_seconds=limit)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _default_limit(L: int) -> float:
    return 10.0


def _warm_start(dec: Decisions, keep, host, nvme, rec, bg, bh, bn):
    """A heuristic's decisions as a MIP start, when they lie in this model's space (single-block
    recompute segments only)."""
    L = len(keep)
    if any(s is Saved.RECOMPUTE and dec.boundary[j] is Place.NONE for j, s in enumerate(dec.saved) if j > 0):
        return None
    start = []
    for j in range(L):
        s = dec.saved[j]
        start += [(keep[j], float(s is Saved.KEEP)), (host[j], float(s is Saved.HOST)),
                  (nvme[j], float(s is Saved.NVME)), (rec[j], float(s is Saved.RECOMPUTE))]
        r = s is Saved.RECOMPUTE
        p = dec.boundary[j] if r else Place.NONE
        if j == 0 and r:
            p = Place.HOST
        start += [(bg[j], float(p is Place.GPU)), (bh[j], float(p is Place.HOST)), (bn[j], float(p is Place.NVME))]
    return start
