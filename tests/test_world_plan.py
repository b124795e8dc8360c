"""Plans for several data-parallel ranks (``ir.sharding``): the collectives are ops with effects,
ordered by ``ir.order`` like every other op, checked by ``verify``, priced by the simulator; a world of
one has none of them (``benchmarks/compare_plans.py`` checks that its plans are unchanged)."""

import dataclasses

import pytest

from lazytrain.compiler.api import Compiler, compile_model
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.solvers.heuristics import HEURISTICS
from lazytrain.compiler.synthetic import chain
from lazytrain.ir import GiB, Op, OpKind, Plan, PlanError, Resource, TensorId, TensorKind, verify
from lazytrain.ir.sharding import ALIGN, padded_numel, shard_numel

COLL = (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE)


def _graph(tied=False):
    return chain(4, tied=tied, hidden=256, seq_len=128, layer_params=1_000_000, saved_per_token=4000, vocab=1000)


def _plan(world=2, policy="megatrain", clip=True, mb=2, n=4):
    g = _graph()
    comp = Compiler(g, get_profile("h200"), {"gpu_bytes": 80 * GiB, "host_bytes": 64 * GiB, "nvme_bytes": 0},
                    param_dtype="bfloat16", optimizer="hybrid8bit", clip=clip, world_size=world)
    return comp.build(HEURISTICS[policy](g, mb, n), mb * n)


def test_shards_are_aligned_and_cover_the_block():
    numels = [10, 5000, 4096]
    s = shard_numel(numels, 3)
    assert s % ALIGN == 0 and 3 * s >= ALIGN + 2 * ALIGN + ALIGN
    assert padded_numel(numels, 1) == sum(numels) and padded_numel(numels, 3) == 3 * s


@pytest.mark.parametrize("policy", ["megatrain", "keep-all", "recompute-all"])
@pytest.mark.parametrize("clip", [True, False])
def test_world_plan_verifies_with_one_collective_per_transfer(policy, clip):
    plan = _plan(policy=policy, clip=clip)
    assert plan.count(OpKind.ALL_GATHER) == plan.count(OpKind.LOAD) > 0
    assert plan.count(OpKind.REDUCE_SCATTER) == plan.count(OpKind.GRAD_OFFLOAD) > 0
    assert plan.count(OpKind.ALL_REDUCE) == 1
    assert all(op.resource is Resource.NET for op in plan.ops if op.kind in COLL)
    one = _plan(world=1, policy=policy, clip=clip)
    assert not any(op.kind in COLL for op in one.ops) and "net" not in one.predicted["busy_s"]
    # each rank copies its shard over PCIe: half the bytes
    h2d = {w: sum(op.nbytes for op in p.ops if op.kind is OpKind.LOAD) for w, p in ((1, one), (2, plan))}
    assert h2d[2] < 0.51 * h2d[1]
    assert plan.predicted["busy_s"]["net"] > 0


def test_collectives_print_as_one_line_golden():
    plan = _plan()
    lines = {op.kind: str(op) for op in plan.ops if op.kind in COLL}
    assert lines[OpKind.ALL_REDUCE].split()[1:4] == ["all_reduce", "grad", "norms"]
    ag = next(op for op in plan.ops if op.kind is OpKind.ALL_GATHER)
    assert str(ag).startswith(f"#{ag.id} all_gather   params[{ag.block}]")
    assert f"after #{ag.id - 1}" in str(ag)          # it waits for this rank's shard load


def test_round_trip_and_wrong_world_refused(tmp_path):
    plan = _plan()
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back.world_size == 2 and [str(o) for o in back.ops] == [str(o) for o in plan.ops]
    with pytest.raises(PlanError, match="compiled for world size 2 but the runtime has 1 process"):
        back.check_world_size(1)
    back.check_world_size(2)


def test_verify_refuses_a_missing_gather_or_a_collective_in_a_world_of_one():
    plan = _plan()
    ag = next(op for op in plan.ops if op.kind is OpKind.ALL_GATHER)
    # the gather turned into a no-op: the forward reads params that were never assembled
    bad = [dataclasses.replace(op, kind=OpKind.ALL_REDUCE, tensor=None) if op.id == ag.id else op for op in plan.ops]
    with pytest.raises(PlanError):
        verify(dataclasses.replace(plan, ops=bad))
    # a dependency dropped: the gather may read the shard before its load is done
    bad = [dataclasses.replace(op, deps=()) if op.id == ag.id else op for op in plan.ops]
    with pytest.raises(PlanError, match="without depending"):
        verify(dataclasses.replace(plan, ops=bad))
    one = _plan(world=1)
    extra = Op(id=len(one.ops), kind=OpKind.ALL_REDUCE, block=0, resource=Resource.NET)
    d = dataclasses.replace(one, ops=[*one.ops, extra]).to_json()
    with pytest.raises(PlanError, match="all_reduce in a plan for world size 1"):
        Plan.from_json(d)


def test_tied_and_resident_plans_for_several_ranks_verify_with_their_collectives():
    """A tied parameter is a section of its own (the reader gathers and reduce-scatters it like its other
    parameters); a resident block keeps its shards on the GPU and is gathered once a step after its update,
    reduce-scattered into its accumulator after its backward, its gathered copy freed."""
    g = _graph(tied=True)
    plain = compile_model(g, batch_size=8, policy="megatrain", world_size=2, resident="none")
    assert plain.count(OpKind.ALL_GATHER) == plain.count(OpKind.LOAD)
    plan = compile_model(g, batch_size=8, policy="megatrain", world_size=2, resident=1)
    res = sorted(plan.decisions.resident_blocks)
    assert res == [0, g.n_blocks - 1]           # the tie group, whole
    for j in res:
        ag = [op for op in plan.ops if op.kind is OpKind.ALL_GATHER and op.block == j]
        rs = [op for op in plan.ops if op.kind is OpKind.REDUCE_SCATTER and op.block == j]
        up = next(op for op in plan.ops if op.kind is OpKind.UPDATE and op.block == 0)    # the tied owner's
        assert len(ag) == len(rs) == 1 and up.id < ag[0].id and up.id in ag[0].deps
        assert not any(op.kind is OpKind.LOAD and op.block == j for op in plan.ops)
    # without clipping the next step's update waits for the reduce-scatters adding into its accumulator
    from lazytrain.ir.order import cross_period
    from lazytrain.ir.semantics import Sizes
    loose = compile_model(g, batch_size=8, policy="megatrain", world_size=2, resident=1, clip=False)
    u0 = next(op.id for op in loose.ops if op.kind is OpKind.UPDATE and op.block == 0)
    rs = {op.id for op in loose.ops if op.kind is OpKind.REDUCE_SCATTER and op.block in res}
    assert len(rs) == 2 and rs <= set(cross_period(loose.ops, Sizes.of_plan(loose), clip=False)[u0])
    # the gather moved before the update: the forward would read last step's parameters
    ag = next(op for op in plan.ops if op.kind is OpKind.ALL_GATHER and op.block == 0)
    up = next(op for op in plan.ops if op.kind is OpKind.UPDATE and op.block == 0)
    ops = [dataclasses.replace(op, id=up.id) if op.id == ag.id else dataclasses.replace(op, id=ag.id)
           if op.id == up.id else op for op in plan.ops]
    ops = sorted(ops, key=lambda op: op.id)
    with pytest.raises(PlanError):
        verify(dataclasses.replace(plan, ops=[dataclasses.replace(op, deps=tuple(d for d in op.deps if d < op.id))
                                              for op in ops]))
    with pytest.raises(ValueError, match="not a multiple of the 2 nodes"):
        compile_model(_graph(), batch_size=8, policy="megatrain", world_size=3, nodes=2)


def test_a_tied_sections_slice_is_the_same_elements_in_its_owner_and_its_reader():
    """Every element of every tensor is in exactly one rank's owned pieces, and a reader's link slice is
    the owner's tied slice (same length, linked both ways), on every rank."""
    from lazytrain.runtime.shards import gathered_layouts, owned_pieces, shard_layouts
    g = _graph(tied=True)
    for world in (2, 3):
        gathered = gathered_layouts(g, world)
        covered = {}
        for r in range(world):
            shards = shard_layouts(gathered, world, r)
            for lay in gathered:
                for seg, a, b in owned_pieces(lay, world, r):
                    covered[seg.name] = covered.get(seg.name, 0) + b - a
            (here, owner, off), = shards[-1].links
            there, readers = shards[owner].shared[0]
            assert owner == 0 and there.offset == off and there.numel == here.numel
            assert readers == [(g.n_blocks - 1, here.offset)] and here.offset >= shards[-1].owned_numel
        assert covered == {p.name: p.numel for b in g.blocks for p in b.params if p.owner == b.index}


def test_host_budget_is_shared_by_the_ranks_of_a_host():
    plan = compile_model(_graph(), batch_size=8, policy="milp", world_size=4, nodes=2, host_memory="64GiB",
                         time_limit=2)
    assert plan.world_size == 4 and plan.options["nodes"] == 2
    assert plan.budgets["host_bytes"] == 32 * GiB
    assert plan.count(OpKind.ALL_GATHER) > 0
    streamed = min(set(range(plan.graph.n_blocks)) - plan.decisions.resident_blocks)
    assert TensorId(kind=TensorKind.PARAM_SHARD, index=streamed) in {op.tensor for op in plan.ops}


def test_the_milp_chooses_resident_blocks_for_several_ranks_and_prices_their_shards():
    """At N > 1 ``resident="auto"`` lets the MILP keep a prefix on the GPU: each resident block is gathered once a
    step (no load, no backward re-gather) and reduce-scattered after its backward; the solver's step time is the
    simulator's.  The MILP's host row counts one rank's shard of the store: with a host budget per rank above the
    shard and below the whole store (0.025 GiB here against 0.017 and 0.035) it solves instead of falling back to
    a heuristic plan."""
    plan = compile_model(_graph(), batch_size=8, policy="milp", world_size=2, time_limit=2, host_memory="0.05GiB")
    res = sorted(plan.decisions.resident_blocks)
    assert plan.decisions.policy == "milp" and "milp_fallback" not in plan.decisions.notes and res
    for j in res:
        assert [op.kind for op in plan.ops if op.block == j and op.kind in COLL[:2]] == list(COLL[:2])
        assert not any(op.kind is OpKind.LOAD and op.block == j for op in plan.ops)
    assert plan.decisions.notes["objective_s"] == pytest.approx(plan.predicted["step_time_s"], rel=0.01)
    none = compile_model(_graph(), batch_size=8, policy="milp", world_size=2, time_limit=2, resident="none")
    assert plan.predicted["step_time_s"] < none.predicted["step_time_s"]


def test_compile_command_batch_is_the_global_batch_split_over_the_world(tmp_path, capsys):
    """``lazytrain compile --batch B --world-size N``: B is what one optimizer step sees over all N GPUs (as
    ``train --gpus N`` takes it), each rank's plan B / N rows; a B that does not divide is one line, before work."""
    from lazytrain.app.cli import main
    out = tmp_path / "plan.json"
    common = ["tiny", "--seq", "64", "--gpu-memory", "8GiB", "--policy", "keep-all", "--hardware", "cpu",
              "--dtype", "float32", "-o", str(out)]
    assert main(["compile", *common, "--batch", "8", "--world-size", "2"]) == 0
    plan = Plan.load(out)
    assert (plan.batch_size, plan.world_size) == (4, 2)
    capsys.readouterr()
    assert main(["compile", *common, "--batch", "7", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("lazytrain compile: error: --batch 7 is the global batch, split evenly over --world-size 2 GPUs: "
                   "it must be a multiple of 2")
