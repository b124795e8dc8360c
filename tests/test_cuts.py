"""Cuts of compiled blocks (``frontend/cuts.py``): every cut trains as eager does, the MILP chooses them, plans
carry them.

The partition test runs the partitioned fx graphs as they are (no Inductor, fp32 on the CPU): for each cut of a
decoder layer of a tiny Qwen2, forward then backward give eager autograd's outputs and gradients (Llama's layer
cuts the same way; one architecture keeps the test at a few seconds).
The MILP test is a synthetic chain whose layers offer a cut saving a fifth of the bytes for half a forward more
in the backward: with room to keep everything it keeps the min-cut, under a tight GPU budget it chooses the cut
and beats the same chain without cuts.  The runtime's side (a plan's cut kept, offloaded, reloaded) is
``test_compiled_blocks.py``'s every-tier plan with cuts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_runtime import SEQ, _model

import lazytrain
from lazytrain.compiler.synthetic import chain
from lazytrain.frontend.compiled import contiguous_spec, cut, joint, propose, saved_bytes
from lazytrain.frontend.cuts import flop_estimate
from lazytrain.frontend.program import build_split
from lazytrain.ir import Cut, Place, Plan, PlanError, Saved

MB = 2


def _layer(kind: str):
    """Block 1 (the first decoder layer) of a tiny model: its program, argument specs (fp32, parameters first)
    and real arguments (the model's parameters, random inputs)."""
    model = _model(kind)
    sp = build_split(model, micro_batch=MB, seq_len=SEQ, device="cpu", dtype=torch.float32)
    b = sp.blocks[1]
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(3)
    args = [params[n].detach().clone().requires_grad_(True) for n in b.param_names]
    for n in b.input_names:
        shape, dt, rg = sp.values[n]
        args.append(torch.randn(shape, generator=g, dtype=dt).requires_grad_(rg and dt.is_floating_point))
    specs = [contiguous_spec(a.shape, a.dtype, a.requires_grad) for a in args]
    return b, specs, args


def test_every_cut_of_a_layer_gives_eager_gradients():
    b, specs, args = _layer("qwen2")
    n = len(b.param_names)
    cuts = propose(b.gm, specs, "meta", n)
    assert len(cuts) >= 3 and cuts[0][0] == 1.0 and cuts[0][2] == 0
    assert all(x[1] > y[1] and x[2] <= y[2] for x, y in zip(cuts, cuts[1:]))   # fewer bytes, more recompute
    outs = b.gm(*args)
    grad_out = [torch.randn_like(o) for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [a for a in args if a.requires_grad]
    want = torch.autograd.grad([o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad], wrt, grad_out)
    whole = joint(b.gm, specs, "cpu")
    for budget, nbytes, _, _ in cuts:
        part = cut(whole, n, budget=budget)
        # the trace counts on meta, where grouped-query attention repeats K and V (``trace_export.sdpa``): the
        # runtime's partition saves at most what the plan counted
        assert saved_bytes(part, n) <= nbytes
        with torch.no_grad():
            res = list(part.fw(*[a.detach() for a in args]))
            saved = res[part.n_outputs:]
            for k, o in zip(range(part.n_outputs), res):
                torch.testing.assert_close(o, outs[k], rtol=1e-5, atol=1e-6)
            grads = list(part.bw(*saved, *grad_out))
        got = [grads[i] for i, a in enumerate(args) if a.requires_grad]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"budget {budget}")


def test_flop_estimate_prices_attention_by_name_not_position():
    """The CUDA kernels take ``is_causal`` at another position than the CPU one: the price is the same."""
    import torch.fx as fx
    q = torch.empty(1, 4, 64, 16, device="meta")
    aten = torch.ops.aten
    g = fx.Graph()
    qn = g.placeholder("q")
    qn.meta["val"] = q
    cpu = g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (qn, qn, qn, 0.0, True))
    eff = g.call_function(aten._scaled_dot_product_efficient_attention.default, (qn, qn, qn, None, True, 0.0, True))
    est = flop_estimate()
    assert est(cpu) == est(eff) == 2 * 2 * 4 * 64 * 64 * 16 // 2


def _with_cut(graph, bytes_share: float, recompute_share: float):
    """``graph`` whose layers offer a second cut (and the graph marked as traced for compiled blocks)."""
    blocks = tuple(dataclasses.replace(b, cuts=(
        Cut(budget=1.0, saved_bytes=b.saved_bytes),
        Cut(budget=0.2, saved_bytes=int(b.saved_bytes * bytes_share),
            recompute_flops=int(b.fwd_flops * recompute_share)))) if b.kind == "layer" else b for b in graph.blocks)
    return dataclasses.replace(graph, blocks=blocks,
                               meta={**graph.meta, "compiled_blocks": {"blocks": list(range(len(blocks)))}})


def _compile(graph, gpu: str) -> Plan:
    return lazytrain.compile(graph, batch_size=8, seq_len=graph.seq_len, gpu_memory=gpu, host_memory="200GiB",
                             hardware="h200", policy="milp", compile_blocks=True, micro_batch=8)


def test_milp_chooses_a_cut_when_memory_binds_and_the_min_cut_when_it_does_not(tmp_path):
    graph = _with_cut(chain(6, saved_per_token=300_000), 0.2, 0.5)
    roomy = _compile(graph, "80GiB")
    assert roomy.decisions.cut == () and Saved.RECOMPUTE not in roomy.decisions.saved
    tight = _compile(graph, "10GiB")
    assert any(tight.decisions.cut)
    without = _compile(_with_cut(chain(6, saved_per_token=300_000), 1.0, 0.0), "10GiB")
    assert tight.predicted["step_time_s"] < without.predicted["step_time_s"]
    # the plan round-trips through JSON, verified, with its cuts
    tight.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again.decisions.cut == tight.decisions.cut
    assert again.predicted["peak_gpu_bytes"] == tight.predicted["peak_gpu_bytes"]
    assert "at budget 0.2" in again.summary()


def test_a_plan_refuses_cuts_it_cannot_run(tmp_path):
    graph = _with_cut(chain(3, saved_per_token=300_000), 0.2, 0.5)
    plan = _compile(graph, "10GiB")
    L = plan.graph.n_blocks
    d = plan.to_json()
    for chosen, options, match in (([0, 5] + [0] * (L - 2), None, "offers 2 cuts"),
                                   ([0, 1] + [0] * (L - 2), {}, "does not compile its blocks")):
        bad = {**d, "decisions": {**d["decisions"], "cut": chosen},
               "options": d["options"] if options is None else {}}
        with pytest.raises(PlanError, match=match):
            Plan.from_json(bad)
    rec = dataclasses.replace(plan.decisions, saved=(Saved.KEEP, Saved.RECOMPUTE) + plan.decisions.saved[2:],
                              boundary=(Place.NONE, Place.GPU) + plan.decisions.boundary[2:],
                              cut=(0, 1) + (0,) * (L - 2))
    with pytest.raises(ValueError, match="runs the min-cut"):
        rec.check()
