"""Run a compiled plan on the GPU and compare it with the compiler's prediction.

    python benchmarks/run_plan.py --model qwen2.5-3b --batch 8 --seq 1024 --gpu-memory 24GiB \\
        --policy milp --steps 3 --warmup 2 [--micro-batch 4] [--optimizer hybrid8bit] [-o run.json] \\
        [--artifacts DIR] [--compile-blocks]

Builds a random-init model from a preset on the CPU in bf16, compiles a plan for the H200 profile
(``--hardware``), caps the GPU at ``--gpu-memory`` with ``torch.cuda.set_per_process_memory_fraction``,
runs warm-up + measured steps on random tokens, then one profiled step.  Prints and writes JSON:
median step seconds, model TFLOPS, predicted step time, predicted vs measured peak GPU GiB
(``torch.cuda.max_memory_allocated``), host RSS GiB, and how much of each transfer kind was hidden
under compute (plus the exposed update time) in the profiled step.  With ``--artifacts DIR``, each run
also leaves ``DIR/<batch>_<policy>/``: ``plan.json``, the profiled step's ``profile.json``, its
measured Perfetto ``trace.json`` and ``memory.png`` (predicted and measured GPU memory, the budget),
as ``lazytrain trace plan.json --measured profile.json --plot memory.png`` would write them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import lazytrain
from lazytrain.compiler.options import LossHead
from lazytrain.frontend.random_init import random_model
from lazytrain.ir import GiB
from lazytrain.measure.bench_worker import host_rss_bytes
from lazytrain.runtime.profiling import plan_digest
from lazytrain.util.units import parse_size


def parser() -> argparse.ArgumentParser:
    """The command line; its defaults are also the settings the bench's lazytrain rows start from."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", default="1024", help="tokens a row, or 'max' (the longest that fits)")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--gpu-memory", default="24GiB")
    ap.add_argument("--host-memory", default=None)
    ap.add_argument("--policy", default="milp")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--optimizer", default="hybrid8bit", choices=["hybrid8bit", "adamw"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--optim-threads", type=int, default=None,
                    help="host threads of the 8-bit optimizer (default: torch.get_num_threads())")
    ap.add_argument("-o", "--out", default=None)
    ap.add_argument("--artifacts", default=None, metavar="DIR",
                    help="per run, write plan.json, profile.json, trace.json (measured) and memory.png "
                         "into DIR/<batch>_<policy>/")
    ap.add_argument("--runs", default=None,
                    help="several runs on one model build, e.g. '8:megatrain,32:milp,8:milp:12,32:milp@auto/6,"
                         "1x32768:milp,1xmax:milp,32:milp:c80GiB' (batch[xseq]:policy[@resident[/gpu_update]]"
                         "[:optimizer threads][:c<GPU memory cap to train under, default --gpu-memory>]"
                         "[:single_pass|:recompute (the loss head, default --loss-head)]; seq a number "
                         "or 'max'); runs with the same compile arguments share one plan; "
                         "results go to OUT as a JSON list")
    ap.add_argument("--loss-head", default="auto", choices=LossHead.names(),
                    help="how the fused loss head forms its gradients (compile_model's loss_head)")
    ap.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR",
                    help="the preset's config with rope_scaling {rope_type: TYPE, factor: FACTOR} (e.g. yarn:4, as "
                         "Qwen2.5's model cards advise past 32,768 tokens), for sequences beyond its declared "
                         "positions")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the profiled step after the measured ones (no hidden-transfer figures)")
    ap.add_argument("--calibrate", action="store_true",
                    help="compile(..., calibrate=True): time the model's own blocks at each plan's shape first "
                         "(kept in a copy of the hardware profile, so a shape is timed once per invocation)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="compile(time_limit=S): seconds per MILP solve, and no wall-clock deadline on the search "
                         "(default: the search's deadline, which a loaded machine can run out)")
    ap.add_argument("--memory-report", action="store_true",
                    help="run the first warm-up step with device memory recorded op by op (synchronised, slow) and "
                         "print the ops whose measured peak most exceeds the plan's; also when that step runs out "
                         "of memory")
    ap.add_argument("--compile-blocks", action="store_true",
                    help="compile(..., compile_blocks=True): block programs compiled by Inductor (the compile's "
                         "seconds, distinct programs and cache hits go into the output as block_compile)")
    ap.add_argument("--resident", default="auto", type=lambda t: t if t in ("none", "auto") else int(t),
                    help="none, auto (default: the compiler's choice) or a number of leading blocks kept on the GPU")
    ap.add_argument("--profile-steps", type=int, default=None, metavar="N",
                    help="profiled steps after the measured ones (default 1, 3 with --refit: its rates are each the "
                         "median over them)")
    ap.add_argument("--refit", action="store_true",
                    help="after each run, read the host update, parameter load and gradient offload rates its "
                         "profiled step reached (lazytrain.measure.step_rates) into the hardware profile, "
                         "compile again and run that plan too: its prediction is priced at the measured in-step rates")
    ap.add_argument("--save-profile", default=None, metavar="PATH",
                    help="after each run, write the hardware profile the runs priced with (with --calibrate or "
                         "--refit, its measurements) to PATH, to start a later invocation from it")
    ap.add_argument("--gpu-update", default="auto", type=lambda t: t if t in ("none", "auto") else int(t),
                    help="none, auto (default: the compiler's choice) or a number of the first streamed blocks "
                         "updated on the GPU (compile(..., gpu_update=...)); none for the A/B without")
    return ap


def save_profile(a) -> None:
    """The profile the runs priced with, written to ``--save-profile``."""
    if a.save_profile:
        from lazytrain.compiler.profiles import get_profile
        get_profile(a.hardware).save(a.save_profile)


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("run_plan.py needs a CUDA GPU")

    if a.seq != "max":
        a.seq = int(a.seq)
    if a.calibrate or a.refit:      # measurements go into a copy of the profile
        import tempfile

        from lazytrain.compiler.profiles import get_profile
        copy = Path(tempfile.mkdtemp(prefix="lazytrain-calibration-")) / "hardware.json"
        get_profile(a.hardware).save(copy)
        a.hardware = str(copy)
    spec = a.model if a.rope_scaling is None else scaled_rope_config(a.model, a.rope_scaling)
    torch.manual_seed(0)
    t = time.perf_counter()
    model = random_model(spec)
    build_s = time.perf_counter() - t
    if a.runs:
        results = []
        default_resident, default_gpu_update, default_loss_head = a.resident, a.gpu_update, a.loss_head
        for spec in a.runs.split(","):
            b, pol, *threads = spec.split(":")
            pol, _, res = pol.partition("@")
            b, _, seq = b.partition("x")
            a.batch, a.policy = int(b), pol
            if seq:
                a.seq = seq if seq == "max" else int(seq)
            res, _, gpu = res.partition("/")
            a.resident = (res if res in ("none", "auto") else int(res)) if res else default_resident
            a.gpu_update = (gpu if gpu in ("none", "auto") else int(gpu)) if gpu else default_gpu_update
            a.run_cap = None
            a.loss_head = default_loss_head
            for extra in threads:       # optimizer threads, "c" and the GPU memory cap it trains under, a head mode
                if extra.startswith("c"):
                    a.run_cap = extra[1:]
                elif extra in LossHead.names():
                    a.loss_head = extra
                else:
                    a.optim_threads = int(extra)
            try:
                results.extend(run_refit(a, model, build_s) if a.refit else [run_one(a, model, build_s)])
            except Exception as e:  # noqa: BLE001 - keep the other runs; report this one
                import traceback
                traceback.print_exc()
                results.append({"batch": a.batch, "seq": a.seq, "policy": pol, "error": f"{type(e).__name__}: {e}"})
            torch.cuda.empty_cache()
            save_profile(a)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=1)
        return results
    out = run_refit(a, model, build_s) if a.refit else run_one(a, model, build_s)
    save_profile(a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def scaled_rope_config(preset: str, scaling: str) -> str:
    """A ``config.json`` of ``preset`` whose rotary embedding is scaled by ``scaling`` (``TYPE:FACTOR``)."""
    import tempfile

    from lazytrain.frontend.presets import PRESETS
    kind, _, factor = scaling.partition(":")
    cfg = dict(PRESETS[preset])
    cfg["rope_scaling"] = {"rope_type": kind, "factor": float(factor),
                           "original_max_position_embeddings": cfg["max_position_embeddings"]}
    cfg["max_position_embeddings"] = int(cfg["max_position_embeddings"] * float(factor))
    folder = Path(tempfile.mkdtemp(prefix=f"{preset}-{kind}-"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(folder / "config.json")


def run_refit(a, model, build_s: float) -> list[dict]:
    """``run_one``, then the in-step rates of its profiled step written into the hardware profile
    (``a.hardware``, a file), and ``run_one`` again on the plan compiled with them."""
    from lazytrain.compiler.hardware import HardwareProfile
    from lazytrain.measure.step_rates import measure
    measured: list = []
    first = run_one(a, model, build_s, measured=measured)
    if not measured:
        raise SystemExit("--refit needs the profiled step (drop --no-profile)")
    plan, profs = measured[0]
    hw = HardwareProfile.load(a.hardware)
    rates = measure(plan, profs)
    print(f"in-step rates: {rates.describe(hw)}")
    rates.apply(hw).save(a.hardware)
    torch.cuda.empty_cache()
    second = run_one(a, model, build_s)
    second["refit"] = {"host_update_gparams": rates.host_update_gparams, "param_load_gbps": rates.param_load_gbps,
                       "grad_offload_gbps": rates.grad_offload_gbps, "forward_ratio": rates.forward_ratio,
                       "backward_ratio": rates.backward_ratio, "ops": rates.ops, "from": rates.describe(hw),
                       "same_decisions_as_measured": second["decisions_digest"] == first["decisions_digest"]}
    first["refit_stage"], second["refit_stage"] = "measured", "refit"
    return [first, second]


def _digest(d) -> str:
    import hashlib
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


#: the plans compiled in this invocation, by their compile arguments
_compiled: dict = {}


def run_one(a, model, build_s: float, plan=None, measured: list | None = None) -> dict:
    """Compile (unless ``plan`` is given), cap, train warm-up + measured steps and, unless
    ``a.profile`` is False, one profiled step; return the figures (and append (plan, profile) to ``measured``)."""
    t = time.perf_counter()
    if plan is None:
        kw = dict(batch_size=a.batch, seq_len=a.seq, micro_batch=a.micro_batch, gpu_memory=a.gpu_memory,
                  host_memory=a.host_memory, hardware=a.hardware, policy=a.policy, optimizer=a.optimizer,
                  nvme_dir=a.nvme_dir, resident=getattr(a, "resident", "auto"),
                  calibrate=getattr(a, "calibrate", False), compile_blocks=getattr(a, "compile_blocks", False),
                  time_limit=getattr(a, "time_limit", None), gpu_update=getattr(a, "gpu_update", "auto"),
                  loss_head=getattr(a, "loss_head", "auto"))
        key = json.dumps(kw, sort_keys=True, default=str)
        if isinstance(a.hardware, str) and Path(a.hardware).is_file():      # --refit rewrites the file: a new plan
            key += _digest(Path(a.hardware).read_text())
        if key not in _compiled:         # runs that differ only in how they run (optimizer threads) share the plan
            _compiled[key] = lazytrain.compile(model, **kw)
        plan = _compiled[key]
    compile_s = time.perf_counter() - t
    print(plan.summary())
    seq = plan.seq_len

    gpu_bytes = parse_size(getattr(a, "run_cap", None) or a.gpu_memory)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_bytes / total))

    from lazytrain.runtime.optim import Hybrid8bitAdamW, TorchAdamW
    threads = getattr(a, "optim_threads", None)
    opt = (Hybrid8bitAdamW(lr=a.lr, max_grad_norm=1.0, num_threads=threads) if a.optimizer == "hybrid8bit"
           else TorchAdamW(lr=a.lr, max_grad_norm=1.0))
    t = time.perf_counter()
    trainer = lazytrain.Trainer(model, plan, optimizer=opt, device="cuda", nvme_dir=a.nvme_dir)
    setup_s = time.perf_counter() - t
    block_compile = trainer.compile_report.to_json() if trainer.compile_report is not None else None
    cfg = getattr(model, "config", None)
    vocab = int(getattr(cfg, "vocab_size", None) or getattr(cfg, "vocab", None) or 1000)
    g = torch.Generator().manual_seed(1)

    def batch():
        ids = torch.randint(0, vocab, (a.batch, seq), generator=g)
        return ids, ids.clone()

    stats = []
    memory = None
    alloc0 = {}
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            torch.cuda.reset_peak_memory_stats()
            alloc0 = _allocator_events()
        if i == 0 and getattr(a, "memory_report", False):
            memory, s = memory_report(trainer, plan, batch())
        else:
            s = trainer.step(batch())
        print(f"step {i}{' (warm-up)' if i < a.warmup else ''}: loss {s.loss:.4f} {s.step_s:.3f} s "
              f"{s.model_tflops:.1f} model TFLOPS grad norm {s.grad_norm:.3f}")
        if i >= a.warmup:
            stats.append(s)
    peak = torch.cuda.max_memory_allocated()
    allocator = {k: v - alloc0.get(k, 0) for k, v in _allocator_events().items()}
    prof = None
    if getattr(a, "profile", True):
        trainer.profile = True
        profs = []
        for _ in range(getattr(a, "profile_steps", None) or (3 if getattr(a, "refit", False) else 1)):
            trainer.step(batch())
            profs.append(trainer.last_profile)
        prof = profs[-1]
        if measured is not None:
            measured.append((plan, profs))
    trainer.close()

    med = statistics.median(s.step_s for s in stats)
    pred = plan.predicted
    out = {
        "model": a.model, "rope_scaling": a.rope_scaling, "batch": a.batch, "seq": seq, "seq_asked": a.seq,
        "micro_batch": plan.micro_batch,
        "policy": a.policy, "seq_tile": plan.graph.meta.get("seq_tile"), "calibrated": getattr(a, "calibrate", False),
        "resident": sorted(plan.decisions.resident_blocks),
        "gpu_updated": sorted(plan.decisions.gpu_updated_blocks),
        "loss_head": "single_pass" if (plan.graph.meta.get("loss_head") or {}).get("single_pass") else "recompute",
        "optimizer": a.optimizer,
        "optim_threads": getattr(opt, "num_threads", None), "gpu_memory": a.gpu_memory,
        "run_cap": getattr(a, "run_cap", None) or a.gpu_memory, "allocator_events": allocator,
        "device": torch.cuda.get_device_name(0),
        "total_params": plan.graph.total_params, "steps": a.steps, "warmup": a.warmup,
        "plan_digest": plan_digest(plan), "decisions_digest": _digest(plan.decisions.to_json()),
        "median_step_s": med, "tokens_per_s": a.batch * seq / med,
        "model_tflops": 6 * plan.graph.total_params * a.batch * seq / med / 1e12,
        "model_attn_tflops": (6 * plan.graph.total_params * seq + plan.graph.attention_model_flops)
        * a.batch / med / 1e12,
        "predicted_step_s": pred.get("step_time_s"),
        "predicted_over_measured": (pred.get("step_time_s") or 0) / med,
        "predicted_peak_gpu_gib": pred.get("peak_gpu_bytes", 0) / GiB, "measured_peak_gpu_gib": peak / GiB,
        "host_rss_gib": host_rss_bytes() / GiB, "losses": [s.loss for s in stats],
        "step_s": [s.step_s for s in stats],
        **({"hidden": prof.hidden, "transfer_s": prof.transfer_s, "exposed_update_s": prof.exposed_update_s,
            "update_s": prof.update_s, "device_update_s": prof.device_update_s,
            "update_exposed_fraction": prof.update_exposed_fraction, "profiled_step_s": prof.step_s,
            "busy_s": prof.busy_s} if prof else {}),
        "build_s": build_s, "compile_s": compile_s, "setup_s": setup_s,
        "compile_blocks": bool(plan.options.get("compile_blocks")), "block_compile": block_compile,
        **({"memory_report": memory} if memory else {}),
    }
    if prof is not None:
        out["by_kind"] = by_kind(plan, prof)
    print(json.dumps({k: v for k, v in out.items() if k != "losses"}, indent=1))
    if getattr(a, "artifacts", None) and prof is not None:
        dec = plan.decisions
        tag = f"{a.batch}_{a.policy}" + (f"_res{len(dec.resident_blocks)}" if dec.resident_blocks else "") \
            + (f"_gu{len(dec.gpu_updated_blocks)}" if dec.gpu_updated_blocks else "")
        out["artifacts"] = str(save_artifacts(Path(a.artifacts) / tag, plan, prof))
    return out


def _allocator_events() -> dict[str, int]:
    """The caching allocator's counters that stall the step: retries (a failed cudaMalloc, the cache freed and
    tried again), cudaFree calls and device-wide synchronizations they forced, segments mapped / unmapped."""
    st = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_free", "num_sync_all_streams", "num_device_alloc", "num_ooms")
    return {k: int(st.get(k, 0)) for k in keys}


def by_kind(plan, prof) -> dict[str, dict]:
    """The profiled step's ops against the plan's predicted seconds, summed by (kind, resource): where the
    prediction is off (each op timed from when its stream or worker started it, waits excluded)."""
    by_id = {op.id: op for op in plan.ops}
    out: dict[str, dict] = {}
    for i, _res, t0, t1 in prof.trace:
        op = by_id[i]
        row = out.setdefault(f"{op.kind.value}@{op.resource.value}", {"ops": 0, "predicted_s": 0.0, "measured_s": 0.0})
        row["ops"] += 1
        row["predicted_s"] += op.seconds
        row["measured_s"] += t1 - t0
    for row in out.values():
        row["measured_over_predicted"] = row["measured_s"] / row["predicted_s"] if row["predicted_s"] else None
    return out


def memory_report(trainer, plan, batch, top: int = 12):
    """One step with device memory recorded op by op (``runtime/memtrack.py``), against the plan's curve:
    the ``top`` ops whose measured peak most exceeds the predicted one, printed and returned with the step's
    stats; an out-of-memory error is reported the same way (its op's peak is where it stopped) and raised."""
    from lazytrain.runtime.context import describe
    from lazytrain.runtime.memtrack import compare, track
    base = torch.cuda.memory_allocated()
    error = None
    with track(trainer) as mem:
        try:
            s = trainer.step(batch)
        except RuntimeError as e:
            error, s = e, None
    rows = sorted(compare(plan, mem), key=lambda r: r.predicted_peak - r.measured_peak)[:top]
    report = {"base_gib": base / GiB, "measured_peak_gib": max(r.peak for r in mem.records) / GiB,
              "predicted_peak_gib": plan.predicted.get("peak_gpu_bytes", 0) / GiB,
              "worst": [{"op": describe(r.op), "measured_peak_gib": r.measured_peak / GiB,
                         "predicted_peak_gib": r.predicted_peak / GiB, "measured_after_gib": r.measured_after / GiB,
                         "predicted_after_gib": r.predicted_after / GiB} for r in rows]}
    print("memory report (GiB): base {base_gib:.2f}, measured peak {measured_peak_gib:.2f}, predicted peak "
          "{predicted_peak_gib:.2f}".format(**report))
    for w in report["worst"]:
        print(f"  {w['op']}: peak {w['measured_peak_gib']:.2f} measured / {w['predicted_peak_gib']:.2f} predicted, "
              f"after {w['measured_after_gib']:.2f} / {w['predicted_after_gib']:.2f}")
    if error is not None:
        raise error
    return report, s


def save_artifacts(folder: Path, plan, prof) -> Path:
    """The plan, the profiled step and what ``lazytrain trace --measured`` draws from them."""
    from lazytrain.compiler.timeline import write_step
    folder.mkdir(parents=True, exist_ok=True)
    plan.save(folder / "plan.json")
    prof.save(folder / "profile.json", plan)
    for line in write_step(plan, folder / "trace.json", plot=folder / "memory.png", profile=prof):
        print(line)
    return folder


if __name__ == "__main__":
    main()
