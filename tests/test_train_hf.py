"""``lazytrain train --model DIR`` with local Hugging Face folders: tiny models of several architectures
train, evaluate and resume (also once the folder is gone); broken folders are one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lazytrain.app.cli import main

pytest.importorskip("transformers")

ARGS = ["--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
        "--threads", "1", "--time-limit-min", "2"]
SHAPES = {      # tiny, with the vocabulary (128) larger than the task tokenizer's (98)
    "llama": dict(num_key_value_heads=2),
    "gemma2": dict(num_key_value_heads=2, head_dim=8),     # softcapped attention: no SDPA, eager
    "gpt_neox": dict(),
}


def write_folder(folder: Path, model_type: str = "llama", *, weights: bool = True, vocab: int = 128) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                               **SHAPES.get(model_type, {}))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    if not weights:
        for f in folder.glob("*.safetensors"):
            f.unlink()
    return folder


def _train(out: Path, *extra) -> dict:
    assert main(["train", *ARGS, "--output", str(out), *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_fine_tunes_a_local_folder_and_resumes_without_it(model_type, tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "hf", model_type)
    m = _train(tmp_path / "run", "--model", str(folder), "--steps", "2")
    assert m["steps_done"] == 2 and 0.0 <= m["exact_match"] <= 1.0
    assert m["model"]["pretrained"] == str(folder.resolve()) and m["model"]["config"]["model_type"] == model_type
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in m["loss_curve"])
    assert (tmp_path / "run" / "checkpoint" / "checkpoint.json").is_file()
    # the checkpoint holds every weight and metrics.json the config: neither the folder nor the cwd matter
    shutil.rmtree(folder)
    monkeypatch.chdir(tmp_path / "run")
    r = _train(tmp_path / "resumed", "--resume", str(tmp_path / "run"), "--steps", "3")
    assert r["steps_done"] == 3 and r["loss_curve"][:2] == m["loss_curve"]


def test_config_only_folder_is_a_random_init_that_resumes_from_elsewhere(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "cfg", weights=False)
    monkeypatch.chdir(tmp_path)
    m = _train(tmp_path / "run", "--model", "cfg", "--steps", "2")
    assert m["model"] == {"config": json.loads((folder / "config.json").read_text())}
    monkeypatch.chdir(tmp_path / "run")
    assert _train(tmp_path / "resumed", "--resume", str(tmp_path / "run"), "--steps", "3")["steps_done"] == 3


def _broken(tmp_path: Path, kind: str) -> Path:
    good = write_folder(tmp_path / "good")
    bad = tmp_path / kind
    bad.mkdir()
    weights = good / "model.safetensors"
    config = json.loads((good / "config.json").read_text())
    if kind == "no-config":
        shutil.copy(weights, bad)
    elif kind == "bad-json":
        shutil.copy(weights, bad)
        (bad / "config.json").write_text('{"model_type": "llama", "hidden')
    elif kind == "not-an-object":
        shutil.copy(weights, bad)
        (bad / "config.json").write_text("[1, 2]")
    elif kind == "bad-heads":
        shutil.copy(weights, bad)
        (bad / "config.json").write_text(json.dumps(config | {"num_attention_heads": 3}))
    elif kind == "corrupt-weights":
        shutil.copy(good / "config.json", bad)
        (bad / "model.safetensors").write_text("not safetensors")
    elif kind == "weights-of-another-shape":
        shutil.copy(weights, bad)
        (bad / "config.json").write_text(json.dumps(config | {"vocab_size": 256}))
    elif kind == "small-vocab":
        shutil.rmtree(bad)
        write_folder(bad, vocab=64)
    return bad


@pytest.mark.parametrize("kind, message", [
    ("no-config", "has no config.json"),
    ("bad-json", "not valid JSON"),
    ("not-an-object", "must be a JSON object"),
    ("bad-heads", "num_attention_heads 3"),
    ("corrupt-weights", "model.safetensors: not a readable safetensors file"),
    ("weights-of-another-shape", "do not match config.json"),
    ("small-vocab", "vocabulary of 64"),
])
def test_broken_folders_are_one_line_errors(kind, message, tmp_path, capsys):
    bad = _broken(tmp_path, kind)
    capsys.readouterr()
    assert main(["train", *ARGS, "--model", str(bad), "--steps", "1", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lazytrain train: error:") and message in last, err


def test_a_larger_vocabulary_never_decodes_outside_the_tokenizer():
    """A model whose vocabulary is larger than the tokenizer's: eval restricts its greedy choice to the
    tokenizer's ids, and ``exact_match`` counts an undecodable answer as a miss instead of raising."""
    from lazytrain.app.train import logits_fn
    from lazytrain.tasks import eval_examples, exact_match

    def prefers_150(ids):           # id 150 first, then eos: outside a 98-id tokenizer
        logits = torch.zeros(*ids.shape, 200)
        logits[..., 150] = 1.0
        logits[..., 2] += 2.0 * (ids == 150)
        return logits
    examples = eval_examples(3, "tiny")
    assert exact_match(prefers_150, examples, 3) == 0.0

    class Model(torch.nn.Module):
        def forward(self, input_ids):
            return prefers_150(input_ids)
    fn = logits_fn(Model(), torch.device("cpu"), 98)
    assert fn(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 98)
    assert exact_match(fn, examples, 3) == 0.0
