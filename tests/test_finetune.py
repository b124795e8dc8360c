"""``lazytrain train --data``: a tiny pretrained folder with its own tokenizer and chat template is
fine-tuned on a JSONL file end to end (eval before and after, export, resume, ``lazytrain export`` of the
run), and the mistakes a user can make are one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lazytrain.app.cli import main

pytest.importorskip("transformers")
from ft_fixtures import chat, tiny_folder, write_jsonl  # noqa: E402

ARGS = ["--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
        "--threads", "1", "--time-limit-min", "2"]


def _data(tmp_path, n: int = 40):
    return write_jsonl(tmp_path / "train.jsonl", [chat(f"{'so ' * (i % 9)}{i}+{i % 7}=?", f"{i}+{i % 7}={i + i % 7}")
                                                  for i in range(n)])


def test_fine_tune_pack_evaluate_export_and_resume(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    folder = tiny_folder(tmp_path / "hf")
    data = _data(tmp_path)
    out = tmp_path / "run"
    assert main(["train", *ARGS, "--model", str(folder), "--data", str(data), "--pack", "--seq", "160", "--steps", "3",
                 "--output", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps_done"] == 3 and m["plan"]["packed"] and m["data"]["held_out"]
    assert m["data"]["eval"] == 2 and m["data"]["train"] == 38         # 5% held out, by content
    assert [e["step"] for e in m["eval_curve"]] == [0, 3] and m["exact_match_before"] is not None
    assert 0 <= m["data"]["padding"]["packed"] < m["data"]["padding"]["unpacked"]
    im_end = 3
    assert im_end in m["data"]["stop_ids"] and all(len(e["samples"]) == 2 for e in m["eval_curve"])
    gen = json.loads((out / "model" / "generation_config.json").read_text())
    assert im_end in gen["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.config.model_type == "llama" and (out / "model" / "tokenizer.json").is_file()
    # the run needs neither the folder nor the cwd to resume or export
    shutil.rmtree(folder)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", str(out), "--output", str(out), "--steps", "4", "--no-progress", "--device",
                 "cpu", "--threads", "1"]) == 0
    r = json.loads((out / "metrics.json").read_text())
    assert r["steps_done"] == 4 and r["loss_curve"][:3] == m["loss_curve"]
    assert main(["export", str(out), "-o", str(tmp_path / "again")]) == 0
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    b = AutoModelForCausalLM.from_pretrained(out / "model")
    ids = torch.randint(0, 100, (1, 10))
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_user_mistakes_are_one_line_errors(tmp_path, capsys):
    folder = tiny_folder(tmp_path / "hf")
    bare = tiny_folder(tmp_path / "bare", tokenizer=False)
    data = _data(tmp_path, 6)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(chat("a", "b")) + "\n" + json.dumps({"question": "a", "answer": "b"}) + "\n")
    cases = [
        (["--data", str(data)], "--data needs a model with a tokenizer"),
        (["--model", str(folder), "--data", str(bad)], "bad.jsonl:2: no known format"),
        (["--model", str(bare), "--data", str(data)], "has no tokenizer: pass --tokenizer"),
        (["--model", str(folder), "--data", str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
        (["--model", str(folder), "--data", str(data), "--seq", "4096"], "longer than the model's 512 positions"),
        (["--model", str(tmp_path / "nothing"), "--data", str(data)], "no such file or folder"),
    ]
    capsys.readouterr()
    for extra, words in cases:
        assert main(["train", *ARGS, "--output", str(tmp_path / "o"), *extra]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]       # after transformers' progress bars, if any
        assert last.startswith("lazytrain train: error: ") and words in last, last
    # another tokenizer for a folder without one is fine
    assert main(["train", *ARGS, "--model", str(bare), "--tokenizer", str(folder), "--data", str(data), "--steps",
                 "1", "--no-export", "--output", str(tmp_path / "ok")]) == 0
