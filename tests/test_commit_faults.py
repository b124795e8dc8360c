"""Checkpoint + metrics are one commit point, and a checkpoint is verified byte for byte when loaded (issue 22).

Fault injection: the commit of a new state is killed at every file-system call it makes (each write of
a tensor file, fsync, rename, removal: the k-th call raises and so does every later one, so no cleanup
runs, as after a SIGKILL), and after each kill the folder must hold the previous complete state or the
new one: manifest, metrics and every tensor file of one step, their checksums intact.  Then corruption
of the same size (flipped bytes, a retyped tensor) and edited manifests are refused with the file named.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import small_gpt
from safetensors.torch import load_file, save_file

from lazytrain.runtime import checkpoint
from lazytrain.runtime.checkpoint import META, CheckpointError
from lazytrain.runtime.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.runtime.trainer import Trainer


class Killed(BaseException):
    """The process dying at a file-system call."""


def _opt():
    return Hybrid8bitAdamW(lr=1e-3, block_size=256, min_8bit_numel=64)


@pytest.fixture(scope="module")
def trainer(small_plan):
    tr = Trainer(small_gpt(), small_plan, optimizer=_opt(), device="cpu", verbose=False)
    yield tr
    tr.close()


def _step(tr) -> None:
    ids = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(tr.steps))
    tr.step((ids, ids))


def _metrics(step: int, final_eval: str = "pending") -> dict:
    return {"steps_done": step, "final_eval": final_eval}


def _state(out: Path) -> tuple[int, int, str, dict]:
    """(manifest step, metrics step, metrics' final eval, file entries) of the committed state, every
    tensor file checked against its recorded SHA-256."""
    from lazytrain.runtime.checkpoint import read_extra, read_meta
    folder, meta = read_meta(out / "checkpoint")
    metrics = json.loads(read_extra(folder, meta, "metrics.json"))
    for name, entry in meta["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == entry["sha256"], name
    return meta["step"], metrics["steps_done"], metrics["final_eval"], meta["files"]


class _Faults:
    """Every call of the patched functions counts; the k-th raises Killed, and so does every later one."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def wrap(self, fn):
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls >= self.at:
                raise Killed(f"call {self.calls}: {fn.__name__}")
            return fn(*args, **kwargs)
        return call


def _inject(monkeypatch, faults: _Faults) -> None:
    for mod, name in ((os, "replace"), (os, "rename"), (shutil, "rmtree"), (checkpoint, "save_file"),
                      (tempfile, "mkdtemp")):
        monkeypatch.setattr(mod, name, faults.wrap(getattr(mod, name)))
    # a kill point like the others; the flush to disk itself is skipped (durability is the kernel's, and
    # 5 ms a call on the CI disk)
    monkeypatch.setattr(os, "fsync", faults.wrap(lambda fd: None))


def _kill_at_every_call(monkeypatch, tmp_path: Path, before: Path, commit) -> list[tuple]:
    """Run ``commit(out)`` on a copy of ``before`` killed at call 1, 2, ... until it completes; the
    states left behind (one per kill), then the completed one."""
    seen, k = [], 1
    while True:
        out = tmp_path / f"kill{k}"
        shutil.copytree(before, out)
        faults = _Faults(k)
        with monkeypatch.context() as mp:
            _inject(mp, faults)
            try:
                commit(out)
                done = True
            except Killed:
                done = False
        seen.append(_state(out))
        if done:
            return seen
        k += 1


def test_a_kill_at_any_write_leaves_the_old_or_the_new_state(trainer, tmp_path, monkeypatch):
    from lazytrain.app import runfiles
    before = tmp_path / "before"
    _step(trainer)
    runfiles.commit(trainer, before, _metrics(trainer.steps))                       # state A
    old = _state(before)
    _step(trainer)                                                                  # state B, committed with kills
    states = _kill_at_every_call(monkeypatch, tmp_path, before,
                                 lambda out: runfiles.commit(trainer, out, _metrics(trainer.steps)))
    new = states[-1]
    assert old[:2] == (1, 1) and new[:2] == (2, 2) and old[3] != new[3]
    assert all(s == old or s == new for s in states), [s[:3] for s in states]
    assert len(states) >= 10 and old in states and states.count(new) >= 2    # the commit point lies inside

    # commit 2 (the final eval's metrics): one rename, killed at each call
    states = _kill_at_every_call(monkeypatch, tmp_path / "eval", tmp_path / f"kill{len(states)}",
                                 lambda out: runfiles.update_metrics(out, _metrics(2, "done")))
    assert {s[2] for s in states} == {"pending", "done"} and all(s[:2] == (2, 2) for s in states)

    # what a kill left behind never blocks the next commit, and the state loads into a trainer
    out = tmp_path / "kill1"
    runfiles.commit(trainer, out, _metrics(trainer.steps))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "metrics.json"]
    loaded = Trainer.load_checkpoint(out / "checkpoint", small_gpt(), optimizer=_opt(), device="cpu")
    assert loaded.steps == 2
    loaded.close()


# ---- corruption of the same size and edited manifests ----------------------------------------------------
@pytest.fixture(scope="module")
def saved(trainer, tmp_path_factory):
    d = tmp_path_factory.mktemp("saved") / "ck"
    trainer.save_checkpoint(d)
    return d


def _copy(saved: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(saved, d)
    return d


def _load(d: Path):
    return Trainer.load_checkpoint(d, small_gpt(), optimizer=_opt(), device="cpu")


def test_flipped_bytes_of_the_same_size_are_refused(saved, tmp_path):
    d = _copy(saved, tmp_path)
    path = d / "block_0001.safetensors"
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 64, len(data)):       # 64 bytes of tensor data: a weight becomes garbage
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"block_0001.safetensors: sha256 .* the file is corrupted"):
        _load(d)


def test_a_fifo_in_a_block_files_place_is_refused_unopened(saved, tmp_path):
    """Loading hashes each file before it reads it; a FIFO there is refused, not opened (which would wait for
    a writer forever)."""
    from timeouts import within
    d = _copy(saved, tmp_path)
    (d / "block_0001.safetensors").unlink()
    os.mkfifo(d / "block_0001.safetensors")
    with within(30), pytest.raises(CheckpointError, match=r"block_0001.safetensors: not a regular file"):
        _load(d)


def _retype(d: Path, key_prefix: str, dtype: torch.dtype) -> None:
    """Rewrite block 1 with one tensor of another dtype, and the manifest to match (size, hash, dtype)."""
    path = d / "block_0001.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in sorted(tensors) if k.startswith(key_prefix))
    tensors[key] = tensors[key].to(dtype)
    save_file(tensors, str(path))
    meta = json.loads((d / META).read_text())
    entry = meta["files"][path.name]
    entry.update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    entry["tensors"][key]["dtype"] = {torch.float64: "F64", torch.int32: "I32"}[dtype]
    (d / META).write_text(json.dumps(meta))


@pytest.mark.parametrize("prefix, dtype", [("param.", torch.float64), ("param.", torch.int32)])
def test_a_retyped_tensor_is_refused_even_with_a_matching_manifest(saved, tmp_path, prefix, dtype):
    d = _copy(saved, tmp_path)
    _retype(d, prefix, dtype)
    with pytest.raises(CheckpointError, match=r"tensor \S+ is (float64|int32) .* this model and optimizer hold "):
        _load(d)


def _edit(d: Path, fn) -> None:
    meta = json.loads((d / META).read_text())
    fn(meta)
    (d / META).write_text(json.dumps(meta))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(files=list(m["files"])), "field files must be an object"),
    (lambda m: m.update(files=3), "field files must be an object"),
    (lambda m: m["rng"].pop("torch"), "field rng.torch is missing"),
    (lambda m: m.update(rng="seeded"), "field rng must be an object"),
    (lambda m: m["optimizer"].pop("hyperparameters"), "field optimizer.hyperparameters is missing"),
    (lambda m: m.update(grad_norm={}), "field grad_norm.consecutive_nonfinite is missing"),
    (lambda m: m.update(model="tiny"), "field model must be an object"),
    (lambda m: m.update(step=1e30), "field step must be a whole number"),
    (lambda m: m.update(step=-5), r"field step must be a whole number in \[0,"),
    (lambda m: m.update(step=1000), "step 1000 .* does not match block"),
    (lambda m: m["rng"].update(torch="AAAA"), "malformed RNG state"),
    (lambda m: m["optimizer"]["hyperparameters"].update(lr=-1.0), "hyperparameters.lr must be a finite number"),
    (lambda m: m.update(format="lazytrain.checkpoint/1"), "written by an older version of LazyTrain"),
])
def test_edited_manifest_is_one_clear_error(saved, tmp_path, edit, message):
    d = _copy(saved, tmp_path)
    _edit(d, edit)
    with pytest.raises(CheckpointError, match=message) as e:
        _load(d)
    assert str(d) in str(e.value)


def test_a_manifest_with_a_5000_digit_integer(saved, tmp_path):
    d = _copy(saved, tmp_path)
    (d / META).write_text(re.sub(r'"step": \d+', '"step": ' + "7" * 5000, (d / META).read_text(), count=1))
    with pytest.raises(CheckpointError, match="is not a checkpoint manifest"):
        _load(d)


# ---- the compiled kernel cache ------------------------------------------------------------------------------
def test_kernel_cache_is_private_keyed_and_verified(tmp_path, monkeypatch):
    """Loading a cached library runs its code: it is keyed by source + compiler, kept in a 0700 folder, and
    its SHA-256 is checked before every load (a tampered file is rebuilt; a folder others can write is not
    used).  The build itself is faked here: what is checked is which file would be loaded."""
    import stat

    from lazytrain.runtime.optim import ckernel
    builds = []

    def fake_build(cc, folder, name):
        path = Path(folder) / name
        path.write_bytes(b"library")
        (Path(folder) / (name + ".sha256")).write_text(ckernel._sha256(str(path)))
        builds.append(folder)
        return str(path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(ckernel, "_build", fake_build)
    monkeypatch.setattr(ckernel, "_compiler", lambda: ("cc", "cc 1.0"))
    folder = tmp_path / "lazytrain" / "kernels"
    path = Path(ckernel.library_path())
    assert path.parent == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700 and len(builds) == 1
    assert Path(ckernel.library_path()) == path and len(builds) == 1        # cached and verified
    path.write_bytes(b"tampered")
    assert Path(ckernel.library_path()) == path and path.read_bytes() == b"library" and len(builds) == 2
    monkeypatch.setattr(ckernel, "_compiler", lambda: ("cc", "cc 2.0"))       # another compiler, another key
    assert Path(ckernel.library_path()) != path and len(builds) == 3
    folder.chmod(0o777)                                                       # others could plant a library
    assert Path(ckernel.library_path()).parent != folder and len(builds) == 4
