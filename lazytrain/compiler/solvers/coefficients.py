"""The MILP's coefficients: every number its rows use, per block, in milliseconds and GiB (``milp.py``'s
docstring is the formulation), read off the streamed cost graph (``compiler/costgraph.py``) and, for compiled
blocks, each cut's saved bytes and backward time (``frontend/cuts.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...ir import GiB, TensorId, TensorKind
from ...ir.semantics import static_host_bytes, tie_closure
from ..budgets import Budgets
from ..costgraph import block_attr, build_cost_graph

MS = 1e3


@dataclass(frozen=True)
class Coefficients:
    """Every number the rows use, per block (ms, GiB), read off the streamed cost graph."""

    L: int
    M: int
    P: list
    Gacc: list
    S: list
    A: list
    W: list
    WB: list
    D: list
    fwd: list
    bwd: list
    U: list
    U_gpu: list
    R: list
    load: list
    gout: list
    first_of_group: list
    symmetric: list
    h2d_ms: float
    d2h_ms: float
    nvw_ms: float
    nvr_ms: float
    budget: float
    host_cap: float | None
    host_static: float
    nvme_cap: float
    use_nvme: bool
    #: per block, per cut (``Block.cuts``; one entry: the min-cut only): saved GiB, backward ms it adds, and
    #: forward ms it adds (empty unless a cut's forward was measured: ``CostModel.cut_forward_s``)
    cut_S: list = field(default_factory=list)
    cut_R: list = field(default_factory=list)
    cut_F: list = field(default_factory=list)
    #: per block, ms of its forward that saves for backward at the min-cut (kept, offloaded, or recomputed in the
    #: backward), where that differs from ``fwd``, the forward that saves nothing: measured blocks only
    #: (``CostModel.saving_fwd_s``); empty: every block's is ``fwd``
    fwd_save: list = field(default_factory=list)
    #: with several ranks (``ir.sharding``): per block its all-gather and reduce-scatter on the collective
    #: stream, and the all-reduce of the norms (empty / 0 in a world of one: no rows)
    ag: list = field(default_factory=list)
    rs: list = field(default_factory=list)
    ar: float = 0.0


def coefficients(cost, budgets: Budgets | dict, n_micro: int, host_bytes_per_param: float,
                 gpu_bytes: int | None = None, state_on_nvme: tuple[int, int] = (0, 0)) -> Coefficients:
    """``cost``: the streamed CostModel at the solve's micro-batch (no resident blocks); ``budgets``: the compile's
    (or a plan's dict of them).  ``state_on_nvme``: host bytes the state kept on NVMe frees, less its host copies in
    flight, and the bytes of its files (``state_placement.StateFit``): the host row's and the NVMe row's fixed
    terms."""
    g, hw = cost.graph, cost.hw
    budgets = Budgets.of(budgets)
    L = g.n_blocks
    cg = build_cost_graph(cost)
    per_resident = cost.sizes.resident_bytes_per_param()
    freed, files = state_on_nvme
    nvme_cap = max((budgets.nvme_bytes or 0) - files, 0)
    symmetric = [j for j in range(1, L - 1)
                 if (a := g.blocks[j]).kind == (b := g.blocks[j + 1]).kind == "layer"
                 and a.saved_bytes == b.saved_bytes and a.fwd_flops == b.fwd_flops]
    return Coefficients(
        L=L, M=n_micro,
        P=[b / GiB for b in block_attr(cg, "params_bytes")],
        Gacc=[b / GiB for b in block_attr(cg, "grad_accum_bytes")],
        S=[b / GiB for b in block_attr(cg, "saved_bytes")],
        A=[cg.nodes[("boundary", i)]["bytes"] / GiB for i in range(L + 1)],
        W=[b / GiB for b in block_attr(cg, "workspace_bytes")],
        WB=[b / GiB for b in block_attr(cg, "backward_transient_bytes")],
        D=[b / GiB for b in block_attr(cg, "grad_drain_bytes")],
        fwd=[t * MS for t in block_attr(cg, "fwd_s")],
        bwd=[t * MS for t in block_attr(cg, "bwd_s")],
        U=[t * MS for t in block_attr(cg, "update_s")],
        U_gpu=[hw.gpu_update_seconds(b.trainable_numel / cost.world_size, cost.eight_bit) * MS
               if b.trainable_numel else 0.0 for b in g.blocks],
        R=[_resident_gib(cost, j, per_resident) for j in range(L)],
        load=[t * MS for t in block_attr(cg, "load_s")],
        gout=[t * MS for t in block_attr(cg, "grad_offload_s")],
        first_of_group=[min(tie_closure(g, [j])) for j in range(L)],
        symmetric=symmetric,
        h2d_ms=hw.h2d_seconds(GiB) * MS, d2h_ms=hw.d2h_seconds(GiB) * MS,
        nvw_ms=hw.nvme_seconds(GiB, True) * MS, nvr_ms=hw.nvme_seconds(GiB, False) * MS,
        budget=(gpu_bytes if gpu_bytes is not None else budgets.gpu_bytes) / GiB,
        host_cap=budgets.host_bytes / GiB if budgets.host_bytes else None,
        host_static=(static_host_bytes(g, host_bytes_per_param, cost.sizes.param_dtype, cost.sizes.base_bits)
                     / cost.world_size - freed) / GiB,   # one rank's shard
        nvme_cap=nvme_cap / GiB, use_nvme=bool(budgets.nvme_dir) and nvme_cap > 0,
        ag=[cost.all_gather_s(j) * MS for j in range(L)] if cost.sharded else [],
        rs=[cost.reduce_scatter_s(j) * MS for j in range(L)] if cost.sharded else [],
        ar=cost.all_reduce_s() * MS if cost.sharded else 0.0,
        cut_S=[[cost.saved_bytes(j, k) / GiB for k in range(cost.n_cuts(j))] for j in range(L)],
        cut_R=[[cost.cut_recompute_s(j, k) * MS for k in range(cost.n_cuts(j))] for j in range(L)],
        cut_F=_cut_forward_ms(cost),
        fwd_save=_saving_forward_ms(cost))


def _cut_forward_ms(cost) -> list:
    """Per block, per cut: forward ms the cut adds; empty where no cut's forward was measured (the rows stay as
    they were without measured cuts)."""
    out = [[cost.cut_forward_s(j, k) * MS for k in range(cost.n_cuts(j))] for j in range(cost.graph.n_blocks)]
    return out if any(any(row) for row in out) else []


def _saving_forward_ms(cost) -> list:
    """Per block, its forward's ms when it saves for backward at the min-cut; empty where no block's differs
    from its plain forward (modelled blocks: the rows stay as they were)."""
    out = [cost.saving_fwd_s(j) * MS for j in range(cost.graph.n_blocks)]
    return out if any(abs(t - cost.fwd_s(j) * MS) > 0 for j, t in enumerate(out)) else []


def _resident_gib(cost, j: int, per_resident: float) -> float:
    """GiB block j holds on the GPU for the whole run when resident: its state; with several ranks its
    shard of it plus the gathered parameters, kept from its forward's all-gather to its backward (for a
    prefix, nearly the whole step: counted for all of it).  The gathered fp32 accumulator lives from its
    backward to its reduce-scatter, as a streamed block's does: ``memory_rows`` counts it in B_j."""
    n = cost.sizes.trainable_shard_numel(j)
    if not cost.sharded:       # a frozen parameter: on the GPU in the parameter dtype, no state, no accumulator
        return (n * per_resident + cost.sizes.frozen_shard_numel(j) * cost.sizes.param_bytes) / GiB
    return (n * per_resident + cost.sizes.of(TensorId(kind=TensorKind.PARAMS, index=j))) / GiB
