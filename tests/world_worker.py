"""What each rank of the multi-process tests runs (a module of its own so spawned processes import
it): train a tiny GPT (tied or not) on a global batch and write the losses and final parameters as JSON."""

from __future__ import annotations

import json
import os
import time
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
#: (name, policy, optimizer, tied embedding, resident) of every case each spawn trains, one after the other
CASES = (("adamw", "megatrain", "adamw", False, "none"), ("exact8", "keep-all", "hybrid8bit_unclipped", False, "none"),
         ("hybrid8bit", "keep-all", "hybrid8bit", False, "none"))
#: the case whose arithmetic is one process's at 2 ranks (``compile_plans``), so its results are bit for bit
EXACT = "exact8"


def model(tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config({**CFG, "tie_weights": tied}, device="cpu", dtype=torch.float32)


def batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(steps):
        ids = torch.randint(0, CFG["vocab"], (B, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : 3 + s] = -100          # ranks count different numbers of tokens
        out.append((ids, labels))
    return out


#: the optimizers' learning rate
LR = 1e-3


def optimizer(kind: str):
    if kind == "adamw":
        return TorchAdamW(lr=LR, eps=1e-6, max_grad_norm=1.0)
    return Hybrid8bitAdamW(lr=LR, eps=1e-6, max_grad_norm=None if kind.endswith("unclipped") else 1.0, num_threads=1)


def eight_bit(name: str) -> bool:
    """Does case ``name`` train with the 8-bit optimizer?"""
    return any(c[0] == name and c[2].startswith("hybrid8bit") for c in (*CASES, *CASES4))


#: the 4-rank test's cases (``world4_rank``): the other two policies, each on the tied GPT (its embedding
#: shared by the first and the last block), the MILP's with the first block resident (and so, its tie group,
#: the last: their shards updated on the "GPU"); activations on the host and NVMe; and the 8-bit case,
#: checkpointed at 4 ranks and resumed at 2 and 1
CASES4 = (("tied", "recompute-all", "adamw", True, "none"), ("tied_resident", "milp", "adamw", True, 1),
          ("host_nvme", "host-nvme", "adamw", False, "none"), CASES[-1])


def compile_plans(folder: Path, worlds=(1, 2), cases=CASES) -> None:
    """Every case's plan for each world size, compiled once (by the test process) into ``folder``: what the
    ranks load (``{name}_{world}.json``).  ``EXACT`` runs micro-batches of 2 rows: one process's 2 micro-batches
    are then the 2 ranks' rows, and the gradient it accumulates (g0 + g1) is the one the ranks' reduce-scatter
    sums; unclipped, as the global norm sums per-shard norms, another order than one process's per-block ones."""
    for name, policy, opt, tied, resident in cases:
        m = model(tied)
        for world in worlds:
            if policy == "host-nvme":
                plan = _host_nvme(m, world, folder / "nvme")
            else:
                plan = lazytrain.compile(m, batch_size=B // world, seq_len=SEQ, micro_batch=2 if name == EXACT else 1,
                                         hardware="cpu",
                                         policy=policy, param_dtype="float32", optimizer=opt.removesuffix("_unclipped"),
                                         world_size=world,
                                         resident=resident, time_limit=5)
            plan.save(folder / f"{name}_{world}.json")


def _host_nvme(m: torch.nn.Module, world: int, nvme: Path):
    """Boundaries and saved activations on the host and on NVMe (the 4 blocks: embedding, 2 layers, head)."""
    from lazytrain.compiler.api import Compiler
    from lazytrain.compiler.profiles import get_profile
    from lazytrain.frontend.trace import trace
    from lazytrain.ir import Decisions, GiB, Place, Saved
    dec = Decisions(policy="host-nvme", micro_batch=1, n_micro=B // world,
                    boundary=(Place.HOST, Place.NVME, Place.NONE, Place.GPU),
                    saved=(Saved.HOST, Saved.RECOMPUTE, Saved.NVME, Saved.KEEP))
    budgets = {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB, "nvme_bytes": GiB, "nvme_dir": str(nvme)}
    comp = Compiler(trace(m, seq_len=SEQ, dtype="float32"), get_profile("cpu"), budgets, param_dtype="float32",
                    optimizer="adamw", clip=True, world_size=world)
    return comp.build(dec, B // world)


def trainer(plan_path: str, opt: str, tied: bool = False) -> Trainer:
    from lazytrain.ir import Plan
    return Trainer(model(tied), Plan.load(plan_path), optimizer=optimizer(opt), device="cpu", verbose=False)


#: the last case is checkpointed after this many steps (``train``'s ``ckpt``)
SAVED_AT = 2


def train(world: int, folder: str, ckpt: Path | None = None, cases=CASES) -> tuple[dict, Trainer]:
    """Every case: losses and final parameters (the same on every rank); and the last case's trainer,
    checkpointed to ``ckpt`` after ``SAVED_AT`` steps."""
    out = {}
    for name, _policy, opt, tied, _resident in cases:
        tr = trainer(str(Path(folder) / f"{name}_{world}.json"), opt, tied)
        losses = []
        for b in batches():
            losses.append(tr.step(b).loss)
            if ckpt is not None and name == cases[-1][0] and tr.steps == SAVED_AT:
                tr.save_checkpoint(ckpt)
        out[name] = result(tr, losses)
    return out, tr


def result(tr: Trainer, losses: list[float]) -> dict:
    return {"losses": losses, "params": {k: v.reshape(-1).tolist() for k, v in tr.state_dict().items()}}


def resume(ckpt: Path, plan_path: str) -> dict:
    """The last case resumed from ``ckpt`` with the plan at ``plan_path`` (another world size) and
    trained to the end: its losses after the checkpoint and final parameters."""
    from lazytrain.ir import Plan
    name, _policy, opt, _tied, _resident = CASES[-1]
    tr = Trainer.load_checkpoint(ckpt, model(), optimizer=optimizer(opt), device="cpu", plan=Plan.load(plan_path))
    return result(tr, [tr.step(b).loss for b in batches()[tr.steps:]])


def join(rank: int, world: int, port: int, timeout_s: int = 30) -> None:
    """This process as ``rank`` of ``world``; ``timeout_s``: how long a collective may wait for a peer (short where
    a test kills a rank and waits for the others to name it, longer where 4 ranks share 2 loaded cores)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LAZYTRAIN_COLLECTIVE_TIMEOUT=str(timeout_s))
    torch.set_num_threads(1)


def equivalence_rank(rank: int, world: int, port: int, folder: str) -> None:
    """Train every case (checkpoint ``ck2`` on the way); resume the one-process checkpoint ``ck1`` here;
    then the last rank dies while the world saves ``ck2`` again, and rank 0 writes the errors its save
    and its next step raised."""
    join(rank, world, port)
    f = Path(folder)
    res, tr = train(world, folder, f / "ck2")
    deadline = time.time() + 60      # ck1: saved by the test process while the ranks trained
    while not (f / "ck1" / "checkpoint.json").exists() and time.time() < deadline:
        time.sleep(0.05)
    res["from_ck1"] = resume(f / "ck1", str(f / f"{CASES[-1][0]}_{world}.json"))
    res["sources"] = sources(world, folder)
    if rank == 0:
        (f / "out.json").write_text(json.dumps(res))
    if rank == world - 1:
        import lazytrain.runtime.checkpoint as C
        write = C._write

        def die(*a, **k):       # its files written, its part of the manifest not: no commit may happen
            write(*a, **k)
            os._exit(3)
        C._write = die
    errors = []
    for attempt in (lambda: tr.save_checkpoint(f / "ck2"), lambda: tr.step(batches(1)[0])):
        try:
            attempt()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - the test reads the message
            errors.append(str(e))
    (f / "err.txt").write_text("\n".join(errors))


def world4_rank(rank: int, world: int, port: int, folder: str) -> None:
    """Train ``CASES4`` (the last checkpointed to ``ck4`` at ``SAVED_AT``); rank 0 writes ``out4.json``.  No rank is
    killed here, so a collective may wait long: in a full suite under load a rank of four once stayed behind past
    the 30 s the kill tests use and aborted (-6)."""
    join(rank, world, port, timeout_s=180)
    res, tr = train(world, folder, Path(folder) / "ck4", CASES4)
    tr.close()
    if rank == 0:
        (Path(folder) / "out4.json").write_text(json.dumps(res))
    leave()


def resume4_rank(rank: int, world: int, port: int, folder: str) -> None:
    """The 4-rank checkpoint ``ck4`` resumed by this world and trained to the end; rank 0 writes it."""
    join(rank, world, port, timeout_s=180)
    res = resume(Path(folder) / "ck4", str(Path(folder) / f"{CASES[-1][0]}_{world}.json"))
    if rank == 0:
        (Path(folder) / f"resumed4_{world}.json").write_text(json.dumps(res))
    leave()


def hot_heartbeat_rank(rank: int, world: int, port: int, folder: str) -> None:
    """A world that owns the group and four that join it, never closed, their heartbeat renewed without pause (a
    thread nearly always inside a store write): the process must still exit 0 (it aborted with -6 when a daemon
    heartbeat was still writing as the interpreter finalized)."""
    from lazytrain.runtime import distributed as D
    join(rank, world, port)
    D.HEARTBEAT_S = 0.0
    worlds = [D.World.start("cpu") for _ in range(5)]
    assert all(w is not None for w in worlds)
    import torch.distributed as dist
    dist.barrier()


def leave() -> None:
    """Every rank done before any tears the process group down: the first case's trainer made it and is never closed
    (the later ones joined it); a rank that leaves while others still write to the store rank 0 hosts makes them
    print the store's connection errors."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()



def sources(world: int, folder: str) -> dict:
    """A random init from a config (``random_init``) and a resume (``CheckpointFilled``), on the meta device at
    N > 1 (one process: ``random_model``, the reference): the initial parameters, two steps' losses, and the loss
    of the step the run resumed from its checkpoint takes."""
    from lazytrain.frontend.presets import build_model
    from lazytrain.frontend.random_init import random_init, random_model
    from lazytrain.ir import Plan
    from lazytrain.runtime.weights import CheckpointFilled
    f = Path(folder)
    (f / "config.json").write_text(json.dumps(CFG))
    torch.manual_seed(0)
    if world == 1:
        model, weights = random_model(str(f / "config.json"), torch.float32), None
    else:
        model, weights = random_init(str(f / "config.json"), dtype=torch.float32)
    plan = Plan.load(f / f"hybrid8bit_{world}.json")
    tr = Trainer(model, plan, optimizer=optimizer("hybrid8bit"), device="cpu", verbose=False, weights=weights)
    init = {k: v.reshape(-1).tolist() for k, v in tr.state_dict().items()}
    losses = [tr.step(b).loss for b in batches(2)]
    ck = f / f"ck_sources_{world}"
    tr.save_checkpoint(ck)
    meta = build_model(str(f / "config.json"), device="meta" if world > 1 else "cpu", dtype=torch.float32)
    back = Trainer.load_checkpoint(ck, meta, optimizer=optimizer("hybrid8bit"), device="cpu", verbose=False,
                                   weights=CheckpointFilled() if world > 1 else None)
    on_meta = all(p.device.type == "meta" for m in (model, meta) for p in m.parameters())
    return {"init": init, "losses": [*losses, back.step(batches(3)[2]).loss], "meta": on_meta}
