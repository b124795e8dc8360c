"""The ``lazytrain`` command: argument parsing only; the work is in compiler/ and runtime/.

Each command imports what it runs in its handler; ``build_parser(cmd)`` adds train's and bench's flags only for them."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import fields

from ..compiler.options import LossHead, Optimizer, Policy, Solver
from ..ir import GiB, Plan, PlanError, Sizes, verify
from ..ir.summary import model_tflops_text
from .cli_types import lora, positive, positive_float, positive_or_max, resident, seq_tile, size


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``lazytrain train: error: argument --batch: ...``) and a
    pointer to ``--help``, not the whole usage block with the error under it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _presets() -> str:
    from ..frontend.preset_configs import PRESETS
    return ", ".join(PRESETS)


def _add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"a preset ({_presets()}), a Hugging Face config.json (or its folder), "
                                 f"or package.module:factory (imports that module and calls the factory: it runs "
                                 f"code, so name only code you trust)")
    p.add_argument("--batch", type=positive_or_max, default=8,
                   help="global batch size: the rows one optimizer step sees, over all --world-size GPUs (each GPU's "
                        "plan takes batch / world size), or 'max': the largest batch a GPU's plan fits, times the "
                        "world size (default 8)")
    p.add_argument("--seq", type=positive_or_max, default=None,
                   help="sequence length, or 'max': the longest that fits the batch (default 1024, or the "
                        "positions the model handles when it has fewer)")
    p.add_argument("--micro-batch", type=positive, default=None, help="micro-batch size (default: chosen)")
    p.add_argument("--gpu-memory", type=size, default=None,
                   help="GPU budget, e.g. 24GiB (default: the hardware profile's GPU memory)")
    p.add_argument("--host-memory", type=size, default=None,
                   help="host budget (default: the hardware profile's host memory less a reserve)")
    p.add_argument("--nvme-dir", default=None,
                   help="folder on a fast drive for the NVMe tier: activations the plan spills, and the training "
                        "state (optimizer state, gradients, parameters) that does not fit --host-memory")
    p.add_argument("--nvme-memory", type=size, default=None,
                   help="NVMe budget, e.g. 1TiB (compile names what the state needs when it is short)")
    p.add_argument("--hardware", default=None, help="built-in profile name or a file from `lazytrain profile` "
                                                    "(default: the h200 profile, said on stderr)")
    p.add_argument("--policy", default=Policy.MILP.value, choices=Policy.names(),
                   help="how the schedule is chosen: milp (default: the mixed-integer program decides checkpointing, "
                        "placement, recomputation and overlap), or a fixed rule to compare with: megatrain (a "
                        "boundary kept every 4 layers, the rest recomputed: MegaTrain's), recompute-all (every "
                        "block recomputed), keep-all (nothing recomputed)")
    p.add_argument("--optimizer", default=Optimizer.HYBRID8BIT.value, choices=Optimizer.names())
    p.add_argument("--solver", default=Solver.HIGHS.value, choices=Solver.names(),
                   help="MILP solver tried first (default highs); the other is the fallback where it crashes, hangs or "
                        "answers garbage (not where it finds no plan in its time). Solves run in a child process: a "
                        "solver crash costs that solve, never the compile")
    p.add_argument("--time-limit", type=positive_float, default=None,
                   help="MILP time limit per solve, seconds (default: the compile's solver budget, a few seconds)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="parameter dtype")
    p.add_argument("--seq-tile", type=seq_tile, default="auto", metavar="auto|none|N",
                   help="run the layers' position-wise tails in chunks of N tokens, recomputed in backward; auto "
                        "(default): in chunks of 4096 only when no plan fits without")
    _add_resident_arg(p)
    p.add_argument("--gpu-update", type=resident, default="auto", metavar="none|auto|N|i,j,..", help="streamed "
                   "blocks updated on the GPU (state over PCIe): auto (milp, on a GPU) chooses, N: the first N")
    p.add_argument("--lora", type=lora, default=None, metavar="r=R,alpha=A,targets=M,..",
                   help="train LoRA adapters (PEFT) on the named modules instead of the whole model, e.g. r=16,"
                        "alpha=32,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (targets=all-linear: "
                        "those seven), dropout=0 by default: the base streams frozen, without gradients or optimizer "
                        "state (needs the lora extra: pip install 'lazytrain[lora]')")
    p.add_argument("--base-bits", type=int, default=16, choices=(16, 8, 4),
                   help="with --lora: bits the frozen base is held in on the host and moved to the GPU in (16: the "
                        "parameter dtype; 8: block-wise int8; 4: NF4) (default 16)")
    p.add_argument("--loss-head", default=LossHead.AUTO.value, choices=LossHead.names(),
                   help="how the fused LM head + cross-entropy forms its gradients: single_pass (in the forward, "
                        "no logits recomputed, a vocab x hidden fp32 accumulator held), recompute (the backward "
                        "recomputes the logits), auto (default: the searched plan with a single pass where it still "
                        "fits and the predicted step is shorter, on a GPU profile)")


def _add_resident_arg(p: argparse.ArgumentParser) -> None:
    """The compile's ``--resident``: train's setting (``TrainConfig.resident``), its default ``auto``."""
    from .config import TrainConfig, setting_of
    s = setting_of(TrainConfig.__dataclass_fields__["resident"])
    _add_setting(p, "resident", s, s.help.format(d=TrainConfig()), default="auto")


def _add_train_args(p: argparse.ArgumentParser) -> None:
    """``lazytrain train``'s flags: one for each setting of ``TrainConfig`` and ``FinetuneConfig`` that has a help
    text (``config.py``; its default is the config's, so a flag left out is not in the namespace), and the
    launch's ``--gpus`` / ``--nproc``."""
    from ..compiler.profiles import PROFILES
    from ..tasks import FORMATS
    from ..tasks import PRESETS as DIFFICULTIES
    from .config import FinetuneConfig, TrainConfig, setting_of
    context = dict(d=TrainConfig(), f=FinetuneConfig(), presets=_presets(), difficulties=", ".join(DIFFICULTIES),
                   profiles=", ".join(PROFILES),
                   formats=", ".join(FORMATS))
    data = p.add_argument_group("fine-tune on your data (README: Fine-tune your model)")
    for f in fields(FinetuneConfig):
        s = setting_of(f)
        if s.help is not None:
            _add_setting(data if s.group == "data" else p, f.name, s, s.help.format(**context))
        if f.name == "device":          # the launch's flags where they always stood: beside --device
            _add_launch_args(p)


def _add_setting(p, name: str, s, help: str, default=argparse.SUPPRESS) -> None:
    """One setting's flag: ``--name VALUE`` (its type and choices), or without a value where it has a ``const``
    (``--no-eval``; ``--profile [STEP]`` takes one optionally)."""
    kw = dict(dest=name, default=default, help=help)
    if s.const is not None and s.nargs is None:
        kw.update(action="store_const", const=s.const)
    else:
        choices = s.choices() if callable(s.choices) else s.choices
        kw.update(type=s.type, choices=choices, metavar=s.metavar, nargs=s.nargs, const=s.const)
    p.add_argument(s.flag_name(name), **kw)


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpus", type=positive, default=None, metavar="N",
                   help="train on N GPUs of this host: N processes started by torch.distributed.run, data parallel "
                        "with the host state sharded; --batch is the global batch (a multiple of N)")
    g.add_argument("--nproc", type=positive, default=None, metavar="N",
                   help="as --gpus, but N processes on the CPU (gloo): a run of several ranks without GPUs")


def cmd_compile(a) -> int:
    from ..compiler.progress import on_stderr
    from ..compiler.request import DEFAULT_HARDWARE
    from ..frontend.validate import declared_positions
    from ..util.atomic import output_path
    if a.nvme_memory and not a.nvme_dir:
        raise PlanError("--nvme-memory needs --nvme-dir (the folder to spill to)")
    output_path(a.output, "plan")          # a bad -o now, not after the compile
    batch = _rank_batch(a.batch, a.world_size)
    seq = a.seq or min(1024, declared_positions(a.model) or 1024)
    if a.calibrate:
        from ..measure.calibrate import compile_measured as compile_plan
    else:
        from ..compiler.api import compile_model as compile_plan
    with on_stderr("lazytrain compile: ", a.progress):
        plan = compile_plan(a.model, batch_size=batch, seq_len=seq, micro_batch=a.micro_batch,
                            gpu_memory=a.gpu_memory, host_memory=a.host_memory, nvme_dir=a.nvme_dir,
                            nvme_memory=a.nvme_memory, hardware=a.hardware or DEFAULT_HARDWARE, policy=a.policy,
                            optimizer=a.optimizer, solver=a.solver, time_limit=a.time_limit, param_dtype=a.dtype,
                            resident=a.resident, calibrate=a.calibrate, seq_tile=a.seq_tile, world_size=a.world_size,
                            nodes=a.nodes, compile_blocks=a.compile_blocks, gpu_update=a.gpu_update,
                            loss_head=a.loss_head, lora=a.lora, base_bits=a.base_bits)
    if a.hardware is None:      # after the progress lines: the plan's own line
        print(f"lazytrain: no --hardware given: planned for the {DEFAULT_HARDWARE} profile; name another with "
              f"--hardware (a built-in profile, or a file from `lazytrain profile`)", file=sys.stderr)
    if not a.calibrate:
        from ..compiler.cost import hint_uncalibrated
        hint_uncalibrated(plan, a.model)
    plan.save(a.output)
    print(plan.summary())
    print(f"wrote {a.output}")
    return 0


def _rank_batch(batch: int | str, world_size: int) -> int | str:
    """Each GPU's share of the global ``--batch`` (``max``: the largest a GPU's plan fits), or a one-line error
    where it does not divide."""
    if batch == "max" or batch % world_size == 0:
        return batch if batch == "max" else batch // world_size
    raise PlanError(f"--batch {batch} is the global batch, split evenly over --world-size {world_size} GPUs: it must "
                    f"be a multiple of {world_size}")


def cmd_show(a) -> int:
    plan = Plan.load(a.plan)
    if a.ops:
        print(plan.table(limit=a.limit))
    elif a.blocks:
        print(_blocks_table(plan))
    else:
        print(plan.summary())
        stale = stale_predictions(plan)
        if stale:
            print(f"lazytrain show: {stale}", file=sys.stderr)
    return 0


def stale_predictions(plan) -> str | None:
    """What the plan file's stored predictions say that its ops do not simulate to (a file edited after it was
    compiled), or None: ``show`` prints the stored figures, so it says when they are not the ops' own."""
    from ..compiler.simulate import predicted_gpu_peak, simulate
    pred = plan.predicted
    if not pred.get("step_time_s"):
        return None
    sim = simulate(plan)
    wrong = []
    if not math.isclose(sim.step_time_s, pred["step_time_s"], rel_tol=1e-6):
        wrong.append(f"step {pred['step_time_s']:.4f} s (its ops: {sim.step_time_s:.4f} s)")
    stored = pred.get("peak_gpu_bytes")
    if stored is not None and stored != (peak := predicted_gpu_peak(verify(plan), sim)):
        wrong.append(f"peak GPU {stored / GiB:.2f} GiB (its ops: {peak / GiB:.2f} GiB)")
    if not wrong:
        return None
    return (f"the file's predicted {'; '.join(wrong)}: the plan was changed after it was compiled (`lazytrain "
            "simulate` prints what its ops give)")


def _blocks_table(plan) -> str:
    from tabulate import tabulate
    d = plan.decisions
    sizes = Sizes.of_plan(plan)
    rows = []
    for b in plan.graph.blocks:
        k = d.cut_of(b.index)
        saved = d.saved[b.index].value + (f" (cut {b.cuts[k].budget:g})" if k else "")
        rows.append([b.index, b.name, b.kind, f"{b.param_numel / 1e6:.1f}",
                     f"{sizes.saved_per_sample(b.index) * d.micro_batch / GiB:.3f}",
                     f"{b.fwd_flops * d.micro_batch / 1e12:.3f}",
                     saved, d.boundary[b.index].value, "yes" if d.is_resident(b.index) else ""])
    # two-line headers keep the table inside ~90 columns
    return tabulate(rows, headers=["#", "block", "kind", "params\nM", "saved\nGiB/mb", "fwd\nTFLOP/mb", "saved",
                                   "boundary", "resident"])


def cmd_simulate(a) -> int:
    from tabulate import tabulate

    from ..compiler.simulate import simulate
    plan = Plan.load(a.plan)
    rep = verify(plan)
    sim = simulate(plan)
    flops = 6 * plan.graph.active_params * plan.batch_size * plan.seq_len
    attn = plan.graph.attention_model_flops * plan.batch_size
    rows = [["step time", f"{sim.step_time_s:.4f} s"],
            ["model TFLOPS", model_tflops_text({"model_tflops": flops / sim.step_time_s / 1e12,
                                                "model_attn_tflops": (flops + attn) / sim.step_time_s / 1e12})],
            ["GPU idle (exposed transfers/updates)", f"{sim.gpu_idle_s:.4f} s"]]
    rows += [[f"busy {r}", f"{s:.4f} s ({100 * s / sim.step_time_s:.0f}%)"] for r, s in sim.busy_s.items()]
    rows += [["peak GPU", f"{max(rep.peak_gpu_bytes, sim.peak_gpu_bytes) / GiB:.2f} GiB"],
             ["peak host", f"{rep.peak_host_bytes / GiB:.2f} GiB"],
             ["peak NVMe", f"{rep.peak_nvme_bytes / GiB:.2f} GiB"]]
    print(tabulate(rows, tablefmt="plain"))
    return 0


def cmd_trace(a) -> int:
    from ..compiler.timeline import write_step
    plan = Plan.load(a.plan)
    profile = None
    if a.measured:
        from ..runtime.profiling import StepProfile
        profile = StepProfile.load(a.measured)
        try:
            profile.check(plan)
        except ValueError as e:
            raise ValueError(f"{a.measured} does not belong to {a.plan}: {e}") from None
    for line in write_step(plan, a.output, plot=a.plot, profile=profile):
        print(line)
    return 0


def cmd_profile(a) -> int:
    from ..measure.profile import measure
    if a.step:
        from ..measure.step_rates import refit_file
        print(refit_file(a.output, *a.step))
        return 0
    if not (a.model and os.path.isfile(a.output)):
        hw = measure(quick=a.quick, disk_dir=a.disk_dir)
        with open(a.output, "w") as f:
            json.dump(hw.to_json(), f, indent=1)
        print(hw)
    if a.model:
        from ..measure.calibrate import compile_measured
        plan = compile_measured(a.model, batch_size=a.batch, seq_len=a.seq, micro_batch=a.micro_batch,
                                gpu_memory=a.gpu_memory, hardware=a.output, calibrate=True,
                                param_dtype="bfloat16" if _has_cuda() else "float32", compile_blocks=a.compile_blocks)
        print(plan.summary())
    print(f"wrote {a.output}")
    return 0


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def cmd_train(a) -> int:
    from ..runtime.distributed import env_world_size
    from .config_file import apply
    from .session import stop_status
    from .train import run
    path, items = a.config_file, list(a.overrides)
    if path is not None and "=" in path and not path.lower().endswith((".yaml", ".yml", ".json")):
        path, items = None, [path, *items]      # ``lazytrain train max_steps=5``: no file, only KEY=VALUEs
    a.gpus, a.nproc = getattr(a, "gpus", None), getattr(a, "nproc", None)
    apply(a, path, items)
    if a.print_config:
        from .config_file import dump
        print(dump(config_from_args(a), {"gpus": a.gpus, "nproc": a.nproc}), end="")
        return 0
    n = a.gpus or a.nproc
    if n:
        wanted = "cuda" if a.gpus else "cpu"
        device = getattr(a, "device", None)
        if (device or wanted) != wanted:
            raise ValueError(f"--device {device} with {'--gpus' if a.gpus else '--nproc'}: "
                             "--gpus runs on CUDA GPUs, --nproc on the CPU")
        from .launch import check_launch, launch
        a.device = wanted
        if n > 1 and check_launch(n):
            return launch(a.argv, n, gpus=bool(a.gpus))
    cfg = config_from_args(a)
    metrics = run(cfg)
    if env_world_size() > 1:        # a rank: the launcher reports the run (a rank's non-zero status is a failure)
        return 0
    if metrics.get("stopped_by"):
        print(f"lazytrain train: stopped by {metrics['stopped_by']} after step {metrics['steps_done']}, checkpoint and "
              f"metrics saved: continue with --resume {cfg.output}", file=sys.stderr)
    return stop_status(metrics)


def config_from_args(a: argparse.Namespace):
    """The run's configuration from ``lazytrain train``'s parsed flags: the settings given (and which they were:
    ``given``, for a resume), the config's defaults for the rest (``FinetuneConfig``'s with ``--data`` or a resumed
    ``--data`` run; else a fine-tune flag has no use: said, and left out)."""
    from .config import FinetuneConfig, TrainConfig, setting_of
    cls = TrainConfig
    if "data" in vars(a) or _resumes_a_data_run(getattr(a, "resume", None)):
        cls = FinetuneConfig
    names = {f.name for f in fields(cls)}
    unused = sorted(k for k in vars(a) if k in {f.name for f in fields(FinetuneConfig)} - names)
    if unused:
        flags = ", ".join(setting_of(FinetuneConfig.__dataclass_fields__[k]).flag_name(k) for k in unused)
        warnings.warn(f"{flags}: flags of a run on a data file (--data); this run trains the built-in task and "
                      f"ignores them", stacklevel=2)
    given = {k: v for k, v in vars(a).items() if k in names}
    return cls(**given, given=frozenset(given))


def _resumes_a_data_run(folder: str | None) -> bool:
    """Does ``--resume`` name the output of a ``--data`` run (whose flags, ``--pack`` and the like, then count)?"""
    if not folder:
        return False
    from .finetune.run import is_finetune_run  # (imports torch: only for a resume)
    return is_finetune_run(folder)


def cmd_export(a) -> int:
    from .finetune.export_cmd import export_checkpoint
    written = export_checkpoint(a.source, a.output, config=a.config, tokenizer=a.tokenizer, dtype=a.dtype,
                                merge=a.merge)
    print(f"wrote {' and '.join(str(p) for p in written)}")
    return 0


def cmd_bench(a) -> int:
    from ..measure.bench import config_from_args, run
    run(config_from_args(a))
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``lazytrain`` parser; ``command`` given: only that command's flags that need imports to describe (train's,
    bench's) are added, so a command never loads another's modules."""
    ap = _Parser(prog="lazytrain", description="Compile and run training schedules for models larger than the GPU.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _compile_parser(sub)
    _plan_parsers(sub)
    _profile_parser(sub)
    _train_parser(sub, command in (None, "train"))
    _export_parser(sub)
    _bench_parser(sub, command in (None, "bench"))
    return ap


def _compile_parser(sub) -> None:
    p = sub.add_parser("compile", help="trace, cost, solve, lower, verify; write the plan")
    _add_compile_args(p)
    p.add_argument("-o", "--output", default="plan.json", metavar="PLAN",
                   help="the plan file to write: versioned JSON that `lazytrain show`, `simulate`, `trace` read and a "
                        "Trainer runs (default plan.json)")
    p.add_argument("--calibrate", action="store_true",
                   help="time the model's blocks on this machine at the plan's shapes and compile with those times "
                        "(written into --hardware when it is a file)")
    p.add_argument("--world-size", type=positive, default=1, metavar="N",
                   help="data-parallel GPUs the plan is for (ZeRO-3 sharding of the host state; --batch stays the "
                        "global batch, each GPU's plan takes batch / N; --host-memory is per host) (default 1)")
    p.add_argument("--nodes", type=positive, default=1, help="hosts the --world-size GPUs are spread over (default 1)")
    p.add_argument("--compile-blocks", action="store_true",
                   help="the runtime compiles each distinct block program with Inductor (forward and backward; the "
                        "plan still keeps, offloads and recomputes what backward saves); off by default until "
                        "measured on a GPU")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="say on stderr what the compile is doing (tracing, each micro-batch's solve, the GPU-update "
                        "rule): auto (default) where stderr is a terminal")
    p.set_defaults(fn=cmd_compile)


def _plan_parsers(sub) -> None:
    """``show``, ``simulate`` and ``trace``: what a plan file says."""
    p = sub.add_parser("show", help="print a plan as tables")
    p.add_argument("plan")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ops", action="store_true", help="the op list")
    g.add_argument("--summary", action="store_true", help="totals (default)")
    g.add_argument("--blocks", action="store_true", help="per-block decisions")
    p.add_argument("--limit", type=positive, default=None, help="show at most this many ops")
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("simulate", help="predicted step time, busy time per resource, peak memory per tier")
    p.add_argument("plan")
    p.set_defaults(fn=cmd_simulate)
    p = sub.add_parser("trace", help="Chrome/Perfetto trace of the predicted timeline, or of a measured step")
    p.add_argument("plan")
    p.add_argument("-o", "--output", default="trace.json")
    p.add_argument("--measured", default=None, metavar="PROFILE",
                   help="trace this measured step instead (a profile JSON from StepProfile.save, of this plan)")
    p.add_argument("--plot", default=None, help="also write a memory-over-time PNG here, predicted and (with "
                                                "--measured) measured (needs matplotlib)")
    p.set_defaults(fn=cmd_trace)


def _profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine into a hardware profile")
    p.add_argument("-o", "--output", default="hw.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--disk-dir", default=None, help="where to time disk I/O (default: a temp folder)")
    p.add_argument("--model", default=None, metavar="M",
                   help="also time this model's block programs (forward, backward, recompute) at the shapes a plan "
                        "uses, into -o (added to it when it exists, else after measuring the machine)")
    p.add_argument("--seq", type=positive, default=1024, help="with --model: sequence length (default 1024)")
    p.add_argument("--batch", type=positive, default=8, help="with --model: the batch a plan is for (default 8)")
    p.add_argument("--micro-batch", type=positive, default=None,
                   help="with --model: micro-batch to time (default: the one a plan for --batch chooses)")
    p.add_argument("--gpu-memory", type=size, default=None, help="with --model: GPU budget of that plan")
    p.add_argument("--compile-blocks", action="store_true",
                   help="with --model: time the block programs compiled by Inductor, and each cut of a block the "
                        "compiler may choose, as plans compiled with --compile-blocks run them")
    p.add_argument("--step", nargs="+", default=None, metavar="PLAN PROFILE",
                   help="PLAN PROFILE [PROFILE ...]: write into -o (an existing profile) the host update, parameter "
                        "load and gradient offload rates and the measured blocks' in-step scales that PLAN's profiled "
                        "steps reached (from `train --profile`; each the median over the steps given); later "
                        "compiles price those ops at them")
    p.set_defaults(fn=cmd_profile)


def _train_parser(sub, with_flags: bool) -> None:
    p = sub.add_parser("train", help="fine-tune a model on your data (--data FILE, or a CONFIG.yaml), or train on the "
                                     "built-in arithmetic task: compile, train, evaluate, save",
                       description="Fine-tune a pretrained model on your data (--data FILE: chats, prompt/completion, "
                                   "alpaca or text records; README: Fine-tune your model), or without --data train on "
                                   "generated arithmetic word problems. Either way: build the model, compile a plan "
                                   "for this machine (CUDA when there is a GPU, else the CPU), train until --steps or "
                                   "--time-limit-min, evaluate (exact match of generated answers on held-out "
                                   "examples), and write metrics.json, loss.png and checkpoint/ (with --data also "
                                   "model/, a Hugging Face folder) into --output. The settings may come from a YAML "
                                   "file (CONFIG.yaml) with KEY=VALUE overrides; flags override both. Ctrl-C, SIGTERM "
                                   "or SIGHUP stops after the step in flight and saves (exit status 128 + the "
                                   "signal); twice stops at once.")
    p.add_argument("config_file", nargs="?", default=None, metavar="CONFIG.yaml",
                   help="the run's settings as a YAML file, keyed as Hugging Face's TrainingArguments / TRL's "
                        "SFTConfig name them where they have the setting (learning_rate, max_steps, output_dir, "
                        "per_device_train_batch_size, ...), else by the flag's name with underscores (gpu_memory); "
                        "KEY=VALUE arguments after it and flags override it (README: Config files)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration (every setting, defaults included) as a config file, "
                        "and exit without training")
    if with_flags:
        _add_train_args(p)
    p.set_defaults(fn=cmd_train)


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="a checkpoint as a Hugging Face folder (config, sharded safetensors, tokenizer)")
    p.add_argument("source", metavar="CHECKPOINT_DIR", help="a checkpoint folder, or the --output folder of a run")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the model folder to write")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="the model's config.json (or its folder; default: the run's)")
    p.add_argument("--tokenizer", default=None, metavar="T",
                   help="tokenizer to include: a folder, GGUF file or named model (default: the run's, if any)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the weights (default: the config's)")
    p.add_argument("--merge", action="store_true",
                   help="of a LoRA run: besides DIR/adapter/ (the PEFT adapter), DIR/model/: the adapters merged into "
                        "the base the run recorded (a safetensors folder or named model, checked by its files' "
                        "names and sizes)")
    p.set_defaults(fn=cmd_export)


def _bench_parser(sub, with_flags: bool) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmark: lazytrain, FSDP2 + CPU offload, plain PyTorch")
    if with_flags:
        from ..measure.bench import add_args as _add_bench_args
        _add_bench_args(p)
    p.set_defaults(fn=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args[0] if args and not args[0].startswith("-") else None)
    a, rest = parser.parse_known_args(args)
    a.overrides = []
    if rest:                # ``train CONFIG.yaml key=value ...``: the KEY=VALUEs; anything else is argparse's error
        if a.command != "train" or any(x.startswith("-") for x in rest):
            parser.parse_args(args)         # (exits with argparse's one-line error)
        a.overrides = rest
    a.argv = args     # what --gpus N starts on every rank
    shown = warnings.showwarning
    warnings.showwarning = _warning_printer(a.command, shown)
    try:
        return a.fn(a)
    except (PlanError, ValueError, OSError, RuntimeError) as e:
        if not getattr(e, "quiet", False):       # (a rank's copy of rank 0's error, which rank 0 prints)
            print(f"lazytrain {a.command}: error: {e}", file=sys.stderr)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):    # a rank under torchrun (launch imports torch: seconds)
            from .launch import leave_error
            leave_error(str(e))
        return 2
    except KeyboardInterrupt:
        print(f"lazytrain {a.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown


def _warning_printer(command: str, default):
    """``warnings.showwarning`` for the CLI: LazyTrain's own warnings as one line each, as its errors are
    (``lazytrain compile: warning: ...``, not a source path and line); other packages' as Python shows them."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # lazytrain/, not app/

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(package + os.sep):
            print(f"lazytrain {command}: warning: {message}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)
    return show


if __name__ == "__main__":
    sys.exit(main())
