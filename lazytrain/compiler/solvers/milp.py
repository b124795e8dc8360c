"""The MILP policy: choose recomputation, activation placement (GPU / host / NVMe), the blocks kept
resident on the GPU and so the overlap of every transfer with compute jointly, minimising the
predicted step time.

Formulation (units: milliseconds and GiB, so coefficients are well scaled)::

    windows   w in F_0..F_{L-1}, B_{L-1}..B_0, X        (forward of j, backward of j, between steps)
    T_w >= 0                                            window duration;  objective  min sum_w T_w
    per block j (binaries, one of):   keep[j] + host[j] + nvme[j] + recompute[j] = 1
        keep: saved activations S_j stay on the GPU F_j..B_j;  host/nvme: offloaded in F_j and
        reloaded during B_{j+1};  recompute: forward again in B_j from boundary j
    per boundary j (binaries):  bgpu[j] + bhost[j] + bnvme[j] = recompute[j]
        a recomputed block's input boundary is kept on the GPU, or offloaded in F_j and reloaded
        during B_{j+1}
    resident  prefix[j] >= prefix[j+1] (binaries): the first blocks stay on the GPU for the whole run
        (parameters, optimizer state, gradient accumulator), a tie group whole: res[j] = prefix[first
        block of j's tie group].  Every streamed term below that belongs to block j -- its parameters
        P_j, accumulator Gacc_j and draining gradients D_j, its load, gradient offload and host
        update U_j -- is multiplied by (1 - res[j]); its GPU update U'_j by res[j]; and every memory row
        holds R_j res[j] for the whole run.  Fixed (0 or 1) unless the compile asks the solver to choose.
        With several ranks a resident block keeps its shard of that state (R_j: 1/N of it, plus its
        gathered parameters), is all-gathered once a step (its backward's AG_j is x (1 - res[j])) and
        reduce-scattered after its backward like a streamed block, so Gacc_j and D_j are not x (1 - res[j]).
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
    net       with several ranks (P_j, G_j, U_j are then one rank's shard): T_{F_j} >= AG_{j+1},
              T_{B_j} >= AG_{j-1} (1 - res[j-1]) + RS_{j+1}; block 0's RS_0 and the norms' all-reduce
              join the X chain
    updates   with exact clipping every update waits for the global norm (end of backward) and is
              lagged into the next step, in block order on the host, each before its block's load:
              T_X >= G_0/d2h + U_0 + P_0/h2d;  for j >= 1:
              T_X + sum_{k<j} T_{F_k} >= G_0/d2h + sum_{i<=j} U_i + P_j/h2d
              (without clipping: T_X >= G_0/d2h + U_0 + P_0/h2d and sum U <= T_X + sum_B T_w);
              resident blocks update on the GPU at the step's start: T_X >= sum_j U'_j res[j]
    memory    per window, GPU bytes of: parameters (current + prefetched), block j's gradient
              accumulator and backward temporaries (B_j), saved activations kept so far, offloaded ones
              in flight (two micro-batches: the lowering throttles compute to that) or
              reloaded, kept boundaries, reloaded boundaries, boundary gradients, and the block's
              workspace, plus what resident blocks hold  <=  budget.  B_j is checked at three moments:
              in program order (when the runtime allocates; block j-1's reloads, issued before B_j's
              backward, all held);  at the start in time order, without them but with block j+1's
              gradients still draining (accumulator + cast copy D_{j+1}, from the end of B_{j+1} for
              G_{j+1}/d2h) where B_j starts at once: under the first backward of a kept block
              (D_{j+1} keep[j]), under a recompute from a GPU boundary ((S_j + workspace_j) rec[j] +
              D_{j+1} bgpu[j]), and under its backward when the drain outlasts that recompute.  Those
              products with (1 - res[j+1]) are linearised (z >= overlap - res[j+1], z >= 0).
              Boundary values: micro-batch k of a window holds M - k of one side's and k + 1 of the
              other's: max(A_j, A_{j+1}) M + min(A_j, A_{j+1}).
              host: static store + M sum_j (S_j host[j] + A_j bhost[j]) <= budget;  NVMe likewise.
    head      the last block neither offloads nor stores its boundary off the GPU (it runs its
              forward and backward back to back).
    cuts      a compiled block with several cuts (``frontend/cuts.py``) has one binary per (placement, cut):
              keep[j] = sum_k keep[j,k] (host, nvme likewise), and every S_j above is the chosen cut's:
              S_j keep[j] -> sum_k S_jk keep[j,k]; its backward window adds M sum_k R_jk (keep+host+nvme)[j,k],
              its forward window M sum_k F_jk (keep+host+nvme)[j,k] (F: a measured cut's forward, else 0)
              (R_jk: what cut k recomputes) and its backward transient sum_k (S_j0 - S_jk) (...)[j,k] (the
              regenerated values); spill[j] and reload_late[j] are then in GiB (<= their fraction times the
              chosen cut's offloaded bytes) rather than fractions of S_j.  A block with one cut has the columns,
              rows and coefficients above exactly.

Coefficients come from the cost graph (``compiler/costgraph.py``), built for the streamed model.  The
model is small (8L binaries, 4L+1 continuous); identical layers are symmetric, so a time limit
returns the incumbent and its gap, and symmetry-breaking rows order kept layers.  The solve itself
runs in a child process (``solvers/isolated.py``).  The lowered plan's memory is checked afterwards
(``ir.verify`` in program order, the simulator in time order); a solution over budget is excluded by
a no-good cut and the MILP re-solved (a short chain; a long one's identical layers would offer the
excluded assignment's twins), else the window model's budget is tightened by the excess
(``compiler/search.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...ir import Decisions, Place, PlanError, Saved, SolverStats
from . import isolated
from .coefficients import MS, Coefficients, coefficients
from .lp import LinearModel, Var, xsum

__all__ = ["Coefficients", "MilpOptions", "build_model", "coefficients", "decode", "solve"]

#: relative gap at which a chain longer than ``SHORT_CHAIN`` blocks stops: 0.5% [ledger: milp-gap-target]
GAP_TARGET = 0.005
SHORT_CHAIN = 12
#: CBC's cut generation level: 2, moderate [ledger: milp-cbc-cuts]
CBC_CUTS = 2


@dataclass(frozen=True)
class MilpOptions:
    """What one solve is asked: the solvers to try in order, its time limit, exact clipping, and the
    resident blocks -- fixed (``resident``) or chosen by the solver among leading prefixes
    (``choose_resident``, with ``resident`` then the blocks that must be resident)."""

    clip: bool = True
    order: tuple[str, ...] = isolated.DEFAULT_ORDER
    time_limit: float = 10.0
    resident: frozenset = frozenset()
    choose_resident: bool = False
    #: a block whose saved activations or boundary are reloaded starts its backward while the next block's
    #: gradients drain (``memory_rows``): set once the time-ordered check of a solution found its peak under a drain
    drain_under_reloads: bool = False


@dataclass
class Variables:
    """The model's columns, named as the docstring names them."""

    keep: list
    host: list
    nvme: list
    rec: list
    bg: list
    bh: list
    bn: list
    spill: list
    late: list
    prefix: list
    res: list            # res[j]: prefix[first block of j's tie group]
    TF: list
    TB: list
    TX: Var
    decisions: list = field(default_factory=list)     # the binaries a no-good cut or a start names

    #: res[j] where the compile fixed it (0 or 1), None where the solver chooses
    fixed_res: list = field(default_factory=list)
    #: per block, per cut: keep / host / nvme binaries (one cut: the keep[j], host[j], nvme[j] columns themselves)
    keep_c: list = field(default_factory=list)
    host_c: list = field(default_factory=list)
    nvme_c: list = field(default_factory=list)

    def cuts(self, j: int) -> int:
        return len(self.keep_c[j])

    def saved(self, c: Coefficients, j: int, place: str):
        """GiB block j saves per micro-batch where ``place`` says ("keep", "host", "nvme", "off": host or nvme),
        at the chosen cut: S_j times the binary for a block of one cut."""
        cols = {"keep": (self.keep_c,), "host": (self.host_c,), "nvme": (self.nvme_c,),
                "off": (self.host_c, self.nvme_c)}[place]
        if self.cuts(j) == 1:
            x = cols[0][j][0] if len(cols) == 1 else cols[0][j][0] + cols[1][j][0]
            return c.S[j] * x
        return xsum(c.cut_S[j][k] * col[j][k] for col in cols for k in range(self.cuts(j)))

    def by_cut(self, c: Coefficients, j: int, coef: list):
        """sum_k coef[k] (keep+host+nvme)[j,k]: what the chosen cut adds (0 for a block of one cut)."""
        if self.cuts(j) == 1:
            return 0.0
        return xsum(coef[k] * (self.keep_c[j][k] + self.host_c[j][k] + self.nvme_c[j][k])
                    for k in range(1, self.cuts(j)) if coef[k])

    def spilled(self, c: Coefficients, j: int):
        """GiB of block j's offload per micro-batch that finishes in the next window."""
        return c.S[j] * self.spill[j] if self.cuts(j) == 1 else 1 * self.spill[j]

    def late_gib(self, c: Coefficients, j: int):
        """GiB of block j's reload per micro-batch that finishes in its own backward window."""
        return c.S[j] * self.late[j] if self.cuts(j) == 1 else 1 * self.late[j]

    def streamed(self, j: int):
        """1 - res[j]: the factor of block j's streamed terms."""
        return 1 - self.fixed_res[j] if self.fixed_res[j] is not None else 1 - self.res[j]

    def unless_resident(self, m: LinearModel, binary_sum, j: int, name: str):
        """``binary_sum * (1 - res[j])`` for a 0/1 sum of binaries: a constant factor where res[j] is
        fixed, else a new continuous z >= binary_sum - res[j], z >= 0 (exact at its minimum, and
        only rows bounding it from above use it)."""
        if self.fixed_res[j] is not None:
            return binary_sum * (1 - self.fixed_res[j])
        z = m.add_var(name)
        m += z >= binary_sum - self.res[j], f"{name}_bound"
        return z


def variables(m: LinearModel, c: Coefficients, opts: MilpOptions) -> Variables:
    L, M = c.L, c.M
    nv = 1.0 if c.use_nvme else 0.0
    K = [len(c.cut_S[j]) if c.cut_S else 1 for j in range(L)]
    keep_c = [[m.binary(f"keep_saved[{j}]" + (f"[cut {k}]" if k else "")) for k in range(K[j])] for j in range(L)]
    host_c = [[m.binary(f"saved_on_host[{j}]" + (f"[cut {k}]" if k else "")) for k in range(K[j])] for j in range(L)]
    nvme_c = [[m.binary(f"saved_on_nvme[{j}]" + (f"[cut {k}]" if k else ""), ub=nv) for k in range(K[j])]
              for j in range(L)]
    keep, host, nvme = ([col[j][0] if K[j] == 1 else xsum(col[j]) for j in range(L)]
                        for col in (keep_c, host_c, nvme_c))
    rec = [m.binary(f"recompute[{j}]") for j in range(L)]
    bg = [m.binary(f"boundary_on_gpu[{j}]") for j in range(L)]
    bh = [m.binary(f"boundary_on_host[{j}]") for j in range(L)]
    bn = [m.binary(f"boundary_on_nvme[{j}]", ub=nv) for j in range(L)]
    # transfers overlap the next window at micro-batch granularity: offloads of block j may finish
    # during F_{j+1} (at most two micro-batches: the lowering throttles compute), and reloads of
    # block k may finish during B_k (each micro-batch's backward waits only for its own)
    # (in GiB for a block of several cuts: a fraction times the chosen cut's bytes, bounded in ``choice_rows``)
    spill = [m.add_var(f"offload_spill[{j}]", ub=min(1.0, 2.0 / M) * (1 if K[j] == 1 else max(c.cut_S[j])))
             for j in range(L)]
    late = [m.add_var(f"reload_late[{j}]", ub=(M - 1) / M * (1 if K[j] == 1 else max(c.cut_S[j])))
            for j in range(L)]   # the first micro-batch is early
    prefix = []
    for j in range(L):
        fixed = 1.0 if j in opts.resident else None
        if fixed is None and not opts.choose_resident:
            fixed = 0.0
        lb, ub = (fixed, fixed) if fixed is not None else (0.0, 1.0)
        prefix.append(m.add_var(f"resident_prefix[{j}]", lb=lb, ub=ub, integer=True))
    res = [prefix[c.first_of_group[j]] for j in range(L)]
    TF = [m.add_var(f"T_F[{j}]") for j in range(L)]
    TB = [m.add_var(f"T_B[{j}]") for j in range(L)]
    TX = m.add_var("T_X")
    v = Variables(keep, host, nvme, rec, bg, bh, bn, spill, late, prefix, res, TF, TB, TX,
                  keep_c=keep_c, host_c=host_c, nvme_c=nvme_c)
    cols = [x for col in (keep_c, host_c, nvme_c) for j in range(L) for x in col[j][1:]]
    v.decisions = [*(x[0] for x in keep_c), *(x[0] for x in host_c), *(x[0] for x in nvme_c), *rec, *bg, *bh, *bn,
                   *prefix, *cols]
    v.fixed_res = [None if opts.choose_resident and c.first_of_group[j] not in opts.resident
                   else float(c.first_of_group[j] in opts.resident) for j in range(L)]
    return v


def choice_rows(m: LinearModel, c: Coefficients, v: Variables, opts: MilpOptions) -> None:
    L = c.L
    for j in range(L):
        m += v.keep[j] + v.host[j] + v.nvme[j] + v.rec[j] == 1, f"one_policy[{j}]"
        m += v.bg[j] + v.bh[j] + v.bn[j] == v.rec[j], f"boundary_iff_recompute[{j}]"
        if v.cuts(j) == 1:
            m += v.spill[j] <= v.host[j] + v.nvme[j], f"spill_only_offloads[{j}]"
            m += v.late[j] <= v.host[j] + v.nvme[j], f"late_only_reloads[{j}]"
        else:
            m += v.spill[j] <= min(1.0, 2.0 / c.M) * v.saved(c, j, "off"), f"spill_only_offloads[{j}]"
            m += v.late[j] <= (c.M - 1) / c.M * v.saved(c, j, "off"), f"late_only_reloads[{j}]"
    m += 1 * v.spill[L - 1] == 0, "nothing_after_the_last_forward"
    h = L - 1
    m += v.host[h] + v.nvme[h] + v.bh[h] + v.bn[h] == 0, "head_stays_on_gpu"
    m += 1 * v.bg[0] == 0, "batch_is_on_host"     # boundary 0 is the batch: reloaded from the host
    m += 1 * v.bn[0] == 0, "batch_not_on_nvme"
    if opts.choose_resident:
        for j in range(L - 1):
            m += v.prefix[j] >= v.prefix[j + 1], f"resident_is_a_prefix[{j}]"
    # symmetry breaking: among identical consecutive layers, prefer keeping later ones
    for j in c.symmetric:
        m += v.keep[j] <= v.keep[j + 1], f"sym_keep[{j}]"


def time_rows(m: LinearModel, c: Coefficients, v: Variables, opts: MilpOptions) -> None:
    L, M = c.L, c.M
    TF, TB, TX = v.TF, v.TB, v.TX
    boff = [v.bh[j] + v.bn[j] for j in range(L)]
    cut_ms = [v.by_cut(c, j, c.cut_R[j]) if c.cut_R else 0.0 for j in range(L)]
    cut_fwd_ms = [v.by_cut(c, j, c.cut_F[j]) if c.cut_F else 0.0 for j in range(L)]
    load = [c.load[j] * v.streamed(j) for j in range(L)]
    gout = [c.gout[j] * v.streamed(j) for j in range(L)]
    U = [c.U[j] * v.streamed(j) for j in range(L)]
    # a block that saves at its min-cut (kept or offloaded) runs the saving forward, measured apart from the plain one
    save_fwd_ms = [(c.fwd_save[j] - c.fwd[j]) * (v.keep_c[j][0] + v.host_c[j][0] + v.nvme_c[j][0])
                   if c.fwd_save and c.fwd_save[j] != c.fwd[j] else 0.0 for j in range(L)]
    rec_ms = c.fwd_save or c.fwd       # a recompute is a saving forward
    for j in range(L):
        m += TF[j] >= M * c.fwd[j] + M * cut_fwd_ms[j] + M * save_fwd_ms[j], f"gpu_F[{j}]"
        if j + 1 < L:
            m += TF[j] >= load[j + 1], f"h2d_F[{j}]"
        spilled_in = v.spilled(c, j - 1) if j >= 1 else 0.0
        m += TF[j] >= M * c.d2h_ms * (v.saved(c, j, "off") - v.spilled(c, j) + spilled_in + c.A[j] * boff[j]), \
            f"d2h_F[{j}]"
        if c.use_nvme:
            m += TF[j] >= M * c.nvw_ms * (v.saved(c, j, "nvme") + c.A[j] * v.bn[j]), f"nvme_F[{j}]"
        m += TB[j] >= M * c.bwd[j] + M * rec_ms[j] * v.rec[j] + M * cut_ms[j], f"gpu_B[{j}]"
        if j >= 1:
            k = j - 1
            reloads = M * c.h2d_ms * (v.saved(c, k, "off") - v.late_gib(c, k) + v.late_gib(c, j) + c.A[k] * boff[k])
            if j == L - 1:
                # the head runs forward and backward back to back: block L-2's parameters load while
                # the head's forward runs (nothing else uses H2D then); its reloads wait for the
                # head's backward window (their offloads may still be draining)
                m += TB[j] >= reloads, f"h2d_B[{j}]"
                m += TF[j] + TB[j] >= load[k] + reloads, f"h2d_head[{j}]"
            else:
                m += TB[j] >= (load[k] if k != L - 1 else 0.0) + reloads, f"h2d_B[{j}]"
            if c.use_nvme:
                m += TB[j] >= M * c.nvr_ms * (v.saved(c, k, "nvme") + c.A[k] * v.bn[k]), f"nvme_B[{j}]"
        if j + 1 < L:
            m += TB[j] >= gout[j + 1], f"d2h_B[{j}]"
        # the last late reload must land before the last micro-batch's backward can run
        m += TB[j] >= M * c.h2d_ms * v.late_gib(c, j) + c.bwd[j] + cut_ms[j], f"late_reload_then_backward[{j}]"
    # block 0's reloads happen before its backward (nothing left to hide them under)
    m += TB[0] >= M * c.bwd[0] + M * rec_ms[0] * v.rec[0] + M * cut_ms[0] + M * c.h2d_ms * c.A[0] * v.bh[0], \
        "h2d_B_first"
    m += TB[0] >= M * c.h2d_ms * v.late_gib(c, 0), "h2d_B_0_late"
    # with several ranks block 0's gradient is reduce-scattered before its offload, the norms all-reduced
    # before any update, and each load all-gathered before its forward (0 for one rank)
    net = [c.rs[0] + c.ar + c.ag[j] for j in range(L)] if c.ag else None
    if net:
        net_rows(m, c, v)
        m += TX >= gout[0] + U[0] + load[0] + net[0], "step_boundary_chain"
    else:
        m += TX >= gout[0] + U[0] + load[0], "step_boundary_chain"
    if any(c.U_gpu):
        m += TX >= xsum(c.U_gpu[j] * v.res[j] for j in range(L)), "resident_updates_on_gpu"
    if opts.clip:
        for j in range(1, L):
            m += TX + xsum(TF[:j]) >= gout[0] + xsum(U[: j + 1]) + load[j] + (net[j] if net else 0.0), \
                f"lazy_update[{j}]"
    else:
        m += TX + xsum(TB) >= xsum(U), "host_updates_fit"


def net_rows(m: LinearModel, c: Coefficients, v: Variables) -> None:
    """The collective stream, overlapped with compute as PCIe is: F_j all-gathers block j+1 (the
    prefetch), B_j all-gathers block j-1 and reduce-scatters block j+1's gradients.  A resident block is
    gathered once a step, in the forward, and kept to its backward: B_j's gather is (1 - res[j-1]) of it;
    its reduce-scatter stays (its shard accumulators are summed over the ranks as a streamed block's)."""
    L, TF, TB = c.L, v.TF, v.TB
    for j in range(L):
        if j + 1 < L:
            m += TF[j] >= c.ag[j + 1], f"net_F[{j}]"
        gather = c.ag[j - 1] * v.streamed(j - 1) if 1 <= j and j - 1 != L - 1 else 0.0
        scatter = c.rs[j + 1] if j + 1 < L else 0.0
        if gather or scatter:
            m += TB[j] >= gather + scatter, f"net_B[{j}]"


def memory_rows(m: LinearModel, c: Coefficients, v: Variables, drain_under_reloads: bool = False) -> None:
    L, M = c.L, c.M
    off = [v.saved(c, j, "off") for j in range(L)]      # GiB per micro-batch
    boff = [v.bh[j] + v.bn[j] for j in range(L)]
    P = [c.P[j] * v.streamed(j) for j in range(L)]
    held = xsum(c.R[j] * v.res[j] for j in range(L))     # what resident blocks hold for the whole run
    # with several ranks a resident block's gradients also accumulate gathered in B_j, summed into its shard
    # by a reduce-scatter that may end under B_{j-1}: its Gacc and its drain D are counted as a streamed one's
    sharded = bool(c.ag)
    acc = [c.Gacc[j] * (1.0 if sharded else v.streamed(j)) for j in range(L)]

    def drains(overlap, k: int, name: str):
        """The share of block k's gradient drain under an overlap (``v.unless_resident`` in a world of one)."""
        return overlap if sharded else v.unless_resident(m, overlap, k, name)
    for j in range(L):
        # boundary values in flight: micro-batch k of a window holds M - k of one side's values and
        # k + 1 of the other's (activations j -> j+1 forward, their gradients backward)
        flowing = max(c.A[j], c.A[j + 1]) * M + min(c.A[j], c.A[j + 1])
        kept = xsum(M * v.saved(c, i, "keep") + c.A[i] * M * v.bg[i] for i in range(j + 1))
        nxt = P[j + 1] if j + 1 < L else 0.0
        spilled = min(2, M) * off[j - 1] if j >= 1 else 0.0
        m += (held + P[j] + nxt + kept + flowing + min(2, M) * off[j] + spilled + c.W[j]
              <= c.budget), f"gpu_memory_F[{j}]"
        prev = j - 1
        pre_p = P[prev] if prev >= 0 else 0.0
        # block j's reloads (saved activations, or the boundary its recompute starts from) are in
        start = held + P[j] + pre_p + kept + flowing + M * off[j] + c.A[j] * M * boff[j]
        # in program order (when the runtime allocates) block j-1's reloads are issued before B_j's
        # backward: the allocator holds them all
        reloaded = M * off[prev] + c.A[prev] * M * boff[prev] if prev >= 0 else 0.0
        # a resident block j frees no parameter slot, so the load of block j-2 (which waits for the last
        # free, ``lower.load``) is in flight under B_j too, beside j-1's [ledger: milp-memory-rows]
        if j >= 2 and not sharded and v.fixed_res[j] != 0.0:
            res_j = v.res[j] if v.fixed_res[j] is None else v.fixed_res[j]
            reloaded = reloaded + c.P[j - 2] * v.unless_resident(m, res_j, j - 2, f"second_prefetch[{j}]")
        # a backward follows its micro-batch's recompute, which freed that micro-batch's boundary
        # (a cut's backward regenerates what it did not save: live while it runs)
        regen = v.by_cut(c, j, [c.cut_S[j][0] - s for s in c.cut_S[j]]) if c.cut_S else 0.0
        backward = (start - c.A[j] * v.rec[j] + acc[j] + c.S[j] * v.rec[j] + c.WB[j] + regen)
        m += backward + reloaded <= c.budget, f"gpu_memory_B[{j}]"
        if j + 1 < L:
            # early in B_j, before block j-1's reloads, block j+1's gradients are still draining
            # (cast, then D2H, from the end of B_{j+1}).  Certain only where B_j starts at once: a
            # kept block's first backward; a recompute from a GPU boundary (and its backward when
            # the drain outlasts that recompute).  A reload may hold B_j back past the drain; where the
            # reloads ran during B_{j+1} it does not (``drain_under_reloads``: the time-ordered check of a
            # solution found its peak under a drain; then a block whose saved activations or boundary are
            # reloaded is taken to start at once too [ledger: milp-memory-rows]).  A resident block j+1 drains
            # nothing in a world of one.
            at_once = v.bg[j] + (boff[j] if drain_under_reloads else 0.0)
            overlap = v.keep[j] + (at_once if c.gout[j + 1] > c.fwd[j] else 0.0) + \
                (off[j] if drain_under_reloads else 0.0)
            m += (backward + c.D[j + 1] * drains(overlap, j + 1, f"drain_under_B[{j}]")
                  <= c.budget), f"gpu_memory_B_start[{j}]"
            m += (start + (c.S[j] + c.W[j]) * v.rec[j]
                  + c.D[j + 1] * drains(1 * at_once, j + 1, f"drain_under_recompute[{j}]")
                  <= c.budget), f"gpu_memory_recompute[{j}]"
    if c.host_cap:
        m += c.host_static + M * xsum(v.saved(c, j, "host") + c.A[j] * v.bh[j] for j in range(L)) <= c.host_cap, \
            "host_memory"
    if c.use_nvme:
        m += M * xsum(v.saved(c, j, "nvme") + c.A[j] * v.bn[j] for j in range(L)) <= c.nvme_cap, "nvme_capacity"


def objective(c: Coefficients, v: Variables):
    """The step time, plus a tie-break: among plans of equal step time prefer the one keeping fewer
    bytes on the GPU (a margin for the time-ordered peak that the windows cannot see); 1e-4 ms per
    GiB never outweighs a real time difference at the solver's gap."""
    step = xsum(v.TF) + xsum(v.TB) + v.TX
    on_gpu = xsum(c.M * v.saved(c, j, "keep") + c.A[j] * c.M * v.bg[j] for j in range(c.L))
    return step + 1e-4 * on_gpu


def assignment(dec: Decisions, v: Variables, L: int) -> list[tuple[Var, float]] | None:
    """Decisions as values of the decision binaries (a MIP start or a no-good cut), when they lie in
    this model's space (single-block recompute segments only)."""
    if any(s is Saved.RECOMPUTE and dec.boundary[j] is Place.NONE for j, s in enumerate(dec.saved) if j > 0):
        return None
    out = []
    for j in range(L):
        s, cut = dec.saved[j], dec.cut_of(j)
        if cut >= v.cuts(j):
            return None
        for col, place in ((v.keep_c, Saved.KEEP), (v.host_c, Saved.HOST), (v.nvme_c, Saved.NVME)):
            out += [(col[j][k], float(s is place and k == cut)) for k in range(v.cuts(j))]
        out.append((v.rec[j], float(s is Saved.RECOMPUTE)))
        p = dec.boundary[j] if s is Saved.RECOMPUTE else Place.NONE
        if j == 0 and s is Saved.RECOMPUTE:
            p = Place.HOST
        out += [(v.bg[j], float(p is Place.GPU)), (v.bh[j], float(p is Place.HOST)), (v.bn[j], float(p is Place.NVME))]
    if v.fixed_res[0] is None or any(r is None for r in v.fixed_res):
        res = dec.resident_blocks
        k = next((j for j in range(L) if j not in res), L)        # the leading prefix it keeps
        out += [(v.prefix[j], float(j < k)) for j in range(L)]
    return out


def build_model(c: Coefficients, opts: MilpOptions, *, warm: Decisions | None = None,
                exclude: tuple = ()) -> tuple[LinearModel, Variables]:
    """The whole model: columns, choice, time and memory rows, objective, no-good cuts, start."""
    m = LinearModel()
    v = variables(m, c, opts)
    choice_rows(m, c, v, opts)
    time_rows(m, c, v, opts)
    memory_rows(m, c, v, opts.drain_under_reloads)
    m.objective = objective(c, v)
    for n, bad in enumerate(exclude):
        ones = assignment(bad, v, c.L) or []
        on = [var for var, x in ones if x > 0.5]
        off = [var for var, x in ones if x <= 0.5]
        if on:
            m += xsum(1 - var for var in on) + xsum(off) >= 1, f"no_good[{n}]"
    if warm is not None:
        m.start = [(var.index, x) for var, x in assignment(warm, v, c.L) or []]
    return m, v


def decode(v: Variables, x: list[float], *, micro_batch: int, n_micro: int, objective_s: float) -> Decisions:
    def on(var) -> bool:
        return (x[var.index] if isinstance(var, Var) else var.value(x)) > 0.5

    L = len(v.keep)
    saved, boundary, cut = [], [], []
    for j in range(L):
        saved.append(Saved.KEEP if on(v.keep[j]) else Saved.HOST if on(v.host[j]) else
                     Saved.NVME if on(v.nvme[j]) else Saved.RECOMPUTE)
        cut.append(next((k for k in range(v.cuts(j)) for col in (v.keep_c, v.host_c, v.nvme_c) if on(col[j][k])), 0))
        boundary.append(Place.GPU if on(v.bg[j]) else Place.HOST if on(v.bh[j]) else
                        Place.NVME if on(v.bn[j]) else Place.NONE)
    if saved[0] is Saved.RECOMPUTE:
        boundary[0] = Place.HOST
    resident = tuple(on(v.res[j]) for j in range(L))
    return Decisions(policy="milp", micro_batch=micro_batch, n_micro=n_micro, boundary=tuple(boundary),
                     saved=tuple(saved), resident=resident if any(resident) else (),
                     notes={"objective_s": objective_s}, cut=tuple(cut) if any(cut) else ())


def solve(c: Coefficients, opts: MilpOptions, *, micro_batch: int, warm: Decisions | None = None,
          exclude: tuple = ()) -> tuple[Decisions, SolverStats]:
    """Solve one micro-batch's model in the solver process.  Raises ``PlanError`` (with ``.stats``)
    when there is no plan, ``isolated.SolverFailure`` when every solver failed."""
    m, v = build_model(c, opts, warm=warm, exclude=exclude)
    gap = GAP_TARGET if c.L > SHORT_CHAIN else 1e-9
    r = isolated.solve(m, order=opts.order, time_limit=opts.time_limit, gap=gap, cuts=CBC_CUTS)
    step_s = sum(r.x[t.index] for t in (*v.TF, *v.TB, v.TX)) / MS if r.ok else None
    stats = SolverStats(status=r.status, objective=step_s, gap=r.gap if r.ok else None, n_vars=m.n_vars,
                        n_constraints=m.n_rows, seconds=round(r.seconds, 3), solver=r.solver,
                        failures=tuple(r.failures))
    if not r.ok:
        within = f" within the time limit of {opts.time_limit:.1f} s" if r.status != "infeasible" else ""
        err = PlanError(f"no feasible plan found at micro-batch {micro_batch} ({r.status}{within})")
        err.stats = stats
        raise err
    return decode(v, r.x, micro_batch=micro_batch, n_micro=c.M, objective_s=step_s), stats
