"""Accuracy of the fewer-bytes optimizer options against the exact default, on the built-in task (issue #41, point 4).

    PYTHONPATH=. python benchmarks/bytes_per_param.py [--steps 300] [--batch 32] [--lr 3e-3] [--seed 0]
        [--difficulty tiny-pad-carry] [--eval-size 500] [--threads 2]
        [--options hybrid8bit,hybrid8bit-sr,hybrid4bit,hybrid4bit-sr]

What ``lazytrain train`` does (its task GPT, batches, warm-up + cosine schedule, betas (0.9, 0.98), clip 1.0,
exact match on the held-out problems), with one difference: the parameters are bf16 on the CPU too (the run
compiles with ``param_dtype="bfloat16"``).  ``lazytrain train`` on a CPU keeps fp32 parameters, whose load buffer
is the master itself, so there the options would change nothing; on a GPU the load buffer is bf16 and the master
format is what the options change.  Every option runs with the same seed, model, data and schedule; the output
is one row per option (final train loss = mean of the last 20 steps, eval loss and exact match on the held-out
problems, host bytes per parameter, seconds) and a JSON file beside it with the loss curves.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import lazytrain
from lazytrain.app.config import TrainConfig
from lazytrain.app.loop import lr_at
from lazytrain.app.train import build_task_model, logits_fn
from lazytrain.compiler.options import Optimizer
from lazytrain.runtime.optim import Hybrid8bitAdamW
from lazytrain.runtime.trainer import Trainer
from lazytrain.tasks import CharTokenizer, eval_examples, exact_match, get_difficulty, train_batches


def _optimizer(option: str, cfg: TrainConfig) -> Hybrid8bitAdamW:
    choice = Optimizer(option)
    return Hybrid8bitAdamW(lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay,
                           max_grad_norm=cfg.max_grad_norm, num_threads=torch.get_num_threads(),
                           stochastic_rounding=choice.stochastic_rounding, moment_bits=choice.moment_bits,
                           seed=cfg.seed)


@torch.no_grad()
def _eval_loss(model, seq: int, cfg: TrainConfig, diff, n_batches: int = 4) -> float:
    """Mean loss of ``n_batches`` batches drawn with another seed than training's (fresh problems of the task)."""
    batches = train_batches(cfg.batch, difficulty=diff, seed=cfg.seed + 1_000_003, seq_len=seq,
                            tokenizer=CharTokenizer(), loss_on_prompt=cfg.loss_on_prompt)
    losses = []
    for _ in range(n_batches):
        b = next(batches)
        logits = logits_fn(model, torch.device("cpu"))(b.input_ids)
        losses.append(float(torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), b.labels[:, 1:].reshape(-1), ignore_index=-100)))
    return sum(losses) / len(losses)


def run(option: str, cfg: TrainConfig) -> dict:
    diff = get_difficulty(cfg.difficulty)
    tok = CharTokenizer()
    seq = cfg.seq or diff.seq_len
    model, _ = build_task_model(cfg, seq, tok.vocab_size)
    plan = lazytrain.compile(model, batch_size=cfg.batch, seq_len=seq, hardware="cpu", optimizer=option,
                             param_dtype="bfloat16", policy=cfg.policy, gpu_memory="8GiB", host_memory="16GiB")
    opt = _optimizer(option, cfg)
    trainer = Trainer(model, plan, optimizer=opt, device="cpu", verbose=False)
    batches = train_batches(cfg.batch, difficulty=diff, seed=cfg.seed, seq_len=seq, tokenizer=tok,
                            loss_on_prompt=cfg.loss_on_prompt)
    curve, t0 = [], time.perf_counter()
    for step in range(cfg.steps):
        opt.lr = lr_at(cfg, step, cfg.steps)
        b = next(batches)
        curve.append(trainer.step((b.input_ids, b.labels)).loss)
    train_s = time.perf_counter() - t0
    trainer.sync_to_model()
    model.eval()
    em = exact_match(logits_fn(model, torch.device("cpu"), tok.vocab_size), eval_examples(cfg.eval_size, diff,
                                                                                           seed=cfg.seed), 100)
    row = {"option": option, "final_loss": sum(curve[-20:]) / len(curve[-20:]),
           "eval_loss": _eval_loss(model, seq, cfg, diff), "exact_match": em,
           "host_bytes_per_param": opt.host_bytes_per_param, "train_s": train_s, "loss_curve": curve}
    trainer.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--difficulty", default=TrainConfig.difficulty)
    ap.add_argument("--eval-size", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--options", default="hybrid8bit,hybrid8bit-sr,hybrid4bit,hybrid4bit-sr")
    ap.add_argument("--out", default="benchmarks/results/issue41_bytes_per_param/task.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = TrainConfig(steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed, difficulty=a.difficulty,
                      eval_size=a.eval_size, policy="megatrain")
    rows = []
    for option in a.options.split(","):
        rows.append(run(option, cfg))
        r = rows[-1]
        print(f"{option:15s} final loss {r['final_loss']:.4f}  eval loss {r['eval_loss']:.4f}  exact match "
              f"{r['exact_match']:.1%}  {r['host_bytes_per_param']:.3f} B/param  {r['train_s']:.0f} s", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"format": "lazytrain.bytes-per-param/1", "args": vars(a), "rows": rows}, indent=1))
    assert all(math.isfinite(r["final_loss"]) for r in rows)


if __name__ == "__main__":
    main()
