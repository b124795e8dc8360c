"""Per-op compute times of a profiled step against the plan's prices, and what ran beside each op.

    python benchmarks/forward_ops.py ARTIFACTS/32_milp_res11_gu8    (a run_plan.py --artifacts folder)

One line per forward, recompute and backward in start order: block, resident / GPU-updated / saving, predicted
and measured ms, their ratio, start, and the milliseconds each other kind of op overlapped it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lazytrain.ir import Plan
from lazytrain.runtime.profiling import StepProfile


def main(folder: Path) -> None:
    plan = Plan.load(folder / "plan.json")
    prof = StepProfile.load(folder / "profile.json")
    by_id = {op.id: op for op in plan.ops}
    spans = [(by_id[i], res, t0, t1) for i, res, t0, t1 in prof.trace]
    dec = plan.decisions
    print("block kind res gu save  pred_ms meas_ms  ratio  start_ms  overlapping(kind:ms)")
    for op, res, t0, t1 in sorted(spans, key=lambda s: s[2]):
        if op.kind.value not in ("compute", "backward", "recompute"):
            continue
        beside: dict[str, float] = {}
        for other, res2, s0, s1 in spans:
            overlap = min(t1, s1) - max(t0, s0)
            if other is not op and res2 != res and overlap > 0:
                beside[other.kind.value] = beside.get(other.kind.value, 0.0) + overlap * 1e3
        print(f"{op.block:4d} {op.kind.value[:4]} {int(dec.is_resident(op.block))} {int(dec.is_gpu_updated(op.block))} "
              f"{int(bool(getattr(op, 'save', False)))}  {op.seconds * 1e3:7.2f} {(t1 - t0) * 1e3:7.2f} "
              f"{(t1 - t0) / max(op.seconds, 1e-9):6.3f} {t0 * 1e3:8.1f}  "
              + " ".join(f"{k}:{v:.1f}" for k, v in sorted(beside.items())))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
