"""``compile_model``: model -> verified, simulated Plan.  The passes, in order:
trace -> cost -> solve (policy, per candidate micro-batch) -> lower -> verify -> simulate.
Each pass's wall time goes into ``plan.history``."""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings

from ..frontend.trace_cache import TraceCache, trace_and_store
from ..frontend.validate import check_compile_args, micro_batch_candidates
from ..ir import GiB, OpKind, Place, Plan, PlanError, Saved, verify
from ..ir.graph import ModelGraph
from ..util.torch_free import is_dtype
from . import background_trace
from . import gpu_update as gpu_update_rule
from .budgets import BudgetError, budget_error, held_host_bytes, make_budgets  # noqa: F401 - BudgetError: what compile_model raises
from .cost import CostModel
from .loss_chunk import LOSS_HEAD_MODES, faster_head, single_pass_rows, with_loss_chunk
from .lower import lower_with_effects
from .measured_workspace import with_measured_workspace
from .paused_gc import paused_gc
from .profiles import get_profile
from .progress import log
from .resident import resident_request
from .search import Search
from .simulate import SimResult, simulate
from .solvers import isolated
from .solvers.isolated import DEFAULT_ORDER, SOLVERS
from .world import check_world, per_rank_budgets

POLICIES = ("milp", "megatrain", "recompute-all", "keep-all")
DEFAULT_SOLVER = DEFAULT_ORDER[0]
#: seconds one MILP solve may take by default; a time limit returns the incumbent and its gap
SOLVE_TIME_LIMIT = 10.0
#: host bytes per parameter by optimizer (load buffer + grad buffer + master + states)
HOST_BYTES_PER_PARAM = {"hybrid8bit": 8.25, "adamw": 16.0}


def _as_graph(model, seq_len: int, param_dtype: str, history: list, packed: bool = False,
              seq_tile: int | None = None, compile_blocks: bool = False) -> ModelGraph:
    if isinstance(model, ModelGraph):
        if packed and not model.meta.get("packed"):
            raise ValueError("packed=True but the ModelGraph given was traced unpacked: trace it with packed=True")
        if compile_blocks and "compiled_blocks" not in model.meta:
            raise ValueError("compile_blocks=True but the ModelGraph given was traced for eager blocks: trace it "
                             "with compile_blocks=True")
        return model
    t = time.perf_counter()
    # a preset or config found in the trace cache is never built: building imports transformers; a trace for
    # compiled blocks (its saved bytes come from the partitioner) is not cached
    cache = None if compile_blocks else TraceCache.of(model, seq_len=seq_len, dtype=param_dtype, packed=packed,
                                                      seq_tile=seq_tile)
    graph = None if cache is None else cache.load()
    hit = graph is not None
    if not hit:
        log.info("tracing %s at %s tokens%s", model if isinstance(model, str) else type(model).__name__,
                 f"{seq_len:,}", "" if cache is None else " (not in the trace cache yet: later compiles read it)")
        graph = trace_and_store(model, cache, seq_len=seq_len, dtype=param_dtype, packed=packed, seq_tile=seq_tile,
                                compile_blocks=compile_blocks)
        log.info("traced: %d blocks in %.1f s", graph.n_blocks, time.perf_counter() - t)
    history.append({"pass": "trace", "seconds": round(time.perf_counter() - t, 4),
                    **({"cached": True} if hit else {})})
    return graph


class Compiler:
    """Everything fixed for one compile: graph, hardware, budgets, options; ``search`` answers the
    questions about plans (``compiler/search.py``)."""

    def __init__(self, graph: ModelGraph, hw, budgets: dict, *, param_dtype: str, optimizer: str, clip: bool,
                 solver: str = DEFAULT_SOLVER, time_limit: float | None = None, resident: frozenset = frozenset(),
                 choose_resident: bool = False, world_size: int = 1, nodes: int = 1, compile_blocks: bool = False,
                 deadline: float | None = None, rule_follows: bool = False):
        if solver not in SOLVERS:
            raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
        self.graph, self.hw, self.budgets = graph, hw, budgets
        #: blocks every plan of this compiler keeps on the GPU (``Decisions.resident``), and whether the
        #: MILP may keep a leading prefix of the others too
        self.resident = frozenset(resident)
        self.choose_resident = choose_resident
        self.param_dtype, self.optimizer, self.clip = param_dtype, optimizer, clip
        #: the solver asked for first, the other one if it fails
        self.solver_order = (solver, *(s for s in SOLVERS if s != solver))
        self.time_limit = time_limit
        #: CPU seconds the planning may take in all, the search and the GPU-update rule after it
        #: (``search.DEADLINE_S`` when None; ``compiler/deadline.py``)
        self.deadline = deadline
        #: the GPU-update rule runs after the search (``gpu_update.choose``): the search leaves it a share of
        #: the deadline
        self.rule_follows = rule_follows
        self.options = {"host_bytes_per_param": HOST_BYTES_PER_PARAM[optimizer], "optimizer": optimizer,
                        "clip": clip}
        #: data-parallel ranks and hosts (``ir.sharding``); a world of one writes nothing of them
        self.world_size, self.nodes = world_size, nodes
        if world_size > 1:
            self.options["nodes"] = nodes
        if compile_blocks:      # the runtime compiles the block programs (``frontend/compiled.py``)
            self.options["compile_blocks"] = True
        self._costs: dict[tuple, CostModel] = {}         # ``cost``'s, by its arguments
        #: the search says its micro-batches' results (``compiler/progress.py``); not a re-solve's own search
        self.progress = True
        self.search = Search(self)

    def with_gpu_budget(self, gpu_bytes: int, deadline: float | None = None) -> Compiler:
        """This compiler with another GPU budget and a search of its own (``gpu_update.choose`` re-solves with
        the memory its GPU-updated blocks need set aside), within ``deadline`` CPU seconds if given."""
        other = copy.copy(self)
        other.budgets = {**self.budgets, "gpu_bytes": gpu_bytes}
        if deadline is not None:
            other.deadline = deadline
        other.rule_follows = False          # its search is the rule's own
        other.progress = False
        other.search = Search(other)
        return other

    def solve_time_limit(self) -> float:
        """Seconds one MILP solve may take: the caller's, else ``SOLVE_TIME_LIMIT``."""
        return self.time_limit if self.time_limit is not None else SOLVE_TIME_LIMIT

    def cost(self, micro_batch: int, resident: frozenset | None = None, cut: tuple = (),
             gpu_updated: frozenset = frozenset()) -> CostModel:
        """The cost model of one micro-batch and placement, built once: a search builds many plans at each
        micro-batch, and a cost model's tables (``CostModel._block_s``, its ``Sizes``) are computed on first use."""
        resident = self.resident if resident is None else resident
        key = (micro_batch, resident, tuple(cut), gpu_updated)
        cost = self._costs.get(key)
        if cost is None or cost.graph is not self.graph or cost.hw is not self.hw:
            cost = self._costs[key] = CostModel(self.graph, self.hw, micro_batch, self.param_dtype,
                                                self.optimizer == "hybrid8bit", resident=resident,
                                                world_size=self.world_size, nodes=self.nodes, cut=cut,
                                                gpu_updated=gpu_updated)
        return cost

    def with_resident(self, decisions):
        """``decisions`` with this compiler's fixed resident blocks (policies decide the rest)."""
        L = self.graph.n_blocks
        res = tuple(j in self.resident for j in range(L)) if self.resident else ()
        return decisions if decisions.resident == res else dataclasses.replace(decisions, resident=res)

    def build(self, decisions, batch_size: int, *, check_budget: bool = True) -> Plan:
        """Lower, verify (against the budgets unless told not to) and simulate one decision."""
        return self.build_simulated(decisions, batch_size, check_budget=check_budget)[0]

    def build_simulated(self, decisions, batch_size: int, *, check_budget: bool = True) -> tuple[Plan, SimResult]:
        """``build``, and the simulation its predictions come from (the search reads where memory peaks)."""
        with paused_gc():
            return self._build_simulated(decisions, batch_size, check_budget)

    def _build_simulated(self, decisions, batch_size: int, check_budget: bool) -> tuple[Plan, SimResult]:
        cost = self.cost(decisions.micro_batch, decisions.resident_blocks, decisions.cut, decisions.gpu_updated_blocks)
        if check_budget:
            self._quick_reject(decisions, cost)
        ops, effs = lower_with_effects(decisions, cost, clip=self.clip)
        budgets = self.budgets if check_budget else {k: v for k, v in self.budgets.items() if k == "nvme_dir"}
        plan = Plan(graph=self.graph, hardware=self.hw.to_json(), budgets=dict(budgets), batch_size=batch_size,
                    seq_len=self.graph.seq_len, param_dtype=self.param_dtype, decisions=decisions, ops=ops,
                    options=dict(self.options), world_size=self.world_size)
        rep = verify(plan, early_exit=check_budget, effs=effs, sizes=cost.sizes)
        sim = simulate(plan, effs=effs, sizes=cost.sizes)
        plan.predicted = self._predicted(plan, rep, sim)
        if plan.budgets.get("gpu_bytes") and plan.predicted["peak_gpu_bytes"] > plan.budgets["gpu_bytes"]:
            raise PlanError(f"simulated peak GPU memory {plan.predicted['peak_gpu_bytes'] / GiB:.2f} GiB "
                            f"exceeds the budget")
        return plan, sim

    def _predicted(self, plan: Plan, rep, sim) -> dict:
        """The plan's predicted figures: the simulated step, verify's memory peaks and the rates they imply."""
        ops = plan.ops
        flops = 6 * self.graph.active_params * plan.batch_size * self.graph.seq_len
        blocks, dec = self.graph.blocks, plan.decisions
        forward, work = {OpKind.COMPUTE, OpKind.RECOMPUTE}, {OpKind.COMPUTE, OpKind.RECOMPUTE, OpKind.BACKWARD}
        hw_flops = sum(blocks[op.block].fwd_flops if op.kind in forward
                       else blocks[op.block].bwd_flops + (blocks[op.block].cuts[dec.cut_of(op.block)].recompute_flops
                                                          if dec.cut_of(op.block) else 0)
                       for op in ops if op.kind in work) * dec.micro_batch
        return {
            "step_time_s": sim.step_time_s, "peak_gpu_bytes": max(rep.peak_gpu_bytes, sim.peak_gpu_bytes),
            "peak_host_bytes": rep.peak_host_bytes, "peak_nvme_bytes": rep.peak_nvme_bytes,
            "host_static_bytes": rep.host_static_bytes, "busy_s": sim.busy_s,
            "exposed_transfer_s": sim.exposed_transfer_s,
            "model_tflops": flops / sim.step_time_s / 1e12 if sim.step_time_s else 0.0,
            "model_attn_tflops": (flops + self.graph.attention_model_flops * plan.batch_size) / sim.step_time_s / 1e12
            if sim.step_time_s else 0.0,
            "hardware_tflops": hw_flops / sim.step_time_s / 1e12 if sim.step_time_s else 0.0,
            "tokens_per_s": plan.batch_size * self.graph.seq_len / sim.step_time_s if sim.step_time_s else 0.0,
        }

    def _quick_reject(self, dec, cost: CostModel) -> None:
        """A lower bound on GPU memory without lowering: at the end of the forward every kept saved
        activation and every boundary kept on the GPU is resident at once."""
        M = dec.n_micro
        kept = sum(cost.saved_bytes(j) for j, s in enumerate(dec.saved) if s is Saved.KEEP)
        kept += sum(cost.act_bytes(i) for i, p in enumerate(dec.boundary) if p is Place.GPU and i > 0
                    and dec.saved[i] is Saved.RECOMPUTE)
        kept += cost.sizes.resident_bytes() / M
        if kept * M > self.budgets["gpu_bytes"]:
            raise PlanError(f"kept activations alone need {kept * M / GiB:.2f} GiB of GPU memory")

    def within_budgets(self, plan: Plan) -> bool:
        """Check a plan built without budgets against them, and adopt the budgets if it fits."""
        pred, b = plan.predicted, self.budgets
        ok = (pred["peak_gpu_bytes"] <= b["gpu_bytes"] and pred["peak_host_bytes"] <= b["host_bytes"]
              and pred["peak_nvme_bytes"] <= (b.get("nvme_bytes") or 0))
        if ok:
            plan.budgets = dict(b)
        return ok

    def micro_batches(self, batch_size: int, micro_batch: int | None) -> list[int]:
        """Candidate micro-batch sizes, largest first: the given one, else divisors of the batch
        up to 32 whose op list stays bounded (``validate.micro_batch_candidates``)."""
        return micro_batch_candidates(batch_size, self.graph.n_blocks, micro_batch)

    def best(self, policy: str, batch_size: int, micro_batch: int | None = None, tries: int = 2) -> Plan | None:
        """Best feasible plan of ``policy`` over micro-batch sizes (``Search.best``)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        return self.search.best(policy, batch_size, micro_batch, tries)

    def leanest(self, batch_size: int, micro_batch: int | None) -> Plan:
        """The leaner on GPU memory of the frugal plans, built without budgets (``Search.frugal_plans``: every block
        recomputed, or every block's saved tensors on the host; boundaries on the host), at the smallest
        micro-batch, with the blocks asked to be resident (they hold their memory whatever else the plan does).
        Both lie in the MILP's space; a plan mixing the two per block may need less still, so "needs at least" is
        a bound of these two, not of every plan."""
        mb = micro_batch or 1
        plans = list(self.search.frugal_plans(batch_size, mb, check_budget=False))
        if not plans:      # neither builds: the recompute's own error says why
            return self.build(self.search.frugal(batch_size, mb), batch_size, check_budget=False)
        return min(plans, key=lambda p: p.predicted["peak_gpu_bytes"])


def compile_model(model, *, batch_size: int | str = 8, seq_len: int = 1024, micro_batch: int | None = None,
                  gpu_memory=None, host_memory=None, nvme_dir: str | None = None, nvme_memory=None,
                  hardware: str = "h200", policy: str = "milp", optimizer: str = "hybrid8bit",
                  param_dtype: str = "bfloat16", clip: bool = True, solver: str = DEFAULT_SOLVER,
                  time_limit: float | None = None, reserve=None, max_batch_limit: int = 1 << 16,
                  resident="auto", calibrate: bool = False, packed: bool = False,
                  seq_tile: int | str | None = "auto", world_size: int = 1, nodes: int = 1,
                  compile_blocks: bool = False, deadline: float | None = None, gpu_update="auto",
                  loss_head: str = "auto") -> Plan:
    """Compile a training plan.  ``model``: an ``nn.Module`` (meta or real), a preset name, a path
    to a Hugging Face ``config.json``, ``package.module:factory``, or an already traced ModelGraph.

    ``gpu_memory`` / ``host_memory`` / ``nvme_memory`` accept bytes or sizes like ``"24GiB"``;
    they default to the hardware profile's.  ``batch_size="max"`` finds the largest batch with a
    feasible plan, up to ``max_batch_limit``; ``seq_len="max"`` the longest sequence for the batch
    (``seq_search``).  ``reserve`` is GPU memory kept back for the CUDA
    context, cuBLAS workspaces and allocator fragmentation (default: 1.5 GiB + 5% of the budget).

    ``resident`` keeps blocks on the GPU for the whole run (parameters, optimizer state, gradients;
    their update runs on the GPU, off the host): ``"none"``, ``"auto"`` (default: for the MILP policy
    on a GPU the solver chooses how many leading blocks to keep, tied groups whole, jointly with the
    rest of the plan; the fixed policies stream everything, as the systems they stand for do), a
    number of leading blocks, or a list of block indices.

    ``solver``: the MILP solver tried first (``"highs"`` or ``"cbc"``); every solve runs in a child
    process, so a solver that crashes or hangs costs that solve only: the other solver is tried,
    then the best heuristic plan is used, with one warning and the failures in ``plan.solver``.
    ``time_limit``: CPU seconds per solve (default ``SOLVE_TIME_LIMIT``).  ``deadline``: CPU seconds (the
    compile's and its solver's; at most four times as many wall seconds) the search for the plan may take in
    all, heuristics, solves, the checks of their plans and the GPU-update rule after them included (default
    ``search.DEADLINE_S``, none when ``time_limit`` is given; the search leaves the rule ``search.RULE_RESERVE_S``
    of it); counted in CPU time, a busy machine does not change the plan.  When it runs out
    the best plan found so far is returned and ``plan.solver.out_of_time`` says so (``deadline_clock``: which
    clock ran out).

    ``calibrate=True`` times the model's own blocks on this machine at the plan's micro-batch and
    sequence length and compiles with those times (``lazytrain.measure.calibrate``; written into ``hardware``
    when it is a file).

    ``packed``: batches carry ``position_ids`` and hold several examples a row, each attending only to
    itself (a Hugging Face causal LM; ``frontend/packing.py``).

    ``world_size``: data-parallel ranks (GPUs) the plan is for, over ``nodes`` hosts (``ir.sharding``):
    ``batch_size`` is then per rank, each rank holds 1/N of the host state (the host budget is per host,
    shared by its ranks), loads its shard and all-gathers the block, reduce-scatters the gradients, and
    the global clip norm is an all-reduce.  Resident blocks and tied parameters shard the same way (a resident
    block keeps its shard of its state on the GPU, gathered once a step); ``"auto"`` lets the MILP choose them.

    ``seq_tile``: run the layers' position-wise tails (output projection, norm, MLP) in chunks of that
    many tokens, recomputed in backward (``tiling.py``); ``"auto"`` (default) does so, in chunks of
    ``ir.graph.TILE_TOKENS``, only when no plan fits without; ``None``: never.

    ``gpu_update``: streamed blocks whose update runs on the GPU (``Decisions.gpu_update``: the gradient stays
    on the GPU into the next step, parameters and optimizer state cross PCIe for the update): ``"auto"``
    (default: for the MILP policy on a GPU in a world of one, the rule of ``compiler/gpu_update.py`` chooses
    how many, trading resident blocks for them, by the simulated step under the budgets), ``"none"``, a number
    of the first streamed blocks, or a list of block indices.

    ``compile_blocks``: the runtime runs each distinct block program compiled by Inductor, forward and backward,
    the tensors its backward needs still kept, moved and recomputed by the plan (``frontend/compiled.py``); the
    graph's saved bytes are then what the compiled forwards save.  Off by default until measured on a GPU.

    ``loss_head``: how the fused LM head + cross-entropy forms its gradients (``frontend/loss_head.py``):
    ``"auto"`` (default: on a GPU, the searched plan's decisions with a single-pass head where they still fit and
    the simulated step is shorter, ``compiler/loss_chunk.py``), ``"single_pass"`` (the forward forms them, no
    logits recomputed, a weight-gradient accumulator held; the search plans for it) or ``"recompute"`` (the
    backward recomputes the logits chunk by chunk).
    """
    param_dtype = _param_dtype(param_dtype)
    held = held_host_bytes(model) if host_memory is None else 0
    if held:    # resolved here, once: the searches and the calibration below compile a traced graph (it holds none)
        host_memory = make_budgets(get_profile(hardware), held_bytes=held)["host_bytes"]
    options = {k: v for k, v in locals().items() if k not in ("model", "held")}
    # seq_search, auto_tile and calibrate run compile_model themselves: imported where they are asked for
    # (calibrate runs the Trainer, a layer above the compiler: the one call upward, on request only)
    if seq_len == "max":
        from .seq_search import compile_max_seq
        return compile_max_seq(compile_model, model, options)
    if seq_tile == "auto":
        from .auto_tile import compile_auto_tiled
        return compile_auto_tiled(compile_model, model, options)
    if calibrate:
        from ..measure.calibrate import compile_calibrated
        return compile_calibrated(compile_model, model, {k: v for k, v in options.items() if k != "calibrate"})
    _check_options(policy=policy, optimizer=optimizer, seq_len=seq_len, micro_batch=micro_batch, seq_tile=seq_tile,
                   deadline=deadline, compile_blocks=compile_blocks, loss_head=loss_head, time_limit=time_limit)
    check_compile_args(model, batch_size=batch_size, seq_len=seq_len, micro_batch=micro_batch, nvme_dir=nvme_dir)
    bg = background_trace.start(model, seq_len=seq_len, dtype=param_dtype, packed=packed, seq_tile=seq_tile,
                                compile_blocks=compile_blocks, check=lambda: make_budgets(
                                    get_profile(hardware), gpu_memory, host_memory, nvme_dir, nvme_memory, reserve))
    if bg is not None:          # a preset's first compile: searched on its seed while it is traced elsewhere
        return background_trace.compile_seeded(compile_model, model, bg, options)
    history: list[dict] = []
    t0 = time.perf_counter()
    comp, gpu_req = _compiler(model, options, history)
    # cost, lower, verify and simulate run for each candidate the search builds (``Compiler.build``)
    plan = _search(comp, policy, batch_size, micro_batch, max_batch_limit)
    plan = _gpu_updated(comp, plan, policy, gpu_req, micro_batch)
    if loss_head == "auto" and comp.hw.has_gpu:
        plan = faster_head(comp, plan)      # the single-pass loss head, where the plan has the memory for it
    if plan.decisions.notes.get("milp_failed"):
        warnings.warn(f"micro-batch {plan.micro_batch}: {plan.decisions.notes['milp_fallback']}", stacklevel=2)
    if comp.search.failures:
        warnings.warn("the MILP solvers failed (" + "; ".join(comp.search.failures) + "); the plan comes from "
                      f"the {plan.decisions.policy} policy where they did (plan.solver.failures)", stacklevel=2)
    plan = _returned(comp, plan, policy)
    plan.history = [*history, *plan.history, {"pass": "total", "seconds": round(time.perf_counter() - t0, 4)}]
    return plan


def _compiler(model, o: dict, history: list[dict]) -> tuple[Compiler, object]:
    """The ``Compiler`` of one compile (``o``: ``compile_model``'s checked options): the model traced (or its
    trace read from the cache), the budgets, the loss head's chunk and the measured workspaces applied, the
    resident and GPU-update requests resolved; with the GPU-update request for after the search."""
    policy, world_size = o["policy"], o["world_size"]
    if policy == "milp":
        isolated.prestart(o["solver"])       # its start-up overlaps the trace
    hw = get_profile(o["hardware"])
    graph = _as_graph(model, o["seq_len"], o["param_dtype"], history, o["packed"], o["seq_tile"], o["compile_blocks"])
    budgets = make_budgets(hw, o["gpu_memory"], o["host_memory"], o["nvme_dir"], o["nvme_memory"], o["reserve"])
    graph = with_loss_chunk(graph, budgets["gpu_bytes"], _forced_single_rows(graph, budgets, o["loss_head"]))
    graph = with_measured_workspace(graph, hw)               # calibrated transients, where they exceed the traced
    fixed, auto = resident_request(graph, o["resident"])
    gpu_req = gpu_update_rule.request(o["gpu_update"])
    if gpu_req not in ("auto", "none", 0, ()) and world_size > 1:
        raise ValueError(f"GPU-updated streamed blocks need a world of one (gpu_update={o['gpu_update']!r}, "
                         f"world_size {world_size}): use gpu_update='none' (or 'auto', which chooses none there)")
    if world_size != 1 or o["nodes"] != 1:
        check_world(world_size, o["nodes"])
        budgets = per_rank_budgets(budgets, world_size, o["nodes"])
    comp = Compiler(graph, hw, budgets, param_dtype=o["param_dtype"], optimizer=o["optimizer"], clip=o["clip"],
                    solver=o["solver"], time_limit=o["time_limit"], resident=fixed,
                    choose_resident=auto and policy == "milp" and hw.has_gpu, world_size=world_size,
                    nodes=o["nodes"], compile_blocks=o["compile_blocks"], deadline=o["deadline"],
                    rule_follows=gpu_update_rule.rule_runs(gpu_req, policy, hw.has_gpu, world_size))
    return comp, gpu_req


def _forced_single_rows(graph: ModelGraph, budgets: dict, mode: str) -> int | None:
    """Rows a chunk of the single-pass loss head asked for takes (one sample's at most, as the recompute's chunk),
    else None: the recompute, which ``faster_head`` may turn into a single pass after the search."""
    head = graph.meta.get("loss_head")
    if mode != "single_pass" or not isinstance(head, dict) or not budgets.get("gpu_bytes"):
        return None
    return (single_pass_rows(head, budgets["gpu_bytes"], head["seq_len"]) or [1])[0]


#: the dtypes a plan keeps its parameters in on the GPU (bf16 on a GPU; fp32 for CPU runs, eager's references)
PARAM_DTYPES = ("bfloat16", "float16", "float32")


def _param_dtype(d) -> str:
    """``d`` (a name or a ``torch.dtype``) as the name a plan records, or ``ValueError``."""
    name = str(d).removeprefix("torch.") if isinstance(d, str) or is_dtype(d) else None
    if name not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {', '.join(PARAM_DTYPES)} (or the torch dtype), got {d!r}")
    return name


def _check_options(*, policy: str, optimizer: str, seq_len, micro_batch, seq_tile, deadline=None,
                   compile_blocks: bool = False, loss_head: str = "auto", time_limit=None) -> None:
    """The options ``compile_model`` checks itself, before the sizes (``frontend/validate.py``)."""
    if time_limit is not None and (not isinstance(time_limit, (int, float)) or isinstance(time_limit, bool)
                                   or not time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds per solve or None, got {time_limit!r}")
    if loss_head not in LOSS_HEAD_MODES:
        raise ValueError(f"loss_head must be one of {', '.join(map(repr, LOSS_HEAD_MODES))}, got {loss_head!r}")
    if not isinstance(compile_blocks, bool):
        raise ValueError(f"compile_blocks must be True or False, got {compile_blocks!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if optimizer not in HOST_BYTES_PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(HOST_BYTES_PER_PARAM)}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer or 'max', got {seq_len!r}")
    if micro_batch is not None and (not isinstance(micro_batch, int) or micro_batch < 1):
        raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    if seq_tile is not None and (not isinstance(seq_tile, int) or isinstance(seq_tile, bool) or seq_tile < 1):
        raise ValueError(f"seq_tile must be a positive number of tokens, 'auto' or None, got {seq_tile!r}")
    if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool)
                                 or not deadline > 0):
        raise ValueError(f"deadline must be a positive number of seconds or None, got {deadline!r}")


def _search(comp: Compiler, policy: str, batch_size, micro_batch: int | None, max_batch_limit) -> Plan:
    """The best plan of ``policy`` at this batch (or the largest batch with one, for ``"max"``), or the
    ``BudgetError`` that says what memory would make one fit."""
    if batch_size == "max":
        if not isinstance(max_batch_limit, int) or max_batch_limit < 1:
            raise ValueError(f"max_batch_limit must be a positive integer, got {max_batch_limit!r}")
        plan, tried = comp.search.max_batch(policy, micro_batch, max_batch_limit)
        if plan is None:
            raise budget_error(comp, tried, micro_batch)
        return plan
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer or 'max', got {batch_size!r}")
    plan = comp.best(policy, batch_size, micro_batch)
    if plan is None:
        raise budget_error(comp, batch_size, micro_batch, policy)
    return plan


def _gpu_updated(comp: Compiler, plan: Plan, policy: str, req, micro_batch: int | None = None) -> Plan:
    """The searched plan with the GPU-updated streamed blocks asked for, or (``"auto"``, the MILP policy on a
    GPU in a world of one) those the rule of ``compiler/gpu_update.py`` chooses."""
    if req == "auto":           # (``rule_follows``: the MILP policy, a GPU, a world of one)
        return gpu_update_rule.choose(comp, plan) if comp.rule_follows else plan
    if req == "none":
        return plan
    return gpu_update_rule.fixed(comp, plan, req, policy, micro_batch)     # (a world of one: ``_compiler``)


def _returned(comp: Compiler, plan: Plan, policy: str) -> Plan:
    """The plan handed to the caller: a copy, so the search's memo stays as it was, with the step time
    of the megatrain policy at its batch for comparison."""
    plan = dataclasses.replace(plan, predicted=dict(plan.predicted), budgets=dict(plan.budgets))
    if policy != "megatrain":
        base = comp.best("megatrain", plan.batch_size)
        if base is not None:
            plan.predicted["megatrain_step_time_s"] = base.predicted["step_time_s"]
    return plan
