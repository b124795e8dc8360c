"""GGUF input: a Llama written as llama.cpp lays it out loads dequantized with the same logits, and
fine-tunes into a Hugging Face folder (no quantization left in its config)."""

from __future__ import annotations

import json

import pytest
import torch

from lazytrain.app.cli import main

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
from ft_fixtures import chat, tiny_folder, write_gguf, write_jsonl  # noqa: E402


def test_a_gguf_loads_with_the_same_logits_and_fine_tunes_into_a_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    from lazytrain.hf.model_loading import load_gguf
    folder = tiny_folder(tmp_path / "hf")
    src = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = write_gguf(src, tmp_path / "tiny.gguf")
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        assert torch.equal(load_gguf(path).eval()(input_ids=ids).logits, src(input_ids=ids).logits)
    data = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", f"a{i}") for i in range(8)])
    assert main(["train", "--model", str(path), "--tokenizer", str(folder), "--data", str(data), "--steps", "1",
                 "--batch", "2", "--no-eval", "--no-progress", "--device", "cpu", "--threads", "1", "--policy",
                 "keep-all", "--output", str(tmp_path / "run")]) == 0
    cfg = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert cfg["dtype"] == "float32"           # dequantized to the training dtype
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
