"""LazyTrain IR: the model as blocks, and the plan as an explicit op list.

Grammar of a plan (one op per line, ``#id kind tensor move bytes ms after deps``)::

    plan     ::= op*                          -- program order; each resource runs its ops in this order
    op       ::= load        params[j]            host->gpu   (h2d)
               | compute     block[j] mbM [+saved] reads params[j], act[j] mbM; writes act[j+1] mbM
               | recompute   block[j] mbM         as compute, during backward; always writes saved[j] mbM
               | backward    block[j] mbM         reads saved[j], dact[j+1]; writes dact[j]; accumulates grads[j]
               | offload     act[i]|saved[j] mbM  gpu->host (d2h) | host->nvme (nvme)   -- a copy
               | reload      act[i]|saved[j] mbM  nvme->host (nvme) | host->gpu (h2d)   -- a copy
               | grad_offload grads[j]            gpu->host (d2h), moves
               | update      block[j]             optimizer step on the host (cpu), or on the GPU (gpu)
                                                  for a resident or GPU-updated block
               | state_load  ostate[j]            host->gpu (h2d): a GPU-updated block's parameters and
                                                  optimizer state, for its update and its forward
               | state_store ostate[j]            gpu->host (d2h): both back to the host store after it
               | state_read  params|grads|ostate[j]  nvme->host (nvme): a copy of state kept on NVMe
               | state_write params|grads|ostate[j]  host->nvme (nvme): a host copy back into its file
               | free        tensor on tier       drops one copy
               | all_gather  params[j]            reads pshard[j]; writes params[j] (net)   -- world_size > 1
               | reduce_scatter gshard[j]         reads, drops grads[j] gpu; writes gshard[j] (net)
               | all_reduce  grad norms           sums the ranks' squared norms (net), after the last grad_offload
    deps     ::= op ids that must finish first (always earlier ops): every hazard on a value between
                 two resources (``ir.order``), so the list states all the ordering the runtime keeps

One list is one period of the steady state: an ``update`` placed before its block's
``grad_offload`` is *lagged*: it applies the previous step's gradients and must finish before the
block's parameters are loaded again (``docs/architecture.md``, "The plan contract").  A *resident*
block (``Decisions.resident``) keeps its parameters, optimizer state and gradient accumulator on the
GPU for the whole run: it has no ``load``, ``free params`` or ``grad_offload``; its ``update`` runs
on the GPU stream at the start of the next step, before any forward reads it.  A *GPU-updated* block
(``Decisions.gpu_update``) streams, but its gradient accumulator stays on the GPU into the next step,
where ``state_load``, ``update`` (gpu) and ``state_store`` replace its host update and its forward's load.
A block whose state is kept on NVMe (``Decisions.nvme_state``: its parameters, gradients or optimizer state, each
on its own) has one file per component; its host copy is then a plan value like an activation: ``state_read``
makes it before the ops that read it (``load``, ``update``), ``state_write`` puts back what ``update`` or
``grad_offload`` changed, and ``free`` drops it.

A plan for ``world_size`` N > 1 (``ir.sharding``) is one rank's list, the same on every rank: a
``load`` copies the rank's shard (``pshard[j]``) and an ``all_gather`` assembles ``params[j]``; a
``reduce_scatter`` sums the ranks' ``grads[j]`` into this rank's ``gshard[j]``, which ``grad_offload``
moves to the host; one ``all_reduce`` sums the squared gradient norms.
"""

from .decisions import Decisions, Place, Saved
from .graph import Block, Cut, ModelGraph, ParamSpec, TensorSpec
from .ops import GiB, Op, OpKind, Resource, TensorId, TensorKind, Tier
from .plan import PLAN_FORMAT, Plan, PlanError, SolverStats
from .semantics import Sizes, effects
from .verify import MemoryReport, verify

__all__ = ["Block", "Cut", "Decisions", "GiB", "MemoryReport", "ModelGraph", "Op", "OpKind", "PLAN_FORMAT", "ParamSpec",
           "Place", "Plan", "PlanError", "Resource", "Saved", "Sizes", "SolverStats", "TensorId", "TensorKind",
           "TensorSpec", "Tier", "effects", "verify"]
