"""Training state on NVMe (``Decisions.nvme_state``): a model whose state does not fit its host budget trains with
parameters, gradients and optimizer state in files exactly as with all of it in RAM (losses and parameters bit
for bit), for every policy, fp32 AdamW and the Hybrid 8-bit optimizer; checkpoints resume across placements; a
kill in the middle of a state write loses nothing committed; and the errors a user can meet."""

from __future__ import annotations

import copy
import dataclasses
import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import lazytrain
from lazytrain.compiler.budgets import BudgetError
from lazytrain.compiler.builder import Compiler
from lazytrain.compiler.options import Optimizer
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.request import HOST_BYTES_PER_PARAM
from lazytrain.frontend.presets import build_from_config
from lazytrain.ir import Op, OpKind, PlanError, TensorKind, verify
from lazytrain.runtime.nvme import NvmeError
from lazytrain.runtime.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 67, "tie_word_embeddings": False,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
B, SEQ, MB = 4, 16, 2
#: (plan dtype, optimizer): fp32 AdamW on fp32 parameters, the 8-bit optimizer on bf16
OPTIMIZERS = {"adamw": "float32", "hybrid8bit": "bfloat16"}
#: the host-only options (stochastic-rounding master, 4-bit moments): their state on NVMe too, bf16 parameters
HOST_ONLY = ("hybrid8bit-sr", "hybrid4bit", "hybrid4bit-sr")


def _model(layers: int = CONFIG["num_hidden_layers"]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config({**CONFIG, "num_hidden_layers": layers}, device="cpu", dtype=torch.float32)


def _optimizer(name: str, clip: float | None = 1.0):
    if name == "adamw":
        return TorchAdamW(lr=1e-3, eps=1e-6, max_grad_norm=clip)
    choice = Optimizer(name)
    return Hybrid8bitAdamW(lr=1e-3, max_grad_norm=clip, stochastic_rounding=choice.stochastic_rounding,
                           moment_bits=choice.moment_bits)


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(n):
        ids = torch.randint(0, CONFIG["vocab_size"], (B, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : 2 + s] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _state_bytes(model, opt: str) -> int:
    per = HOST_BYTES_PER_PARAM[Optimizer(opt)]
    return int(sum(p.numel() for p in model.parameters()) * per)


def _placed_plan(model, opt: str, policy: str, nvme_dir, *, share: float = 0.6, clip: bool = True):
    """A plan compiled with a host budget of ``share`` of the state's bytes: the compile keeps the rest on NVMe."""
    return lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=MB, hardware="cpu",
                             param_dtype=OPTIMIZERS.get(opt, "bfloat16"), optimizer=opt, policy=policy, clip=clip,
                             gpu_memory="8GiB", host_memory=int(_state_bytes(model, opt) * share),
                             nvme_dir=str(nvme_dir), nvme_memory="1GiB")


def _in_ram(plan, opt: str, clip: bool = True):
    """The same decisions with every byte of state in the host store (the reference)."""
    budgets = dict(plan.budgets, host_bytes=64 * 2**30)
    comp = Compiler(plan.graph, get_profile("cpu"), budgets, param_dtype=plan.param_dtype, optimizer=opt, clip=clip)
    return comp.build(dataclasses.replace(plan.decisions, nvme_state={}), plan.batch_size)


def _train(model, plan, opt: str, batches, clip: float | None = 1.0):
    m = copy.deepcopy(model)
    t = Trainer(m, plan, optimizer=_optimizer(opt, clip), device="cpu", verbose=False)
    losses = [t.step(b).loss for b in batches]
    t.sync_to_model()
    t.close()
    return losses, {k: v.detach().clone() for k, v in m.named_parameters()}


def _assert_same(a, b) -> None:
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("policy", ["megatrain", "recompute-all", "keep-all", "milp"])
def test_state_on_nvme_trains_bit_for_bit(policy, opt, tmp_path):
    model = _model()
    plan = _placed_plan(model, opt, policy, tmp_path, share=0.55)
    placed = plan.decisions.nvme_state
    assert placed.get("ostate"), placed          # the host budget is below the state: the compile moved some of it
    assert plan.predicted["peak_host_bytes"] <= plan.budgets["host_bytes"]
    kinds = {op.kind for op in plan.ops}
    assert {OpKind.STATE_READ, OpKind.STATE_WRITE} <= kinds
    batches = _batches(4)
    _assert_same(_train(model, plan, opt, batches), _train(model, _in_ram(plan, opt), opt, batches))


@pytest.mark.parametrize("opt", HOST_ONLY)
def test_host_only_optimizers_state_on_nvme_trains_bit_for_bit(opt, tmp_path):
    """Their ``streamed_state`` (no lo with -sr; 4-bit codes half the 8-bit ones) in the files, ``step_streamed`` on
    the host copies: the same losses and parameters as with the state in RAM."""
    model = _model()
    plan = _placed_plan(model, opt, "recompute-all", tmp_path, share=0.55)
    assert plan.decisions.nvme_state.get("ostate") and not plan.decisions.resident_blocks
    batches = _batches(4)
    _assert_same(_train(model, plan, opt, batches), _train(model, _in_ram(plan, opt), opt, batches))


def test_every_component_on_nvme(tmp_path):
    """A budget that leaves room for little more than the host copies in flight: parameters, gradients and
    optimizer state all go to NVMe, and training is still bit for bit the same (8 layers: the copies in flight, 3
    blocks' of each component, are a third of the state)."""
    model = _model(8)
    plan = _placed_plan(model, "hybrid8bit", "recompute-all", tmp_path, share=0.4)
    assert set(plan.decisions.nvme_state) == {"params", "grads", "ostate"}
    batches = _batches(3)
    _assert_same(_train(model, plan, "hybrid8bit", batches), _train(model, _in_ram(plan, "hybrid8bit"), "hybrid8bit",
                                                                    batches))


def test_same_step_updates_without_clipping(tmp_path):
    """Without clipping each update follows its gradient's offload: the gradient never goes to NVMe."""
    model = _model(8)
    plan = _placed_plan(model, "adamw", "recompute-all", tmp_path, clip=False, share=0.75)
    assert plan.decisions.nvme_state and "grads" not in plan.decisions.nvme_state
    batches = _batches(3)
    _assert_same(_train(model, plan, "adamw", batches, clip=None),
                 _train(model, _in_ram(plan, "adamw", clip=False), "adamw", batches, clip=None))


@pytest.mark.parametrize("first,second", [("ram", "nvme"), ("nvme", "ram")])
def test_checkpoint_resumes_across_placements(first, second, tmp_path):
    """Two steps with one placement, a checkpoint, two more with the other: as four with all state in RAM."""
    model = _model()
    placed = _placed_plan(model, "hybrid8bit", "recompute-all", tmp_path / "nv")
    ram = _in_ram(placed, "hybrid8bit")
    plans = {"ram": ram, "nvme": placed}
    batches = _batches(4)
    want = _train(model, ram, "hybrid8bit", batches)

    m = copy.deepcopy(model)
    t = Trainer(m, plans[first], optimizer=_optimizer("hybrid8bit"), device="cpu", verbose=False)
    losses = [t.step(b).loss for b in batches[:2]]
    t.save_checkpoint(tmp_path / "ckpt")
    t.close()
    m2 = copy.deepcopy(model)
    t2 = Trainer.load_checkpoint(tmp_path / "ckpt", m2, plan=plans[second], optimizer=_optimizer("hybrid8bit"),
                                 device="cpu", verbose=False)
    losses += [t2.step(b).loss for b in batches[2:]]
    t2.sync_to_model()
    t2.close()
    _assert_same((losses, {k: v.detach().clone() for k, v in m2.named_parameters()}), want)


_KILLED_CHILD = textwrap.dedent("""
    import sys, os, time, torch
    sys.path.insert(0, {tests!r})
    import test_nvme_state as T
    from lazytrain.ir import Plan
    from lazytrain.runtime.nvme import NvmeStore
    from lazytrain.runtime.trainer import Trainer
    plan = Plan.load({plan!r})
    m = T._model()
    t = Trainer(m, plan, optimizer=T._optimizer("hybrid8bit"), device="cpu", verbose=False)
    batches = T._batches(4)
    for b in batches[:2]:
        t.step(b)
    t.save_checkpoint({ckpt!r})
    real = NvmeStore.write_into
    def half_then_hang(self, f, host):      # half of a state file written, then killed
        raw = host.contiguous().view(-1).view(torch.uint8)
        with open(f.path, "r+b") as fh:
            fh.write(raw[: raw.numel() // 2].numpy().tobytes())
        print("writing", flush=True)
        time.sleep(60)
    NvmeStore.write_into = half_then_hang
    t.step(batches[2])
""")


def test_kill_during_a_state_write_loses_nothing_committed(tmp_path):
    model = _model()
    plan = _placed_plan(model, "hybrid8bit", "recompute-all", tmp_path / "nv")
    plan.save(tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    code = _KILLED_CHILD.format(tests=os.path.dirname(__file__), plan=str(tmp_path / "plan.json"), ckpt=str(ckpt))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "writing", child.stderr.read()
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=120)
    batches = _batches(4)
    want = _train(model, _in_ram(plan, "hybrid8bit"), "hybrid8bit", batches)
    m = copy.deepcopy(model)
    t = Trainer.load_checkpoint(ckpt, m, plan=plan, optimizer=_optimizer("hybrid8bit"), device="cpu", verbose=False)
    assert t.steps == 2
    losses = [t.step(b).loss for b in batches[2:]]
    t.sync_to_model()
    t.close()
    assert losses == want[0][2:]
    for k, v in m.named_parameters():
        assert torch.equal(v.detach(), want[1][k]), k


def test_verify_refuses_an_update_whose_state_is_not_written_back(tmp_path):
    plan = _placed_plan(_model(), "hybrid8bit", "recompute-all", tmp_path)
    ops = plan.ops
    drop = next(op.id for op in ops if op.kind is OpKind.STATE_WRITE and op.tensor.kind is TensorKind.OPT_STATE)
    kept = [op for op in ops if op.id != drop]
    renum = {op.id: i for i, op in enumerate(kept)}
    bad = dataclasses.replace(plan, ops=[dataclasses.replace(op, id=renum[op.id], deps=tuple(
        renum[d] for d in op.deps if d in renum)) for op in kept])
    with pytest.raises(PlanError, match="before a state_write puts it back on NVMe"):
        verify(bad)


def test_verify_refuses_state_ops_of_state_in_ram(tmp_path):
    plan = _placed_plan(_model(), "hybrid8bit", "recompute-all", tmp_path)
    ram = _in_ram(plan, "hybrid8bit")
    rogue = next(op for op in plan.ops if op.kind is OpKind.STATE_READ)
    bad = dataclasses.replace(ram, ops=[*ram.ops, Op(id=len(ram.ops), kind=OpKind.STATE_READ, block=rogue.block,
                                                     tensor=rogue.tensor, src=rogue.src, dst=rogue.dst,
                                                     resource=rogue.resource)])
    with pytest.raises(PlanError, match="is not"):
        verify(bad)


def test_a_full_disk_is_an_error_before_training(tmp_path, monkeypatch):
    plan = _placed_plan(_model(), "hybrid8bit", "recompute-all", tmp_path)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(NvmeError, match="cannot hold|space"):
        Trainer(_model(), plan, optimizer=_optimizer("hybrid8bit"), device="cpu", verbose=False)


def test_host_store_leaves_out_the_state_on_nvme(tmp_path):
    model = _model()
    plan = _placed_plan(model, "hybrid8bit", "recompute-all", tmp_path)
    t = Trainer(copy.deepcopy(model), plan, optimizer=_optimizer("hybrid8bit"), device="cpu", verbose=False)
    placed = plan.decisions.nvme_state
    for j in placed.get("params", ()):
        assert t.store.load[j].numel() == 0
    for j in placed.get("grads", ()):
        assert t.store.grad[j].numel() == 0
    files = t.ctx.nvme_state.files
    assert {(k.value, j) for k, j in files} == {(k, j) for k, v in placed.items() for j in v}
    t.close()


def test_compile_names_the_host_and_nvme_a_state_needs(tmp_path):
    model = _model(8)
    state = _state_bytes(model, "hybrid8bit")
    common = dict(batch_size=B, seq_len=SEQ, micro_batch=MB, hardware="cpu", param_dtype="bfloat16",
                  optimizer="hybrid8bit", gpu_memory="8GiB", policy="recompute-all")
    with pytest.raises(BudgetError, match="give --nvme-dir .* --nvme-memory of at least"):
        lazytrain.compile(model, host_memory=state // 2, **common)
    with pytest.raises(BudgetError, match="raise --nvme-memory"):
        lazytrain.compile(model, host_memory=state // 2, nvme_dir=str(tmp_path), nvme_memory=state // 20, **common)
    with pytest.raises(BudgetError, match="with all of it that can go to NVMe there .* raise --host-memory"):
        lazytrain.compile(model, host_memory=state // 50, nvme_dir=str(tmp_path), nvme_memory="1GiB", **common)


def test_lazytrain_train_keeps_state_on_nvme_and_resumes_in_another_folder(tmp_path):
    """``lazytrain train`` with a host budget below the task model's state: its state goes to ``--nvme-dir``, the
    files go when the run ends, and ``--resume`` rebuilds them in another folder."""
    import json

    from lazytrain.app.cli import main
    tiny = ["--batch", "4", "--no-eval", "--policy", "recompute-all", "--no-progress", "--device", "cpu",
            "--time-limit-min", "0", "--threads", "1", "--host-memory", "6MiB", "--nvme-memory", "1GiB"]
    out = tmp_path / "run"
    assert main(["train", *tiny, "--steps", "2", "--output", str(out), "--nvme-dir", str(tmp_path / "a")]) == 0
    plan = json.loads((out / "checkpoint" / "checkpoint.json").read_text())["plan"]
    assert plan["decisions"]["nvme_state"]
    assert not list((tmp_path / "a").iterdir())          # scratch: removed with the trainer
    assert main(["train", *tiny, "--steps", "3", "--output", str(out), "--resume", str(out),
                 "--nvme-dir", str(tmp_path / "b")]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_done"] == 3
    with pytest.raises(SystemExit) as stop:             # an empty folder name: a flag error
        main(["train", *tiny, "--steps", "2", "--output", str(tmp_path / "bad"), "--nvme-dir", "",
              "--nvme-memory", "1GiB"])
    assert stop.value.code == 2


def test_a_slow_drive_is_said_before_training(tmp_path, monkeypatch):
    """A drive measured at a tenth of the plan's rates: a warning with the NVMe time it implies; at the plan's rates,
    none."""
    from lazytrain.app import disk_check
    plan = _placed_plan(_model(), "hybrid8bit", "recompute-all", tmp_path)
    want = plan.hardware["nvme_read_gbps"], plan.hardware["nvme_write_gbps"]
    monkeypatch.setattr("lazytrain.measure.disk.disk_rates", lambda folder, nbytes: {
        "nvme_read_gbps": want[0] / 10, "nvme_write_gbps": want[1] / 10})
    warning = disk_check.slow_disk_warning(plan, str(tmp_path))
    assert warning is not None and "lazytrain profile --disk-dir" in warning and "s a step instead of" in warning
    monkeypatch.setattr("lazytrain.measure.disk.disk_rates", lambda folder, nbytes: {
        "nvme_read_gbps": want[0], "nvme_write_gbps": want[1]})
    assert disk_check.slow_disk_warning(plan, str(tmp_path)) is None
    assert disk_check.slow_disk_warning(_in_ram(plan, "hybrid8bit"), str(tmp_path)) is None


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["recompute-all", "milp"])
def test_state_on_nvme_on_the_gpu_trains_bit_for_bit(policy, tmp_path):
    """On the GPU (page-locked staging buffers, the real streams and workers): the same bits as all state in RAM."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _model()
    plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=MB, hardware="h100", param_dtype="bfloat16",
                             optimizer="hybrid8bit", policy=policy, gpu_memory="8GiB",
                             host_memory=int(_state_bytes(model, "hybrid8bit") * 0.4), nvme_dir=str(tmp_path),
                             nvme_memory="1GiB", resident="none", gpu_update="none")
    assert set(plan.decisions.nvme_state) == {"params", "grads", "ostate"}
    ram = _in_ram(plan, "hybrid8bit")
    batches = _batches(4)

    def run(p):
        m = copy.deepcopy(model)
        t = Trainer(m, p, optimizer=_optimizer("hybrid8bit"), device="cuda", verbose=False)
        losses = [t.step(b).loss for b in batches]
        t.sync_to_model()
        t.close()
        return losses, {k: v.detach().clone() for k, v in m.named_parameters()}
    _assert_same(run(plan), run(ram))
