"""Inputs an adversarial user would try, and injected faults: how many give a clean error, how many are
accepted, and whether any gives a traceback, hangs, loses the last good state or runs code.

Categories (each attempt runs in this process under a time limit):

    cli        flags of ``compile`` / ``train`` out of range (exit 2, one line, no traceback, in time)
    config     config.json fields set to bad values (ValueError naming the file, or a model that builds)
    manifest   checkpoint.json fields deleted or retyped (CheckpointError, or a trainer that loads)
    metrics    the metrics committed with a checkpoint deleted or retyped (``--resume``'s check)
    batch      ``Trainer.step`` with malformed batches (ValueError, the trainer still usable)
    plan       plan files with absurd sizes and huge integers (PlanError)
    flips      random bytes flipped in a checkpoint's tensor files (CheckpointError: checksum)
    kills      the commit of checkpoint + metrics killed at every file-system call; ``lazytrain train``
               SIGKILLed at random moments (the folder holds a complete, loadable state)
    code       a run folder naming a factory, a tampered kernel cache (nothing runs)

    python benchmarks/adversarial.py [--out results.json] [--kills 6] [--flips 40]

Outcomes: ``error`` (clean refusal), ``ok`` (accepted, works), ``traceback`` (an exception that is not
a clean error), ``hang`` (over the limit), ``lost`` / ``ran`` (state lost, code run: never expected).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import SMALL_GPT, small_gpt  # noqa: E402
from timeouts import within  # noqa: E402

import lazytrain  # noqa: E402
from lazytrain.app import runfiles  # noqa: E402
from lazytrain.app.cli import main  # noqa: E402
from lazytrain.frontend.presets import build_model  # noqa: E402
from lazytrain.ir import PlanError  # noqa: E402
from lazytrain.runtime.checkpoint import CheckpointError  # noqa: E402
from lazytrain.runtime.optim.hybrid8bit import Hybrid8bitAdamW  # noqa: E402
from lazytrain.runtime.trainer import Trainer  # noqa: E402

CLEAN = (ValueError, TypeError, PlanError, CheckpointError, FileNotFoundError)
TRAIN = ["--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
         "--threads", "1"]
BAD_VALUES = [None, "x", -1, 0, 1e30, 10**30, [], {}, True, -1.5]


class Log:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, cat: str, what: str, outcome: str, detail: str = "") -> None:
        self.rows.append({"category": cat, "input": what, "outcome": outcome, "detail": detail[:200]})

    def attempt(self, cat: str, what: str, fn, limit: float = 60.0) -> None:
        """Run ``fn``; a clean exception is ``error``, a return ``ok``, anything else ``traceback``."""
        try:
            with within(limit), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                fn()
            self.add(cat, what, "ok")
        except TimeoutError:
            self.add(cat, what, "hang")
        except CLEAN as e:
            one_line = "\n" not in str(e).strip()
            self.add(cat, what, "error" if one_line else "traceback", f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - what we are looking for
            self.add(cat, what, "traceback", f"{type(e).__name__}: {e}")

    def cli(self, cat: str, args: list[str], limit: float = 60.0) -> None:
        err = io.StringIO()
        try:
            with within(limit), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                try:
                    rc = main(args)
                except SystemExit as e:
                    rc = e.code
        except TimeoutError:
            self.add(cat, " ".join(args), "hang")
            return
        except Exception as e:  # noqa: BLE001
            self.add(cat, " ".join(args), "traceback", f"{type(e).__name__}: {e}")
            return
        text = err.getvalue()
        ok_error = rc == 2 and "Traceback" not in text and text.count("\n") == 1
        self.add(cat, " ".join(args), "ok" if rc == 0 else ("error" if ok_error else "traceback"), text.strip())


# ---- categories --------------------------------------------------------------------------------------
def cli(log: Log, tmp: Path) -> None:
    for v in ["0", "-1", "65537", "100000", "10000000000000", "65521", "4096", "ten", "1e3", "9" * 30]:
        log.cli("cli", ["compile", "tiny", "--batch", v, "--seq", "64", "--hardware", "cpu", "-o", str(tmp / "p.json")])
    for v in ["0", "513", "10000000", str(2**24 + 1), str(2**61), "1.5"]:
        log.cli("cli", ["compile", "tiny", "--seq", v, "--hardware", "cpu", "-o", str(tmp / "p.json")])
    for v in ["0", "3", "65536", "-2"]:
        log.cli("cli", ["compile", "tiny", "--batch", "64", "--micro-batch", v, "--seq", "64", "--hardware", "cpu",
                        "-o", str(tmp / "p.json")])
    for v in ["/x/../etc", "../up", "a/../../b"]:
        log.cli("cli", ["compile", "tiny", "--seq", "64", "--hardware", "cpu", "--nvme-dir", v, "--nvme-memory",
                        "1GiB", "-o", str(tmp / "p.json")])
    out = str(tmp / "run")
    for flag, values in {"--eval-size": ["0", "1492", "2000", "100000000", "-3"],
                         "--batch": ["0", "100000000", "65536", "200000"],
                         "--seq": ["10", "10000000", "1000000", str(2**40)],
                         "--seed": ["-1", "99999999999999999999999", str(2**63), "x"],
                         "--threads": ["0", "1000", "-1", "3"],
                         "--steps": ["0", "-5", "1.5"], "--lr": ["0", "-1", "nan", "inf", "x"],
                         "--warmup": ["-1"], "--eval-every": ["-1"], "--time-limit-min": ["-1", "x"],
                         "--profile": ["0", "-1"], "--difficulty": ["impossible"], "--gpu-memory": ["1XB", "-1"],
                         "--resume": [str(tmp / "nothing"), "/"], "--model": ["nosuch", "os:getcwd"]}.items():
        for v in values:
            log.cli("cli", ["train", *TRAIN, flag, v, "--steps", "1", "--output", out])


def config(log: Log, tmp: Path) -> None:
    qwen = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 67, "max_position_embeddings": 64}
    fields = {**qwen, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
              "attention_dropout": 0.0}
    for base, keys in ((qwen, list(fields)), (SMALL_GPT, [*SMALL_GPT, "rope", "rope_theta"])):
        for key in keys:
            for v in [*BAD_VALUES, "delete"]:
                cfg = {**(base if base is SMALL_GPT else fields)}
                if v == "delete":
                    cfg.pop(key, None)
                else:
                    cfg[key] = v
                path = tmp / "config.json"
                path.write_text(json.dumps(cfg))
                log.attempt("config", f"{cfg.get('model_type')} {key}={v!r}",
                            lambda path=path: build_model(str(path)), 30)
    for raw in (b"\xff\xfe", b"[1]", b"{", b'{"model_type": ' + b"9" * 5000 + b"}", b"[" * 100000):
        path = tmp / "config.json"
        path.write_bytes(raw)
        log.attempt("config", f"bytes {raw[:12]!r}...", lambda path=path: build_model(str(path)), 30)


def _paths(d, prefix=()):
    """Key paths of a JSON object, depth first (lists by index, at most the first 2 items); not into the
    plan (tests/test_fuzz_plan.py fuzzes plans)."""
    items = d.items() if isinstance(d, dict) else list(enumerate(d))[:2] if isinstance(d, list) else ()
    for k, v in items:
        p = (*prefix, k)
        yield p
        if p != ("plan",) and not (isinstance(v, list) and len(v) > 8):
            yield from _paths(v, p)


def _set(d, path: tuple, value) -> None:
    for k in path[:-1]:
        d = d[k]
    if value == "delete":
        d.pop(path[-1])
    else:
        d[path[-1]] = value


def _name(path: tuple, v) -> str:
    return ".".join(map(str, path)) + ("" if v == "delete" else f"={v!r}") + (" deleted" if v == "delete" else "")


def _load(d: Path) -> None:
    """Load the checkpoint at ``d`` into a fresh trainer (and close it)."""
    Trainer.load_checkpoint(d, small_gpt(), optimizer=Hybrid8bitAdamW(lr=1e-3, block_size=256, min_8bit_numel=64),
                            device="cpu").close()


def manifest(log: Log, tmp: Path, saved: Path) -> None:
    meta = json.loads((saved / "checkpoint.json").read_text())
    for path in _paths(meta):
        for v in ("delete", None, "x", -1, 1e30, [], {}):
            d = tmp / "ck"
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(saved, d)
            m = json.loads((d / "checkpoint.json").read_text())
            _set(m, path, v)
            (d / "checkpoint.json").write_text(json.dumps(m))
            log.attempt("manifest", _name(path, v), lambda d=d: _load(d))


def metrics(log: Log, tmp: Path, run: Path) -> None:
    from lazytrain.app.config import TrainConfig
    m0 = json.loads((run / "checkpoint" / "metrics.json").read_text())
    for path in _paths({k: m0[k] for k in ("format", "settings", "model", "steps_done", "tokens", "train_s",
                                           "loss_curve", "eval_curve")}):
        for v in ("delete", None, "x", -1, 1e30, []):
            r = tmp / "r"
            shutil.rmtree(r, ignore_errors=True)
            shutil.copytree(run, r)
            m = json.loads((r / "checkpoint" / "metrics.json").read_text())
            _set(m, path, v)
            (r / "checkpoint" / "metrics.json").write_text(json.dumps(m))
            log.attempt("metrics", _name(path, v), lambda r=r: runfiles.load_resume(TrainConfig(resume=str(r),
                                                                                             steps=10)))


def batches(log: Log, plan) -> None:
    tr = Trainer(small_gpt(), plan, device="cpu", verbose=False)
    z = torch.zeros
    cases = {"0 rows": (z(0, 16, dtype=torch.long),) * 2, "0 columns": (z(4, 0, dtype=torch.long),) * 2,
             "string": ("abc", "abc"), "ragged": ([[1, 2], [3]],) * 2, "None": (None, None),
             "floats": (z(4, 16),) * 2, "bools": (z(4, 16, dtype=torch.bool),) * 2,
             "id past vocab": (torch.full((4, 16), 61),) * 2, "negative id": (torch.full((4, 16), -1),) * 2,
             "label past head": (z(4, 16, dtype=torch.long), torch.full((4, 16), 99)),
             "too long": (z(4, 17, dtype=torch.long),) * 2, "too many rows": (z(5, 16, dtype=torch.long),) * 2,
             "1-D": (z(16, dtype=torch.long),) * 2, "3-D": (z(4, 16, 1, dtype=torch.long),) * 2,
             "shapes differ": (z(4, 16, dtype=torch.long), z(4, 15, dtype=torch.long)),
             "dict missing labels": {"input_ids": z(4, 16, dtype=torch.long)},
             "dict extra key": {"input_ids": z(4, 16, dtype=torch.long), "labels": z(4, 16, dtype=torch.long), "x": 1},
             "left padding": {"input_ids": z(4, 16, dtype=torch.long), "labels": z(4, 16, dtype=torch.long),
                              "attention_mask": torch.cat([z(4, 1), torch.ones(4, 15)], 1)},
             "a list of 3": [z(4, 16, dtype=torch.long)] * 3, "a number": 7}
    for name, b in cases.items():
        log.attempt("batch", name, lambda b=b: tr.step(b))
    log.attempt("batch", "still usable after all of them", lambda: tr.step((z(4, 16, dtype=torch.long),) * 2))
    for name, args in {"plan None": (None,), "plan dict": ({},), "plan path": ("plan.json",),
                       "model None": ("model",), "device cuda": ("cuda",), "device tpu": ("tpu",)}.items():
        def build(args=args, name=name):
            if name.startswith("plan"):
                Trainer(small_gpt(), args[0], device="cpu")
            elif name.startswith("model"):
                Trainer(None, plan, device="cpu")
            else:
                Trainer(small_gpt(), plan, device=args[0])
        log.attempt("batch", f"Trainer({name})", build)
    tr.close()


def plans(log: Log, tmp: Path, plan) -> None:
    edits = {"seq_len 2**61": lambda d: d.update(seq_len=2**61) or d["graph"].update(seq_len=2**61),
             "batch_size 2**40": lambda d: d.update(batch_size=2**40),
             "batch_size 0": lambda d: d.update(batch_size=0), "seq_len -1": lambda d: d.update(seq_len=-1),
             "nvme_dir /x/../etc": lambda d: d["budgets"].update(nvme_dir="/x/../etc")}
    for name, edit in edits.items():
        d = plan.to_json()
        edit(d)
        (tmp / "p.json").write_text(json.dumps(d))
        log.attempt("plan", name, lambda: lazytrain.Plan.load(tmp / "p.json"))
    text = json.dumps(plan.to_json())
    for name, new in {"5,000-digit batch": '"batch_size": ' + "9" * 5000, "float batch": '"batch_size": 4.0'}.items():
        (tmp / "p.json").write_text(text.replace('"batch_size": 4', new, 1))
        log.attempt("plan", name, lambda: lazytrain.Plan.load(tmp / "p.json"))


def flips(log: Log, tmp: Path, saved: Path, n: int, rng: random.Random) -> None:
    files = sorted(saved.glob("*.safetensors"))
    for _ in range(n):
        d = tmp / "ck"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(saved, d)
        f = d / rng.choice(files).name
        data = bytearray(f.read_bytes())
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(data))
        log.attempt("flips", f"{f.name} byte {pos}", lambda d=d: _load(d))


def kills(log: Log, tmp: Path, plan, n_proc: int, rng: random.Random) -> None:
    """Every file-system call of both commits (as tests/test_commit_faults.py), then real SIGKILLs."""
    from test_commit_faults import _kill_at_every_call, _state
    tr = Trainer(small_gpt(), plan, optimizer=Hybrid8bitAdamW(lr=1e-3, block_size=256, min_8bit_numel=64),
                 device="cpu", verbose=False)
    ids = torch.randint(0, 61, (4, 16))
    tr.step((ids, ids))
    before = tmp / "before"
    runfiles.commit(tr, before, {"steps_done": 1, "final_eval": "pending"})
    old = _state(before)
    tr.step((ids, ids))
    with _patcher() as mp:
        states = _kill_at_every_call(mp, tmp / "k1", before,
                                     lambda out: runfiles.commit(tr, out, {"steps_done": 2, "final_eval": "pending"}))
        new = states[-1]
        for k, s in enumerate(states, 1):
            log.add("kills", f"commit 1 killed at call {k}", "ok" if s in (old, new) else "lost", str(s[:3]))
        states = _kill_at_every_call(mp, tmp / "k2", tmp / "k1" / f"kill{len(states)}",
                                     lambda out: runfiles.update_metrics(out, {"steps_done": 2, "final_eval": "done"}))
        for k, s in enumerate(states, 1):
            log.add("kills", f"commit 2 killed at call {k}", "ok" if s[:2] == (2, 2) else "lost", str(s[:3]))
    tr.close()
    # a real process: a run at step 2 resumed to step 4 in its own folder, SIGKILLed at a random moment
    # of that resume (compile, replay, steps, both commits); the folder keeps step 2 or step 4, complete
    base = tmp / "proc_base"
    _quiet(["train", *TRAIN, "--steps", "2", "--output", str(base)])
    cmd = [sys.executable, "-m", "lazytrain.app.cli", "train", *TRAIN, "--steps", "4"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t = time.perf_counter()
    shutil.copytree(base, tmp / "proc_full")
    subprocess.run([*cmd, "--resume", str(tmp / "proc_full"), "--output", str(tmp / "proc_full")], env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    whole = time.perf_counter() - t
    for i in range(n_proc):
        out = tmp / f"proc{i}"
        shutil.copytree(base, out)
        p = subprocess.Popen([*cmd, "--resume", str(out), "--output", str(out)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        at = rng.uniform(0.0, whole)
        time.sleep(at)
        p.send_signal(signal.SIGKILL)
        p.wait()
        try:
            _, meta = _read(out)
            log.add("kills", f"resume SIGKILLed at {at:.1f} of {whole:.1f} s",
                    "ok" if meta["step"] in (2, 4) else "lost", f"step {meta['step']}")
        except Exception as e:  # noqa: BLE001
            log.add("kills", f"resume SIGKILLed at {at:.1f} of {whole:.1f} s", "lost", f"{type(e).__name__}: {e}")


def _quiet(args: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(args) == 0


def _read(out: Path):
    """The committed state of a killed run: manifest, metrics (as --resume checks them), trainer."""
    from lazytrain.app.config import TrainConfig
    from lazytrain.app.train import rebuild_model
    from lazytrain.runtime.checkpoint import read_meta
    folder, meta = read_meta(out / "checkpoint")
    _, prev = runfiles.load_resume(TrainConfig(resume=str(out), steps=100))
    Trainer.load_checkpoint(out / "checkpoint", rebuild_model(prev["model"]), device="cpu").close()
    return folder, meta


@contextlib.contextmanager
def _patcher():
    import pytest
    mp = pytest.MonkeyPatch()
    try:
        yield mp
    finally:
        mp.undo()


def code(log: Log, tmp: Path, run: Path) -> None:
    from lazytrain.app.config import TrainConfig
    marker = tmp / "ran"
    (tmp / "adv_factory.py").write_text(f"def build():\n    open({str(marker)!r}, 'w').close()\n")
    sys.path.insert(0, str(tmp))
    for spec in ("adv_factory:build", "os:getcwd", "subprocess:getoutput"):
        r = tmp / "r"
        shutil.rmtree(r, ignore_errors=True)
        shutil.copytree(run, r)
        m = json.loads((r / "checkpoint" / "metrics.json").read_text())
        m["model"] = {"spec": spec}
        (r / "checkpoint" / "metrics.json").write_text(json.dumps(m))
        log.attempt("code", f"resume a run whose model is {spec}", lambda r=r: runfiles.load_resume(
            TrainConfig(resume=str(r), steps=10)))
    log.add("code", "factory imported by a refused resume", "ran" if marker.exists() else "ok")
    from lazytrain.runtime.optim import ckernel
    path = ckernel.library_path()
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path + ".new").write_bytes(bytes(data))    # replaced, not written in place: this process maps it
    os.replace(path + ".new", path)
    rebuilt = ckernel.library_path()
    intact = ckernel._sha256(rebuilt) == Path(rebuilt + ".sha256").read_text().strip()
    log.add("code", "tampered cached kernel", "ok" if intact else "ran", "rebuilt before loading")


def main_(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows and counts here (JSON)")
    ap.add_argument("--kills", type=int, default=12, help="lazytrain train resumes to SIGKILL")
    ap.add_argument("--flips", type=int, default=40, help="random single-bit flips in tensor files")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    log = Log()
    tmp = Path(tempfile.mkdtemp(prefix="lazytrain-adversarial-"))
    t0 = time.perf_counter()
    plan = lazytrain.compile(small_gpt(), batch_size=4, seq_len=16, micro_batch=2, hardware="cpu", gpu_memory="8GiB",
                             host_memory="16GiB", param_dtype="float32", optimizer="adamw", policy="megatrain")
    tr = Trainer(small_gpt(), plan, optimizer=Hybrid8bitAdamW(lr=1e-3, block_size=256, min_8bit_numel=64),
                 device="cpu", verbose=False)
    tr.step((torch.zeros(4, 16, dtype=torch.long),) * 2)
    tr.save_checkpoint(tmp / "saved")
    tr.close()
    run = tmp / "run"
    _quiet(["train", *TRAIN, "--steps", "2", "--output", str(run)])
    for name, fn in (("cli", lambda: cli(log, tmp)), ("config", lambda: config(log, tmp)),
                     ("manifest", lambda: manifest(log, tmp, tmp / "saved")),
                     ("metrics", lambda: metrics(log, tmp, run)),
                     ("batch", lambda: batches(log, plan)), ("plan", lambda: plans(log, tmp, plan)),
                     ("flips", lambda: flips(log, tmp, tmp / "saved", a.flips, rng)),
                     ("kills", lambda: kills(log, tmp, plan, a.kills, rng)), ("code", lambda: code(log, tmp, run))):
        t = time.perf_counter()
        fn()
        print(f"{name}: {Counter(r['outcome'] for r in log.rows if r['category'] == name)} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    counts = Counter((r["category"], r["outcome"]) for r in log.rows)
    bad = [r for r in log.rows if r["outcome"] in ("traceback", "hang", "lost", "ran")]
    summary = {"attempts": len(log.rows), "by_outcome": dict(Counter(r["outcome"] for r in log.rows)),
               "by_category": {f"{c}/{o}": n for (c, o), n in sorted(counts.items())}, "bad": bad,
               "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps({k: v for k, v in summary.items() if k != "bad"}, indent=1))
    for r in bad:
        print("BAD", r)
    if a.out:       # paths of this machine left out: the temporary folder, the repository, the home folder
        accepted = [f"{r['category']}: {r['input']}" for r in log.rows if r["outcome"] == "ok"]
        samples = {c: [f"{r['input']} -> {r['detail']}" for r in log.rows if r["category"] == c
                       and r["outcome"] == "error"][:4] for c in dict.fromkeys(r["category"] for r in log.rows)}
        text = json.dumps({**summary, "accepted": accepted, "error_samples": samples}, indent=1)
        for where, name in ((str(tmp), "$TMP"), (str(ROOT), "$REPO"), (str(Path.home()), "$HOME")):
            text = text.replace(where, name)
        Path(a.out).write_text(text)
    shutil.rmtree(tmp, ignore_errors=True)
    return summary


if __name__ == "__main__":
    sys.exit(1 if main_()["bad"] else 0)
