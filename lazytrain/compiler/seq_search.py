"""``compile(seq_len="max")``: the longest sequence whose plan fits the budgets at a given batch.

Every figure of a block depends on the sequence length (activations and matmuls linearly, attention
quadratically), so each length probed is traced again (a few seconds for a large model, on ``meta``).
Memory only grows with the length, so feasibility is monotone: the search doubles from ``START``
tokens until a length does not fit (or ``limit``), then bisects down to ``1 / RESOLUTION`` of the
answer, rounded to a power of two times a whole number, as ``--batch max`` does for the batch.

A length fits when the leanest plan the chosen policy has fits every budget: for the MILP, every block
recomputed, every boundary on the host, the smallest micro-batch (that plan lies in the MILP's space,
so the MILP then finds one at least as good); for a fixed policy, its own plan.  The length that
does not fit names its binding constraint: the budget the leanest plan exceeds, and by how much.  With
``seq_tile="auto"`` a length that does not fit is probed again with the layers' tails tiled
(``tiling.py``).  The answer is then compiled as any length is, and the plan's notes carry the search's
result.
"""

from __future__ import annotations

import dataclasses

from ..frontend.presets import build_model
from ..frontend.trace import trace
from ..frontend.validate import declared_positions, scaled_rope
from ..ir import PlanError
from ..ir.graph import TILE_TOKENS, ModelGraph
from .auto_tile import compile_tiled
from .budgets import BudgetError, binding, make_budgets
from .builder import Compiler
from .profiles import get_profile
from .request import CompileRequest
from .resident import resident_request
from .search import Search
from .solvers.heuristics import HEURISTICS

#: the search starts here and doubles: long enough that short lengths cost no probes
START = 1024
#: the smallest length searched, and the step below START
MIN_SEQ = 128
#: the answer is within 1/RESOLUTION of the longest feasible length (at least MIN_SEQ)
RESOLUTION = 64
#: the longest length searched: a million tokens, past any context the supported models are trained for
LIMIT = 1 << 20


#: with calibration, how often the longest length steps down when the measured transients do not fit it
CALIBRATED_RETRIES = 3


def _final_plan(model, graphs: dict, req: CompileRequest, lo: int, hi: int, why: dict):
    """(plan, length, the shortest length known not to fit) at the search's answer ``lo``.  Calibration times
    the model's blocks, so it needs the model (else the probe's trace serves), and it measures their transients
    too (``compiler/measured_workspace.py``): where those do not fit ``lo``, a length 1/16 shorter is tried,
    measured again."""
    attempt = 0
    while True:
        try:
            return compile_tiled(model if req.calibrate else graphs[lo],
                                            dataclasses.replace(req, seq_len=lo)), lo, hi
        except BudgetError as e:
            shorter = (lo - lo // 16) // _step(lo) * _step(lo)
            attempt += 1
            if not req.calibrate or attempt > CALIBRATED_RETRIES or shorter < MIN_SEQ:
                raise
            hi, why[lo], lo = lo, f"the measured transients do not fit: {e}", shorter


def _step(seq: int) -> int:
    """The bisection's resolution at ``seq``: a power of two about ``seq / RESOLUTION``, at least MIN_SEQ."""
    return max(MIN_SEQ, 1 << max(0, seq.bit_length() - RESOLUTION.bit_length()))


def _leanest(comp, policy: str, batch: int, micro_batch: int | None):
    """The leanest plan ``policy`` has at this length, built without budgets: for the MILP, the frugal plan
    (``Search.leanest``); for a fixed policy, its own plan; at the smallest micro-batch either way."""
    mb = micro_batch or 1
    if policy not in HEURISTICS:
        return Search(comp).leanest(batch, mb)
    return comp.build(comp.with_resident(HEURISTICS[policy](comp.graph, mb, batch // mb)), batch, check_budget=False)


def compile_max_seq(model, req: CompileRequest):
    """The plan of ``req`` (``seq_len="max"``) at the longest feasible length (module docstring)."""
    if isinstance(model, ModelGraph):
        raise ValueError("seq_len='max' needs the model (a module, preset or config): a traced ModelGraph has one "
                         "sequence length")
    batch, policy = req.batch_size, req.policy.value
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"seq_len='max' needs a fixed batch (a positive integer), got {batch!r}")
    if isinstance(model, str):
        model = build_model(model)
    declared = declared_positions(model)
    # past the positions a model declares it fails or extrapolates (validate.check_positions), unless its
    # config scales the rotary embedding for longer sequences
    limit = declared if declared is not None and not scaled_rope(model) else LIMIT
    hw = get_profile(req.hardware)
    budgets = make_budgets(hw, req.gpu_memory, req.host_memory, req.nvme_dir, req.nvme_memory, req.reserve)
    graphs: dict[int, ModelGraph] = {}
    why: dict[int, str | None] = {}

    tile = req.seq_tile
    tiles = [None, TILE_TOKENS] if tile == "auto" else [tile]

    def fits(seq: int) -> bool:
        """Does the leanest plan fit at ``seq``: untiled, else (``seq_tile="auto"``) with the tails tiled?"""
        if seq in why:
            return why[seq] is None
        for t in [t for t in tiles if t is None or seq > t] or [None]:
            graph = trace(model, seq_len=seq, dtype=req.param_dtype, seq_tile=t, compile_blocks=req.compile_blocks)
            if t is not None and not graph.meta.get("seq_tile") and seq in why:
                continue        # nothing to tile: the untiled probe stands
            fixed, _ = resident_request(graph, req.resident)
            comp = Compiler(graph, hw, budgets, param_dtype=req.param_dtype, optimizer=req.optimizer, clip=req.clip,
                            resident=fixed, base_bits=req.base_bits)
            try:
                why[seq] = binding(_leanest(comp, policy, batch, req.micro_batch), budgets)
            except PlanError as e:
                why[seq] = str(e)
            graphs[seq] = graph
            if why[seq] is None:
                break
        return why[seq] is None

    lo, hi = 0, START
    while fits(hi):
        lo = hi
        if lo >= limit:
            break
        hi = min(2 * hi, limit)
    while hi - lo > _step(lo):
        mid = (lo + hi) // 2 // _step(lo) * _step(lo)
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        raise BudgetError(f"no sequence of {MIN_SEQ} tokens or more fits batch {batch} (seq {hi}: {why[hi]})")
    plan, lo, hi = _final_plan(model, graphs, req, lo, hi, why)
    if lo < limit:
        note = f"longest feasible seq {lo} at batch {batch}; seq {hi} does not fit: {why[hi]}"
    elif limit == LIMIT:
        note = f"seq {lo}: the search's limit; longer may fit"
    else:
        note = (f"seq {lo}: the positions the model declares (max_position_embeddings); a config that scales "
                f"its rotary embedding (rope_scaling) may go longer")
    if declared is not None and lo > declared:
        note += f" (beyond the model's {declared} declared positions: its rope scaling covers them)"
    plan.decisions.notes["seq_search"] = note
    return plan
