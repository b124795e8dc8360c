"""The builder of one compile: ``Compiler`` holds everything fixed for it (graph, hardware, budgets, options) and
turns a plan's decisions into a verified, simulated ``Plan`` (cost -> lower -> verify -> simulate).  The search
(``compiler/search.py``) asks it for plans and it never asks the search anything; the pipeline
(``compiler/pipeline.py``) makes both."""

from __future__ import annotations

import copy
import dataclasses

from ..ir import GiB, OpKind, Place, Plan, PlanError, Saved, verify
from ..ir.graph import ModelGraph
from ..ir.semantics import frozen_bytes_per_param, nvme_pairs
from ..ir.tiers import TIERS
from .budgets import Budgets
from .cost import CostModel
from .lower import lower_with_effects
from .options import Optimizer, Solver
from .paused_gc import paused_gc
from .request import HOST_BYTES_PER_PARAM
from .simulate import SimResult, predicted_gpu_peak, simulate
from .solvers.isolated import DEFAULT_ORDER
from .state_placement import placed_fit
from .time_limits import LIMITS


def check_frozen(graph: ModelGraph, world_size: int, base_bits: int) -> None:
    """Refuse what a model with a frozen base cannot be planned with: several ranks (the ZeRO-3 shards cover every
    parameter's state: a LoRA run trains on one GPU), and a base in other bits than 16, 8 or 4."""
    frozen_bytes_per_param(base_bits, 2)          # (raises on bits it has no format for)
    if graph.frozen_params and world_size > 1:
        raise ValueError(f"the model has frozen parameters ({graph.frozen_params:,} of {graph.total_params:,}: a LoRA "
                         f"base) and world_size is {world_size}: adapters train on one GPU (world_size=1)")
    if base_bits != 16 and not graph.frozen_params:
        raise ValueError(f"base_bits={base_bits} quantizes the frozen base, but this model has no frozen parameters "
                         "(train with LoRA, or leave base_bits at 16)")


class Compiler:
    """Everything fixed for one compile: graph, hardware, budgets, options (the search's among them: the solver, its
    time limit and deadline, read by ``search.Search``), and the builds of plans from decisions."""

    def __init__(self, graph: ModelGraph, hw, budgets: Budgets | dict, *, param_dtype: str, optimizer: str, clip: bool,
                 solver: str = DEFAULT_ORDER[0], time_limit: float | None = None, resident: frozenset = frozenset(),
                 choose_resident: bool = False, world_size: int = 1, nodes: int = 1, compile_blocks: bool = False,
                 deadline: float | None = None, rule_follows: bool = False, base_bits: int = 16):
        solver, optimizer = Solver.parse(solver, "unknown solver"), Optimizer.parse(optimizer, "unknown optimizer")
        #: the budgets (a plan's dict of them is read as the record)
        self.graph, self.hw, self.budgets = graph, hw, Budgets.of(budgets)
        #: blocks every plan of this compiler keeps on the GPU (``Decisions.resident``), and whether the
        #: MILP may keep a leading prefix of the others too
        self.resident = frozenset(resident)
        self.choose_resident = choose_resident
        self.param_dtype, self.optimizer, self.clip = param_dtype, optimizer.value, clip
        #: the solver asked for first, the other one if it fails
        self.solver_order = (solver.value, *(s.value for s in Solver if s != solver))
        self.time_limit = time_limit
        #: CPU seconds the planning may take in all, the search and the GPU-update rule after it
        #: (``LIMITS.deadline_s`` when None; ``compiler/deadline.py``)
        self.deadline = deadline
        #: the GPU-update rule runs after the search (``gpu_update.choose``): the search leaves it a share of
        #: the deadline
        self.rule_follows = rule_follows
        self.options = {"host_bytes_per_param": HOST_BYTES_PER_PARAM[optimizer], "optimizer": optimizer.value,
                        "clip": clip}
        #: data-parallel ranks and hosts (``ir.sharding``); a world of one writes nothing of them
        self.world_size, self.nodes = world_size, nodes
        if world_size > 1:
            self.options["nodes"] = nodes
        if compile_blocks:      # the runtime compiles the block programs (``frontend/compiled.py``)
            self.options["compile_blocks"] = True
        check_frozen(graph, world_size, base_bits)
        #: bits the frozen base is held in on the host and moved in (16: the parameter dtype; ``Sizes.base_bits``)
        self.base_bits = base_bits
        if base_bits != 16:
            self.options["base_bits"] = base_bits
        #: state every plan of this compiler keeps on NVMe (``Decisions.nvme_state``), chosen before the search
        #: (``state_placement.place``); empty: all of it in the host store
        self.nvme_state: dict[str, tuple[int, ...]] = {}
        self._costs: dict[tuple, CostModel] = {}         # ``cost``'s, by its arguments
        #: the search says its micro-batches' results (``compiler/progress.py``); not a re-solve's own search
        self.progress = True

    def with_gpu_budget(self, gpu_bytes: int, deadline: float | None = None) -> Compiler:
        """This compiler with another GPU budget, for a search of its own (``gpu_update.choose`` re-solves with
        the memory its GPU-updated blocks need set aside), within ``deadline`` CPU seconds if given."""
        other = copy.copy(self)
        other.budgets = dataclasses.replace(self.budgets, gpu_bytes=gpu_bytes)
        if deadline is not None:
            other.deadline = deadline
        other.rule_follows = False          # its search is the rule's own
        other.progress = False
        return other

    def with_graph(self, graph: ModelGraph) -> Compiler:
        """This compiler building plans of ``graph`` instead (another loss head: ``loss_chunk.faster_head``), its cost
        models its own."""
        other = copy.copy(self)
        other.graph, other._costs = graph, {}
        return other

    def solve_time_limit(self) -> float:
        """Seconds one MILP solve may take: the caller's, else ``LIMITS.solve_s``."""
        return self.time_limit if self.time_limit is not None else LIMITS.solve_s

    def cost(self, micro_batch: int, resident: frozenset | None = None, cut: tuple = (),
             gpu_updated: frozenset = frozenset(), nvme: frozenset | None = None) -> CostModel:
        """The cost model of one micro-batch and placement, built once: a search builds many plans at each
        micro-batch, and a cost model's tables (``CostModel._block_s``, its ``Sizes``) are computed on first use.
        ``nvme``: the state kept on NVMe as ``Sizes.nvme`` pairs (default: this compiler's)."""
        resident = self.resident if resident is None else resident
        nvme = nvme_pairs(self.nvme_state) if nvme is None else nvme
        key = (micro_batch, resident, tuple(cut), gpu_updated, nvme)
        cost = self._costs.get(key)
        if cost is None or cost.graph is not self.graph or cost.hw is not self.hw:
            cost = self._costs[key] = CostModel(self.graph, self.hw, micro_batch, self.param_dtype,
                                                Optimizer(self.optimizer).eight_bit, resident=resident,
                                                world_size=self.world_size, nodes=self.nodes, cut=cut,
                                                gpu_updated=gpu_updated, nvme=nvme,
                                                host_bytes_per_param=self.options["host_bytes_per_param"],
                                                base_bits=self.base_bits)
        return cost

    def state_on_nvme(self) -> tuple[int, int]:
        """The host bytes the state kept on NVMe frees (less its host copies in flight) and the bytes of its files:
        what the MILP's host and NVMe rows hold fixed (``solvers/coefficients.py``)."""
        if not self.nvme_state:
            return 0, 0
        f = placed_fit(self)
        return f.nvme_bytes - f.in_flight_bytes, f.nvme_bytes

    def with_state(self, decisions):
        """``decisions`` with this compiler's NVMe state placement (``nvme_state``), less the blocks these
        decisions keep on the GPU or update there (their state is the host store's)."""
        if not self.nvme_state:
            return decisions
        gpu = decisions.resident_blocks | decisions.gpu_updated_blocks
        state = {k: tuple(j for j in v if j not in gpu) for k, v in self.nvme_state.items()}
        return decisions if decisions.nvme_state == state else dataclasses.replace(decisions, nvme_state=state)

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
        decisions = self.with_state(decisions)
        cost = self.cost(decisions.micro_batch, decisions.resident_blocks, decisions.cut, decisions.gpu_updated_blocks,
                         nvme_pairs(decisions.nvme_state))
        if check_budget:
            self._quick_reject(decisions, cost)
        ops, effs = lower_with_effects(decisions, cost, clip=self.clip)
        budgets = self.budgets.to_json() if check_budget else {"nvme_dir": self.budgets.nvme_dir}
        plan = Plan(graph=self.graph, hardware=self.hw.to_json(), budgets=budgets, batch_size=batch_size,
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
        # each tier's peak as verify walked it (the GPU's also as the simulation's timeline holds it)
        peaks = {s.peak: getattr(rep, s.peak) for s in TIERS.values()}
        peaks["peak_gpu_bytes"] = predicted_gpu_peak(rep, sim)
        return {
            "step_time_s": sim.step_time_s, **peaks, "host_static_bytes": rep.host_static_bytes, "busy_s": sim.busy_s,
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
        if kept * M > self.budgets.gpu_bytes:
            raise PlanError(f"kept activations alone need {kept * M / GiB:.2f} GiB of GPU memory")

    def within_budgets(self, plan: Plan) -> bool:
        """Check a plan built without budgets against them, and adopt the budgets if it fits."""
        pred, b = plan.predicted, self.budgets
        ok = all(pred[s.peak] <= (getattr(b, s.budget) or 0) for s in TIERS.values())
        if ok:
            plan.budgets = b.to_json()
        return ok
