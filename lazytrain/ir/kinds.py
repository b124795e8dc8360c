"""The op registry: one row per ``OpKind`` with everything the IR knows of it, so that a new kind is one
row here, its effects function (``semantics.EFFECTS``) and its runtime handler (``runtime.interpreter.HANDLERS``;
the runtime sits above the IR, so it keeps its own table, which a test checks is complete).

Who reads which column: ``semantics.effects_of`` the effects; ``Op.__str__`` the printer (kept in ``ops.py``
beside the op it prints, so that the IR's data imports no registry); the lowering the resource an op of the kind
runs on (a copy's comes from the tier table, ``ir.tiers``); ``schema`` which kinds are copies and which
collectives; ``order.cross_period`` which kinds end a step; the grammar lines are those of
``lazytrain/ir/__init__.py`` (a test checks each is there).  ``docs/architecture.md``, "How to add an op kind",
lists the places a new kind needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .ops import OPERAND_TEXT, Op, OpKind, Resource, operand_text
from .semantics import EFFECTS, EffectsFn


@dataclass(frozen=True, slots=True, kw_only=True)
class OpSpec:
    kind: OpKind
    #: its line of the plan grammar (``lazytrain/ir/__init__.py``), from the kind's name on
    grammar: str
    #: what an op of the kind reads, writes, drops and changes in place (``semantics.effects_of``)
    effects: EffectsFn
    #: the resources an op of the kind runs on, the first where the lowering has no other reason; empty: a
    #: copy, whose resource is its tiers' (``ir.tiers.copy``)
    resources: tuple[Resource, ...]
    #: the operand column of its printed line (``Op.__str__``: ``ops.OPERAND_TEXT``, next to the op it prints)
    what: Callable[[Op], str] = operand_text
    #: the last ops of a step: with exact clipping a lagged update waits for all of the previous step's
    #: (``order.cross_period``)
    ends_step: bool = False

    @property
    def is_copy(self) -> bool:
        """A copy of one value between two tiers: it needs a tensor, a source and a destination tier."""
        return not self.resources

    @property
    def collective(self) -> bool:
        """It runs between the ranks of a data-parallel world, on the collective stream (``world_size > 1``)."""
        return self.resources == (Resource.NET,)


def _row(kind: OpKind, grammar: str, resources: tuple[Resource, ...], **kw) -> OpSpec:
    return OpSpec(kind=kind, grammar=grammar, effects=EFFECTS[kind], resources=resources,
                  what=OPERAND_TEXT.get(kind, operand_text), **kw)


_H2D, _D2H, _GPU, _CPU, _NET = Resource.H2D, Resource.D2H, Resource.GPU, Resource.CPU, Resource.NET

#: one row per op kind, in the grammar's order
KINDS: dict[OpKind, OpSpec] = {s.kind: s for s in (
    _row(OpKind.LOAD, "load        params[j]            host->gpu   (h2d)", (_H2D,)),
    _row(OpKind.COMPUTE, "compute     block[j] mbM [+saved] reads params[j], act[j] mbM; writes act[j+1] mbM",
         (_GPU,)),
    _row(OpKind.RECOMPUTE, "recompute   block[j] mbM         as compute, during backward; always writes saved[j] mbM",
         (_GPU,)),
    _row(OpKind.BACKWARD, "backward    block[j] mbM         reads saved[j], dact[j+1]; writes dact[j]; accumulates "
         "grads[j]", (_GPU,), ends_step=True),
    _row(OpKind.OFFLOAD, "offload     act[i]|saved[j] mbM  gpu->host (d2h) | host->nvme (nvme)   -- a copy", ()),
    _row(OpKind.RELOAD, "reload      act[i]|saved[j] mbM  nvme->host (nvme) | host->gpu (h2d)   -- a copy", ()),
    _row(OpKind.GRAD_OFFLOAD, "grad_offload grads[j]            gpu->host (d2h), moves", (_D2H,), ends_step=True),
    _row(OpKind.UPDATE, "update      block[j]             optimizer step on the host (cpu), or on the GPU (gpu)",
         (_CPU, _GPU)),
    _row(OpKind.STATE_LOAD, "state_load  ostate[j]            host->gpu (h2d): a GPU-updated block's parameters and",
         (_H2D,)),
    _row(OpKind.STATE_STORE, "state_store ostate[j]            gpu->host (d2h): both back to the host store after it",
         (_D2H,)),
    _row(OpKind.STATE_READ, "state_read  params|grads|ostate[j]  nvme->host (nvme): a copy of state kept on NVMe",
         (Resource.NVME,)),
    _row(OpKind.STATE_WRITE, "state_write params|grads|ostate[j]  host->nvme (nvme): a host copy back into its file",
         (Resource.NVME,)),
    _row(OpKind.FREE, "free        tensor on tier       drops one copy", (Resource.NONE,)),
    _row(OpKind.ALL_GATHER, "all_gather  params[j]            reads pshard[j]; writes params[j] (net)   -- "
         "world_size > 1", (_NET,)),
    _row(OpKind.REDUCE_SCATTER, "reduce_scatter gshard[j]         reads, drops grads[j] gpu; writes gshard[j] (net)",
         (_NET,), ends_step=True),
    _row(OpKind.ALL_REDUCE, "all_reduce  grad norms           sums the ranks' squared norms (net), after the last "
         "grad_offload", (_NET,), ends_step=True),
)}

#: kinds that copy a value between tiers, and the collectives (``OpSpec.is_copy``, ``OpSpec.collective``)
COPY_KINDS = frozenset(k for k, s in KINDS.items() if s.is_copy)
COLLECTIVES = tuple(k for k, s in KINDS.items() if s.collective)
#: kinds whose previous-step ops a clipped lagged update waits for (``OpSpec.ends_step``)
STEP_END_KINDS = frozenset(k for k, s in KINDS.items() if s.ends_step)


def spec(kind: OpKind) -> OpSpec:
    """The registry's row of ``kind``."""
    return KINDS[kind]


def resource(kind: OpKind) -> Resource:
    """The resource an op of ``kind`` runs on where nothing else decides (not for a copy: its tiers' decide)."""
    return KINDS[kind].resources[0]
