"""``verify(plan)``: check a plan from its ops alone, without trusting the solver that made it.

In four named steps: the ids and ranges; the updates (every block updated exactly once per step,
after all its gradients are on the host, or lagged before all of them); the residency and memory walk
(every input resident where it is read, nothing left behind, peak memory per tier recomputed in
program order); and the ordering (``ir.order``: every hazard between two resources is a dependency,
so the runtime, which reads nothing but ``op.deps``, cannot race).  Then the budgets.  Any failure is
a ``PlanError`` naming the op.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .format import PLAN_FORMAT, PlanError
from .ops import GiB, Op, OpKind, Resource, TensorId, TensorKind, Tier
from .order import Hazard, HazardWalk, UpdateOrder
from .semantics import Effects, Sizes, effects, resident_shards, static_host_bytes, tie_closure
from .tiers import TIERS

if TYPE_CHECKING:      # annotations only: plan.py imports this module to check what it reads
    from .plan import Plan


@dataclass(frozen=True)
class MemoryReport:
    peak_gpu_bytes: int
    peak_host_bytes: int           # static host store + offloaded activations at their peak
    peak_nvme_bytes: int
    host_static_bytes: int
    gpu_curve: tuple[int, ...]     # GPU bytes after each op (program order)


def host_static_bytes(plan: Plan, sizes: Sizes | None = None) -> int:
    """Host store: parameters, master weights, optimizer state and gradient buffers (one rank's shard
    of them in a world of several), less what the plan keeps on NVMe (``nvme_static_bytes``)."""
    per_param = float(plan.options.get("host_bytes_per_param", 16.0))
    state = static_host_bytes(plan.graph, per_param, plan.param_dtype, int(plan.options.get("base_bits", 16)))
    return int(state) // plan.world_size - nvme_static_bytes(plan, sizes)


def nvme_static_bytes(plan: Plan, sizes: Sizes | None = None) -> int:
    """The files of the state kept on NVMe (``Decisions.nvme_state``): each the size of its host copy."""
    if not plan.decisions.nvme_state:
        return 0
    sizes = Sizes.of_plan(plan, like=sizes)
    return sum(sizes.of(TensorId(kind=k, index=j), Tier.HOST) for k, j in sizes.nvme)


def _fail(op: Op, msg: str) -> PlanError:
    return PlanError(f"op #{op.id} ({op}): {msg}")


def verify(plan: Plan, *, early_exit: bool = False, effs: list[Effects] | None = None,
           sizes: Sizes | None = None) -> MemoryReport:
    """Check ``plan``; returns its memory report or raises PlanError.  With ``early_exit`` the
    walk stops at the first point over the GPU budget (used when screening candidates).  ``effs``: each
    op's ``effects`` where the caller has them (the lowering computes them), else computed here; ``sizes``:
    the caller's ``Sizes``, used where they equal the plan's (``Sizes.of_plan``)."""
    sizes = Sizes.of_plan(plan, like=sizes)
    _check_ids(plan)
    _check_sharded(plan, sizes)
    order = _check_updates(plan, sizes)
    _check_state_tier(plan, sizes)
    if effs is None:
        effs = [effects(op, sizes) for op in plan.ops]
    elif len(effs) != len(plan.ops):
        raise ValueError(f"effs holds {len(effs)} effects for {len(plan.ops)} ops")
    report = _walk(plan, sizes, effs, order, early_exit)
    _check_order(plan, effs)
    for spec in TIERS.values():
        cap, used = plan.budgets.get(spec.budget), getattr(report, spec.peak)
        if cap is not None and used > cap:
            raise PlanError(f"peak {spec.label} memory {used / GiB:.2f} GiB exceeds the budget of {cap / GiB:.2f} GiB")
    return report


def _check_ids(plan: Plan) -> None:
    L, M = plan.graph.n_blocks, plan.n_micro
    for i, op in enumerate(plan.ops):
        if op.id != i:
            raise PlanError(f"op at position {i} has id {op.id}; ids must be 0..n-1 in order")
        if not 0 <= op.block < L:
            raise _fail(op, f"block {op.block} out of range 0..{L - 1}")
        if op.mb is not None and not 0 <= op.mb < M:
            raise _fail(op, f"micro-batch {op.mb} out of range 0..{M - 1}")
        for d in op.deps:
            if not 0 <= d < i:
                raise _fail(op, f"depends on #{d}, which is not an earlier op (dependencies must point back)")


def _check_sharded(plan: Plan, sizes: Sizes) -> None:
    """A plan for several ranks: every parameter load completed by an all_gather, every gradient
    reduce-scattered before its offload (the residency walk checks the order), a resident block gathered
    and reduce-scattered once a step, and one all_reduce of the norms after the last offload."""
    if plan.world_size == 1:
        return
    count = {k: plan.count(k) for k in (OpKind.LOAD, OpKind.ALL_GATHER, OpKind.GRAD_OFFLOAD, OpKind.REDUCE_SCATTER,
                                        OpKind.ALL_REDUCE)}
    res = len(sizes.resident)
    if count[OpKind.ALL_GATHER] != count[OpKind.LOAD] + res or \
            count[OpKind.REDUCE_SCATTER] != count[OpKind.GRAD_OFFLOAD] + res:
        raise PlanError(f"a plan for world size {plan.world_size} needs one all_gather per load and one "
                        f"reduce_scatter per grad_offload, and one of each per resident block (has {count}, "
                        f"{res} resident blocks)")
    last_off = max((op.id for op in plan.ops if op.kind is OpKind.GRAD_OFFLOAD), default=-1)
    if count[OpKind.ALL_REDUCE] != 1 or next(op.id for op in plan.ops if op.kind is OpKind.ALL_REDUCE) < last_off:
        raise PlanError(f"a plan for world size {plan.world_size} needs exactly one all_reduce of the gradient "
                        "norms, after the last grad_offload")


def _check_updates(plan: Plan, sizes: Sizes) -> UpdateOrder:
    """Every owner updated exactly once: after every gradient of its readers is on the host, or
    (lagged) before all of them and before any load of its parameters; a resident block on the GPU."""
    ops = plan.ops
    # the kinds these passes over every op compare with, as locals: a member read off its Enum is slow
    update, grad_offload, load, free = OpKind.UPDATE, OpKind.GRAD_OFFLOAD, OpKind.LOAD, OpKind.FREE
    updates: dict[int, Op] = {}
    for op in ops:
        if op.kind is update:
            if op.block in updates:
                raise _fail(op, f"block {op.block} is updated twice in one step (first at #{updates[op.block].id})")
            updates[op.block] = op
    resident = sizes.resident
    if resident and tie_closure(plan.graph, resident) != resident:
        raise PlanError(f"blocks {sorted(tie_closure(plan.graph, resident) - resident)} share tied parameters with "
                        f"resident blocks but are not resident (a tie group is resident as a whole)")
    grad_off = {op.block: op.id for op in ops if op.kind is grad_offload}
    blocks = plan.graph.blocks
    for j in grad_off:          # (an empty gradient would be left on the host, read by no update)
        if not blocks[j].grad_numel:
            raise _fail(ops[grad_off[j]], f"block {j} has no parameters to train: its empty gradient is freed on "
                                          "the GPU, not offloaded")
    for j, op in updates.items():
        if not blocks[j].trainable_numel:
            raise _fail(op, f"block {j} owns no trainable parameters: it has nothing to update")
    empty = sorted(j for j in sizes.gpu_updated if not blocks[j].trainable_numel)
    if empty:
        raise PlanError(f"blocks {empty} are GPU-updated (decisions.gpu_update) but own no parameters to update")
    first_load: dict[int, Op] = {}              # owner -> the first load of a block reading its parameters
    for op in ops:
        if op.kind is load:
            for o in sizes.owners(op.block):
                first_load.setdefault(o, op)
    for owner in sorted({p.owner for b in plan.graph.blocks for p in b.params if p.trainable}):
        if owner not in updates:
            raise PlanError(f"block {owner} owns trainable parameters but is never updated")
        u = updates[owner]
        readers = sizes.readers(owner)
        if owner in sizes.gpu_updated:
            _check_gpu_update(plan, sizes, u)
            continue
        if owner in resident:
            _check_resident_update(plan, u, readers)
            continue
        for r in readers:
            if r not in grad_off:
                raise PlanError(f"block {r}'s gradients never leave the GPU (no grad_offload)")
        before = [grad_off[r] < u.id for r in readers]
        if not any(before):      # lagged: last step's gradients, applied before the parameters load again
            first = first_load.get(owner)
            if first is not None and first.id < u.id:
                raise _fail(first, f"loads parameters of block {owner} before its lagged update #{u.id}")
        elif not all(before):
            raise _fail(u, "update runs between the gradients of its contributors (some before, some after)")
    state = (OpKind.STATE_LOAD, OpKind.STATE_STORE)
    for op in ops:
        if op.kind in state and op.block not in sizes.gpu_updated:
            raise _fail(op, f"block {op.block} is not GPU-updated (decisions.gpu_update): its state stays on the host")
    gathered = plan.world_size > 1      # with several ranks a resident block's gathered parameters are freed
    moving, fixed = (load, grad_offload), (TensorKind.PARAMS, TensorKind.GRADS)
    for op in ops:
        if op.block in resident and op.kind in moving or (
                op.kind is free and op.block in resident and op.tensor is not None
                and op.tensor.kind in fixed and not gathered):
            raise _fail(op, f"block {op.block} is resident: its parameters and gradients never move")
    return UpdateOrder.of(ops, sizes)


def _check_resident_update(plan: Plan, u: Op, readers) -> None:
    """A resident block's update runs on the GPU stream, lagged: at the start of the step, after the
    previous step's backward (the clip coefficient is known then) and before any forward reads it."""
    if u.resource is not Resource.GPU:
        raise _fail(u, f"block {u.block} is resident: its update must run on the GPU")
    first = next((op for op in plan.ops if op.kind in (OpKind.COMPUTE, OpKind.RECOMPUTE, OpKind.BACKWARD,
                                                       OpKind.ALL_GATHER) and op.block in readers), None)
    if first is not None and first.id < u.id:
        raise _fail(first, f"reads resident block {u.block}'s parameters before its update #{u.id}")


def _check_gpu_update(plan: Plan, sizes: Sizes, u: Op) -> None:
    """A GPU-updated block (``Decisions.gpu_update``): in a world of one, sharing no tied parameter; its
    gradient never leaves the GPU; each step one ``state_load`` (H2D), its ``update`` on the GPU, lagged
    (before the block's forward: the previous step's norm is known at the step's start, this step's only
    after the backward), and one ``state_store`` (D2H); its forward reads the parameters the update made
    (no ``load`` before it) and every ``load`` of it comes after the store (the host copy is stale before)."""
    j, ops = u.block, plan.ops
    if plan.world_size > 1:
        raise _fail(u, f"block {j} is GPU-updated, which needs a world of one (world size {plan.world_size})")
    if tie_closure(plan.graph, {j}) != {j}:
        raise _fail(u, f"block {j} is GPU-updated but shares tied parameters with blocks "
                       f"{sorted(tie_closure(plan.graph, {j}) - {j})}")
    if u.resource is not Resource.GPU:
        raise _fail(u, f"block {j} is GPU-updated: its update must run on the GPU")
    mine = [op for op in ops if op.block == j]
    loads = [op for op in mine if op.kind is OpKind.STATE_LOAD]
    stores = [op for op in mine if op.kind is OpKind.STATE_STORE]
    if len(loads) != 1 or len(stores) != 1:
        raise _fail(u, f"block {j} is GPU-updated: it needs one state_load and one state_store a step "
                       f"(has {len(loads)} and {len(stores)})")
    for op, res in ((loads[0], Resource.H2D), (stores[0], Resource.D2H)):
        if op.resource is not res:
            raise _fail(op, f"{op.kind.value} runs on {res.value}")
    if not loads[0].id < u.id < stores[0].id:
        raise _fail(u, f"block {j}'s update must come between its state_load #{loads[0].id} and its state_store "
                       f"#{stores[0].id}")
    for op in mine:
        if op.kind is OpKind.GRAD_OFFLOAD:
            raise _fail(op, f"block {j} is GPU-updated: its gradient stays on the GPU")
        if op.kind in (OpKind.COMPUTE, OpKind.RECOMPUTE, OpKind.BACKWARD) and op.id < u.id:
            raise _fail(u, f"block {j} is GPU-updated: its update must come before its forward #{op.id} (lagged: "
                           "after this step's backward the global norm is not known yet)")
        if op.kind is OpKind.LOAD and op.id < stores[0].id:
            raise _fail(op, f"loads block {j}'s parameters before its state_store #{stores[0].id} writes them back")
    first_fwd = next((op.id for op in mine if op.kind is OpKind.COMPUTE), None)
    first_load = next((op.id for op in mine if op.kind is OpKind.LOAD), None)
    if first_load is not None and first_fwd is not None and first_load < first_fwd:
        raise _fail(ops[first_fwd], f"block {j} is GPU-updated: its forward must read the parameters its update "
                                    f"left on the GPU, not load #{first_load}")


def _check_state_tier(plan: Plan, sizes: Sizes) -> None:
    """State kept on NVMe (``Decisions.nvme_state``): a world of one, blocks sharing no tied parameter, and
    ``state_read`` / ``state_write`` only of placed components, between NVMe and the host."""
    nvme = sizes.nvme
    if nvme:
        if plan.world_size > 1:
            raise PlanError(f"the plan keeps state on NVMe (decisions.nvme_state), which needs a world of one "
                            f"(world size {plan.world_size})")
        tied = sorted({j for _, j in nvme if tie_closure(plan.graph, {j}) != {j}})
        if tied:
            raise PlanError(f"blocks {tied} keep state on NVMe but share tied parameters (a tied weight stays in "
                            "the host store)")
    moves = {OpKind.STATE_READ: (Tier.NVME, Tier.HOST), OpKind.STATE_WRITE: (Tier.HOST, Tier.NVME)}
    for op in plan.ops:
        want = moves.get(op.kind)
        if want is None:
            continue
        t = op.tensor
        if t is None or (t.kind, op.block) not in nvme or t.index != op.block or t.mb is not None:
            raise _fail(op, f"{op.kind.value} moves state kept on NVMe (decisions.nvme_state), and block "
                            f"{op.block}'s {t.kind.value if t else 'nothing'} is not")
        if (op.src, op.dst) != want:
            raise _fail(op, f"{op.kind.value} moves {want[0].value}->{want[1].value}")
        if op.resource is not Resource.NVME:
            raise _fail(op, f"{op.kind.value} runs on nvme")


#: kinds whose host copies are the host store, not plan memory (``_static``)
_STATIC_HOST_KINDS = frozenset((TensorKind.GRADS, TensorKind.PARAMS, TensorKind.OPT_STATE))


#: the tiers ``_static`` compares with, as module constants (it runs for every write and drop of a compile's walk)
_GPU_TIER, _NVME_TIER = Tier.GPU, Tier.NVME


def _static(t: TensorId, tier: Tier, batch: set, nvme: frozenset = frozenset(),
            batch_kinds: set | frozenset | None = None) -> bool:
    """Copies that are not plan memory: host gradients and parameters (the host store), or their files where
    the state is kept on NVMe (``nvme``: ``Sizes.nvme``), the batch on the host, and resident blocks' shards on
    the GPU (``batch`` holds these copies: ``resident_bytes`` counts the shards; ``batch_kinds``, where given,
    their tensor kinds, which rule out most copies before the set lookup)."""
    if t.kind in _STATIC_HOST_KINDS and tier is not _GPU_TIER:
        return (tier is _NVME_TIER) == ((t.kind, t.index) in nvme)
    return (batch_kinds is None or t.kind in batch_kinds) and (t, tier) in batch


def _walk(plan: Plan, sizes: Sizes, effs: list[Effects], order: UpdateOrder, early_exit: bool) -> MemoryReport:
    """Residency and memory in program order: every read and drop finds its copy, no copy is written
    twice, the step ends as it began (the batch and the pending host gradients), and the peak per tier."""
    ops = plan.ops
    start = _StepStart(plan, sizes, order)
    where, batch = start.where, start.batch
    curve = []
    gpu_cap = plan.budgets.get("gpu_bytes")
    grad_readers = _update_readers(ops, effs)

    # the loop below runs once per op (~10^5 for 72 micro-batches of 80 blocks): enum members as locals (a
    # class attribute of an Enum is a descriptor lookup), each copy's tiers looked up once
    GPU, HOST, GRADS, UPDATE = Tier.GPU, Tier.HOST, TensorKind.GRADS, OpKind.UPDATE
    nvme = sizes.nvme
    #: host copies of state kept on NVMe that an op changed and no state_write has put back yet
    dirty: dict[TensorId, int] = {}
    dirtying = (UPDATE, OpKind.GRAD_OFFLOAD)
    batch_kinds = {t.kind for t, _ in batch}
    use = dict.fromkeys(TIERS, 0)        # plan bytes on each tier now, and at their peak
    use[GPU] = sizes.resident_bytes() + sizes.kept_grad_bytes()
    peak = dict(use)
    off_gpu = [tier for tier in TIERS if tier is not GPU]
    for op, eff in zip(ops, effs):
        drops, mutates = eff.drops, eff.mutates
        if op.kind is UPDATE:     # (its reads and drops are checked, not its in-place writes)
            for t, _ in eff.reads:
                grad_readers[t] -= 1
            drops, mutates = tuple(d for d in drops if grad_readers[d[0]] == 0), ()
        for group in (eff.reads, mutates):
            for t, tier in group:
                at = where.get(t)
                if at is None or tier not in at:
                    raise _fail(op, f"reads {t} on {tier.value}, which is not resident there")
        for t, tier in eff.writes:
            at = where[t]
            if tier in at:
                if t.kind is GRADS and tier is GPU:
                    at[tier] = op.id   # accumulation
                    continue
                raise _fail(op, f"writes {t} on {tier.value}, which is already there (leak or double load)")
            at[tier] = op.id
            if not _static(t, tier, batch, nvme, batch_kinds):
                use[tier] += sizes.of(t, tier)
        gpu_now = use[GPU] + eff.transient      # (a transient is GPU memory only)
        if gpu_now > peak[GPU]:
            peak[GPU] = gpu_now
        if early_exit and gpu_cap is not None and peak[GPU] > gpu_cap:
            raise _fail(op, f"GPU memory {peak[GPU] / GiB:.2f} GiB exceeds the budget of {gpu_cap / GiB:.2f} GiB")
        if nvme:
            _track_dirty(op, eff, dirty, nvme, dirtying)
        for t, tier in drops:
            if t in dirty and tier is HOST:
                raise _fail(op, f"drops {t} on the host, which #{dirty[t]} changed, before a state_write puts it "
                                "back on NVMe (the change would be lost)")
            at = where.get(t)
            if at is None or tier not in at:
                raise _fail(op, f"drops {t} on {tier.value}, which is not resident there")
            del at[tier]
            if not _static(t, tier, batch, nvme, batch_kinds):
                use[tier] -= sizes.of(t, tier)
        for tier in off_gpu:
            if use[tier] > peak[tier]:
                peak[tier] = use[tier]
        curve.append(use[GPU])
    start.check_end(where)
    if dirty:
        t, i = next(iter(dirty.items()))
        raise _fail(ops[i], f"changes {t} on the host and no state_write puts it back on NVMe")
    static_host = host_static_bytes(plan, sizes)
    peak[HOST] += static_host
    peak[_NVME_TIER] += nvme_static_bytes(plan, sizes)
    return MemoryReport(**{TIERS[tier].peak: n for tier, n in peak.items()}, host_static_bytes=static_host,
                        gpu_curve=tuple(curve))


def _track_dirty(op: Op, eff: Effects, dirty: dict, nvme: frozenset, dirtying: tuple) -> None:
    """Host copies of NVMe-kept state an ``update`` or a ``grad_offload`` changed, until a ``state_write``."""
    if op.kind is OpKind.STATE_WRITE:
        dirty.pop(op.tensor, None)
    elif op.kind in dirtying:
        for t, tier in (*eff.writes, *eff.mutates):
            if tier is Tier.HOST and (t.kind, t.index) in nvme:
                dirty.setdefault(t, op.id)


class _StepStart:
    """Where every copy is when a step starts (``where``: tensor -> tier -> producer op id, -1 for "before the
    step"), which must hold again when it ends: the gradients lagged updates apply (``pending``), the host
    parameters of streamed blocks, the batch and resident blocks' shards (``batch``), and for GPU-updated blocks
    the host store's state and the accumulators the last backward left on the GPU (``kept``)."""

    def __init__(self, plan: Plan, sizes: Sizes, order: UpdateOrder):
        resident = sizes.resident
        self.where: dict[TensorId, dict[Tier, int]] = defaultdict(dict)
        where = self.where
        self.pending = {c for o in order.lagged - resident for c in sizes.readers(o)}
        nvme = sizes.nvme

        def home(kind: TensorKind, j: int) -> Tier:        # the static copy: the host store's, or the file
            return Tier.NVME if (kind, j) in nvme else Tier.HOST
        for b in self.pending:
            where[TensorId(kind=TensorKind.GRADS, index=b)][home(TensorKind.GRADS, b)] = -1
        for j in range(plan.graph.n_blocks):
            if j not in resident:
                where[TensorId(kind=TensorKind.PARAMS, index=j)][home(TensorKind.PARAMS, j)] = -1
        for kind, j in nvme:
            if kind is not TensorKind.PARAMS and (kind is not TensorKind.GRADS or j not in self.pending):
                where[TensorId(kind=kind, index=j)][Tier.NVME] = -1
        batch = {(TensorId(kind=TensorKind.ACT, index=0, mb=m), Tier.HOST) for m in range(plan.n_micro)}
        batch |= {v for j in resident for v in resident_shards(sizes, j)}
        for t, tier in batch:
            where[t][tier] = -1
        self.batch = batch
        self.nvme = nvme
        self.kept = {TensorId(kind=TensorKind.GRADS, index=j) for j in sizes.gpu_updated}
        for j in sizes.gpu_updated:
            where[TensorId(kind=TensorKind.OPT_STATE, index=j)][Tier.HOST] = -1
            where[TensorId(kind=TensorKind.GRADS, index=j)][Tier.GPU] = -1

    def check_end(self, where: dict[TensorId, dict[Tier, int]]) -> None:
        """The step ends as it began: the kept accumulators on the GPU, nothing else left over, the same host
        gradients pending."""
        kept, batch = self.kept, self.batch
        missing = sorted(t.index for t in kept if Tier.GPU not in where.get(t, {}))
        if missing:
            raise PlanError(f"GPU-updated blocks {missing} end the step without their gradient accumulator on the "
                            "GPU (the next step's update applies it)")
        leftovers = [f"{t} on {tier.value}" for t, tiers in where.items() for tier in tiers
                     if not _static(t, tier, batch, self.nvme) and not (t in kept and tier is Tier.GPU)]
        if leftovers:
            raise PlanError(f"the step ends with tensors still resident: {', '.join(leftovers[:5])}"
                            f"{' …' if len(leftovers) > 5 else ''} (every step must start from the same state)")
        on_nvme = {j for kind, j in self.nvme if kind is TensorKind.GRADS}     # (their files always are there)
        host_grads = {t.index for t, tiers in where.items() if t.kind is TensorKind.GRADS and Tier.HOST in tiers}
        if host_grads != self.pending - on_nvme:
            raise PlanError(f"gradients of blocks {sorted(host_grads ^ (self.pending - on_nvme))} are left pending "
                            "at the end of the step")


def _update_readers(ops: list[Op], effs: list[Effects]) -> dict[TensorId, int]:
    """How many updates read each host gradient: a tied reader's is read by several and dropped by the last."""
    readers: dict[TensorId, int] = defaultdict(int)
    for op, eff in zip(ops, effs):
        if op.kind is OpKind.UPDATE:
            for t, _ in eff.reads:
                readers[t] += 1
    return readers


_NO_RESOURCE = Resource.NONE      # (``_ordered`` runs once per hazard: a member read off its Enum is slow)


def _ordered(ops: list[Op], op: Op, before: int) -> bool:
    """Is op ``before`` certain to finish before ``op`` starts?  Yes if it is a dependency, runs earlier
    on the same resource (each resource is FIFO), or precedes a dependency on its own resource."""
    if before in op.deps:
        return True
    res = ops[before].resource
    if res is _NO_RESOURCE:        # a free has no FIFO: only a direct dependency orders it
        return False
    return res is op.resource or any(ops[d].resource is res and d > before for d in op.deps)


def _check_order(plan: Plan, effs: list[Effects]) -> None:
    """Every hazard (``ir.order``) is ordered by a dependency or a resource's FIFO."""
    ops = plan.ops
    walk = HazardWalk()
    for op, eff in zip(ops, effs):
        for h in walk.step(op, eff):
            if not _ordered(ops, op, h.before):
                raise _fail(op, f"{_unordered(op, h, ops)} (compile the plan again)")


def _unordered(op: Op, h: Hazard, ops: list[Op]) -> str:
    """What an unordered hazard means, in the plan's words."""
    if h.kind == "norm":
        return f"takes the step's gradient norm without depending on {ops[h.before].kind.value} #{h.before}"
    t, tier = h.value
    if h.kind == "read" and op.kind is OpKind.UPDATE and ops[h.before].kind is OpKind.GRAD_OFFLOAD:
        return f"update must depend on grad_offload #{h.before}"
    if h.kind == "read" and op.kind is OpKind.LOAD:
        return f"loads parameters of block {t.index} without waiting for its update #{h.before}"
    if h.kind == "read":
        return f"reads {t} on {tier.value} produced by #{h.before} on another resource without depending on it"
    if op.kind is OpKind.FREE:
        who = "its reader" if h.kind == "write" else "its producer"
        return f"frees {t} on {tier.value} without waiting for {who} #{h.before}"
    if h.kind == "write":
        return f"changes {t} on {tier.value} while its reader #{h.before} may still run, without depending on it"
    return f"writes {t} on {tier.value} after #{h.before} changed it on another resource, without depending on it"


# ---- JSON shape check (before building objects, so bad files give a PlanError) ------------
_REQUIRED = {"format": str, "model": dict, "graph": dict, "hardware": dict, "budgets": dict, "batch_size": int,
             "seq_len": int, "param_dtype": str, "decisions": dict, "ops": list}
_OP_FIELDS = {"id": int, "kind": str, "block": int}
_LIMIT = 1 << 62


def check_plan_json(d: object) -> None:
    if not isinstance(d, dict):
        raise PlanError("plan file must hold a JSON object")
    fmt = d.get("format")
    if fmt != PLAN_FORMAT:
        if isinstance(fmt, str) and fmt.startswith("lazytrain.plan/"):
            raise PlanError(f"plan format {fmt!r} is not supported by this version (expects {PLAN_FORMAT!r}); "
                            "compile the plan again with this version")
        raise PlanError(f"not a LazyTrain plan (format {fmt!r}, expected {PLAN_FORMAT!r})")
    for key, typ in _REQUIRED.items():
        if key not in d:
            raise PlanError(f"plan is missing the field {key!r}")
        if not isinstance(d[key], typ) or (typ is int and isinstance(d[key], bool)):
            raise PlanError(f"plan field {key!r} must be {typ.__name__}, got {type(d[key]).__name__}")
    for key in ("batch_size", "seq_len"):
        if not 0 < d[key] < _LIMIT:
            raise PlanError(f"plan field {key!r} out of range: {d[key]}")
    kinds = {k.value for k in OpKind}
    for i, o in enumerate(d["ops"]):
        if not isinstance(o, dict):
            raise PlanError(f"op {i} must be an object")
        for key, typ in _OP_FIELDS.items():
            if not isinstance(o.get(key), typ) or isinstance(o.get(key), bool):
                raise PlanError(f"op {i}: field {key!r} missing or not {typ.__name__}")
        if o["kind"] not in kinds:
            raise PlanError(f"op {i}: unknown kind {o['kind']!r} (known: {', '.join(sorted(kinds))})")
        deps = o.get("deps", [])
        if not isinstance(deps, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in deps):
            raise PlanError(f"op {i}: deps must be a list of op ids")
        for x in deps:
            if not 0 <= x < i:
                raise PlanError(f"op {i}: dependency #{x} does not point to an earlier op (a cycle or a bad id)")
        for key in ("nbytes",):
            v = o.get(key, 0)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _LIMIT:
                raise PlanError(f"op {i}: {key} must be a non-negative integer below 2**62")
        v = o.get("seconds", 0.0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e9:
            raise PlanError(f"op {i}: seconds must be a non-negative number")
