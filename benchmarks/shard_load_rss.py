"""Peak host memory (RSS) per rank at start-up: every rank building the whole model, against each rank
reading only its shard, for every model source.

    python benchmarks/shard_load_rss.py [--layers 8] [--hidden 1024] [--out benchmarks/results/shard_load_rss.md]

Writes a random-init Llama-shaped Hugging Face folder (bf16 safetensors, untied head) and the same weights as an
F32 GGUF file into a temporary folder, then for 1 and 2 gloo processes on the CPU and each way of loading --
``whole`` / ``shards``: the folder (``model_loading.shard_loadable``); ``gguf``: the GGUF file, dequantized whole
on every rank (``finetune.run.shard_weights`` says why); ``random-whole`` / ``random-shards``: the folder's
config with random weights (``random_init``); ``resume-whole`` / ``resume-shards``: the checkpoint the
``shards`` run saved, into a model built on the CPU or on the meta device (``weights.CheckpointFilled``) --
every rank compiles the same plan (``megatrain``, deterministic), builds its ``Trainer`` with the Hybrid 8-bit
optimizer and trains one step.  Reported per rank: ``VmHWM`` (peak RSS) after importing torch and
transformers (the floor every process pays), after the trainer is built (start-up) and after the step; the ranks
of one run are spawned together, one run after the other.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 1 << 30


def _write_folder(folder: Path, layers: int, hidden: int) -> int:
    import torch

    from lazytrain.frontend.presets import build_from_config
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
           "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
           "num_key_value_heads": hidden // 64, "vocab_size": 32000, "max_position_embeddings": 256,
           "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = build_from_config(cfg, device="cpu", dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _write_gguf(folder: Path) -> None:
    """The folder's weights as an F32 GGUF file beside it, laid out as llama.cpp lays them (the tests' writer)."""
    import torch

    from lazytrain.hf.model_loading import from_pretrained
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from ft_fixtures import write_gguf
    write_gguf(from_pretrained(folder).to(torch.float32), folder.parent / "model.gguf")


MODES = ("whole", "shards", "gguf", "random-whole", "random-shards", "resume-whole", "resume-shards")


def _rank(rank: int, world: int, port: int, folder: str, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    import torch
    import transformers  # noqa: F401 - its import is part of the floor

    import lazytrain
    from lazytrain.frontend.presets import build_model
    from lazytrain.frontend.random_init import random_init, random_model
    from lazytrain.hf.model_loading import from_pretrained, load_gguf, shard_loadable
    from lazytrain.measure.bench_worker import proc_status_bytes
    from lazytrain.runtime.optim import Hybrid8bitAdamW
    from lazytrain.runtime.trainer import Trainer
    from lazytrain.runtime.weights import CheckpointFilled
    torch.set_num_threads(1)
    floor = proc_status_bytes("VmHWM")
    torch.manual_seed(0)
    weights, config = None, str(Path(folder, "config.json"))
    if mode == "whole":
        model = from_pretrained(Path(folder))
    elif mode == "shards":
        model, weights = shard_loadable(Path(folder))
    elif mode == "gguf":
        model = load_gguf(Path(folder).parent / "model.gguf")
    elif mode == "random-whole":
        model = random_model(config, torch.float32)
    elif mode == "random-shards":
        model, weights = random_init(config, torch.float32)
    else:
        model = build_model(config, device="cpu" if mode == "resume-whole" else "meta", dtype=torch.float32)
        weights = CheckpointFilled() if mode == "resume-shards" else None
    plan = lazytrain.compile(model, batch_size=2 // world, seq_len=64, micro_batch=1, hardware="cpu",
                             policy="megatrain", param_dtype="float32", optimizer="hybrid8bit", world_size=world)
    opt = Hybrid8bitAdamW(lr=1e-4, num_threads=1)
    if mode.startswith("resume"):
        tr = Trainer.load_checkpoint(Path(out, f"ck_{world}"), model, optimizer=opt, device="cpu", verbose=False,
                                     weights=weights)
    else:
        tr = Trainer(model, plan, optimizer=opt, device="cpu", verbose=False, weights=weights)
    start = proc_status_bytes("VmHWM")
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1))
    loss = tr.step((ids, ids)).loss
    step = proc_status_bytes("VmHWM")
    if mode == "shards":
        tr.save_checkpoint(Path(out, f"ck_{world}"))
    tr.close()
    Path(out, f"{mode}_{world}_{rank}.json").write_text(json.dumps({"floor": floor, "start": start, "step": step,
                                                                   "loss": loss}))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out", default=None, help="markdown table to write (default: print only)")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "model")
        n = _write_folder(folder, a.layers, a.hidden)
        _write_gguf(folder)
        rows = [f"Llama shape, {a.layers} layers, hidden {a.hidden}: {n / 1e6:.1f} M parameters ({n * 4 / GiB:.2f} GiB "
                "in fp32, the dtype the CPU trains in); bf16 safetensors folder. Peak RSS per rank (GiB):", "",
                "| load | processes | rank | after imports | start-up (trainer built) | after one step | loss |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for mode in MODES:
            for world in (1, 2):
                port = _port()
                procs = [ctx.Process(target=_rank, args=(r, world, port, str(folder), mode, tmp)) for r in range(world)]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                    if p.exitcode:
                        raise SystemExit(f"{mode} x{world}: a rank exited with {p.exitcode}")
                for r in range(world):
                    d = json.loads(Path(tmp, f"{mode}_{world}_{r}.json").read_text())
                    rows.append(f"| {mode} | {world} | {r} | {d['floor'] / GiB:.2f} | {d['start'] / GiB:.2f} | "
                                f"{d['step'] / GiB:.2f} | {d['loss']:.4f} |")
    text = "\n".join(rows) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(f"# Start-up host memory per rank: whole model against shard loading\n\n"
                               f"`python benchmarks/shard_load_rss.py --layers {a.layers} --hidden {a.hidden}` "
                               f"(2-core CPU machine, gloo).\n\n{text}")


if __name__ == "__main__":
    main()
