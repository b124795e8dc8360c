"""The compile's stages over one ``CompileRequest`` (``compiler/request.py``) of one length, one tiling and no
calibration: ``run`` calls them in order, each a function of the request and the stage before:

1. ``resolve_graph``: the model traced, or its trace read from the cache;
2. ``budgets_for``: the memory budgets (per rank in a world of several);
3. ``compiler_for``: the ``Compiler`` (``compiler/builder.py``): the loss head's chunk and the measured workspaces
   applied to the graph, the resident blocks asked for, the state kept on NVMe where the host cannot hold it
   (``compiler/state_placement.py``);
4. ``searched``: the best plan of the policy (``compiler/search.py``; every plan it builds is lowered, verified and
   simulated), or the ``BudgetError`` that says what memory would make one fit;
5. ``gpu_updated``: the GPU-updated streamed blocks asked for, or the rule's (``compiler/gpu_update.py``);
6. ``with_loss_head``: the single-pass loss head where it is faster (``compiler/loss_chunk.py``);
7. ``returned``: the plan handed back, a copy, with the megatrain step beside it.

The outer searches sit above this module, each a loop over requests that calls the level below it, never one
above: ``compiler/api.py`` (``compile_request``: the longest sequence, ``seq_search.py``) -> ``auto_tile.py`` (the
tiling) -> ``fixed.py`` (the calibration, supplied by the layer that runs models; a preset's seeded search,
``background_trace.py``) -> ``run`` here.  Each stage's wall time goes into ``plan.history``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

from ..frontend.trace_cache import TraceCache, trace_and_store
from ..frontend.validate import check_compile_args
from ..ir import Plan
from ..ir.graph import ModelGraph
from . import gpu_update as gpu_update_rule
from . import state_placement
from .budgets import Budgets, budget_error, make_budgets
from .builder import Compiler
from .hardware import HardwareProfile
from .loss_chunk import faster_head, single_pass_rows, with_loss_chunk
from .measured_workspace import with_measured_workspace
from .options import LossHead, Policy
from .profiles import get_profile
from .progress import caller_stacklevel, log
from .request import CompileRequest
from .resident import resident_request
from .search import Search
from .solvers import isolated
from .world import per_rank_budgets


def checked_run(model, req: CompileRequest) -> Plan:
    """``run`` after the request's sizes are checked against the model (``frontend/validate.py``)."""
    check_compile_args(model, batch_size=req.batch_size, seq_len=req.seq_len, micro_batch=req.micro_batch,
                       nvme_dir=req.nvme_dir)
    return run(model, req)


def run(model, req: CompileRequest) -> Plan:
    """The stages of the module docstring, in order."""
    history: list[dict] = []
    t0 = time.perf_counter()
    if req.policy is Policy.MILP:
        isolated.prestart(req.solver.value)       # its start-up overlaps the trace
    hw = get_profile(req.hardware)
    graph = resolve_graph(model, req, history)
    budgets = budgets_for(req, hw)
    search = Search(compiler_for(graph, hw, budgets, req))
    plan = searched(search, req)
    plan = gpu_updated(search, plan, req)
    plan = with_loss_head(search, plan, req)
    if plan.decisions.notes.get("milp_failed"):
        warnings.warn(f"micro-batch {plan.micro_batch}: {plan.decisions.notes['milp_fallback']}",
                      stacklevel=caller_stacklevel())
    if search.failures:
        warnings.warn("the MILP solvers failed (" + "; ".join(search.failures) + "); the plan comes from "
                      f"the {plan.decisions.policy} policy where they did (plan.solver.failures)",
                      stacklevel=caller_stacklevel())
    plan = returned(search, plan, req)
    plan.history = [*history, *plan.history, {"pass": "total", "seconds": round(time.perf_counter() - t0, 4)}]
    return plan


def resolve_graph(model, req: CompileRequest, history: list) -> ModelGraph:
    """``model``'s graph at the request's length: a traced ``ModelGraph`` as given (checked against the request), else
    read from the trace cache, else traced (and stored for later compiles); the pass goes into ``history``."""
    seq_len, dtype, packed, seq_tile, compiled = (req.seq_len, req.param_dtype, req.packed, req.seq_tile,
                                                  req.compile_blocks)
    if isinstance(model, ModelGraph):
        if packed and not model.meta.get("packed"):
            raise ValueError("packed=True but the ModelGraph given was traced unpacked: trace it with packed=True")
        if compiled and "compiled_blocks" not in model.meta:
            raise ValueError("compile_blocks=True but the ModelGraph given was traced for eager blocks: trace it "
                             "with compile_blocks=True")
        return model
    t = time.perf_counter()
    # a preset or config found in the trace cache is never built: building imports transformers; a trace for
    # compiled blocks (its saved bytes come from the partitioner) is not cached
    cache = None if compiled else TraceCache.of(model, seq_len=seq_len, dtype=dtype, packed=packed, seq_tile=seq_tile)
    graph = None if cache is None else cache.load()
    hit = graph is not None
    if not hit:
        log.info("tracing %s at %s tokens%s", model if isinstance(model, str) else type(model).__name__,
                 f"{seq_len:,}", "" if cache is None else " (not in the trace cache yet: later compiles read it)")
        graph = trace_and_store(model, cache, seq_len=seq_len, dtype=dtype, packed=packed, seq_tile=seq_tile,
                                compile_blocks=compiled)
        log.info("traced: %d blocks in %.1f s", graph.n_blocks, time.perf_counter() - t)
    history.append({"pass": "trace", "seconds": round(time.perf_counter() - t, 4),
                    **({"cached": True} if hit else {})})
    return graph


def budgets_for(req: CompileRequest, hw: HardwareProfile) -> Budgets:
    """The request's memory budgets on ``hw`` (``budgets.make_budgets``); a rank's share in a world of several."""
    budgets = make_budgets(hw, req.gpu_memory, req.host_memory, req.nvme_dir, req.nvme_memory, req.reserve)
    if req.world_size != 1 or req.nodes != 1:       # (the world's shape: checked in the request)
        budgets = per_rank_budgets(budgets, req.world_size, req.nodes)
    return budgets


def compiler_for(graph: ModelGraph, hw: HardwareProfile, budgets: Budgets, req: CompileRequest) -> Compiler:
    """The ``Compiler`` of the request: the graph with its loss head's chunk chosen and the measured workspaces
    applied, the resident blocks asked for, whether the GPU-update rule follows the search."""
    graph = with_loss_chunk(graph, budgets.gpu_bytes, _forced_single_rows(graph, budgets, req.loss_head))
    graph = with_measured_workspace(graph, hw)               # calibrated transients, where they exceed the traced
    fixed, auto = resident_request(graph, req.resident)
    policy = req.policy.value
    comp = Compiler(graph, hw, budgets, param_dtype=req.param_dtype, optimizer=req.optimizer, clip=req.clip,
                    solver=req.solver, time_limit=req.time_limit, resident=fixed,
                    choose_resident=auto and policy == "milp" and hw.has_gpu, world_size=req.world_size,
                    nodes=req.nodes, compile_blocks=req.compile_blocks, deadline=req.deadline,
                    rule_follows=gpu_update_rule.rule_runs(req.gpu_update, policy, hw.has_gpu, req.world_size),
                    base_bits=req.base_bits)
    comp.nvme_state = state_placement.place(comp, req.batch_size)
    return comp


def _forced_single_rows(graph: ModelGraph, budgets: Budgets, mode: LossHead) -> int | None:
    """Rows a chunk of the single-pass loss head asked for takes (one sample's at most, as the recompute's chunk),
    else None: the recompute, which ``faster_head`` may turn into a single pass after the search."""
    head = graph.meta.get("loss_head")
    if mode is not LossHead.SINGLE_PASS or not isinstance(head, dict) or not budgets.gpu_bytes:
        return None
    return (single_pass_rows(head, budgets.gpu_bytes, head["seq_len"]) or [1])[0]


def searched(search: Search, req: CompileRequest) -> Plan:
    """The best plan of the request's policy at its batch (or the largest batch with one, for ``"max"``), or the
    ``BudgetError`` that says what memory would make one fit."""
    policy, batch_size, micro_batch = req.policy.value, req.batch_size, req.micro_batch
    if batch_size == "max":
        limit = req.max_batch_limit
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_batch_limit must be a positive integer, got {limit!r}")
        plan, tried = search.max_batch(policy, micro_batch, limit)
        if plan is None:
            raise budget_error(search, tried, micro_batch)
        return plan
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer or 'max', got {batch_size!r}")
    plan = search.best(policy, batch_size, micro_batch)
    if plan is None:
        raise budget_error(search, batch_size, micro_batch, policy)
    return plan


def gpu_updated(search: Search, plan: Plan, req: CompileRequest) -> Plan:
    """The searched plan with the GPU-updated streamed blocks asked for, or (``"auto"``, the MILP policy on a
    GPU in a world of one) those the rule of ``compiler/gpu_update.py`` chooses."""
    gpu_req = req.gpu_update
    if gpu_req == "auto":           # (``rule_follows``: the MILP policy, a GPU, a world of one)
        return gpu_update_rule.choose(search, plan) if search.comp.rule_follows else plan
    if gpu_req == "none":
        return plan
    return gpu_update_rule.fixed(search, plan, gpu_req, req.policy.value, req.micro_batch)   # (a world of one)


def with_loss_head(search: Search, plan: Plan, req: CompileRequest) -> Plan:
    """The plan with the single-pass loss head where it still fits and is faster (``loss_head="auto"`` on a GPU)."""
    if req.loss_head is LossHead.AUTO and search.comp.hw.has_gpu:
        return faster_head(search, plan)
    return plan


def returned(search: Search, plan: Plan, req: CompileRequest) -> Plan:
    """The plan handed to the caller: a copy, so the search's memo stays as it was, with the step time
    of the megatrain policy at its batch for comparison."""
    plan = dataclasses.replace(plan, predicted=dict(plan.predicted), budgets=dict(plan.budgets))
    if req.policy is not Policy.MEGATRAIN:
        base = search.best("megatrain", plan.batch_size)
        if base is not None:
            plan.predicted["megatrain_step_time_s"] = base.predicted["step_time_s"]
    return plan
