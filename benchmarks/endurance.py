"""Endurance: many CPU-mode steps of the ``tiny`` preset with flat host memory.

    python benchmarks/endurance.py [--steps 1000] [--batch 4] [--seq 64] [--policy megatrain] [-o endurance.json]

Builds ``tiny`` (about 3.5M parameters, fp32) on the CPU, compiles a plan for the ``cpu`` hardware
profile and runs ``--steps`` training steps on random tokens with fp32 AdamW and clipping.  Host RSS
(``VmRSS`` of this process) is read after step 100 and after the last step; the run passes when they
are within ``--tolerance`` (5%) of each other, i.e. nothing accumulates per step (pool buffers, NVMe
files, futures, profiler records).  Step 100 is the reference, not step 1: the first steps grow the
activation pool and warm up allocator caches; after that the op list repeats and every buffer is
reused.  The policy ``host-nvme`` (hand-made decisions putting boundaries and saved activations on
the host and on NVMe) exercises the offload paths; ``megatrain`` and the other policies are plain
compiles.  Exit status 1 when RSS grew by more than the tolerance.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time

import torch

import lazytrain
from lazytrain.frontend.presets import build_model
from lazytrain.measure.bench_worker import host_rss_bytes
from lazytrain.runtime.optim.torch_adamw import TorchAdamW


def _plan(model, args, nvme_dir: str) -> lazytrain.Plan:
    if args.policy != "host-nvme":
        return lazytrain.compile(model, batch_size=args.batch, seq_len=args.seq, hardware="cpu",
                                 gpu_memory="4GiB", host_memory="16GiB", param_dtype="float32", optimizer="adamw",
                                 policy=args.policy)
    from lazytrain.compiler.api import Compiler
    from lazytrain.compiler.profiles import get_profile
    from lazytrain.frontend.trace import trace
    from lazytrain.ir import Decisions, GiB, Place, Saved
    graph = trace(model, seq_len=args.seq, dtype="float32")
    L = graph.n_blocks
    boundary = tuple((Place.HOST, Place.NVME, Place.GPU)[i % 3] for i in range(L))
    saved = tuple((Saved.HOST, Saved.NVME, Saved.RECOMPUTE)[i % 3] for i in range(L))
    dec = Decisions(policy="host-nvme", micro_batch=max(1, args.batch // 2), n_micro=min(2, args.batch),
                    boundary=boundary, saved=saved)
    budgets = {"gpu_bytes": 4 * GiB, "host_bytes": 16 * GiB, "nvme_bytes": GiB, "nvme_dir": nvme_dir}
    comp = Compiler(graph, get_profile("cpu"), budgets, param_dtype="float32", optimizer="adamw", clip=True)
    return comp.build(dec, args.batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--reference-step", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--policy", default="megatrain",
                    choices=["megatrain", "recompute-all", "keep-all", "milp", "host-nvme"])
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu", dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="lazytrain-endurance-") as nvme_dir:
        plan = _plan(model, args, nvme_dir)
        trainer = lazytrain.Trainer(model, plan, optimizer=TorchAdamW(lr=1e-4, max_grad_norm=1.0), device="cpu")
        vocab = plan.graph.blocks[0].params[0].shape[0]
        g = torch.Generator().manual_seed(1)
        rss: dict[int, int] = {}
        losses, skipped = [], 0
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
            st = trainer.step({"input_ids": ids, "labels": ids})
            losses.append(st.loss)
            skipped += st.skipped
            if step in (args.reference_step, args.steps):
                gc.collect()
                rss[step] = host_rss_bytes()
            if step % 100 == 0:
                print(f"step {step}: loss {st.loss:.4f}, {time.perf_counter() - t0:.0f} s, "
                      f"RSS {host_rss_bytes() / 2**20:.1f} MiB", flush=True)
        trainer.close()
    a, b = rss[args.reference_step], rss[args.steps]
    growth = (b - a) / a
    out = {"steps": args.steps, "policy": plan.decisions.policy, "batch": args.batch, "seq": args.seq,
           "micro_batch": plan.micro_batch, "params": plan.graph.total_params,
           f"rss_step_{args.reference_step}_mib": round(a / 2**20, 1),
           f"rss_step_{args.steps}_mib": round(b / 2**20, 1),
           "growth": round(growth, 4), "tolerance": args.tolerance, "skipped_steps": skipped,
           "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4),
           "seconds": round(time.perf_counter() - t0, 1), "ok": abs(growth) <= args.tolerance}
    print(f"RSS at step {args.reference_step}: {a / 2**20:.1f} MiB; at step {args.steps}: {b / 2**20:.1f} MiB "
          f"({100 * growth:+.2f}%, limit ±{100 * args.tolerance:.0f}%)")
    print(json.dumps(out))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
