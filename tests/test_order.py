"""The plan states its whole ordering (``ir.order``): every hazard between two resources is a dependency
in ``op.deps``, ``verify`` refuses a plan that leaves one out, and the runtime runs with exactly what
the plan states (a norm-first plan's clip coefficient included)."""

from __future__ import annotations

import copy
import dataclasses
import json
from functools import lru_cache

import pytest
import torch
from eager_ref import assert_same_parameters, random_batches, step_beside_eager

from lazytrain.compiler.api import Compiler
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.synthetic import chain
from lazytrain.frontend.presets import build_from_config
from lazytrain.frontend.trace import trace
from lazytrain.ir import Decisions, GiB, OpKind, Place, Plan, PlanError, Resource, Saved, verify
from lazytrain.ir.order import HazardWalk, UpdateOrder
from lazytrain.ir.semantics import Sizes, effects
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

CFG = {"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 32, "n_layer": 3, "n_head": 2, "d_ff": 48,
       "max_seq": 32, "tie_weights": True}
SEQ = 16
#: every tier for boundaries and saved activations, on the GPT's 5 blocks (embedding tied to the head)
MIXED = Decisions(policy="mixed", micro_batch=1, n_micro=2,
                  boundary=(Place.HOST, Place.NVME, Place.NONE, Place.HOST, Place.GPU),
                  saved=(Saved.HOST, Saved.RECOMPUTE, Saved.RECOMPUTE, Saved.NVME, Saved.RECOMPUTE))


def _model(device: str = "meta") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config(CFG, device=device, dtype=torch.float32)


@lru_cache(maxsize=2)
def _plan_json(clip: bool) -> str:
    graph = trace(_model(), seq_len=SEQ, dtype="float32")
    budgets = {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB, "nvme_bytes": GiB, "nvme_dir": "nvme"}
    comp = Compiler(graph, get_profile("cpu"), budgets, param_dtype="float32", optimizer="adamw", clip=clip)
    return json.dumps(comp.build(MIXED, 2).to_json())


def _plan(clip: bool = True) -> Plan:
    return Plan.from_json(json.loads(_plan_json(clip)))


def test_readers_and_owners_of_tied_parameters():
    g = chain(4, tied=True, hidden=64, seq_len=16, layer_params=1000, saved_per_token=100, vocab=50)
    L = g.n_blocks
    assert g.readers(0) == (0, L - 1)           # the head reads the tied embedding
    assert g.owners(L - 1) == (0, L - 1)
    assert g.readers(1) == (1,) and g.owners(1) == (1,)
    assert g.readers(L - 1) == (L - 1,)


def _reachable(plan: Plan, src: int, dst: int) -> bool:
    """Does ``src`` finish before ``dst`` starts, through dependencies and each resource's list order?"""
    ops = plan.ops
    nxt: dict[int, list[int]] = {}
    last: dict[Resource, int] = {}
    for op in ops[:dst + 1]:
        for d in op.deps:
            nxt.setdefault(d, []).append(op.id)
        if op.resource is not Resource.NONE:
            if op.resource in last:
                nxt.setdefault(last[op.resource], []).append(op.id)
            last[op.resource] = op.id
    todo, seen = [src], {src}
    while todo:
        for k in nxt.get(todo.pop(), ()):
            if k == dst:
                return True
            if k < dst and k not in seen:
                seen.add(k)
                todo.append(k)
    return False


def _memory_bound(plan: Plan, op, d: int) -> bool:
    """The lowering's own dependencies: a compute after an offload (throttle), a load after a free."""
    before = plan.ops[d].kind
    return (op.kind, before) in ((OpKind.COMPUTE, OpKind.OFFLOAD), (OpKind.LOAD, OpKind.FREE))


@pytest.mark.parametrize("clip", [True, False])
def test_a_dropped_dependency_is_refused_unless_still_implied(clip):
    """Drop each dependency of the plan in turn: verify must refuse every drop after which the two ops
    are no longer ordered (by another dependency or a resource's order)."""
    plan = _plan(clip)
    refused = 0
    for i, op in enumerate(plan.ops):
        for d in op.deps:
            if _memory_bound(plan, op, d):
                continue
            ops = list(plan.ops)
            ops[i] = dataclasses.replace(op, deps=tuple(x for x in op.deps if x != d))
            cut = Plan(**{**plan.__dict__, "ops": ops})
            if _reachable(cut, d, i):
                continue
            with pytest.raises(PlanError, match="compile the plan again"):
                verify(cut)
            refused += 1
    assert refused > 50


def test_a_plan_file_missing_a_dependency_is_refused(tmp_path):
    """A reload of an activation to the GPU after the free of its forward copy: the runtime used to add
    this ordering itself; now the plan states it, and a file without it does not load."""
    d = json.loads(_plan_json(True))
    ops = d["ops"]
    reload = next(o for o in ops if o["kind"] == "reload" and o["dst"] == "gpu" and o["tensor"][0] == "saved"
                  and any(ops[x]["kind"] == "free" and ops[x]["tensor"] == o["tensor"] for x in o["deps"]))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    Plan.load(path)
    reload["deps"] = [x for x in reload["deps"] if ops[x]["kind"] != "free"]
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=rf"op #{reload['id']} .*without depending on it"):
        Plan.load(path)


def _updates_last(plan: Plan) -> Plan:
    """``plan`` with every update moved after the last gradient offload (same step, norm-first), its
    dependencies renumbered and completed with the hazards of the new order."""
    moved = [o for o in plan.ops if o.kind is not OpKind.UPDATE] + [o for o in plan.ops if o.kind is OpKind.UPDATE]
    new = {o.id: i for i, o in enumerate(moved)}
    ops = [dataclasses.replace(o, id=i, deps=tuple(new[d] for d in o.deps)) for i, o in enumerate(moved)]
    sizes, walk = Sizes.of_plan(plan), HazardWalk()
    ops = [dataclasses.replace(o, deps=tuple(sorted({*o.deps, *walk.deps(o, effects(o, sizes), ops)}))) for o in ops]
    return Plan(**{**plan.__dict__, "ops": ops})


def test_update_order():
    sizes = Sizes.of_plan(_plan(True))
    lagged = UpdateOrder.of(_plan(True).ops, sizes)
    assert lagged.lagged == set(lagged.updates) and lagged.norm_first
    streamed = UpdateOrder.of(_plan(False).ops, sizes)
    assert not streamed.lagged and not streamed.norm_first
    last = _updates_last(_plan(False))
    order = UpdateOrder.of(last.ops, sizes)
    assert order.norm_first and all(order.takes_norm(last.ops[u]) for u in order.updates.values())


def test_norm_first_plan_states_the_clip_coefficients_wait():
    """Same-step updates after every gradient offload take the step's global norm: each depends on the
    last grad_offload, and without that dependency the plan is refused."""
    plan = _updates_last(_plan(False))
    verify(plan)
    last_grad = max(op.id for op in plan.ops if op.kind is OpKind.GRAD_OFFLOAD)
    first = next(op for op in plan.ops if op.kind is OpKind.UPDATE)
    assert last_grad in first.deps
    ops = list(plan.ops)
    ops[first.id] = dataclasses.replace(first, deps=tuple(d for d in first.deps if d != last_grad))
    with pytest.raises(PlanError, match="gradient norm without depending on grad_offload"):
        verify(Plan(**{**plan.__dict__, "ops": ops}))


def test_norm_first_same_step_updates_clip_like_eager(tmp_path):
    """The same plan run with a clipping optimizer: the updates apply this step's clip coefficient (taken
    once, before the first of them, the tied embedding's sum reused by its update), as eager PyTorch."""
    model = _model("cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref = copy.deepcopy(model)
    plan = _updates_last(_plan(False))
    lr, eps = 1e-3, 1e-6
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=lr, eps=eps, max_grad_norm=0.5), device="cpu",
                 nvme_dir=str(tmp_path), verbose=False)
    assert tr.ctx.updates.norm_first and not tr.ctx.updates.lagged
    step_beside_eager(tr, ref, random_batches(CFG["vocab"], 2, SEQ, 3), lambda m, ids, labels: m(ids, labels),
                      lr=lr, eps=eps, clip=0.5)
    assert not tr.ctx.updates.pending           # nothing lagged: the parameters are final after each step
    tr.sync_to_model()
    tr.close()
    assert_same_parameters(model, ref)
