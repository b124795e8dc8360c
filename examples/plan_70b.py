"""Compile and inspect a plan for Llama-3-70B on one 80 GiB GPU, without a GPU.

The model is built on the ``meta`` device (shapes only, nothing allocated), traced into blocks,
costed on a built-in hardware profile, and scheduled; then we print the summary, a few ops, the
per-block decisions and the simulated timeline's figures.

    python examples/plan_70b.py                      # llama3-70b, batch 16 x 2048, H100 80 GiB
    python examples/plan_70b.py --model tiny --fast  # what tests/test_examples.py runs
"""

from __future__ import annotations

import argparse
from collections import Counter

import lazytrain
from lazytrain.compiler.simulate import simulate
from lazytrain.ir import GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gpu-memory", default="80GiB")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--fast", action="store_true", help="the megatrain heuristic instead of the MILP")
    a = ap.parse_args()

    plan = lazytrain.compile(a.model, batch_size=a.batch, seq_len=a.seq, gpu_memory=a.gpu_memory,
                             host_memory="2TiB", hardware=a.hardware, policy="megatrain" if a.fast else "milp",
                             time_limit=20)
    print(plan.summary())
    print("\nfirst ops of the program:")
    print(plan.table(limit=12))
    kinds = Counter(op.kind.value for op in plan.ops)
    print("\nops by kind:", ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    saved = Counter(s.value for s in plan.decisions.saved)
    print("saved activations per block:", dict(saved))

    sim = simulate(plan)
    g = plan.graph
    print(f"\n{g.total_params / 1e9:.1f} B parameters in {g.n_blocks} blocks; micro-batch {plan.micro_batch} x "
          f"{plan.n_micro}")
    print(f"simulated step {sim.step_time_s:.2f} s, {plan.batch_size * plan.seq_len / sim.step_time_s:,.0f} tokens/s, "
          f"model TFLOPS {6 * g.total_params * plan.batch_size * plan.seq_len / sim.step_time_s / 1e12:.0f}")
    print("busy:", ", ".join(f"{r} {s / sim.step_time_s:.0%}" for r, s in sim.busy_s.items()))
    print(f"peak GPU {plan.predicted['peak_gpu_bytes'] / GiB:.1f} GiB of {a.gpu_memory}, "
          f"peak host {plan.predicted['peak_host_bytes'] / GiB:.0f} GiB")


if __name__ == "__main__":
    main()
