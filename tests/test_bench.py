"""lazytrain bench on the CPU: plain, FSDP2 and lazytrain run one process each on a tiny model, agree
on the loss, and are written as JSON, markdown and PNG; a failing system is a row with an error."""

from __future__ import annotations

import json
import types

import pytest
import torch

from lazytrain.app.cli import main as cli_main
from lazytrain.measure import bench, bench_worker

TINY = {"model_type": "lazytrain-gpt", "vocab": 128, "d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64,
        "max_seq": 32, "tie_weights": True}


@pytest.fixture
def tiny_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _cfg(model: str, out_dir, **kw) -> dict:
    cfg = {"model": model, "batch": 2, "seq": 16, "gpu_memory": "2GiB", "systems": ["plain"], "steps": 3,
           "warmup": 1, "lr": 1e-3, "optimizer": "adamw", "hardware": "cpu", "micro_batch": None, "device": "cpu",
           "budget_s": 120.0, "timeout_s": None, "find_max_batch": False, "max_batch_limit": 4096,
           "out_dir": str(out_dir), "name": "t"}
    return {**cfg, **kw}


def test_bench_cpu_end_to_end(tiny_model, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli_main(["bench", "--model", tiny_model, "--batch", "2", "--seq", "16", "--device", "cpu",
                   "--warmup", "1", "--steps", "3", "--lr", "1e-3", "--gpu-memory", "2GiB",
                   "--systems", "plain,fsdp2,lazytrain-milp", "--out-dir", str(out), "--name", "t"])
    assert rc == 0
    assert "per system" in capsys.readouterr().out          # the time budget is printed
    result = json.loads((out / "t.json").read_text())
    assert result["format"] == bench.FORMAT
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == ["plain", "fsdp2", "lazytrain-milp"]
    assert not any(r.get("error") for r in rows.values()), [r.get("error") for r in rows.values()]
    params = rows["plain"]["params"]
    tokens = 2 * 16
    for name, r in rows.items():
        assert r["params"] == params and len(r["losses"]) == 3 and len(r["step_s"]) == 3
        assert r["model_tflops"] == pytest.approx(6 * params * tokens / r["median_step_s"] / 1e12)
        assert r["tokens_per_s"] == pytest.approx(tokens / r["median_step_s"])
        assert r["host_rss_gib"] > 0.05
        # same init, same seeded tokens, same AdamW and clipping: the same losses, step after step
        assert r["losses"] == pytest.approx(rows["plain"]["losses"], abs=1e-3), name
    assert rows["plain"]["losses"][0] != pytest.approx(rows["plain"]["losses"][-1], abs=1e-4)   # it trains
    assert rows["fsdp2"]["hardware_tflops"] == pytest.approx(rows["fsdp2"]["model_tflops"] * 8 / 6)
    assert rows["plain"]["hardware_tflops"] == pytest.approx(rows["plain"]["model_tflops"])
    assert rows["lazytrain-milp"]["predicted_step_s"] > 0
    assert rows["lazytrain-milp"]["hardware_tflops"] >= rows["lazytrain-milp"]["model_tflops"] * 0.9
    md = (out / "t.md").read_text()
    assert "lazytrain bench --model" in md and "CPU cores" in md and "GiB host RAM" in md
    assert sum(line.startswith("| plain") or line.startswith("| fsdp2") or line.startswith("| lazytrain")
               for line in md.splitlines()) == 3
    assert (out / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "t.logs" / "fsdp2.log").read_text().count("step ") == 4


def test_failures_are_rows(tiny_model, tmp_path):
    # lazytrain cannot fit a 1 MiB cap (a compile error), plain does: one row each, the run goes on
    result = bench.run(_cfg(tiny_model, tmp_path, gpu_memory="1MiB", systems=["lazytrain-milp", "plain"]))
    bad, good = result["rows"]
    assert "BudgetError" in bad["error"] and bad["system"] == "lazytrain-milp"
    assert not good.get("error") and good["model_tflops"] > 0
    assert "BudgetError" in (tmp_path / "t.md").read_text()
    assert (tmp_path / "t.png").exists()
    # a system past its time is killed and reported
    row = bench.run_system("plain", _cfg(tiny_model, tmp_path), 0.5, tmp_path / "slow.log")
    assert row["error"].startswith("timed out after")
    # a worker that dies without a result (here: an unknown system) is reported with its last line
    row = bench.run_system("no-such-system", _cfg(tiny_model, tmp_path), 60, tmp_path / "dead.log")
    assert row["error"].startswith("exit code 1") and "KeyError" in row["error"]


def test_out_of_memory_is_a_result(tiny_model, tmp_path, monkeypatch):
    def run(cfg, opts):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(bench_worker, "load_bench_module", lambda name: types.SimpleNamespace(run=run))
    cfg_path, out_path = tmp_path / "cfg.json", tmp_path / "row.json"
    cfg_path.write_text(json.dumps(_cfg(tiny_model, tmp_path)))
    assert bench_worker.worker_main(["plain", str(cfg_path), str(out_path)]) == 0
    row = json.loads(out_path.read_text())
    assert row["error"].startswith("out of memory: CUDA out of memory") and row["host_rss_gib"] > 0


def test_bad_arguments(tiny_model):
    assert cli_main(["bench", "--model", tiny_model, "--systems", "plain,deepspeed"]) == 2
    assert cli_main(["bench", "--model", tiny_model, "--steps", "2"]) == 2


def test_find_max_batch_keeps_the_main_rows(tiny_model, tmp_path):
    """--find-max-batch: every system's row at --batch (3 measured steps) first, then its largest batch;
    lazytrain's is the compiler's (run for one step), a baseline's comes from one-step tries."""
    result = bench.run(_cfg(tiny_model, tmp_path, systems=["lazytrain-megatrain", "plain"], find_max_batch=True,
                            max_batch_limit=12, budget_s=300.0))
    lt, plain = result["rows"]
    for r in (lt, plain):
        assert not r.get("error") and r["batch"] == 2 and len(r["losses"]) == 3, r
    assert lt["max_batch"] == 12 and lt["max_batch_verified"] is True and lt["max_batch_step_s"] > 0
    # on the CPU nothing runs out of memory: the tries double up to the limit, each one step
    assert [t["batch"] for t in plain["max_batch_tries"]] == [4, 8, 12] and plain["max_batch"] == 12
    assert (tmp_path / "t.logs" / "plain_b4.log").read_text().count("step ") == 1
    md = (tmp_path / "t.md").read_text()
    assert "largest batch under the cap" in md and "12 (ran:" in md and "limit" in md


def test_batch_search_bisects_between_fit_and_out_of_memory(tmp_path, monkeypatch):
    """Doubling from a batch that fits, then bisection; a batch known not to fit is never tried."""
    tried = []

    def fake(system, cfg, timeout, log, batch=None, **kw):
        tried.append(batch)
        assert kw["steps"] == 1 and kw["warmup"] == 0
        return {"error": "out of memory: CUDA"} if batch > 52 else {"batch": batch}
    monkeypatch.setattr(bench, "run_system", fake)
    out = bench._max_batch_by_doubling("plain", {"batch": 8, "max_batch_limit": 4096}, 8, 60, tmp_path)
    assert tried == [16, 32, 64, 48, 56, 52, 54, 53] and out["max_batch"] == 52 and out["max_batch_too_big"] == 53
    tried.clear()
    out = bench._max_batch_by_doubling("plain", {"batch": 100}, None, 60, tmp_path)    # --batch did not fit
    assert tried[:2] == [50, 75] and out["max_batch"] == 52


def test_result_written_before_a_slow_exit_is_kept(tmp_path, monkeypatch):
    """A worker that wrote its row but overran its time while exiting (freeing a large pinned store)
    keeps its row, with a note; one that wrote nothing is a timeout."""
    import subprocess

    class Worker:
        pid = 12345

        def __init__(self, cmd, **kw):
            if write:
                from pathlib import Path
                Path(cmd[-1]).write_text(json.dumps({"system": "plain", "batch": 2, "median_step_s": 1.0}))

        def wait(self, timeout=None):
            if timeout is not None:
                raise subprocess.TimeoutExpired("worker", timeout)
            return -9
    monkeypatch.setattr(bench.subprocess, "Popen", Worker)
    monkeypatch.setattr(bench.os, "killpg", lambda pid, sig: None)
    write = True
    row = bench.run_system("plain", _cfg("m", tmp_path), 5, tmp_path / "w.log")
    assert row["median_step_s"] == 1.0 and row["note"].startswith("killed while exiting")
    write = False
    row = bench.run_system("plain", _cfg("m", tmp_path), 5, tmp_path / "w.log")
    assert row["error"] == "timed out after 5 s"


def test_deepspeed_rows_say_what_is_missing(tiny_model, tmp_path, monkeypatch):
    """DeepSpeed is no dependency and needs a GPU: its rows say which is missing, and the run goes on."""
    cfg_path, out_path = tmp_path / "cfg.json", tmp_path / "row.json"
    cfg_path.write_text(json.dumps(_cfg(tiny_model, tmp_path)))
    assert bench_worker.worker_main(["deepspeed-zero3-offload", str(cfg_path), str(out_path)]) == 0
    assert json.loads(out_path.read_text())["error"].startswith("RuntimeError: deepspeed needs CUDA")
    ds = bench_worker.load_bench_module("systems/deepspeed_offload")
    monkeypatch.setattr(ds.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ds.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="deepspeed is not installed"):
        ds.require_deepspeed(_cfg(tiny_model, tmp_path, device="cuda"))
    # the configs: ZeRO-3 offloads parameters and optimizer, ZeRO-2 the optimizer; bf16, clipping, one micro-batch
    z3, z2 = (ds.ds_config(_cfg(tiny_model, tmp_path, batch=8), s) for s in (3, 2))
    assert z3["zero_optimization"]["offload_param"]["device"] == "cpu" == z2["zero_optimization"]["offload_optimizer"][
        "device"] and "offload_param" not in z2["zero_optimization"]
    assert z3["bf16"]["enabled"] and z3["gradient_clipping"] == 1.0 and z3["train_micro_batch_size_per_gpu"] == 8
    assert bench_worker.SYSTEMS["deepspeed-zero2-offload"] == ("deepspeed_offload", {"stage": 2})
