"""Checkpoints (runtime/checkpoint.py): bit-exact resume, atomic replacement, clear errors, no pickle.

Resume: 6 steps straight equal 3 steps, save, load into a fresh model and trainer, 3 more steps —
losses and final parameters identical (``==`` / ``torch.equal``), for fp32 AdamW and Hybrid 8-bit
AdamW (its C kernel where it builds: deterministic across instances, measured here), with clipping
that actually clips (every update lagged into the next step, so the save must flush), and without
clipping (updates in the step).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import lazytrain
from lazytrain.frontend.presets import build_from_config
from lazytrain.runtime.checkpoint import FORMAT, META, CheckpointError
from lazytrain.runtime.optim import Hybrid8bitAdamW, TorchAdamW
from lazytrain.runtime.trainer import Trainer

B, SEQ = 4, 16
CONFIG = {"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 48,
          "max_seq": 32, "tie_weights": True}
CLIP = 0.05     # below the measured gradient norms (~1-4): every step clips


def _model(config=CONFIG) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config(config, device="cpu", dtype=torch.float32)


def _plan(model, policy="megatrain", clip=True) -> lazytrain.Plan:
    """With ``clip`` every update is lagged into the next step (it needs the global norm); without,
    each block's update runs in the step, right after its gradients."""
    return lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", clip=clip,
                             param_dtype="float32", optimizer="adamw", policy=policy,
                             gpu_memory="8GiB", host_memory="16GiB")


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(n):
        ids = torch.randint(0, CONFIG["vocab"], (B, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : 2 + s] = -100
        out.append((ids, labels))
    return out


OPTIMIZERS = {
    "adamw": lambda clip=CLIP: TorchAdamW(lr=1e-2, eps=1e-6, weight_decay=0.01, max_grad_norm=clip),
    "hybrid8": lambda clip=CLIP: Hybrid8bitAdamW(lr=1e-2, eps=1e-6, weight_decay=0.01, max_grad_norm=clip,
                                       min_8bit_numel=1024, block_size=256, chunk_numel=1024, num_threads=2),
}


def _state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("opt_name,policy,clip,rebuild_optimizer", [
    ("adamw", "megatrain", CLIP, False), ("adamw", "keep-all", None, True),
    ("hybrid8", "megatrain", CLIP, True), ("hybrid8", "keep-all", CLIP, False),
])
def test_resume_is_bit_exact(opt_name, policy, clip, rebuild_optimizer, tmp_path):
    """``clip`` None: updates in the step, else lagged; ``rebuild_optimizer``: load with optimizer=None."""
    n, k = 6, 3
    batches = _batches(n)
    model = _model()
    plan = _plan(model, policy, clip=clip is not None)
    straight = Trainer(model, plan, optimizer=OPTIMIZERS[opt_name](clip), device="cpu")
    assert bool(straight.ctx.updates.lagged) == (clip is not None)
    want = [straight.step(b) for b in batches]
    assert all((clip is None or s.grad_norm > clip) and not s.skipped for s in want)   # clipping is active

    first = Trainer(_model(), plan, optimizer=OPTIMIZERS[opt_name](clip), device="cpu")
    got = [first.step(b) for b in batches[:k]]
    first.save_checkpoint(tmp_path / "ck")
    resumed = Trainer.load_checkpoint(tmp_path / "ck", _model(),
                                      optimizer=None if rebuild_optimizer else OPTIMIZERS[opt_name](clip))
    assert resumed.steps == k and type(resumed.optimizer) is type(straight.optimizer)
    assert resumed.optimizer.hyperparameters() == first.optimizer.hyperparameters()
    got += [resumed.step(b) for b in batches[k:]]
    assert [s.loss for s in got] == [s.loss for s in want]
    assert [s.grad_norm for s in got] == [s.grad_norm for s in want]
    _state_equal(resumed.state_dict(), straight.state_dict())
    for j, lay in enumerate(resumed.store.layouts):     # the moments too, not only the weights
        if lay.owned_numel:
            _state_equal(resumed.optimizer.state_tensors(j), straight.optimizer.state_tensors(j))


def test_lagged_updates_are_flushed_before_saving(tmp_path):
    model = _model()
    trainer = Trainer(model, _plan(model, "megatrain"), optimizer=OPTIMIZERS["adamw"](), device="cpu")
    assert trainer.ctx.updates.lagged
    for b in _batches(2):
        trainer.step(b)
    assert trainer.ctx.updates.pending          # the last step's updates are still waiting
    trainer.save_checkpoint(tmp_path / "ck")
    assert not trainer.ctx.updates.pending
    loaded = Trainer.load_checkpoint(tmp_path / "ck", _model())
    _state_equal(loaded.state_dict(), trainer.state_dict())


def test_rng_and_tracker_state_round_trip(tmp_path):
    model = _model()
    trainer = Trainer(model, _plan(model), optimizer=OPTIMIZERS["adamw"](), device="cpu")
    trainer.step(_batches(1)[0])
    trainer.ctx.tracker.consecutive_nonfinite, trainer.ctx.tracker.total_nonfinite = 2, 5
    torch.manual_seed(123)
    random.seed(456)
    np.random.seed(789)
    np.random.randn()           # leaves a cached gaussian in numpy's state
    trainer.save_checkpoint(tmp_path / "ck")
    want = (torch.rand(4), random.random(), np.random.randn(3))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    loaded = Trainer.load_checkpoint(tmp_path / "ck", _model())
    got = (torch.rand(4), random.random(), np.random.randn(3))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and np.array_equal(got[2], want[2])
    tr = loaded.ctx.tracker
    assert (tr.consecutive_nonfinite, tr.total_nonfinite) == (2, 5)
    assert tr.last_norm == trainer.ctx.tracker.last_norm


# ---- atomicity -----------------------------------------------------------------------------------------
_KILLED_SAVE = textwrap.dedent("""
    import os, sys, time, torch, lazytrain
    from safetensors.torch import save_file
    from lazytrain.frontend.presets import build_from_config
    from lazytrain.runtime import checkpoint
    from lazytrain.runtime.optim import TorchAdamW
    from lazytrain.runtime.trainer import Trainer
    config, ck, expected = {config!r}, sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = build_from_config(config, device="cpu", dtype=torch.float32)
    plan = lazytrain.compile(model, batch_size=4, seq_len=16, micro_batch=2, hardware="cpu",
                             param_dtype="float32", optimizer="adamw", policy="megatrain",
                             gpu_memory="8GiB", host_memory="16GiB")
    trainer = Trainer(model, plan, optimizer=TorchAdamW(lr=1e-2, max_grad_norm=0.05), device="cpu")
    g = torch.Generator().manual_seed(1)
    batch = lambda: (lambda ids: (ids, ids))(torch.randint(0, 61, (4, 16), generator=g))
    for _ in range(2):
        trainer.step(batch())
    trainer.save_checkpoint(ck)
    save_file(trainer.state_dict(), expected + ".part")
    os.replace(expected + ".part", expected)
    trainer.step(batch())
    real = checkpoint.save_file
    def slow(*a, **k):          # the second save hangs after its first tensor file
        real(*a, **k)
        time.sleep(600)
    checkpoint.save_file = slow
    trainer.save_checkpoint(ck)
""")


def test_killed_save_keeps_the_previous_checkpoint(tmp_path):
    from safetensors.torch import load_file
    ck, expected = tmp_path / "ck", tmp_path / "expected.safetensors"
    script = _KILLED_SAVE.format(config=CONFIG)
    proc = subprocess.Popen([sys.executable, "-c", script, str(ck), str(expected)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (expected.exists() and any(any(t.glob("*.safetensors")) for t in tmp_path.glob("ck.tmp-*"))):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)    # in the middle of writing the new checkpoint
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.glob("ck.tmp-*")) and not (tmp_path / "ck.old").exists()
    loaded = Trainer.load_checkpoint(ck, _model())
    assert loaded.steps == 2
    _state_equal(loaded.state_dict(), load_file(str(expected)))
    loaded.save_checkpoint(ck)          # the next save succeeds and clears what the killed one left
    assert not list(tmp_path.glob("ck.tmp-*"))


def test_crash_between_renames_loads_the_old_checkpoint(tmp_path, monkeypatch):
    model = _model()
    trainer = Trainer(model, _plan(model), optimizer=OPTIMIZERS["adamw"](), device="cpu")
    batches = _batches(2)
    trainer.step(batches[0])
    ck = tmp_path / "ck"
    trainer.save_checkpoint(ck)
    saved = trainer.state_dict()
    trainer.step(batches[1])
    real, calls = os.replace, []

    class Killed(Exception):
        pass

    def replace(a, b):
        calls.append((a, b))
        if len(calls) == 2:         # after ck -> ck.old, before the new folder becomes ck
            raise Killed
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        trainer.save_checkpoint(ck)
    monkeypatch.undo()
    assert not ck.exists() and (tmp_path / "ck.old" / META).is_file()
    loaded = Trainer.load_checkpoint(ck, _model())
    assert loaded.steps == 1
    _state_equal(loaded.state_dict(), saved)
    trainer.save_checkpoint(ck)     # completes: ck is the new state, ck.old and the temporary are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert Trainer.load_checkpoint(ck, _model()).steps == 2


def test_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path):
    model = _model()
    trainer = Trainer(model, _plan(model), optimizer=OPTIMIZERS["adamw"](), device="cpu")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a LazyTrain checkpoint"):
        trainer.save_checkpoint(tmp_path / "data")
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"


# ---- errors --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved") / "ck"
    model = _model()
    trainer = Trainer(model, _plan(model), optimizer=OPTIMIZERS["hybrid8"](), device="cpu")
    for b in _batches(2):
        trainer.step(b)
    trainer.save_checkpoint(d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def _edit_meta(d: Path, fn) -> None:
    meta = json.loads((d / META).read_text())
    fn(meta)
    (d / META).write_text(json.dumps(meta))


@pytest.mark.parametrize("damage,match", [
    (lambda d: (d / META).write_text((d / META).read_text()[:1000]), "not valid JSON"),
    (lambda d: (d / META).write_bytes(b""), "not valid JSON"),
    (lambda d: _edit_meta(d, lambda m: m.update(format="lazytrain.checkpoint/0")), "format 'lazytrain.checkpoint/0'"),
    (lambda d: _edit_meta(d, lambda m: m.pop("rng")), "field rng is missing"),
    (lambda d: _edit_meta(d, lambda m: m["model"].update(fingerprint="0123456789abcdef")),
     "fingerprint 0123456789abcdef does not match"),
    (lambda d: _edit_meta(d, lambda m: m["optimizer"].update({"class": "SGD"})), "optimizer SGD"),
    (lambda d: (d / "block_0001.safetensors").write_bytes((d / "block_0001.safetensors").read_bytes()[:-10]),
     "block_0001.safetensors: .* truncated"),
    (lambda d: (d / "block_0000.safetensors").unlink(), "block_0000.safetensors: missing"),
    (lambda d: (d / META).unlink(), "not a LazyTrain checkpoint"),
])
def test_damaged_checkpoint_gives_a_clear_error(saved, tmp_path, damage, match):
    d = _copy(saved, tmp_path / "ck")
    damage(d)
    with pytest.raises(CheckpointError, match=match):
        Trainer.load_checkpoint(d, _model())


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        Trainer.load_checkpoint(tmp_path / "nothing", _model())


def test_checkpoint_of_another_model(saved):
    other = _model({**CONFIG, "d_ff": 64})
    with pytest.raises(CheckpointError, match=r"another model .*fc.weight: checkpoint \[48, 32\], model \[64, 32\]"):
        Trainer.load_checkpoint(saved, other)
    deeper = _model({**CONFIG, "n_layer": 3})
    with pytest.raises(CheckpointError, match="another model"):
        Trainer.load_checkpoint(saved, deeper, plan=_plan(deeper))


def test_wrong_optimizer(saved):
    with pytest.raises(CheckpointError, match="holds Hybrid8bitAdamW state, the optimizer given is TorchAdamW"):
        Trainer.load_checkpoint(saved, _model(), optimizer=TorchAdamW(lr=1e-3))
    with pytest.raises(CheckpointError, match="block_size is 2048, the state was saved with block_size=256"):
        Trainer.load_checkpoint(saved, _model(), optimizer=Hybrid8bitAdamW(lr=1e-3))


# ---- no pickle -----------------------------------------------------------------------------------------
def test_only_json_and_safetensors(saved):
    files = sorted(saved.iterdir())
    assert {f.suffix for f in files} == {".json", ".safetensors"}
    meta = json.loads((saved / META).read_text())
    assert meta["format"] == FORMAT and meta["plan"]["format"] == "lazytrain.plan/1"
    for f in files:
        data = f.read_bytes()
        assert not data.startswith((b"\x80", b"PK\x03\x04")), f      # pickle protocol 2+, torch.save zip
        assert b"\x80\x04\x95" not in data[:4096], f
        if f.suffix == ".safetensors":      # 8-byte header size, JSON header, raw tensor bytes: nothing else
            n = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + n])
            header.pop("__metadata__")
            end = max(v["data_offsets"][1] for v in header.values())
            assert 8 + n + end == len(data)
