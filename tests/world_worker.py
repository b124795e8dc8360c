"""What each rank of the multi-process tests runs (a module of its own so spawned processes import
it): train a tiny untied GPT on a global batch and write the losses and final parameters as JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

import lazytrain
from lazytrain.frontend.presets import build_from_config
from lazytrain.runtime.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

#: 8-bit moments need tensors of at least 4096 elements: d_model 64 x d_ff 128 layers have them
CFG = {"model_type": "lazytrain-gpt", "vocab": 67, "d_model": 64, "n_layer": 2, "n_head": 2, "d_ff": 128,
       "max_seq": 16, "tie_weights": False}
B, SEQ, STEPS = 4, 16, 3
#: (name, policy, optimizer) of every case each spawn trains, one after the other
CASES = (("adamw", "megatrain", "adamw"), ("hybrid8bit", "keep-all", "hybrid8bit"))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config(CFG, device="cpu", dtype=torch.float32)


def batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(steps):
        ids = torch.randint(0, CFG["vocab"], (B, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : 3 + s] = -100          # ranks count different numbers of tokens
        out.append((ids, labels))
    return out


def optimizer(kind: str):
    if kind == "adamw":
        return TorchAdamW(lr=1e-3, eps=1e-6, max_grad_norm=1.0)
    return Hybrid8bitAdamW(lr=1e-3, eps=1e-6, max_grad_norm=1.0, num_threads=1)


def compile_plans(folder: Path) -> dict:
    """Every case's plan for one process and for two ranks, compiled once (by the test process) into
    ``folder``: what the ranks load."""
    m = model()
    paths = {}
    for name, policy, opt in CASES:
        for world in (1, 2):
            plan = lazytrain.compile(m, batch_size=B // world, seq_len=SEQ, micro_batch=1, hardware="cpu",
                                     policy=policy, param_dtype="float32", optimizer=opt, world_size=world)
            paths[(name, world)] = str(folder / f"{name}_{world}.json")
            plan.save(paths[(name, world)])
    return paths


def trainer(plan_path: str, opt: str) -> Trainer:
    from lazytrain.ir import Plan
    return Trainer(model(), Plan.load(plan_path), optimizer=optimizer(opt), device="cpu", verbose=False)


def train(world: int, folder: str) -> tuple[dict, Trainer]:
    """Every case: losses and final parameters (the same on every rank); and the last case's trainer."""
    out = {}
    for name, _policy, opt in CASES:
        tr = trainer(str(Path(folder) / f"{name}_{world}.json"), opt)
        losses = [tr.step(b).loss for b in batches()]
        out[name] = {"losses": losses, "params": {k: v.reshape(-1).tolist() for k, v in tr.state_dict().items()}}
    return out, tr


def join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LAZYTRAIN_COLLECTIVE_TIMEOUT="30")
    torch.set_num_threads(1)


def equivalence_rank(rank: int, world: int, port: int, folder: str) -> None:
    """Train every case; then the last rank dies and rank 0 writes the error its next step raised."""
    join(rank, world, port)
    res, tr = train(world, folder)
    if rank == 0:
        (Path(folder) / "out.json").write_text(json.dumps(res))
    if rank == world - 1:
        os._exit(3)
    try:
        tr.step(batches(1)[0])
        (Path(folder) / "err.txt").write_text("no error")
    except Exception as e:  # noqa: BLE001 - the test reads the message
        (Path(folder) / "err.txt").write_text(str(e))
