"""Calibration of compiled blocks' cuts (``calibrate.cut_timings``, ``block_timing.CutTiming``): a timed cut's
forward and backward are what the cost model, the MILP and the plan use; an untimed one stays modelled, and the
summary says which.

The cost-model and plan tests use a synthetic chain whose layers offer a second cut (``test_cuts._with_cut``)
and made-up timings: fast, and the figures are known.  The end-to-end test calibrates a tiny Qwen2 with compiled
blocks on the CPU (the partition's fx graphs stand in for Inductor, as in ``test_compiled_blocks``): it starts a
trainer per cut index and partitions each program at its cuts, 18-31 s on a shared 2-core machine, hence ``slow``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_cuts import _compile, _with_cut

import lazytrain
import lazytrain.frontend.compiled as compiled
from lazytrain.compiler.api import Compiler
from lazytrain.compiler.block_timing import BlockTiming, CutTiming
from lazytrain.compiler.cost import CostModel
from lazytrain.compiler.hardware import HardwareProfile
from lazytrain.compiler.profiles import PROFILES, get_profile
from lazytrain.compiler.solvers.coefficients import coefficients
from lazytrain.compiler.synthetic import chain
from lazytrain.ir import OpKind, Saved
from lazytrain.ir.summary import measured_cuts
from lazytrain.measure.calibrate import cut_plan, measure_blocks, missing

MB = 8


def _timings(graph, *, cut_bytes_delta: int = 0) -> tuple[BlockTiming, BlockTiming]:
    """(min-cut only, with cut 1 timed) for the chain's layers: forward 2 ms, backward 5 ms, recompute 2.2 ms;
    cut 1 forward 2.1 ms, backward 9 ms (``cut_bytes_delta``: the cut timed names other saved bytes)."""
    j = 1
    c = graph.blocks[j].cuts[1]
    base = BlockTiming(signature=graph.block_signature(j), block="layer", micro_batch=MB, seq_len=graph.seq_len,
                       forward_s=2e-3, backward_s=5e-3, recompute_s=2.2e-3, samples=3)
    return base, dataclasses.replace(base, cuts=(CutTiming(budget=c.budget, saved_bytes=c.saved_bytes + cut_bytes_delta,
                                                           forward_s=2.1e-3, backward_s=9e-3, samples=3),))


def test_a_timed_cut_is_priced_as_measured_and_an_untimed_one_as_modelled():
    graph = _with_cut(chain(6, saved_per_token=300_000), 0.2, 0.5)
    base, timed = _timings(graph)
    cut = tuple(1 if len(b.cuts) > 1 else 0 for b in graph.blocks)
    hw = get_profile("h200")
    measured = CostModel(graph, hw.with_timings([timed]), MB, "bfloat16", cut=cut)
    assert (measured.fwd_s(1), measured.bwd_s(1)) == (pytest.approx(2.1e-3), pytest.approx(9e-3))
    assert measured.cut_recompute_s(1, 1) == pytest.approx(4e-3) and measured.recompute_s(1) == 2.2e-3
    at_min = CostModel(graph, hw.with_timings([timed]), MB, "bfloat16")      # the same block at the min-cut
    assert (at_min.fwd_s(1), at_min.bwd_s(1)) == (2e-3, 5e-3)
    # a profile timed before cuts were is calibrated again (``missing``); one with the cuts timed is not
    untimed = [0, graph.n_blocks - 1]          # the embedding and the head have no timing here
    assert missing(graph, hw.with_timings([timed]), MB) == untimed
    assert missing(graph, hw.with_timings([base]), MB) == list(range(graph.n_blocks))
    for profile in (hw.with_timings([base]), hw.with_timings([_timings(graph, cut_bytes_delta=1)[1]])):
        modelled = CostModel(graph, profile, MB, "bfloat16", cut=cut)     # no cut timed, or another cut timed
        assert modelled.fwd_s(1) == 2e-3 and modelled.cut_timing(1, 1) is None
        assert modelled.bwd_s(1) == pytest.approx(5e-3 + 2.2e-3 * modelled._cut_share(1, 1))


def test_plans_take_the_measured_cut_and_the_summary_says_so():
    """The same decisions (the MILP's at a budget where it chooses the cut) built with each profile: the ops of a
    block at the cut take the measured seconds, and the MILP's rows the measured forward too (``cut_F``)."""
    graph = _with_cut(chain(6, saved_per_token=300_000), 0.2, 0.5)
    chosen = _compile(graph, "10GiB")
    dec, at = chosen.decisions, [j for j in range(graph.n_blocks) if chosen.decisions.cut_of(j)]
    assert at, "the tight budget makes the MILP choose the cut"
    summaries = {}
    for name, t in zip(("modelled", "measured"), _timings(graph)):
        hw = get_profile("h200").with_timings([t])
        plan = Compiler(graph, hw, chosen.budgets, param_dtype="bfloat16", optimizer="hybrid8bit", clip=True,
                        compile_blocks=True).build(dec, chosen.batch_size)
        ops = {(op.kind, op.block): op.seconds for op in plan.ops if op.mb == 0}
        coef = coefficients(CostModel(graph, hw, MB), chosen.budgets, dec.n_micro, 12.0)
        if name == "measured":
            assert measured_cuts(plan) == at and coef.cut_F[1] == [0.0, pytest.approx(0.1)]
            assert all(ops[(OpKind.COMPUTE, j)] == pytest.approx(2.1e-3) for j in at)
            assert all(ops[(OpKind.BACKWARD, j)] == pytest.approx(9e-3) for j in at)
        else:
            assert measured_cuts(plan) == [] and coef.cut_F == []
            assert all(ops[(OpKind.COMPUTE, j)] == 2e-3 for j in at)
        summaries[name] = " ".join(plan.summary().split())
    assert "The cuts' forward and backward are measured" in summaries["measured"]
    assert "A cut's backward costs the min-cut backward plus" in summaries["modelled"]


def test_a_block_that_saves_at_the_min_cut_runs_the_measured_saving_forward():
    """Calibration times a recomputed block's forward (saves nothing) apart from its recompute (saves at the
    min-cut, as a kept or offloaded block's forward does): the plan prices each forward by what it saves, and the
    MILP's rows the same (``fwd_save``), so its objective still agrees with the simulated step."""
    graph = _with_cut(chain(6, saved_per_token=300_000), 0.2, 0.5)
    base = _timings(graph)[0]                  # forward 2 ms, recompute 2.2 ms
    hw = get_profile("h200").with_timings([base])
    cost = CostModel(graph, hw, MB, "bfloat16")
    assert (cost.fwd_s(1), cost.saving_fwd_s(1), cost.recompute_s(1)) == (2e-3, 2.2e-3, 2.2e-3)
    at_cut = CostModel(graph, hw.with_timings([_timings(graph)[1]]), MB, "bfloat16",
                       cut=tuple(1 if len(b.cuts) > 1 else 0 for b in graph.blocks))
    assert at_cut.saving_fwd_s(1) == pytest.approx(2.1e-3)        # at a timed cut: that cut's saving forward
    coef = coefficients(cost, {"gpu_bytes": 10 * 2**30, "host_bytes": 200 * 2**30}, 1, 12.0)
    assert coef.fwd_save[1] == pytest.approx(2.2) and coef.fwd[1] == pytest.approx(2.0)
    assert coefficients(CostModel(graph, get_profile("h200"), MB, "bfloat16"), {"gpu_bytes": 10 * 2**30,
                        "host_bytes": 200 * 2**30}, 1, 12.0).fwd_save == []      # modelled: rows as before
    for gpu in ("14GiB", "80GiB"):
        plan = lazytrain.compile(graph, batch_size=8, seq_len=graph.seq_len, gpu_memory=gpu, host_memory="200GiB",
                                 hardware=hw, policy="milp", micro_batch=8, resident="none", gpu_update="none")
        saved = [op for op in plan.ops if op.kind is OpKind.COMPUTE and op.block == 1]
        assert saved and all(op.seconds == (2.2e-3 if op.save else 2e-3) for op in saved)
        if not plan.decisions.notes.get("milp_fallback"):
            obj = plan.solver.objective
            assert abs(plan.predicted["step_time_s"] - obj) <= 0.02 * obj


def test_cut_plan_saves_every_offering_block_at_the_cut():
    graph = _with_cut(chain(4, saved_per_token=300_000), 0.2, 0.5)
    hw = get_profile("h200")
    plan = lazytrain.compile(graph, batch_size=2 * MB, seq_len=graph.seq_len, gpu_memory="40GiB",
                             host_memory="200GiB", hardware=hw, policy="recompute-all", compile_blocks=True,
                             micro_batch=MB, resident="none", optimizer="adamw")
    cp = cut_plan(plan, hw, 1)
    layers = [j for j, b in enumerate(graph.blocks) if len(b.cuts) > 1]
    assert [cp.decisions.cut_of(j) for j in range(graph.n_blocks)] == [int(j in layers) for j in range(graph.n_blocks)]
    assert all(cp.decisions.saved[j] is Saved.KEEP for j in layers)
    assert all(op.save for op in cp.ops if op.kind is OpKind.COMPUTE and op.block in layers)
    assert cut_plan(plan, hw, 2) is None                          # no block offers a third cut
    # where keeping them does not fit but offloading them does, they are offloaded
    host = dataclasses.replace(cp.decisions, saved=tuple(Saved.HOST if j in layers else s
                                                         for j, s in enumerate(cp.decisions.saved)))
    comp = Compiler(graph, hw, plan.budgets, param_dtype=plan.param_dtype, optimizer="adamw", clip=True,
                    compile_blocks=True)
    low, high = comp.build(host, plan.batch_size).predicted["peak_gpu_bytes"], cp.predicted["peak_gpu_bytes"]
    assert low < high
    off = cut_plan(dataclasses.replace(plan, budgets={**plan.budgets, "gpu_bytes": (low + high) // 2}), hw, 1)
    assert off is not None and off.decisions.saved == host.saved and off.decisions.cut == cp.decisions.cut


def test_cut_timings_round_trip_and_old_profiles_load():
    graph = _with_cut(chain(2, saved_per_token=300_000), 0.2, 0.5)
    base, timed = _timings(graph)
    hw = PROFILES["cpu"].with_timings([timed, dataclasses.replace(base, signature="eager")])
    data = json.loads(json.dumps(hw.to_json()))
    assert HardwareProfile.from_json(data) == hw
    assert "cuts" not in next(t for t in data["calibration"] if t["signature"] == "eager")   # written as before
    ct = data["calibration"][0]["cuts"][0]
    for bad, match in (({**ct, "backward_s": 0}, "a cut's backward_s must be a positive number"),
                       ({**ct, "samples": 1.5}, "saved_bytes and samples whole numbers"),
                       ({k: v for k, v in ct.items() if k != "budget"}, "a cut's timing needs the fields")):
        with pytest.raises(ValueError, match=match):
            BlockTiming.from_json({**data["calibration"][0], "cuts": [bad]})
    with pytest.raises(ValueError, match="cuts must be a list of cut timings"):
        BlockTiming.from_json({**data["calibration"][0], "cuts": {"a": 1}})


CONFIG = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 97, "max_position_embeddings": 128}


@pytest.mark.slow
def test_calibration_times_every_cut_of_a_compiled_qwen2_layer(monkeypatch):
    pytest.importorskip("transformers")
    from lazytrain.frontend.presets import build_from_config
    from lazytrain.frontend.trace import trace
    monkeypatch.setattr(compiled, "inductor", lambda gm, **_: (lambda args: gm(*args)))
    model = build_from_config(CONFIG, device="cpu", dtype=torch.float32)
    hw = PROFILES["cpu"]
    timings = measure_blocks(model, hw, seq_len=32, micro_batch=2, param_dtype="float32", gpu_memory="2GiB",
                             host_memory="4GiB", repeats=1, verbose=False, compile_blocks=True)
    graph = trace(model, seq_len=32, dtype="float32", compile_blocks=True)
    layer = next(t for t in timings if "(layer)" in t.block)
    j = next(j for j, b in enumerate(graph.blocks) if b.kind == "layer")
    assert layer.signature == graph.block_signature(j)
    offered = graph.blocks[j].cuts[1:]
    assert [(c.budget, c.saved_bytes) for c in layer.cuts] == [(c.budget, c.saved_bytes) for c in offered]
    assert all(c.samples == 2 * 2 for c in layer.cuts)         # two layers x two micro-batches x one step
    assert all(not t.cuts for t in timings if t is not layer)    # the embedding offers one cut, the head runs eager
    cost = CostModel(graph, hw.with_timings(timings), 2, "float32", False, cut=tuple(
        len(b.cuts) - 1 if b.cuts else 0 for b in graph.blocks))
    assert cost.bwd_s(j) == layer.cuts[-1].backward_s and cost.fwd_s(j) == layer.cuts[-1].forward_s
