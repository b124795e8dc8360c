"""Compiled block programs (``frontend/compiled.py``, ``runtime/compiled_block.py``) train as eager does.

The runtime's part (the partitioned forward's saved list kept, offloaded to host and NVMe, reloaded and
recomputed through ``saved[j]``; gradients from the partitioned backward) is checked with the partition's fx
graphs run as they are (``_graphs``: no C++ compile, so fast), on the GPT and Qwen2 and on plans that keep,
offload to host and NVMe, and recompute.  One test runs Inductor itself (its C++ compile of the two distinct
programs of a 3-layer GPT, cold, is most of its time) and checks that a second compile hits Inductor's FX
graph cache.  Tolerances: as ``test_runtime`` (fp32 rounding only; Inductor's fused kernels reduce in another
order than eager's, within the same rtol 1e-5).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from eager_ref import assert_same_parameters, step_beside_eager
from test_runtime import EPS, LR, SEQ, B, _batches, _eager_loss, _mixed, _model

import lazytrain
import lazytrain.frontend.compiled as compiled
from lazytrain.compiler.api import Compiler
from lazytrain.compiler.profiles import get_profile
from lazytrain.frontend.trace import trace
from lazytrain.ir import Decisions, GiB, Place, PlanError, Saved, TensorId, TensorKind
from lazytrain.ir.semantics import Sizes
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

#: steps each equivalence test trains: the first applies no update (lagged), the next two apply one each
STEPS = 3


def _graphs(gm, **_):
    """The partition's graph run as fx code: the compiled-block calling convention without Inductor."""
    return lambda args: gm(*args)


#: every tier for the saved tensors of the compiled blocks (embedding, 3 layers; the head runs eager)
EVERY_TIER = ((Place.HOST, Place.GPU, Place.NVME, Place.HOST, Place.NONE),
              (Saved.HOST, Saved.KEEP, Saved.NVME, Saved.RECOMPUTE, Saved.HOST))


def _decisions(name: str, mb: int) -> Decisions:
    if not name.startswith("every-tier"):
        return _mixed(name, mb)
    boundary, saved = EVERY_TIER
    # with cuts (``frontend/cuts.py``): the kept layer saves its input only, the NVMe one the cheapest cut
    cut = (0, 3, 1, 0, 0) if name == "every-tier-cuts" else ()
    return Decisions(policy=name, micro_batch=mb, n_micro=B // mb, boundary=boundary, saved=saved, cut=cut)


def _plan(model, name: str, mb: int, nvme_dir) -> lazytrain.Plan:
    graph = trace(model, seq_len=SEQ, dtype="float32", compile_blocks=True)
    budgets = {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB, "nvme_bytes": GiB, "nvme_dir": str(nvme_dir)}
    comp = Compiler(graph, get_profile("cpu"), budgets, param_dtype="float32", optimizer="adamw", clip=True,
                    compile_blocks=True)
    return comp.build(_decisions(name, mb), B)


def _train_beside_eager(kind: str, plan_fn) -> Trainer:
    model = _model(kind)
    ref = copy.deepcopy(model)
    trainer = Trainer(model, plan_fn(model), optimizer=TorchAdamW(lr=LR, eps=EPS, max_grad_norm=1.0), device="cpu",
                      verbose=False)
    step_beside_eager(trainer, ref, _batches(kind, STEPS), lambda m, ids, labels: _eager_loss(kind, m, ids, labels),
                      lr=LR, eps=EPS, clip=1.0)
    trainer.sync_to_model()
    assert_same_parameters(model, ref)
    trainer.close()
    return trainer


@pytest.mark.parametrize("kind,name,mb", [("qwen2", "every-tier-cuts", 2)])
def test_partitioned_blocks_match_eager(kind, name, mb, tmp_path, monkeypatch):
    """Keep, host, NVMe and recompute of compiled blocks' saved tensors (the plan has all four), at the min-cut
    (host, recompute) and at cuts that save less and recompute in the backward (keep, NVMe)."""
    monkeypatch.setattr(compiled, "inductor", _graphs)
    plans = []
    tr = _train_beside_eager(kind, lambda m: plans.append(_plan(m, name, mb, tmp_path)) or plans[-1])
    rep, L = tr.compile_report, plans[0].graph.n_blocks
    assert set(tr.program.compiled) == set(range(L - 1)) and rep.eager == {L - 1: "the loss head"}
    assert not rep.failed
    assert rep.programs == (2 if name == "every-tier" else 4)   # the embedding, one per layer program and cut
    assert set(plans[0].decisions.saved[:L - 1]) == set(Saved)
    assert name != "every-tier-cuts" or plans[0].graph.blocks[1].cuts[3].budget == 0.0
    assert 0 < rep.saved_vs_plan <= 1.0          # the CPU's partitions save at most what the plan counted


def test_a_failed_inductor_compile_runs_the_partition_uncompiled(tmp_path, monkeypatch):
    """The layers' Inductor compile fails (the embedding's does not): they run their partitions' fx graphs, so each
    forward saves what the plan counted at its cut (eager autograd would save the whole forward's activations,
    more), the gradients are eager's, and one warning names the blocks and the error."""
    def layers_fail(gm, **kw):
        if any(n.target is torch.ops.aten.addmm.default for n in gm.graph.nodes):
            raise RuntimeError("no kernel for this")
        return _graphs(gm)
    monkeypatch.setattr(compiled, "inductor", layers_fail)
    seen: list = []
    real = compiled.CompiledBlock.forward

    def forward(self, args):
        outs, saved = real(self, args)
        seen.append((self, [a.untyped_storage().data_ptr() for a in args],
                     {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}))
        return outs, saved
    monkeypatch.setattr(compiled.CompiledBlock, "forward", forward)
    plans = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = _train_beside_eager("gpt", lambda m: plans.append(_plan(m, "every-tier-cuts", 2, tmp_path)) or plans[-1])
    mine = [str(w.message) for w in caught if "could not be compiled" in str(w.message)]
    assert len(mine) == 1 and "blocks 1 (layers.0), 2 (layers.1), 3 (layers.2): Inductor failed" in mine[0]
    assert "RuntimeError: no kernel for this" in mine[0]
    rep, plan = tr.compile_report, plans[0]
    assert set(tr.program.compiled) == {0, 1, 2, 3} and set(rep.uncompiled) == {1, 2, 3} and not rep.failed
    assert rep.blocks == 1 and "partitioned but not compiled (Inductor failed): 3 blocks" in rep.line()
    sizes, got = Sizes.of_plan(plan), {}
    for j in (1, 2, 3):     # at cuts 3 and 1 (kept, NVMe) and the min-cut (recomputed)
        cb, n = tr.program.compiled[j], len(tr.program.blocks[j].param_names)
        got[j] = {sum(b for ptr, b in saved.items() if ptr not in args[:n]) for c, args, saved in seen if c is cb}
        assert got[j] == {sizes.of(TensorId(kind=TensorKind.SAVED, index=j))}, j
    # block 1's cut saves a tenth of the min-cut's bytes (GPT's eager autograd saves as many as the min-cut)
    assert max(got[1]) * 10 < plan.graph.blocks[1].cuts[0].saved_bytes * plan.micro_batch


@pytest.mark.slow      # Inductor's cold C++ compile of 5 graphs: 50-90 s on a shared 2-core machine
def test_inductor_blocks_match_eager_and_hit_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    tr = _train_beside_eager("gpt", lambda m: _plan(m, "host-nvme-b", 2, tmp_path))
    first = tr.compile_report
    assert first.programs == 2 and first.cache_misses == 5 and first.blocks == 4    # fw + bw each, one forward-only
    again = _model("gpt")
    tr2 = Trainer(again, _plan(again, "host-nvme-b", 2, tmp_path), device="cpu", verbose=False)
    assert tr2.compile_report.cache_hits == 5 and tr2.compile_report.cache_misses == 0
    tr2.close()


def test_plan_records_compiled_blocks(tmp_path):
    model = _model("gpt")
    plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, hardware="cpu", param_dtype="float32",
                             optimizer="adamw", policy="megatrain", gpu_memory="8GiB", compile_blocks=True)
    assert plan.options["compile_blocks"] is True
    assert plan.graph.meta["compiled_blocks"]["blocks"] == list(range(plan.graph.n_blocks - 1))
    assert "compiled blocks" in plan.summary()
    plan.save(tmp_path / "p.json")
    assert lazytrain.Plan.load(tmp_path / "p.json").options["compile_blocks"] is True
    eager = lazytrain.compile(model, batch_size=B, seq_len=SEQ, hardware="cpu", param_dtype="float32",
                              optimizer="adamw", policy="megatrain", gpu_memory="8GiB")
    assert "compile_blocks" not in eager.options and "compiled_blocks" not in eager.graph.meta
    with pytest.raises(ValueError, match="traced for eager blocks"):
        lazytrain.compile(eager.graph, batch_size=B, seq_len=SEQ, hardware="cpu", compile_blocks=True)
    with pytest.raises(ValueError, match="compile_blocks must be True or False"):
        lazytrain.compile(eager.graph, batch_size=B, seq_len=SEQ, hardware="cpu", compile_blocks="yes")
    plan.options["compile_blocks"] = 1
    with pytest.raises(PlanError, match="options.compile_blocks must be true or false"):
        plan.save(tmp_path / "bad.json")
        lazytrain.Plan.load(tmp_path / "bad.json")


def test_partition_saves_fewer_bytes_than_eager_on_a_qwen2_layer():
    """The min-cut partition recomputes the layer's pointwise and norm ops: fewer saved bytes than eager's hooks."""
    model = _model("qwen2")
    eager = trace(model, seq_len=SEQ, dtype="float32")
    comp = trace(model, seq_len=SEQ, dtype="float32", compile_blocks=True)
    assert comp.blocks[1].saved_bytes < eager.blocks[1].saved_bytes
    assert comp.blocks[-1].saved_bytes == eager.blocks[-1].saved_bytes       # the head runs eager
