"""CPU-mode runtime: every schedule trains exactly like eager PyTorch.

For each model (the package's GPT with tied embeddings, tiny Hugging Face Qwen2 and Llama) and each
schedule (the heuristic policies, and hand-made decisions that put boundaries and saved activations
on the host and on NVMe), 5 steps of ``Trainer`` give the same losses and, after ``sync_to_model``,
the same parameters as eager training with ``torch.optim.AdamW`` (+ ``clip_grad_norm_``).

Hyper-parameters: lr 1e-3, eps 1e-6.  Some parameters have a mathematically zero gradient (the key
bias: softmax is invariant to a shift of every score), so their fp32 gradient is rounding noise
that depends on summation order (micro-batching changes it); Adam divides by sqrt(v) + eps, so a
tiny eps would turn that noise into lr-sized steps.  With eps 1e-6 every difference stays ~20x
below the atol of 1e-6 (measured), while every other parameter is still held to rtol 1e-5.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from eager_ref import assert_same_parameters, step_beside_eager

import lazytrain
from lazytrain.compiler.api import Compiler
from lazytrain.compiler.profiles import get_profile
from lazytrain.frontend.presets import build_from_config
from lazytrain.ir import Decisions, GiB, Place, PlanError, Saved
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.store import HostMemoryError
from lazytrain.runtime.trainer import Trainer

B, SEQ, STEPS = 4, 16, 5
LR, EPS = 1e-3, 1e-6


def _hf(model_type: str, tied: bool) -> dict:
    return {"model_type": model_type, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 67, "tie_word_embeddings": tied,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


CONFIGS = {
    "gpt": {"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 32, "n_layer": 3, "n_head": 2, "d_ff": 48,
            "max_seq": 32, "tie_weights": True},
    "qwen2": _hf("qwen2", True),
    "llama": _hf("llama", False),
}


def _vocab(kind: str) -> int:
    c = CONFIGS[kind]
    return c.get("vocab", c.get("vocab_size"))


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = build_from_config(CONFIGS[kind], device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():   # HF inits norms to ones and biases to zeros: perturb so they matter
            p.add_(torch.randn_like(p) * 0.02)
    return m


def _batches(kind: str, n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(n):
        ids = torch.randint(0, _vocab(kind), (B, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : 3 + s] = -100      # micro-batches count different numbers of tokens
        labels[2, -4:] = -100
        out.append((ids, labels))
    return out


def _eager_loss(kind: str, model, ids, labels) -> torch.Tensor:
    if kind == "gpt":
        return model(ids, labels)
    return model(input_ids=ids, labels=labels).loss


BUDGETS = dict(gpu_memory="8GiB", host_memory="16GiB", nvme_memory="1GiB")


def _compile(model, policy: str, mb: int, nvme_dir) -> lazytrain.Plan:
    return lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=mb, hardware="cpu", param_dtype="float32",
                             optimizer="adamw", policy=policy, nvme_dir=str(nvme_dir), **BUDGETS)


def _build(model, dec: Decisions, nvme_dir, clip: bool = True) -> lazytrain.Plan:
    from lazytrain.frontend.trace import trace
    graph = trace(model, seq_len=SEQ, dtype="float32")
    budgets = {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB, "nvme_bytes": GiB, "nvme_dir": str(nvme_dir)}
    comp = Compiler(graph, get_profile("cpu"), budgets, param_dtype="float32", optimizer="adamw", clip=clip)
    return comp.build(dec, B)


# Hand-made placements for 5 blocks (embed, 3 layers, head): every tier for boundaries and saved.
MIXED = {
    "host-nvme-a": ((Place.HOST, Place.NVME, Place.NONE, Place.HOST, Place.GPU),
                    (Saved.HOST, Saved.RECOMPUTE, Saved.RECOMPUTE, Saved.NVME, Saved.RECOMPUTE)),
    "host-nvme-b": ((Place.HOST, Place.HOST, Place.NVME, Place.NONE, Place.NONE),
                    (Saved.NVME, Saved.KEEP, Saved.RECOMPUTE, Saved.RECOMPUTE, Saved.HOST)),
}


def _mixed(name: str, mb: int) -> Decisions:
    boundary, saved = MIXED[name]
    return Decisions(policy=name, micro_batch=mb, n_micro=B // mb, boundary=boundary, saved=saved)


def _check_equivalent(kind: str, plan_fn, clip: float | None = 1.0) -> Trainer:
    model = _model(kind)
    ref = copy.deepcopy(model)
    plan = plan_fn(model)
    opt = TorchAdamW(lr=LR, eps=EPS, max_grad_norm=clip)
    trainer = Trainer(model, plan, optimizer=opt, device="cpu")
    step_beside_eager(trainer, ref, _batches(kind), lambda m, ids, labels: _eager_loss(kind, m, ids, labels),
                      lr=LR, eps=EPS, clip=clip, fused=opt.fused or None)
    trainer.sync_to_model()
    assert_same_parameters(model, ref)
    trainer.close()
    return trainer


@pytest.mark.parametrize("kind,policy,mb", [
    ("gpt", "megatrain", 1), ("gpt", "recompute-all", 2), ("gpt", "keep-all", 2),
    ("qwen2", "megatrain", 2), ("qwen2", "keep-all", 1),
    ("llama", "recompute-all", 1), ("llama", "keep-all", 2),
])
def test_policy_matches_eager(kind, policy, mb, tmp_path):
    _check_equivalent(kind, lambda m: _compile(m, policy, mb, tmp_path))


@pytest.mark.parametrize("kind,name,mb", [
    ("gpt", "host-nvme-a", 2), ("gpt", "host-nvme-b", 1),
    ("qwen2", "host-nvme-a", 1), ("llama", "host-nvme-b", 2),
])
def test_host_and_nvme_placements_match_eager(kind, name, mb, tmp_path):
    def plan_fn(m):
        plan = _build(m, _mixed(name, mb), tmp_path)
        kinds = {(op.src.value, op.dst.value) for op in plan.ops if op.src and op.dst}
        assert ("host", "nvme") in kinds and ("nvme", "host") in kinds and ("gpu", "host") in kinds
        return plan
    _check_equivalent(kind, plan_fn)
    assert not list(tmp_path.glob("*.bin")), "NVMe files must be deleted once reloaded"


@pytest.mark.parametrize("kind,policy,mb,resident", [
    ("gpt", "megatrain", 2, 1),          # the tied embedding + head group (tied: resident together)
    ("gpt", "keep-all", 1, 3),           # the group and two layers
    ("qwen2", "recompute-all", 2, [2]),  # one layer in the middle, the tied group streams
    ("llama", "megatrain", 1, 5),        # every block (untied head)
])
def test_resident_blocks_match_eager(kind, policy, mb, resident, tmp_path):
    """Resident blocks: parameters, optimizer state and gradients stay on the device, updates run
    there (lagged, after the clip coefficient), nothing of them is loaded or offloaded."""
    def plan_fn(m):
        plan = lazytrain.compile(m, batch_size=B, seq_len=SEQ, micro_batch=mb, hardware="cpu",
                                 param_dtype="float32", optimizer="adamw", policy=policy, resident=resident,
                                 nvme_dir=str(tmp_path), **BUDGETS)
        res = plan.decisions.resident_blocks
        assert res and all(op.block not in res for op in plan.ops
                           if op.kind.value in ("load", "grad_offload"))
        assert all(op.resource.value == "gpu" for op in plan.ops if op.kind.value == "update" and op.block in res)
        return plan
    _check_equivalent(kind, plan_fn)


def test_resident_group_is_tie_closed(tmp_path):
    model = _model("gpt")
    plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", param_dtype="float32",
                             optimizer="adamw", policy="megatrain", resident=[0], **BUDGETS)
    L = plan.graph.n_blocks
    assert plan.decisions.resident_blocks == {0, L - 1}      # the head reads the tied embedding
    with pytest.raises(ValueError, match="out of range"):
        lazytrain.compile(model, batch_size=B, seq_len=SEQ, hardware="cpu", resident=[L], **BUDGETS)


def test_no_clipping_same_step_updates(tmp_path):
    """clip=False lowers updates into the backward (not lagged): no flush needed, same result."""
    def plan_fn(m):
        plan = _build(m, _mixed("host-nvme-a", 2), tmp_path, clip=False)
        first_update = min(op.id for op in plan.ops if op.kind.value == "update")
        first_grad = min(op.id for op in plan.ops if op.kind.value == "grad_offload")
        assert first_update > first_grad
        return plan
    _check_equivalent("gpt", plan_fn, clip=None)


def test_clipping_optimizer_refuses_plan_without_global_norm(tmp_path):
    model = _model("gpt")
    plan = _build(model, _mixed("host-nvme-a", 2), tmp_path, clip=False)
    with pytest.raises(PlanError, match="clip=True"):
        Trainer(model, plan, optimizer=TorchAdamW(lr=LR, max_grad_norm=1.0), device="cpu")


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory):
    return _compile(_model("gpt"), "megatrain", 2, tmp_path_factory.mktemp("nvme"))


def test_plan_for_another_model_is_refused(gpt_plan):
    other = build_from_config({**CONFIGS["gpt"], "n_layer": 2}, device="cpu", dtype=torch.float32)
    with pytest.raises(PlanError, match="compiled for another model"):
        Trainer(other, gpt_plan, device="cpu")


def test_batch_errors_are_clear_and_leave_the_trainer_usable(gpt_plan):
    tr = Trainer(_model("gpt"), gpt_plan, optimizer=TorchAdamW(lr=LR), device="cpu")
    ids = torch.zeros(B, SEQ + 8, dtype=torch.long)
    with pytest.raises(ValueError, match="recompile"):
        tr.step((ids, ids))
    ids = torch.zeros(B + 1, SEQ, dtype=torch.long)
    with pytest.raises(ValueError, match="compiled for batch 4"):
        tr.step((ids, ids))
    with pytest.raises(ValueError, match="input_ids"):
        tr.step({"labels": ids})
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ))
    bad = [({"input_ids": ids + _vocab("gpt"), "labels": ids}, r"input_ids must lie in \[0, 61\)"),
           ({"input_ids": ids, "labels": ids - 5}, "labels must lie in"),
           ({"input_ids": ids.float(), "labels": ids}, "integer token ids"),
           ({"input_ids": ids, "labels": ids, "position_ids": ids}, "keys the plan does not take: position_ids"),
           ({"input_ids": ids, "labels": ids, "attention_mask": torch.ones(B, SEQ - 1)}, "attention_mask has shape"),
           ({"input_ids": ids, "labels": ids, "attention_mask": torch.cat(
               [torch.zeros(B, 2), torch.ones(B, SEQ - 2)], 1)}, "pad on the right")]
    for batch, message in bad:
        with pytest.raises(ValueError, match=message):
            tr.step(batch)
    assert tr.step({"input_ids": ids, "labels": ids}).tokens == B * (SEQ - 1)   # nothing half-ran
    tr.close()


def test_short_batches_and_right_padding_masks_train_like_eager(tmp_path):
    """Fewer rows, shorter rows, or a right-padding attention_mask: padded with ignored labels, exact."""
    model = _model("gpt")
    ref = copy.deepcopy(model)
    plan = _compile(model, "megatrain", 2, tmp_path)
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=LR, eps=EPS, max_grad_norm=1.0), device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ), generator=g)
    mask = torch.ones(B, SEQ, dtype=torch.long)
    mask[1, 9:] = 0
    cases = [({"input_ids": ids[:3, :11], "labels": ids[:3, :11]}, ids[:3, :11], ids[:3, :11]),
             ({"input_ids": ids, "labels": ids, "attention_mask": mask}, ids, ids.masked_fill(mask == 0, -100))]
    for batch, ref_ids, ref_labels in cases:
        stats = tr.step(batch)
        loss = ref(ref_ids, ref_labels)
        ref_opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        torch.testing.assert_close(stats.loss, loss.item(), rtol=1e-5, atol=1e-6)
        assert stats.tokens == int((ref_labels[:, 1:] != -100).sum())
    tr.sync_to_model()
    tr.close()
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6)


def test_failing_op_is_named(gpt_plan):
    tr = Trainer(_model("gpt"), gpt_plan, optimizer=TorchAdamW(lr=LR), device="cpu")
    real = tr.program.run_block

    def broken(j, params, inputs):
        if j == 2:
            raise ValueError("boom")
        return real(j, params, inputs)
    tr.program.run_block = broken
    ids = torch.zeros(B, SEQ, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"while executing op #\d+ \(compute +block\[2\] mb0.*boom") as e:
        tr.step((ids, ids))
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(RuntimeError, match="previous step failed"):
        tr.step((ids, ids))


def test_host_memory_is_checked_before_allocating(gpt_plan, monkeypatch, capsys):
    import lazytrain.runtime.store as store
    Trainer(_model("gpt"), gpt_plan, optimizer=TorchAdamW(lr=LR), device="cpu").close()
    assert "host memory estimate" in capsys.readouterr().err
    Trainer(_model("gpt"), gpt_plan, optimizer=TorchAdamW(lr=LR), device="cpu", verbose=False).close()
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(store, "mem_available", lambda: 1024)
    model, real_empty, allocated = _model("gpt"), torch.empty, []

    def empty(*a, **k):          # the store's buffers are the allocations that take pin_memory
        if "pin_memory" in k and k.get("device") is None:
            allocated.append(a)
        return real_empty(*a, **k)
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(HostMemoryError, match="available"):
        Trainer(model, gpt_plan, optimizer=TorchAdamW(lr=LR), device="cpu")
    assert "host memory estimate" in capsys.readouterr().err and not allocated


def test_nonfinite_gradient_skips_and_aborts(gpt_plan):
    from lazytrain.runtime.optim.clipping import NonFiniteGradError
    model = _model("gpt")
    tr = Trainer(model, gpt_plan, optimizer=TorchAdamW(lr=LR, max_grad_norm=1.0), device="cpu")
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ))
    tr.step((ids, ids))
    before = {k: v.clone() for k, v in tr.state_dict().items()}
    tr.ctx.store.load[1].fill_(float("nan"))      # poisons block 1's parameters -> NaN gradients
    for _ in range(2):
        assert tr.step((ids, ids)).skipped
    after = tr.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("layers.0"))
    with pytest.raises(RuntimeError) as e:
        tr.step((ids, ids))
    assert isinstance(e.value.__cause__, NonFiniteGradError) or isinstance(e.value, NonFiniteGradError)


def test_profile_reports_hidden_fractions(gpt_plan):
    tr = Trainer(_model("gpt"), gpt_plan, optimizer=TorchAdamW(lr=LR), device="cpu", profile=True)
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ))
    for _ in range(2):
        st = tr.step((ids, ids))
    prof = tr.last_profile
    assert prof is not None and st.step_s > 0 and st.model_tflops > 0
    assert set(prof.hidden) == {"load", "offload", "reload", "grad_offload"}
    assert all(0.0 <= v <= 1.0 for v in prof.hidden.values())
    measured = {i for i, *_ in prof.trace}
    computes = [op.id for op in gpt_plan.ops if op.kind.value in ("compute", "backward")]
    assert set(computes) <= measured
    assert all(a <= b for _, _, a, b in prof.trace)
    assert prof.update_s > 0 and prof.exposed_update_s >= 0
    tr.close()


def test_flush_applies_lagged_update_once(gpt_plan):
    """The lagged plan's last gradients are applied by flush(), exactly once."""
    tr = Trainer(_model("gpt"), gpt_plan, optimizer=TorchAdamW(lr=LR), device="cpu")
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ))
    s0 = {k: v.clone() for k, v in tr.state_dict().items()}  # state_dict flushes: nothing pending yet
    tr.step((ids, ids))
    s1 = tr.state_dict()                                     # applies step 1's update
    assert any(not torch.equal(s0[k], s1[k]) for k in s0)
    assert all(torch.equal(s1[k], v) for k, v in tr.state_dict().items())   # a second flush is a no-op
    t = time.perf_counter()
    tr.step((ids, ids))                                      # its lagged updates find nothing pending
    assert time.perf_counter() - t < 60
    tr.close()


# ---- the dispatcher ---------------------------------------------------------------------------------
class SlowAdamW(TorchAdamW):
    """TorchAdamW whose host update takes ``delay`` seconds more; records when each block's finished."""

    def __init__(self, delay: float, **kw):
        super().__init__(**kw)
        self.delay = delay
        self.finished: dict[int, float] = {}

    def step(self, block, grad, clip_coef=1.0, lr=None):
        time.sleep(self.delay)
        super().step(block, grad, clip_coef, lr)
        self.finished[block] = time.perf_counter()


def _record_issues(monkeypatch) -> list[tuple[int, float]]:
    """Wrap every handler: (op id, time) in the order the dispatcher issues ops."""
    from lazytrain.runtime import interpreter
    issued: list[tuple[int, float]] = []
    for kind, fn in list(interpreter.HANDLERS.items()):
        def rec(ctx, op, fn=fn):
            issued.append((op.id, time.perf_counter()))
            fn(ctx, op)
        monkeypatch.setitem(interpreter.HANDLERS, kind, rec)
    return issued


def test_dispatcher_runs_ahead_of_slow_updates(gpt_plan, monkeypatch):
    """A slow host update holds back only what depends on it: compute of block j is issued before
    the (lagged) update of block j+1 has finished, though program order puts the prefetch of block
    j+1 (which waits for that update) first.  Every op is issued after its dependencies, each
    resource's ops in list order, and the result is the same as with a fast optimizer."""
    ops = gpt_plan.ops
    computes = {op.block: op.id for op in reversed(ops) if op.kind.value == "compute" and op.mb == 0}
    updates = {op.block: op.id for op in ops if op.kind.value == "update"}
    loads = {op.block: op.id for op in reversed(ops) if op.kind.value == "load"}
    late = [j for j in computes if j + 1 in updates and loads[j + 1] < computes[j]]
    assert late, "the plan prefetches block j+1 (after its update) before computing block j"
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ))
    opt = SlowAdamW(0.5, lr=LR, eps=EPS, max_grad_norm=1.0)   # (half a second: issuing on a loaded machine takes less)
    tr = Trainer(_model("gpt"), gpt_plan, optimizer=opt, device="cpu")
    tr.step((ids, ids))                              # step 1: lagged updates have nothing to apply
    issued = _record_issues(monkeypatch)
    tr.step((ids, ids))                              # step 2: every block's update is slow
    order = [i for i, _ in issued]
    when = dict(issued)
    assert sorted(order) == list(range(len(ops)))
    pos = {i: k for k, i in enumerate(order)}
    for op in ops:
        assert all(pos[d] < pos[op.id] for d in op.deps), f"#{op.id} issued before one of its deps {op.deps}"
    for res in {op.resource for op in ops} - {lazytrain.ir.Resource.NONE}:
        mine = [i for i in order if ops[i].resource is res]
        assert mine == sorted(mine), f"{res.value} ops issued out of list order"
    for j in late:
        assert when[computes[j]] < opt.finished[j + 1], (
            f"compute block[{j}] was issued only after block {j + 1}'s update finished")
    tr.step((ids, ids))
    got = tr.state_dict()
    tr.close()
    ref = Trainer(_model("gpt"), gpt_plan, optimizer=TorchAdamW(lr=LR, eps=EPS, max_grad_norm=1.0), device="cpu")
    for _ in range(3):
        ref.step((ids, ids))
    want = ref.state_dict()
    ref.close()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_dispatcher_order_is_program_order_when_nothing_waits(gpt_plan, monkeypatch):
    tr = Trainer(_model("gpt"), gpt_plan, optimizer=TorchAdamW(lr=LR), device="cpu")
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ))
    issued = _record_issues(monkeypatch)
    tr.step((ids, ids))                              # first step: no update runs, nothing waits
    tr.close()
    assert [i for i, _ in issued] == list(range(len(gpt_plan.ops)))


@pytest.fixture(scope="module")
def mixed_plan(tmp_path_factory):
    return _build(_model("gpt"), _mixed("host-nvme-a", 2), tmp_path_factory.mktemp("nvme"))


@pytest.mark.parametrize("kind", ["load", "compute", "recompute", "backward", "offload", "reload",
                                  "grad_offload", "update", "free"])
def test_failure_in_any_handler_names_the_op(mixed_plan, kind, monkeypatch):
    from lazytrain.ir import OpKind
    from lazytrain.runtime import interpreter
    k = OpKind(kind)
    real = interpreter.HANDLERS[k]

    def broken(ctx, op):
        if op.mb in (None, 1):
            raise ValueError("boom")
        real(ctx, op)
    monkeypatch.setitem(interpreter.HANDLERS, k, broken)
    tr = Trainer(_model("gpt"), mixed_plan, optimizer=TorchAdamW(lr=LR, max_grad_norm=1.0), device="cpu")
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ))
    with pytest.raises(RuntimeError, match=rf"while executing op #\d+ \({kind} .*boom") as e:
        tr.step((ids, ids))
    named = int(str(e.value).split("#")[1].split()[0])
    assert mixed_plan.ops[named].kind is k
    assert isinstance(e.value.__cause__, ValueError)


@pytest.mark.parametrize("where", ["update", "nvme"])
def test_failure_on_a_host_worker_names_the_op(mixed_plan, where, monkeypatch):
    """A worker's exception surfaces from the step, naming the worker's op (update or NVMe write)."""
    tr = Trainer(_model("gpt"), mixed_plan, optimizer=TorchAdamW(lr=LR, max_grad_norm=1.0), device="cpu")
    ids = torch.randint(0, _vocab("gpt"), (B, SEQ))
    tr.step((ids, ids))

    def boom(*a, **kw):
        raise OSError("boom")
    if where == "update":
        monkeypatch.setattr(tr.optimizer, "step", boom)
        pattern = r"while executing op #\d+ \(update +block\[\d\]\s*[^)]*\): boom"
    else:
        monkeypatch.setattr(tr.ctx.nvme, "write", boom)
        pattern = r"while executing op #\d+ \(offload .*host->nvme[^)]*\): boom"
    with pytest.raises(RuntimeError, match=pattern):
        tr.step((ids, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_gradient_sum_fused_equals_torch_path(dtype, monkeypatch):
    """The tied embedding's gradient (owner + head's share) and its squared norm: the C kernel's one
    threaded pass equals the torch path's copy, add and norm."""
    from types import SimpleNamespace

    from lazytrain.runtime import gradients as gr
    from lazytrain.runtime.optim import ckernel
    if ckernel.load() is None:
        pytest.skip("no C compiler here")
    n, tail = 3 << 20, 1000                      # > 2^20 per slice: several threads; a plain tail
    seg = SimpleNamespace(offset=0, numel=n)
    gen = torch.Generator().manual_seed(0)
    own, head = (torch.randn(n + tail, generator=gen).to(dtype) for _ in range(2))
    lay = SimpleNamespace(owned_numel=n + tail, trainable_numel=n + tail, shared=[(seg, [(1, 0)])])

    def assemble():
        tied = gr.TiedGrads(SimpleNamespace(layouts=[lay], grad=[own, head]))
        g, sq = tied.sum(0)
        tied.close()
        return g.clone(), sq
    g_fast, sq_fast = assemble()
    monkeypatch.setattr(gr, "_kernels", lambda: None)
    g_ref, sq_ref = assemble()
    assert torch.equal(g_fast, g_ref)
    assert torch.equal(g_fast[n:], own[n:].float())
    exact = float(g_ref[:n].double().square().sum())
    assert sq_fast[0] == pytest.approx(exact, rel=1e-6)       # double accumulation of fp32 partial sums
    assert sq_ref[0] == pytest.approx(exact, rel=1e-3)        # torch's fp32 norm is less exact


def test_resident_blocks_with_the_8bit_optimizer_match_streaming(tmp_path):
    """Hybrid 8-bit AdamW on resident blocks (their fp32 accumulator is the gradient it reads, tied
    shares summed on the device) against the same model streamed (host gradient buffers, tied sum on
    the host): the same training to fp32 rounding of the gradient sums."""
    from lazytrain.runtime.optim import Hybrid8bitAdamW
    runs = {}
    for res in ("none", 3):
        model = _model("gpt")
        plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", param_dtype="float32",
                                 policy="megatrain", resident=res, **BUDGETS)
        tr = Trainer(model, plan, optimizer=Hybrid8bitAdamW(lr=LR, eps=EPS, max_grad_norm=1.0), device="cpu")
        losses = [tr.step(b).loss for b in _batches("gpt")]
        runs[res] = (losses, tr.state_dict())
        tr.close()
    torch.testing.assert_close(runs[3][0], runs["none"][0], rtol=1e-5, atol=1e-6)
    for k, v in runs["none"][1].items():
        torch.testing.assert_close(runs[3][1][k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("kind,name,resident", [("llama", "host-nvme-a", (1, 3)), ("gpt", "host-nvme-b", (0, 2, 4))])
def test_resident_blocks_with_offloaded_and_nvme_activations_match_eager(kind, name, resident, tmp_path):
    """Resident blocks whose saved activations and boundaries go to the host and to NVMe: the saved
    tensors that are views of resident parameters stay references (never copied, never moved)."""
    import dataclasses

    def plan_fn(m):
        L = len(MIXED[name][0])
        dec = dataclasses.replace(_mixed(name, 2), resident=tuple(j in resident for j in range(L)))
        plan = _build(m, dec, tmp_path)
        assert plan.decisions.resident_blocks == frozenset(resident)
        kinds = {(op.src.value, op.dst.value) for op in plan.ops if op.src and op.dst}
        assert ("host", "nvme") in kinds and ("gpu", "host") in kinds
        return plan
    _check_equivalent(kind, plan_fn)


@pytest.mark.parametrize("policy", ["megatrain", "keep-all"])
def test_frozen_parameters_stay_and_the_rest_trains_like_eager(policy, tmp_path):
    """requires_grad=False: no gradient (eager's optimizer skips them; a zero gradient leaves AdamW's
    state at zero and the weight unchanged), the others equal eager; weight decay with frozen ones is refused."""
    model = _model("llama")
    frozen = ["model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"]
    for n in frozen:
        model.get_parameter(n).requires_grad_(False)
    before = {n: model.get_parameter(n).detach().clone() for n in frozen}
    ref = copy.deepcopy(model)
    plan = _compile(model, policy, 2, tmp_path)
    with pytest.raises(ValueError, match="frozen parameters .* weight_decay"):
        Trainer(model, plan, optimizer=TorchAdamW(lr=LR, weight_decay=0.1), device="cpu")
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=LR, eps=EPS, max_grad_norm=1.0), device="cpu")
    step_beside_eager(tr, ref, _batches("llama", 3), lambda m, ids, labels: _eager_loss("llama", m, ids, labels),
                      lr=LR, eps=EPS, params=[p for p in ref.parameters() if p.requires_grad])
    tr.sync_to_model()
    tr.close()
    assert_same_parameters(model, ref)
    for n in frozen:
        assert torch.equal(model.get_parameter(n), before[n]), n


def test_frozen_parameters_stay_bit_exact_with_the_8bit_optimizer(tmp_path):
    from lazytrain.runtime.optim.hybrid8bit import Hybrid8bitAdamW
    model = _model("llama")
    frozen = ["model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight"]
    for n in frozen:
        model.get_parameter(n).requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = Trainer(model, _compile(model, "megatrain", 2, tmp_path),
                 optimizer=Hybrid8bitAdamW(lr=1e-3, max_grad_norm=1.0), device="cpu")
    for ids, labels in _batches("llama", 3):
        tr.step({"input_ids": ids, "labels": labels})
    tr.sync_to_model()
    tr.close()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) is (name in frozen), name
