"""Export to a Hugging Face folder: transformers loads it and its logits equal the trained weights',
from a trainer and from a checkpoint (``lazytrain export``); tied weights, dtypes and the architecture
are kept, shards are written one by one, and a folder that is not a model is never replaced."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lazytrain
from lazytrain.app.cli import main
from lazytrain.hf.export import ExportError, Weight, hf_config, trainer_weights, write_folder

pytest.importorskip("transformers")
from ft_fixtures import tiny_folder, tiny_tokenizer  # noqa: E402
from timeouts import within  # noqa: E402


def _trained(folder, steps: int = 2):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    plan = lazytrain.compile(model, batch_size=2, seq_len=8, hardware="cpu", gpu_memory="2GiB", param_dtype="float32",
                             optimizer="adamw", policy="megatrain")
    tr = lazytrain.Trainer(model, plan, optimizer=lazytrain.optim.TorchAdamW(lr=1e-2), device="cpu", verbose=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 100, (2, 8), generator=g)
        tr.step({"input_ids": ids, "labels": ids})
    return model, tr


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type, tied", [("llama", True), ("qwen2", False)])
def test_a_trained_model_round_trips_through_transformers(tmp_path, model_type, tied):
    from transformers import AutoModelForCausalLM
    src = tiny_folder(tmp_path / "src", model_type=model_type, tied=tied)
    model, tr = _trained(src)
    out = write_folder(tmp_path / "out", trainer_weights(tr), config=hf_config(model.config, type(model).__name__),
                       dtype=torch.float32, tokenizer=tiny_tokenizer(), max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)
    tr.sync_to_model()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(loaded) is type(model) and loaded.config.tie_word_embeddings == tied
    ids = torch.randint(0, 100, (2, 12))
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))      # fp32 out: bit for bit
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert not list(tmp_path.glob("out.tmp-*"))
    tr.close()


def test_export_from_a_checkpoint_keeps_the_folders_dtype(tmp_path):
    from transformers import AutoModelForCausalLM
    src = tiny_folder(tmp_path / "src", dtype=torch.bfloat16)
    model, tr = _trained(src)
    tr.save_checkpoint(tmp_path / "ckpt")
    tr.sync_to_model()
    tr.close()
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out"), "--config", str(src),
                 "--tokenizer", str(src)]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    ids = torch.randint(0, 100, (2, 12))
    torch.testing.assert_close(_logits(loaded.float(), ids), _logits(model.to(torch.bfloat16).float(), ids))


def test_what_is_not_exported(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    w = [Weight("a", (2,), lambda: torch.zeros(2))]
    with pytest.raises(ExportError, match="not a model folder"):
        write_folder(tmp_path / "notes", w, config={}, dtype=torch.float32)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    assert main(["export", str(tmp_path / "notes"), "-o", str(tmp_path / "x")]) == 2
    assert "neither a checkpoint folder" in capsys.readouterr().err
    src = tiny_folder(tmp_path / "src")
    _, tr = _trained(src, steps=1)
    tr.save_checkpoint(tmp_path / "ckpt")
    tr.close()
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "y")]) == 2
    assert "pass --config" in capsys.readouterr().err
    other = tiny_folder(tmp_path / "other", layers=3, tokenizer=False)
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "y"), "--config", str(other)]) == 2
    assert "lack model.layers.2" in capsys.readouterr().err


def test_a_sharded_checkpoints_tensors_are_joined_from_their_pieces(tmp_path):
    """Export reads a checkpoint of several ranks tensor by tensor: each tensor's pieces (here cut at
    uneven places over two rank files, as a rank's shard cuts a large tensor) joined in element order;
    a gap between pieces is refused in one line."""
    from safetensors.torch import save_file

    from lazytrain.frontend.presets import build_from_config
    from lazytrain.hf.export import _sharded_weights
    torch.manual_seed(0)
    model = build_from_config({"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 32, "n_layer": 1, "n_head": 2,
                               "d_ff": 48, "max_seq": 16, "tie_weights": False}, device="cpu", dtype=torch.float32)
    plan = lazytrain.compile(model, batch_size=2, seq_len=16, hardware="cpu", policy="keep-all", param_dtype="float32",
                             optimizer="adamw", world_size=2)
    named = dict(model.named_parameters())
    files, pieces = ({"a.safetensors": {}, "b.safetensors": {}} for _ in range(2))
    for i, (name, p) in enumerate(named.items()):
        cut = (i * 7) % p.numel()                   # 0: all in b; else a holds [0, cut)
        flat = p.detach().reshape(-1)
        for f, (lo, hi) in (("a.safetensors", (0, cut)), ("b.safetensors", (cut, p.numel()))):
            if lo < hi:
                files[f][f"param.{name}"] = flat[lo:hi].clone()
                pieces[f][name] = [lo, hi]
    for f, tensors in files.items():
        save_file(tensors, str(tmp_path / f))
    meta = {"plan": plan.to_json(), "world": {"size": 2, "pieces": pieces}}
    got = {w.name: w.read() for w in _sharded_weights(tmp_path, meta)}
    assert got.keys() == named.keys()
    for name, p in named.items():
        assert torch.equal(got[name], p.detach()), name
    del pieces["a.safetensors"]["layers.0.fc.weight"]
    with pytest.raises(ExportError, match=r"saved pieces of layers.0.fc.weight do not cover elements \[0, 1536\)"):
        _sharded_weights(tmp_path, meta)


@pytest.mark.parametrize("damage", ["flipped bit", "truncated", "header", "fifo"])
def test_a_damaged_checkpoint_is_not_exported(tmp_path, capsys, damage):
    """Export reads a checkpoint through the checks a resume makes (every file's size and SHA-256, its
    tensors against the manifest's): a flipped bit in a weight, a truncated block file or a header edited
    with the manifest's checksum updated is one line, and nothing is written."""
    src = tiny_folder(tmp_path / "src", tokenizer=False)
    _, tr = _trained(src, steps=1)
    tr.save_checkpoint(tmp_path / "ckpt")
    tr.close()
    block = sorted((tmp_path / "ckpt").glob("block_*.safetensors"))[0]
    data = bytearray(block.read_bytes())
    if damage == "flipped bit":
        data[-3] ^= 0x40                # the high exponent bit of the last fp32 weight
        block.write_bytes(bytes(data))
    elif damage == "truncated":
        block.write_bytes(bytes(data[:len(data) // 2]))
    elif damage == "fifo":
        block.unlink()
        os.mkfifo(block)
    else:                               # a tensor renamed, the file's size and sha256 recorded anew
        import hashlib
        header = data[8:8 + int.from_bytes(data[:8], "little")]
        name = next(k for k in json.loads(header) if k.startswith("param."))
        data = data.replace(name.encode(), name[:-1].encode() + b"X", 1)
        block.write_bytes(bytes(data))
        meta_path = tmp_path / "ckpt" / "checkpoint.json"
        meta = json.loads(meta_path.read_text())
        meta["files"][block.name]["sha256"] = hashlib.sha256(data).hexdigest()
        meta_path.write_text(json.dumps(meta))
    with within(60):
        assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out"), "--config", str(src)]) == 2
    err = capsys.readouterr().err.split("lazytrain export: error: ")[-1]
    assert block.name in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert {"flipped bit": "sha256", "truncated": "truncated", "header": "not the ones",
            "fifo": "not a regular file"}[damage] in err
    assert not (tmp_path / "out").exists()


def test_a_runs_config_comes_from_the_metrics_committed_with_its_checkpoint(tmp_path, capsys):
    """``lazytrain export RUN`` takes the model's config from the metrics committed with the checkpoint (their
    SHA-256 checked), not from the run folder's copy: a FIFO there is not read, an edited commit is refused."""
    src = tiny_folder(tmp_path / "src", tokenizer=False)
    run = tmp_path / "run"
    assert main(["train", "--model", str(src), "--batch", "4", "--steps", "1", "--policy", "keep-all", "--no-progress",
                 "--device", "cpu", "--threads", "1", "--no-eval", "--output", str(run)]) == 0
    (run / "metrics.json").unlink()
    os.mkfifo(run / "metrics.json")
    with within(60):
        assert main(["export", str(run), "-o", str(tmp_path / "out")]) == 0
    committed = run / "checkpoint" / "metrics.json"
    committed.write_text(committed.read_text().replace('"hidden_size": 32', '"hidden_size": 64'))
    capsys.readouterr()
    assert main(["export", str(run), "-o", str(tmp_path / "out2")]) == 2
    assert "metrics.json: sha256" in capsys.readouterr().err
