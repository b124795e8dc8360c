"""Predicted LoRA plans (issue #44), on the compiler and simulator only: no GPU is needed.

Each row compiles one configuration of ``--model`` at ``--batch`` x ``--seq`` and writes its predicted step,
tokens/s, peak GPU and host memory and the host bytes per base parameter: LoRA r=16 on all linear layers with the
base in bf16 at 24 GiB GPU / 192 GiB host, the same with a 4-bit (NF4) base at 24 GiB / 64 GiB and an 8-bit one at
24 GiB / 128 GiB (host bytes and transfers the runtime's packed layout, ``util.quant_format``; each load adds the
GPU's dequantization at the profile's ``dequant_gbps`` / ``dequant8_gbps``: the ``dequant`` column is a step's sum
of it, inside the h2d busy time, where the runtime runs it), and a full fine-tune of the same model at
24 GiB / 192 GiB for scale (it needs about 8.25 bytes a parameter in the host store: the row says where it does not
fit).

    python benchmarks/lora_compile.py                      # writes benchmarks/results/issue44_lora/compiles.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lazytrain.compiler.api import compile_model
from lazytrain.compiler.cost import CostModel
from lazytrain.compiler.profiles import get_profile
from lazytrain.ir import GiB, OpKind

OUT = Path(__file__).parent / "results" / "issue44_lora"
LORA = "r=16,alpha=32,targets=all-linear"
ROWS = [("LoRA r=16 all linear, bf16 base", LORA, 16, "24GiB", "192GiB"),
        ("LoRA r=16 all linear, 4-bit NF4 base", LORA, 4, "24GiB", "64GiB"),
        ("LoRA r=16 all linear, 8-bit base", LORA, 8, "24GiB", "128GiB"),
        ("full fine-tune (8-bit AdamW), for scale", None, 16, "24GiB", "192GiB")]


def compile_row(model: str, batch: int, seq: int, hardware: str, what: str, lora, bits: int, gpu: str,
                host: str) -> dict:
    """One configuration's plan as a table row (or the compile's one-line error where it does not fit)."""
    t = time.perf_counter()
    row = {"what": what, "gpu": gpu, "host": host}
    try:
        plan = compile_model(model, lora=lora, base_bits=bits, batch_size=batch, seq_len=seq, gpu_memory=gpu,
                             host_memory=host, hardware=hardware)
    except Exception as e:  # noqa: BLE001 - a configuration that does not fit is a row too
        row.update(error=str(e).splitlines()[0], compile_s=round(time.perf_counter() - t, 1))
        return row
    pred, g = plan.predicted, plan.graph
    step, static = pred["step_time_s"], pred["host_static_bytes"]
    base = (static - _trainable_bytes(plan)) / g.frozen_params if g.frozen_params else None
    row.update(step_s=round(step, 2), tokens_per_s=round(batch * seq / step, 1),
               peak_gpu_gib=round(pred["peak_gpu_bytes"] / GiB, 2),
               peak_host_gib=round(pred["peak_host_bytes"] / GiB, 2), host_static_gib=round(static / GiB, 2),
               trainable=g.trainable_params, frozen=g.frozen_params, micro_batch=plan.micro_batch,
               base_bytes_per_param=None if base is None else round(base, 3),
               busy_s={k: round(v, 2) for k, v in pred["busy_s"].items() if k in ("gpu", "h2d", "d2h", "cpu")},
               resident=len(plan.decisions.resident_blocks), gpu_updated=len(plan.decisions.gpu_updated_blocks),
               dequant_s=round(_dequant_s(plan, hardware, bits), 2), compile_s=round(time.perf_counter() - t, 1))
    return row


def _dequant_s(plan, hardware: str, bits: int) -> float:
    """GPU seconds a step spends dequantizing the base: every load (and state load) of a block, its ``dequant_s``."""
    cost = CostModel(plan.graph, get_profile(hardware), plan.micro_batch, plan.param_dtype, base_bits=bits)
    return sum(cost.dequant_s(op.block) for op in plan.ops if op.kind in (OpKind.LOAD, OpKind.STATE_LOAD))


def _trainable_bytes(plan) -> float:
    return plan.graph.trainable_params * float(plan.options.get("host_bytes_per_param", 16.0))


def table(rows: list[dict], model: str, batch: int, seq: int, hardware: str) -> str:
    lines = [f"# {model}: LoRA vs full fine-tune, predicted ({hardware} profile, batch {batch}, seq {seq})", "",
             "Written by `python benchmarks/lora_compile.py`: the compiler's plan and simulator, no GPU run. "
             "Host bytes per base parameter: the host store's static bytes less the adapters' state, over the "
             "frozen parameters.", "",
             "Busy: seconds a step each resource works (GPU compute, PCIe to and from the GPU, the host update); "
             "resident / GPU-updated: blocks the MILP and the GPU-update rule chose. Block times are modelled from "
             "FLOPs (no calibration).", "",
             "| configuration | GPU / host budget | step (s) | tokens/s | micro-batch | peak GPU (GiB) "
             "| peak host (GiB) | host store (GiB) | B/param of the base | trainable params "
             "| busy gpu / h2d / d2h / cpu (s) | dequant (s) | resident / GPU-updated | compile (s) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['what']} | {r['gpu']} / {r['host']} | does not fit: {r['error']} "
                         f"| | | | | | | | | | | {r['compile_s']} |")
            continue
        bpp = "" if r["base_bytes_per_param"] is None else f"{r['base_bytes_per_param']:.3f}"
        lines.append(f"| {r['what']} | {r['gpu']} / {r['host']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} "
                     f"| {r['micro_batch']} | {r['peak_gpu_gib']:.2f} | {r['peak_host_gib']:.2f} "
                     f"| {r['host_static_gib']:.2f} | {bpp} | {r['trainable']:,} "
                     f"| {' / '.join(str(r['busy_s'].get(k, 0)) for k in ('gpu', 'h2d', 'd2h', 'cpu'))} "
                     f"| {r['dequant_s']} | {r['resident']} / {r['gpu_updated']} | {r['compile_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    rows = [compile_row(a.model, a.batch, a.seq, a.hardware, *r) for r in ROWS]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiles.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "compiles.md").write_text(table(rows, a.model, a.batch, a.seq, a.hardware))
    print(table(rows, a.model, a.batch, a.seq, a.hardware))
    return rows


if __name__ == "__main__":
    main()
