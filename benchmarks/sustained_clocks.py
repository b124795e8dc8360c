"""Does a layer-sized forward run slower once the GPU has been busy a while?  A GPU starts a burst of work at its
boost clocks and settles, within tens of milliseconds of full load, where its power limit holds it; a training
step runs at the second, a short timing loop after idle at the first.

    python benchmarks/sustained_clocks.py

Times a qwen2.5-3b-sized MLP (hidden 2048, intermediate 11008, 32k tokens, bf16) call by call after a second
idle and after 0.3 s / 2 s of 8192-square matmuls, with the SM clock and power nvidia-smi reads after each.
"""

from __future__ import annotations

import subprocess
import time

import torch
import torch.nn.functional as F


def main() -> None:
    dev = "cuda"
    h, inter, tokens = 2048, 11008, 32 * 1024
    w1 = torch.randn(2 * inter, h, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(h, inter, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    square = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def mlp():
        a, b = (x @ w1.t()).chunk(2, -1)
        return x + (F.silu(a) * b) @ w2.t()

    def heat(seconds: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            for _ in range(10):
                square @ square
            torch.cuda.synchronize()

    def timed(n: int) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            start.record()
            mlp()
            end.record()
        torch.cuda.synchronize()
        return [round(s.elapsed_time(e), 3) for s, e in events]

    def clock() -> str:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()

    timed(3)
    for label, before in (("idle 1 s", lambda: time.sleep(1.0)), ("after 0.3 s of matmuls", lambda: heat(0.3)),
                          ("idle 1 s", lambda: time.sleep(1.0)), ("after 2 s of matmuls", lambda: heat(2.0))):
        before()
        t = timed(40)
        print(f"{label}: first 5 {t[:5]}, calls 20-40 median {sorted(t[20:])[10]} ms; clock {clock()}", flush=True)


if __name__ == "__main__":
    main()
