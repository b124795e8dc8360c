"""Sample efficiency of ``lazytrain train``'s default task setup: exact match after N steps, per setting.

    python benchmarks/task_sweep.py --steps 2000 --out sweep.json [--device cuda]

Plain PyTorch (fp32, ``torch.optim.AdamW`` with the train defaults' betas and clipping, the same
warm-up + cosine schedule over ``--steps``, the same batches), so many settings fit in minutes on a GPU;
what it compares is how fast each setting learns per step.  Per-step cost on the 2-core CPU machine is
measured separately (``--cpu-step-s``), since the default must learn within 9 minutes there.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lazytrain.loop import lr_at
from lazytrain.tasks import CharTokenizer, eval_examples, exact_match, train_batches
from lazytrain.train import TASK_GPT, TrainConfig, build_task_model, logits_fn

SETTINGS = {
    "default": {},
    "lr5e-3": {"lr": 5e-3},
    "lr8e-3": {"lr": 8e-3},
    "lr1.2e-2": {"lr": 1.2e-2},
    "b16": {"batch": 16},
    "b16-lr5e-3": {"batch": 16, "lr": 5e-3},
    "b64-lr5e-3": {"batch": 64, "lr": 5e-3},
    "warmup100-lr5e-3": {"warmup": 100, "lr": 5e-3},
    "betas95-lr5e-3": {"betas": (0.9, 0.95), "lr": 5e-3},
    "d96-lr5e-3": {"extra": {"d_model": 96, "d_ff": 384}, "lr": 5e-3},
    "l3-lr5e-3": {"extra": {"n_layer": 3}, "lr": 5e-3},
    "l6-lr5e-3": {"extra": {"n_layer": 6}, "lr": 5e-3},
    "d192-lr3e-3": {"extra": {"d_model": 192, "d_ff": 768, "n_head": 6}},
    "minlr0.02-lr5e-3": {"min_lr_ratio": 0.02, "lr": 5e-3},
    "b16-minlr0.02": {"batch": 16, "min_lr_ratio": 0.02},
    "b16-lr2e-3-minlr0.02": {"batch": 16, "lr": 2e-3, "min_lr_ratio": 0.02},
    "b24-lr4e-3-minlr0.02": {"batch": 24, "lr": 4e-3, "min_lr_ratio": 0.02},
    "b16-lr4e-3-minlr0.02": {"batch": 16, "lr": 4e-3, "min_lr_ratio": 0.02},
    "b12-minlr0.02": {"batch": 12, "min_lr_ratio": 0.02},
}


def run(name: str, over: dict, steps: int, device: torch.device, checkpoints: list[int]) -> dict:
    betas = over.get("betas", (0.9, 0.98))
    cfg = TrainConfig(**{k: v for k, v in over.items() if k != "betas"}, steps=steps)
    tok = CharTokenizer()
    seq = 88
    model, _ = build_task_model(cfg, seq, tok.vocab_size)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=betas, weight_decay=0.0)
    batches = train_batches(cfg.batch, difficulty="tiny", seed=0, seq_len=seq, tokenizer=tok, loss_on_prompt=True)
    evals = eval_examples(500, "tiny", seed=0)
    curve, t0 = [], time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step, step / steps)
        b = next(batches)
        loss = model(b.input_ids.to(device), b.labels.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        if step + 1 in checkpoints:
            model.eval()
            with torch.no_grad():
                em = exact_match(logits_fn(model, device, tok.vocab_size), evals, 250)
            model.train()
            curve.append({"step": step + 1, "exact_match": em, "loss": round(loss.item(), 4)})
            print(f"{name:20s} step {step + 1:5d} loss {loss.item():.3f} exact match {em:.1%}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    return {"name": name, "setting": {k: v for k, v in over.items()}, "params": params, "curve": curve,
            "seconds": round(time.perf_counter() - t0, 1), "task_gpt": {**TASK_GPT, **over.get("extra", {})}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--equal-tokens", action="store_true",
                    help="--steps counts steps of batch 32: a setting of batch B runs steps * 32 / B (the same "
                         "tokens and ~FLOPs, which is what a CPU's minutes buy)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=None, help="comma-separated setting names")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    names = a.only.split(",") if a.only else list(SETTINGS)
    results = []
    for n in names:
        steps = a.steps * 32 // SETTINGS[n].get("batch", 32) if a.equal_tokens else a.steps
        results.append(run(n, SETTINGS[n], steps, dev, sorted({steps // 2, 3 * steps // 4, steps})))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"format": "lazytrain.task-sweep/1", "steps": a.steps, "device": a.device, "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
