"""The state the handlers share: ``Run`` (fixed for the trainer's run) and ``Step`` (one step's,
constructed fresh for each step), and the payloads of plan values.  What carries across steps is the
update path's (``updates.Updates``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..ir import Op, Plan, Resource, TensorId, TensorKind, Tier
from ..ir.ops import tensor_id
from .nvme import NvmeFile, NvmeStore
from .nvme_state import NvmeState
from .optim.base import HostOptimizer
from .optim.clipping import GradNormTracker
from .profiling import Profiler
from .store import HostPool, HostStore
from .streams import Streams

if TYPE_CHECKING:
    from ..frontend.program import BlockProgram
    from .distributed import World
    from .interpreter import Schedule
    from .saved import SavedRecord
    from .updates import Updates

G, H, N = Tier.GPU, Tier.HOST, Tier.NVME


def describe(op: Op) -> str:
    """The op's one-line print without its id (what error messages name)."""
    return " ".join(str(op).split()[1:])


@dataclass
class GpuParams:
    flat: torch.Tensor
    views: dict[str, torch.Tensor]
    #: other buffers the views point into (a resident block's tied links: its owner's buffer)
    extra: tuple[torch.Tensor, ...] = ()

    @property
    def flats(self) -> tuple[torch.Tensor, ...]:
        return (self.flat, *self.extra)


@dataclass
class NvmeCopy:
    file: NvmeFile
    dtype: torch.dtype
    shape: tuple[int, ...]


#: what an op leaves in ``Step.done``: a CUDA event (a stream op), a host worker's future, or None (complete)
Handle = torch.cuda.Event | Future | None
#: one copy's contents (``handlers``'s docstring): a block's parameters, an accumulator, or named tensors
Payload = GpuParams | torch.Tensor | dict


@dataclass(frozen=True, eq=False, kw_only=True)
class Run:
    """What is fixed for a trainer's run: the plan, the program, where things live, who runs them."""

    plan: Plan
    program: BlockProgram
    device: torch.device
    streams: Streams
    store: HostStore
    pool: HostPool
    nvme: NvmeStore | None
    optimizer: HostOptimizer
    tracker: GradNormTracker
    requires_grad: frozenset[str]         # value names that carry gradients
    #: parameters with requires_grad=False: no gradient is taken for them, so their accumulator slice
    #: stays zero and (without weight decay) the update leaves them as they are
    frozen: frozenset[str]
    #: resident blocks (``Decisions.resident``): parameters on the GPU for the whole run, and per
    #: parameter name the slice of its owner's fp32 GPU accumulator that backward adds into
    resident: dict[int, GpuParams]
    resident_targets: dict[int, dict[str, torch.Tensor]]
    updates: Updates                      # the update path, and what it carries across steps
    schedule: Schedule                    # the dispatcher's view of the plan (interpreter.Schedule)
    #: the data-parallel world (``distributed.World``) and the blocks' gathered layouts on the GPU
    #: (``shards``; ``store.layouts`` are then this rank's shards); None in a world of one
    world: World | None = None
    gpu_layouts: list | None = None
    #: with several ranks, a resident block's shard of its parameters on the GPU (its optimizer updates
    #: it in place; ``all_gather`` reads it every step); ``resident`` is then empty
    resident_shards: dict = field(default_factory=dict)
    #: the state the plan keeps on NVMe (``nvme_state.NvmeState``); None where it keeps none
    nvme_state: NvmeState | None = None

    @property
    def L(self) -> int:
        return self.plan.graph.n_blocks

    @property
    def cuda(self) -> bool:
        return self.streams.cuda

    def params(self, j: int, copies: dict) -> GpuParams:
        """Block j's parameters on the GPU: resident, or the loaded copy."""
        p = self.resident.get(j)
        return p if p is not None else _get(copies, tensor_id(TensorKind.PARAMS, j), G)


def _get(copies: dict, t: TensorId, tier: Tier):
    try:
        return copies[(t, tier)]
    except KeyError:
        raise KeyError(f"{t} is not resident on {tier.value}") from None


@dataclass(eq=False)
class Step:
    """One step's state, constructed fresh for each step: nothing of a step leaks into the next."""

    run: Run
    profiler: Profiler | None = None
    copies: dict[tuple[TensorId, Tier], Payload] = field(default_factory=dict)
    saved_rec: dict[tuple[int, int], SavedRecord] = field(default_factory=dict)
    done: dict[int, Handle] = field(default_factory=dict)
    #: per block, its gradient's squared norm on the device (None: taken on the host, tied parameters)
    grad_sq: dict[int, torch.Tensor | None] = field(default_factory=dict)
    loss_parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # mb -> (sum, tokens)
    rng_states: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (block, mb) -> before forward
    inv_tokens: torch.Tensor | None = None
    #: the step's clip coefficient once taken (``Updates.coefficient``); None there: skip the step
    coef: float | None = None
    norm_done: bool = False

    # ---- op bracketing -----------------------------------------------------------------------
    def begin(self, op: Op, res: Resource) -> None:
        """Make ``res`` wait for the op's dependencies, then mark the start (profiling)."""
        self.run.streams.wait_on_stream(res, self.dep_handles(op))
        if self.profiler is not None:
            self.profiler.start(op, self.run.streams.stream(res))

    def end(self, op: Op, res: Resource) -> None:
        ev = self.run.streams.record(res)
        self.done[op.id] = ev
        if self.profiler is not None:
            self.profiler.stop(op, self.run.streams.stream(res))

    def dep_handles(self, op: Op) -> list[Handle]:
        """The completion handles of the op's dependencies (``op.deps``), and of what it waits for from
        the previous step (``interpreter.Schedule.carried``: host updates still running)."""
        carried = [self.run.updates.future(d) for d in self.run.schedule.carried[op.id]]
        return [self.done.get(d) for d in op.deps] + carried

    def submit(self, pool: ThreadPoolExecutor, op: Op, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a host worker after the op's dependencies (waited for in the worker)."""
        handles = self.dep_handles(op)
        prof = self.profiler

        def work():
            Streams.wait_on_host(handles)
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:
                raise RuntimeError(f"while executing op #{op.id} ({describe(op)}): {e}") from e
            if prof is not None:
                prof.host_interval(op, t0, time.perf_counter())
        self.done[op.id] = pool.submit(work)

    def take(self, t: TensorId, tier: Tier):
        try:
            return self.copies.pop((t, tier))
        except KeyError:
            raise KeyError(f"{t} is not resident on {tier.value}") from None

    def get(self, t: TensorId, tier: Tier):
        return _get(self.copies, t, tier)

    def put(self, t: TensorId, tier: Tier, payload: Payload) -> None:
        self.copies[(t, tier)] = payload

    def params(self, j: int) -> GpuParams:
        return self.run.params(j, self.copies)
