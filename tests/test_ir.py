"""IR: ops print as one line, plans round-trip through JSON, verify rejects hand-broken plans."""

import dataclasses
import json

import pytest

from lazytrain.compiler.api import Compiler
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.solvers.heuristics import HEURISTICS, recompute_all
from lazytrain.compiler.synthetic import chain
from lazytrain.ir import GiB, Op, OpKind, Plan, PlanError, TensorId, TensorKind, Tier, verify


def _plan(policy="recompute-all", mb=2, n=4, gpu=80 * GiB):
    g = chain(4, tied=True, hidden=256, seq_len=128, layer_params=1_000_000, saved_per_token=4000, vocab=1000)
    comp = Compiler(g, get_profile("h200"), {"gpu_bytes": gpu, "host_bytes": 64 * GiB, "nvme_bytes": 0},
                    param_dtype="bfloat16", optimizer="hybrid8bit", clip=True)
    return comp.build(HEURISTICS[policy](g, mb, n), mb * n)


def test_op_prints_as_one_line_golden():
    op = Op(id=17, kind=OpKind.OFFLOAD, block=3, mb=2, tensor=TensorId(kind=TensorKind.ACT, index=3, mb=2),
            src=Tier.GPU, dst=Tier.HOST, nbytes=int(0.70 * GiB), seconds=0.0123, deps=(15,))
    assert str(op) == "#17 offload      act[3] mb2         gpu->host    0.70 GiB   12.300 ms after #15"
    assert "\n" not in str(op)


def test_plan_prints_as_its_program_and_table():
    plan = _plan()
    text = str(plan)
    assert text.splitlines()[0].startswith("plan chain4: batch 8 = 4 x 2")
    assert len(text.splitlines()) == len(plan.ops) + 1
    table = plan.table(limit=5)
    assert "kind" in table and "... " in table
    assert "predicted step" in plan.summary()


def test_json_round_trip(tmp_path):
    plan = _plan("megatrain")
    path = tmp_path / "p.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.ops == plan.ops
    assert back.decisions == plan.decisions
    assert back.graph == plan.graph
    assert back.predicted == plan.predicted
    d = json.loads(path.read_text())
    assert d["format"] == "lazytrain.plan/1"
    assert {"step_time_s", "peak_gpu_bytes", "peak_host_bytes"} <= set(d["predicted"])
    assert all(o["kind"] in {k.value for k in OpKind} for o in d["ops"])
    verify(back)


@pytest.mark.parametrize("policy", list(HEURISTICS))
def test_every_policy_verifies(policy):
    verify(_plan(policy))


def _renumber(ops):
    """Drop ops and keep ids/deps consistent (deps on dropped ops are removed)."""
    keep = {o.id: i for i, o in enumerate(ops)}
    return [dataclasses.replace(o, id=i, deps=tuple(keep[d] for d in o.deps if d in keep)) for i, o in enumerate(ops)]


def test_verify_rejects_reading_a_tensor_that_is_not_resident():
    plan = _plan()
    first_load = next(o for o in plan.ops if o.kind is OpKind.LOAD)
    ops = _renumber([o for o in plan.ops if o is not first_load])
    with pytest.raises(PlanError, match="not resident"):
        verify(Plan(**{**plan.__dict__, "ops": ops}))


def test_verify_rejects_memory_over_budget():
    plan = _plan()
    peak = verify(plan).peak_gpu_bytes
    small = Plan(**{**plan.__dict__, "budgets": {**plan.budgets, "gpu_bytes": peak - 1}})
    with pytest.raises(PlanError, match="exceeds the budget"):
        verify(small)


def test_verify_rejects_a_block_updated_twice():
    plan = _plan()
    upd = [o for o in plan.ops if o.kind is OpKind.UPDATE]
    dup = dataclasses.replace(upd[-1], id=len(plan.ops), deps=())
    with pytest.raises(PlanError, match="updated twice"):
        verify(Plan(**{**plan.__dict__, "ops": plan.ops + [dup]}))


def test_verify_rejects_a_race_between_streams():
    plan = _plan()
    # a compute that forgets to wait for its parameter load (another stream) is a race
    i, op = next((i, o) for i, o in enumerate(plan.ops) if o.kind is OpKind.COMPUTE and o.block == 1)
    ops = list(plan.ops)
    ops[i] = dataclasses.replace(op, deps=tuple(d for d in op.deps if plan.ops[d].kind is not OpKind.LOAD))
    with pytest.raises(PlanError, match="without depending"):
        verify(Plan(**{**plan.__dict__, "ops": ops}))


def test_verify_rejects_a_free_before_its_reader():
    plan = _plan()
    i, op = next((i, o) for i, o in enumerate(plan.ops) if o.kind is OpKind.FREE and o.tensor.kind is TensorKind.PARAMS)
    ops = list(plan.ops)
    ops[i] = dataclasses.replace(op, deps=())
    with pytest.raises(PlanError, match="without waiting"):
        verify(Plan(**{**plan.__dict__, "ops": ops}))


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(format="lazytrain.plan/9"), "not supported by this version"),
    (lambda d: d.update(format="something"), "not a LazyTrain plan"),
    (lambda d: d.pop("ops"), "missing the field 'ops'"),
    (lambda d: d.update(batch_size="8"), "must be int"),
    (lambda d: d["ops"][3].update(kind="teleport"), "unknown kind 'teleport'"),
    (lambda d: d["ops"][3].update(deps=[5]), "does not point to an earlier op"),
    (lambda d: d["ops"][3].update(nbytes=-1), "non-negative"),
    (lambda d: d["graph"]["blocks"][1]["params"][0].update(shape=[7, 7]), "fingerprint does not match"),
])
def test_malformed_plan_files_give_plan_errors(tmp_path, mutate, match):
    d = _plan().to_json()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=match):
        Plan.load(path)


def test_truncated_plan_file(tmp_path):
    path = tmp_path / "p.json"
    _plan().save(path)
    path.write_text(path.read_text()[:500])
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(path)


def test_recompute_all_is_leaner_than_keep_all():
    assert verify(_plan("recompute-all")).peak_gpu_bytes < verify(_plan("keep-all")).peak_gpu_bytes


def test_recompute_all_decisions_shape():
    g = chain(3)
    d = recompute_all(g, 1, 2)
    d.check()
    assert d.segments() == [(i, i + 1) for i in range(g.n_blocks)]
