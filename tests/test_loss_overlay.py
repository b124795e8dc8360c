"""benchmarks/loss_overlay.py on the CPU with a small task GPT: lazytrain's loss curve equals plain
PyTorch's (same init, data, AdamW, clipping and schedule, fp32 on both sides), and the JSON and PNG
are written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from lazytrain.app.config import TrainConfig
from lazytrain.tasks import get_difficulty

pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "loss_overlay.py"
SMALL = '{"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64}'


def _load():
    spec = importlib.util.spec_from_file_location("loss_overlay", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlay")
    # warm-up 2 and lr 1e-2: the rate changes every step, so an update applied with the wrong step's rate shows
    res = _load().main(["--model", "task", "--model-override", SMALL, "--device", "cpu", "--threads", "1",
                        "--steps", "6", "--batch", "4", "--lr", "1e-2", "--warmup", "2", "--policy", "keep-all",
                        "--out", str(out)])
    return out, res


def test_curves_overlay(overlay):
    _, res = overlay
    lt, pt = res["lazytrain"]["curve"], res["plain"]["curve"]
    assert [x["step"] for x in lt] == [x["step"] for x in pt] == [1, 2, 3, 4, 5, 6]
    assert lt[0]["loss"] == pytest.approx(pt[0]["loss"], abs=1e-4)
    # later steps too: the schedule reaches each gradient at its own step's rate despite lagged updates
    assert [x["loss"] for x in lt] == pytest.approx([x["loss"] for x in pt], abs=1e-4)
    assert lt[-1]["loss"] < lt[0]["loss"] - 0.1          # it trains, so equal curves are not two flat lines
    assert res["comparison"]["steps_compared"] == 6 and res["comparison"]["max_abs_diff"] < 1e-4
    assert res["plain"]["error"] is None and res["lazytrain"]["stop_reason"] == "steps"


def test_json_and_png_written(overlay):
    out, res = overlay
    data = json.loads((out / "loss_overlay.json").read_text())
    assert data["format"] == "lazytrain.loss-overlay/1" and data["model"] == "task" and data["params"] > 0
    assert data["settings"]["batch"] == 4
    assert data["settings"]["seq"] == get_difficulty(TrainConfig().difficulty).seq_len
    assert data["lazytrain"]["plan"]["policy"] == "keep-all" and data["lazytrain"]["param_dtype"] == "float32"
    assert "--steps 6" in data["command"] and data["comparison"] == res["comparison"]
    assert (out / "loss_overlay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_out_of_memory_is_a_row_not_a_crash(tmp_path, monkeypatch, capsys):
    mod = _load()
    real, calls = mod.shifted_cross_entropy, []

    def ce(logits, labels):            # only plain PyTorch calls it: the third step runs out of memory
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(logits, labels)

    monkeypatch.setattr(mod, "shifted_cross_entropy", ce)
    res = mod.main(["--model", "task", "--model-override", SMALL, "--device", "cpu", "--threads", "1", "--steps", "4",
                    "--batch", "2", "--policy", "keep-all", "--out", str(tmp_path)])
    assert len(res["lazytrain"]["curve"]) == 4 and len(res["plain"]["curve"]) == 2
    assert res["plain"]["stop_reason"] == "out of memory" and "Tried to allocate" in res["plain"]["error"]
    assert res["comparison"]["steps_compared"] == 2
    data = json.loads((tmp_path / "loss_overlay.json").read_text())
    assert len(data["lazytrain"]["curve"]) == 4 and (tmp_path / "loss_overlay.png").is_file()
    assert "OutOfMemoryError" in capsys.readouterr().out
