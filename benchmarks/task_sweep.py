"""Sample efficiency of ``lazytrain train``'s default task setup: exact match after N steps, per setting.

    python benchmarks/task_sweep.py --steps 2000 --out sweep.json [--device cuda] [--seeds 0,1,2 --jobs 8]
    python benchmarks/task_sweep.py --list        # the settings, one a line

``--jobs N`` runs N settings x seeds at once, each in its own process (on one GPU too: each process has
its own CUDA context; CPU threads are split between them unless ``--threads`` says otherwise); the results
are written to ``--out`` as each run ends, so a sweep cut short keeps what finished, and a run that fails
is recorded with its error instead of stopping the others.  At the end a table gives each setting's
exact match at each checkpoint, mean and range over the seeds.

Plain PyTorch (fp32, ``torch.optim.AdamW`` with the train defaults' betas and clipping, the same
warm-up + cosine schedule over ``--steps``, the same batches), so many settings fit in minutes on a GPU;
what it compares is how fast each setting learns per step.  Each result also records its train time
per step (``step_s``, evals excluded: on the CPU with ``--threads 1`` that is the per-step cost that
decides how many steps 9 minutes buy) and, at each checkpoint, the share of answers whose equation was
copied right (``copied``: a miss with it right is an arithmetic slip) and the exact match per kind of
problem (``by_kind``: add or sub, with or without a carry).  Measured on the 2-core machine: the
default copies 88% of the equations right by step 400 of 800 and 100% by 800 while its exact match is
8%, so what the jump waits for is the arithmetic, not the reading.  Hence the answer-format settings
(``difficulty``: ``tiny-pad-rev`` etc., ``lazytrain/tasks/formats.py``): the same problems, the answer
written so that each digit depends on digits already written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's lazytrain, not an installed one

from lazytrain.app.config import TrainConfig
from lazytrain.app.loop import lr_at
from lazytrain.app.train import TASK_GPT, build_task_model, logits_fn
from lazytrain.tasks import CharTokenizer, arith, eval_examples, get_difficulty, predict, train_batches

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
    # the loss on the answer only: the prompt's names and numbers are noise a model cannot predict
    "answer": {"loss_on_prompt": False},
    "answer-lr5e-3": {"loss_on_prompt": False, "lr": 5e-3},
    "answer-b16-minlr0.02": {"loss_on_prompt": False, "batch": 16, "min_lr_ratio": 0.02},
    "answer-b16-lr2e-3-minlr0.02": {"loss_on_prompt": False, "batch": 16, "lr": 2e-3, "min_lr_ratio": 0.02},
    "answer-b16-lr5e-3-minlr0.02": {"loss_on_prompt": False, "batch": 16, "lr": 5e-3, "min_lr_ratio": 0.02},
    "answer-b8-lr2e-3-minlr0.02": {"loss_on_prompt": False, "batch": 8, "lr": 2e-3, "min_lr_ratio": 0.02},
    "answer-b64-lr5e-3": {"loss_on_prompt": False, "batch": 64, "lr": 5e-3},
    "b64-lr5e-3-minlr0.02": {"batch": 64, "lr": 5e-3, "min_lr_ratio": 0.02},
    "b32-lr5e-3-minlr0.02": {"batch": 32, "lr": 5e-3, "min_lr_ratio": 0.02},
    "answer-d96-b16-minlr0.02": {"loss_on_prompt": False, "batch": 16, "min_lr_ratio": 0.02,
                                 "extra": {"d_model": 96, "d_ff": 384}},
    "answer-l3-b16-minlr0.02": {"loss_on_prompt": False, "batch": 16, "min_lr_ratio": 0.02, "extra": {"n_layer": 3}},
    # bare worked answers in the padding (tasks/data.py): more arithmetic for the same tokens
    "drills": {"drills": True},
    "drills-b22-s128": {"drills": True, "batch": 22, "seq": 128},
    "drills-b16-s176": {"drills": True, "batch": 16, "seq": 176},
    # one short question ("How many now?"): 64 tokens a problem on average instead of 75, the longest 69
    "short-b39-s72": {"questions": ("How many now?",), "batch": 39, "seq": 72},
    "short-drills-b39-s72": {"questions": ("How many now?",), "drills": True, "batch": 39, "seq": 72},
    # decoupled weight decay on the matrices (biases and norms undecayed), as grokking setups use
    "wd0.1": {"weight_decay": 0.1},
    "wd1": {"weight_decay": 1.0},
    "drills-wd1": {"drills": True, "weight_decay": 1.0},
    # answer formats (tasks/formats.py): the same problems, the worked answer written another way
    "pad": {"difficulty": "tiny-pad"},
    "rev": {"difficulty": "tiny-rev"},
    "lsb": {"difficulty": "tiny-lsb"},
    "carry": {"difficulty": "tiny-carry"},
    "pad-rev": {"difficulty": "tiny-pad-rev"},
    "pad-lsb": {"difficulty": "tiny-pad-lsb"},
    "pad-carry": {"difficulty": "tiny-pad-carry"},
    "pad-lsb-carry": {"difficulty": "tiny-pad-lsb-carry"},
    "short": {"difficulty": "tiny-short"},
    "short-pad-rev": {"difficulty": "tiny-pad-rev-short"},
    "short-pad-lsb": {"difficulty": "tiny-pad-lsb-short"},
    "pad-rev-wd1": {"difficulty": "tiny-pad-rev", "weight_decay": 1.0},
    "pad-lsb-wd1": {"difficulty": "tiny-pad-lsb", "weight_decay": 1.0},
    "pad-carry-wd1": {"difficulty": "tiny-pad-carry", "weight_decay": 1.0},
    "short-pad-lsb-wd1": {"difficulty": "tiny-pad-lsb-short", "weight_decay": 1.0},
}
#: the answer-format screen: the formats, with the default and weight decay 1 beside them
FORMATS = ("default", "wd1", "pad", "rev", "lsb", "carry", "pad-rev", "pad-lsb", "pad-carry", "pad-lsb-carry", "short",
           "short-pad-rev", "short-pad-lsb", "pad-rev-wd1", "pad-lsb-wd1", "pad-carry-wd1", "short-pad-lsb-wd1")
#: settings of this sweep that ``lazytrain train`` does not have
SWEEP_ONLY = ("betas", "questions", "drills")
#: tokens of one default step (batch 32 x seq 88): ``--equal-tokens`` gives every setting this many a step
DEFAULT_TOKENS = 32 * 88


def run(name: str, over: dict, steps: int, device: torch.device, checkpoints: list[int], seed: int = 0,
        eval_size: int = 500) -> dict:
    """One setting; ``questions`` replaces the task's question wording (train and eval) for the run."""
    saved = arith.QUESTIONS
    arith.QUESTIONS = over.get("questions", saved)
    try:
        return _run(name, over, steps, device, checkpoints, seed, eval_size)
    finally:
        arith.QUESTIONS = saved


def row_tokens(over: dict) -> int:
    """Tokens of one step of a setting: batch x its sequence (the difficulty's longest example by default)."""
    return over.get("batch", 32) * (over.get("seq") or get_difficulty(over.get("difficulty", "tiny")).seq_len)


def _run(name: str, over: dict, steps: int, device: torch.device, checkpoints: list[int], seed: int,
         eval_size: int) -> dict:
    betas = over.get("betas", (0.9, 0.98))
    cfg = TrainConfig(**{k: v for k, v in over.items() if k not in SWEEP_ONLY}, steps=steps, seed=seed)
    tok = CharTokenizer()
    diff = get_difficulty(cfg.difficulty)
    seq = cfg.seq or diff.seq_len
    model, _ = build_task_model(cfg, seq, tok.vocab_size)
    model.to(device)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=betas)
    batches = train_batches(cfg.batch, difficulty=diff, seed=seed, seq_len=seq, tokenizer=tok,
                            loss_on_prompt=cfg.loss_on_prompt, drills=over.get("drills", False))
    evals = eval_examples(eval_size, diff, seed=0)       # the same problems in every format
    curve, t0, eval_s = [], time.perf_counter(), 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step, steps)
        b = next(batches)
        loss = model(b.input_ids.to(device), b.labels.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        if step + 1 in checkpoints:
            t_eval = time.perf_counter()
            model.eval()
            with torch.no_grad():
                got = predict(logits_fn(model, device, tok.vocab_size), evals, 250)
                em, copied = _scores(got, evals)
            model.train()
            eval_s += time.perf_counter() - t_eval
            curve.append({"step": step + 1, "exact_match": em, "copied": copied, "by_kind": _by_kind(got, evals),
                          "loss": round(loss.item(), 4), "sample": got[0]})
            print(f"{name:20s} seed {seed} step {step + 1:5d} loss {loss.item():.3f} exact match {em:.1%} "
                  f"(equation copied right {copied:.1%})", flush=True)
    params = sum(p.numel() for p in model.parameters())
    seconds = time.perf_counter() - t0
    return {"name": name, "seed": seed, "setting": {k: v for k, v in over.items()}, "params": params, "curve": curve,
            "seconds": round(seconds, 1), "step_s": round((seconds - eval_s) / steps, 4), "seq": seq,
            "difficulty": diff.name, "task_gpt": {**TASK_GPT, **over.get("extra", {})}}


def _scores(got: list, evals: list) -> tuple[float, float]:
    """Exact match (the final number, read in the example's answer format), and the share of worked
    answers whose last equation left of its ``=`` is the reference's (the numbers read and the operation
    chosen right): a miss with it right is an arithmetic slip, a miss without it a misread question."""
    em = sum(ex.final_answer(g) == ex.answer for g, ex in zip(got, evals)) / len(evals)
    copied = sum(_last_left(g) == _last_left(ex.solution) for g, ex in zip(got, evals))
    return em, copied / len(evals)


def _last_left(answer: str | None) -> str:
    return (answer or "").rsplit(", ", 1)[-1].split("=", 1)[0]


def _by_kind(got: list, evals: list) -> dict:
    """Exact match per kind of one-step problem: the operation, and whether its units digits carry
    (``19+18``) or borrow (``23-9``), to see which arithmetic the jump is waiting for."""
    hits: dict[str, list[int]] = {}
    for g, ex in zip(got, evals):
        a, s = ex.problem.start, ex.problem.steps[0]
        op = "add" if s.kind.value == "add" else "sub"
        carry = (a % 10 + s.a % 10 >= 10) if op == "add" else (a % 10 < s.a % 10)
        hits.setdefault(f"{op}{'-carry' if carry else ''}", []).append(ex.final_answer(g) == ex.answer)
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(hits.items())}


def _run_in_process(name, over, steps, device, checkpoints, seed, threads, eval_size) -> dict:
    """One run in a worker; a failure becomes a result with its error, so the other runs go on."""
    if threads:
        torch.set_num_threads(threads)
    try:
        return run(name, over, steps, torch.device(device), checkpoints, seed, eval_size)
    except Exception as e:          # noqa: BLE001 -- recorded in the results, not lost with the pool
        print(f"{name} seed {seed} failed: {type(e).__name__}: {e}", flush=True)
        return {"name": name, "seed": seed, "setting": over, "error": traceback.format_exc()}


def _star(args: tuple) -> dict:
    return _run_in_process(*args)


def summary(results: list[dict]) -> str:
    """Per setting and checkpoint step: exact match mean [min-max] over its seeds, and its step time."""
    lines, by_name = [], {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r)
    for name, rs in by_name.items():
        ok = [r for r in rs if "curve" in r]
        cells = []
        for i, point in enumerate(ok[0]["curve"] if ok else []):
            ems = [r["curve"][i]["exact_match"] for r in ok if len(r["curve"]) > i]
            cells.append(f"{point['step']}: {statistics.mean(ems):6.1%} [{min(ems):.0%}-{max(ems):.0%}]")
        step_s = f"{statistics.mean(r['step_s'] for r in ok):.4f} s/step" if ok else ""
        failed = f"  ({len(rs) - len(ok)} failed)" if len(ok) < len(rs) else ""
        lines.append(f"{name:20s} n={len(ok)}  " + "  ".join(cells) + f"  {step_s}{failed}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--equal-tokens", action="store_true",
                    help="--steps counts steps of batch 32 x seq 88: a setting of B x S tokens runs steps * 32 * 88 "
                         "/ (B * S) (the same tokens and ~FLOPs, which is what a CPU's minutes buy)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads a run (default: torch's; with --jobs, the cores shared out between the runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=None, help="comma-separated setting names, or 'formats' (the format screen)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (model init and data), each a run")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    ap.add_argument("--eval-size", type=int, default=500, help="eval problems at each checkpoint (default 500)")
    ap.add_argument("--list", action="store_true", help="print the settings and exit")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.list:
        for n, over in SETTINGS.items():
            print(f"{n:24s} {over}")
        return
    names = list(FORMATS) if a.only == "formats" else a.only.split(",") if a.only else list(SETTINGS)
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"unknown setting(s) {', '.join(unknown)}; --list shows them")
    threads = a.threads or (max(1, (os.cpu_count() or 1) // a.jobs) if a.jobs > 1 else None)
    runs = []
    for n in names:
        steps = a.steps * DEFAULT_TOKENS // row_tokens(SETTINGS[n]) if a.equal_tokens else a.steps
        for seed in (int(x) for x in a.seeds.split(",")):
            runs.append((n, SETTINGS[n], steps, a.device, sorted({steps // 2, 3 * steps // 4, steps}), seed,
                         threads, a.eval_size))
    results: list[dict] = []

    def save() -> None:
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump({"format": "lazytrain.task-sweep/1", "steps": a.steps, "equal_tokens": a.equal_tokens,
                           "device": a.device, "results": results}, f, indent=1)
            os.replace(a.out + ".tmp", a.out)
    if a.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(a.jobs) as pool:
            for r in pool.imap_unordered(_star, runs):
                results.append(r)
                save()
    else:
        for r in runs:
            results.append(_run_in_process(*r))
            save()
    order = {(r[0], r[5]): i for i, r in enumerate(runs)}
    results.sort(key=lambda r: order[r["name"], r["seed"]])
    save()
    print(summary(results))


if __name__ == "__main__":
    main()
