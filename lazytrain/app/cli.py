"""The ``lazytrain`` command: argument parsing only; the work is in compiler/ and runtime/.

Each command imports what it runs in its handler; ``build_parser(cmd)`` adds train's and bench's flags only for them."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

from ..ir import GiB, Plan, PlanError, Sizes, verify
from ..ir.summary import model_tflops_text
from .cli_types import _batch, _minutes, _non_negative, _positive, _positive_float, _resident, _seed, _seq_tile, _size


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``lazytrain train: error: argument --batch: ...``) and a
    pointer to ``--help``, not the whole usage block with the error under it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _presets() -> str:
    from ..frontend.preset_configs import PRESETS
    return ", ".join(PRESETS)


def _difficulty(text: str) -> str:
    """A task preset, or one in answer formats (``tiny-pad-rev``), as its canonical name."""
    from ..tasks import get_difficulty
    try:
        return get_difficulty(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid choice: {e}") from None


def _add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"a preset ({_presets()}), a Hugging Face config.json (or its folder), "
                                 f"or package.module:factory (imports that module and calls the factory: it runs "
                                 f"code, so name only code you trust)")
    p.add_argument("--batch", type=_batch, default=8, help="global batch size, or 'max' (default 8)")
    p.add_argument("--seq", type=_batch, default=None,
                   help="sequence length, or 'max': the longest that fits the batch (default 1024, or the "
                        "positions the model handles when it has fewer)")
    p.add_argument("--micro-batch", type=_positive, default=None, help="micro-batch size (default: chosen)")
    p.add_argument("--gpu-memory", type=_size, default=None,
                   help="GPU budget, e.g. 24GiB (default: the hardware profile's GPU memory)")
    p.add_argument("--host-memory", type=_size, default=None,
                   help="host budget (default: the hardware profile's host memory less a reserve)")
    p.add_argument("--nvme-dir", default=None, help="folder for the NVMe tier")
    p.add_argument("--nvme-memory", type=_size, default=None, help="NVMe budget, e.g. 200GiB")
    p.add_argument("--hardware", default=None, help="built-in profile name or a file from `lazytrain profile` "
                                                    "(default: the h200 profile, said on stderr)")
    p.add_argument("--policy", default="milp", choices=["milp", "megatrain", "recompute-all", "keep-all"])
    p.add_argument("--optimizer", default="hybrid8bit", choices=["hybrid8bit", "adamw"])
    p.add_argument("--solver", default="highs", choices=["highs", "cbc"],
                   help="MILP solver tried first (default highs); the other is the fallback where it crashes, hangs or "
                        "answers garbage (not where it finds no plan in its time). Solves run in a child process: a "
                        "solver crash costs that solve, never the compile")
    p.add_argument("--time-limit", type=_positive_float, default=None,
                   help="MILP time limit per solve, seconds (default: the compile's solver budget, a few seconds)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="parameter dtype")
    p.add_argument("--seq-tile", type=_seq_tile, default="auto", metavar="auto|none|N",
                   help="run the layers' position-wise tails in chunks of N tokens, recomputed in backward; auto "
                        "(default): in chunks of 4096 only when no plan fits without")
    _add_resident_arg(p)
    p.add_argument("--gpu-update", type=_resident, default="auto", metavar="none|auto|N|i,j,..", help="streamed "
                   "blocks updated on the GPU (state over PCIe): auto (milp, on a GPU) chooses, N: the first N")
    p.add_argument("--loss-head", default="auto", choices=["auto", "single_pass", "recompute"],
                   help="how the fused LM head + cross-entropy forms its gradients: single_pass (in the forward, "
                        "no logits recomputed, a vocab x hidden fp32 accumulator held), recompute (the backward "
                        "recomputes the logits), auto (default: the searched plan with a single pass where it still "
                        "fits and the predicted step is shorter, on a GPU profile)")


def _add_resident_arg(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--resident", type=_resident, default=default, metavar="none|auto|N|i,j,..",
                   help="keep blocks on the GPU for the whole run (parameters, optimizer state, gradients; their "
                        "update runs on the GPU): auto lets the compiler choose how many of the first blocks (milp "
                        f"policy, on a GPU), N keeps the first N (tied groups whole) (default {default})")


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from ..tasks import FORMATS
    from ..tasks import PRESETS as DIFFICULTIES
    from .finetune import FinetuneConfig
    from .train import TrainConfig
    d, f = TrainConfig(), FinetuneConfig()
    p.add_argument("--model", default=d.model, metavar="M",
                   help=f"'task' (a small GPT sized for the task, default), a preset ({_presets()}), a local "
                        f"Hugging Face folder (config.json and *.safetensors: fine-tune its "
                        f"weights; config.json alone: random init), a config.json, or package.module:factory "
                        f"(imports and calls it: runs code, so name only code you trust)")
    p.add_argument("--difficulty", default=d.difficulty, type=_difficulty, metavar="NAME",
                   help=f"arithmetic task preset ({', '.join(DIFFICULTIES)}; default {d.difficulty}), optionally with "
                        f"answer formats after it, e.g. tiny-pad-rev ({', '.join(FORMATS)}: tasks/formats.py)")
    p.add_argument("--batch", type=_positive, default=d.batch, metavar="N",
                   help=f"global batch size (default {d.batch})")
    p.add_argument("--seq", type=_positive, default=None, metavar="N",
                   help="sequence length in tokens, at least the difficulty's longest example (default: that)")
    p.add_argument("--steps", type=_positive, default=None, metavar="N",
                   help=f"optimizer steps in all, counting those of a --resume'd run (default {d.steps}; with --data: "
                        f"--epochs; --time-limit-min may stop it sooner)")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help=f"peak learning rate (default {d.lr}; with --data {f.lr})")
    p.add_argument("--warmup", type=_non_negative, default=None, metavar="N",
                   help=f"warm-up steps (default {d.warmup}; with --data {f.warmup})")
    p.add_argument("--gpu-memory", type=_size, default=None, metavar="SIZE",
                   help="GPU budget, e.g. 24GiB (default: the GPU's)")
    p.add_argument("--host-memory", type=_size, default=None, metavar="SIZE",
                   help="host budget, e.g. 64GiB (default: the host's)")
    p.add_argument("--policy", default=d.policy, choices=["milp", "megatrain", "recompute-all", "keep-all"],
                   help=f"how the plan is chosen: the MILP solver, or a fixed heuristic (default {d.policy})")
    _add_resident_arg(p, d.resident)
    p.add_argument("--eval-every", type=_non_negative, default=d.eval_every, metavar="N",
                   help="exact match on 200 eval problems every N steps (default: only at the end)")
    p.add_argument("--eval-size", type=_positive, default=None, metavar="N",
                   help=f"held-out problems for the final exact match (default {d.eval_size}; with --data: at most "
                        f"this many eval examples, default {f.eval_size})")
    p.add_argument("--seed", type=_seed, default=d.seed,
                   help=f"model initialisation and data order, 0 to 2**63 - 1 (default {d.seed})")
    p.add_argument("--time-limit-min", type=_minutes, default=d.time_limit_min, metavar="MIN",
                   help=f"stop training after this many minutes; the lr schedule anneals by then; 0: no limit "
                        f"(default {d.time_limit_min:g})")
    p.add_argument("--output", default=d.output, metavar="DIR", help=f"metrics.json + checkpoint/ (default {d.output})")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run saved in DIR (an --output folder) up to --steps, with its model, data, "
                        "batch and plan; only data is read from DIR, no code runs")
    p.add_argument("--allow-factory", action="store_true",
                   help="let --resume import and call the package.module:factory the run recorded (code named in "
                        "DIR: only for a run folder you trust)")
    p.add_argument("--answer-only-loss", action="store_true",
                   help="loss on the answer only (default: on every token; see lazytrain/app/train.py)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when there is a GPU")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpus", type=_positive, default=None, metavar="N",
                   help="train on N GPUs of this host: N processes started by torch.distributed.run, data parallel "
                        "with the host state sharded; --batch is the global batch (a multiple of N)")
    g.add_argument("--nproc", type=_positive, default=None, metavar="N",
                   help="as --gpus, but N processes on the CPU (gloo): a run of several ranks without GPUs")
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="CPU threads, at most the cores (default: measured, starting from the cores idle at the start)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--profile", type=int, nargs="?", const=5, default=None, metavar="STEP",
                   help="time every op of step STEP (default 5): print how much of each transfer kind and of the "
                        "host update was hidden under compute; write profile.json, trace.json and memory.png")
    _add_data_args(p.add_argument_group("fine-tune on your data (README: Fine-tune your model)"))


def _add_data_args(p) -> None:
    from ..data import LOSS_ON
    p.add_argument("--data", default=None, metavar="FILE",
                   help="train on this JSONL / JSON file (messages, conversations, prompt/completion, alpaca or text "
                        "records) instead of the built-in task; --model then names a pretrained model: "
                        "smollm2-135m-instruct, a Hugging Face folder or a GGUF file")
    p.add_argument("--eval-data", default=None, metavar="FILE",
                   help="evaluate on this file (default: 5%% of --data held out, by a hash of each example)")
    p.add_argument("--tokenizer", default=None, metavar="T", help="a tokenizer other than the model's (folder, GGUF "
                                                                  "file or named model)")
    p.add_argument("--loss-on", default="completion", choices=list(LOSS_ON),
                   help="completion: only the completion / assistant turns carry a loss (default); all: every token")
    p.add_argument("--truncate", default="truncate", choices=["truncate", "drop"],
                   help="examples longer than --seq: cut them (default) or leave them out; counted in the report")
    p.add_argument("--pack", action="store_true",
                   help="several examples a row, each attending only to itself (same loss and gradients as unpacked)")
    p.add_argument("--answer-regex", default=None, metavar="RE",
                   help="exact match compares the first match of RE (its first group) in reply and reference "
                        "(default: the last number)")
    p.add_argument("--max-new-tokens", type=_positive, default=None, metavar="N",
                   help="longest reply generated in evaluation (default: 1.5x the longest reference + 8)")
    p.add_argument("--epochs", type=_positive_float, default=None, help="epochs when --steps is not given (default 1)")
    p.add_argument("--no-eval", action="store_true", help="no exact-match evaluation, during or after the run "
                                                          "(throughput runs)")
    p.add_argument("--no-export", action="store_true", help="do not write OUTPUT/model/, the Hugging Face folder a "
                                                            "--data run writes")
    p.add_argument("--export-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the exported weights (default: that of the weights the model came with)")


def cmd_compile(a) -> int:
    from ..compiler.progress import on_stderr
    from ..compiler.request import DEFAULT_HARDWARE
    from ..frontend.validate import declared_positions
    from ..util.atomic import output_path
    if a.nvme_memory and not a.nvme_dir:
        raise PlanError("--nvme-memory needs --nvme-dir (the folder to spill to)")
    output_path(a.output, "plan")          # a bad -o now, not after the compile
    seq = a.seq or min(1024, declared_positions(a.model) or 1024)
    if a.calibrate:
        from ..measure.calibrate import compile_measured as compile_plan
    else:
        from ..compiler.api import compile_model as compile_plan
    with on_stderr("lazytrain compile: ", a.progress):
        plan = compile_plan(a.model, batch_size=a.batch, seq_len=seq, micro_batch=a.micro_batch,
                            gpu_memory=a.gpu_memory, host_memory=a.host_memory, nvme_dir=a.nvme_dir,
                            nvme_memory=a.nvme_memory, hardware=a.hardware or DEFAULT_HARDWARE, policy=a.policy,
                            optimizer=a.optimizer, solver=a.solver, time_limit=a.time_limit, param_dtype=a.dtype,
                            resident=a.resident, calibrate=a.calibrate, seq_tile=a.seq_tile, world_size=a.world_size,
                            nodes=a.nodes, compile_blocks=a.compile_blocks, gpu_update=a.gpu_update,
                            loss_head=a.loss_head)
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
    from ..compiler.simulate import simulate
    pred = plan.predicted
    if not pred.get("step_time_s"):
        return None
    sim = simulate(plan)
    wrong = []
    if not math.isclose(sim.step_time_s, pred["step_time_s"], rel_tol=1e-6):
        wrong.append(f"step {pred['step_time_s']:.4f} s (its ops: {sim.step_time_s:.4f} s)")
    stored = pred.get("peak_gpu_bytes")
    if stored is not None and stored != sim.peak_gpu_bytes:
        wrong.append(f"peak GPU {stored / GiB:.2f} GiB (its ops: {sim.peak_gpu_bytes / GiB:.2f} GiB)")
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
    from .train import TrainConfig, run
    n = a.gpus or a.nproc
    if n and (a.device or ("cuda" if a.gpus else "cpu")) != ("cuda" if a.gpus else "cpu"):
        raise ValueError(f"--device {a.device} with {'--gpus' if a.gpus else '--nproc'}: "
                         "--gpus runs on CUDA GPUs, --nproc on the CPU")
    if n:
        from .launch import check_launch, launch
        a.device = "cuda" if a.gpus else "cpu"
        if n > 1 and check_launch(n):
            return launch(a.argv, n, gpus=bool(a.gpus))
    cls, extra = TrainConfig, {}
    if a.data:
        from .finetune import FinetuneConfig as cls
        extra = dict(data=a.data, eval_data=a.eval_data, tokenizer=a.tokenizer, loss_on=a.loss_on, truncate=a.truncate,
                     pack=a.pack, answer_regex=a.answer_regex, max_new_tokens=a.max_new_tokens,
                     epochs=a.epochs or 1.0, export=not a.no_export,
                     export_dtype=a.export_dtype)
    d = cls()
    cfg = cls(model=a.model, difficulty=a.difficulty, batch=a.batch, seq=a.seq,
              steps=d.steps if a.steps is None else a.steps, lr=a.lr or d.lr,
              warmup=d.warmup if a.warmup is None else a.warmup, gpu_memory=a.gpu_memory, host_memory=a.host_memory,
              policy=a.policy, resident=a.resident,
              eval_every=a.eval_every, eval_size=a.eval_size or d.eval_size, seed=a.seed,
              time_limit_min=a.time_limit_min, output=a.output, resume=a.resume,
              loss_on_prompt=not a.answer_only_loss, device=a.device, threads=a.threads, profile=a.profile,
              progress=not a.no_progress, allow_factory=a.allow_factory, evaluate=not a.no_eval, **extra)
    run(cfg)
    return 0


def cmd_export(a) -> int:
    from .finetune.export_cmd import export_checkpoint
    print(f"wrote {export_checkpoint(a.source, a.output, config=a.config, tokenizer=a.tokenizer, dtype=a.dtype)}")
    return 0


def cmd_bench(a) -> int:
    from ..measure.bench import config_from_args, run
    run(config_from_args(a))
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    ap = _Parser(prog="lazytrain", description="Compile and run training schedules for models larger than the GPU.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("compile", help="trace, cost, solve, lower, verify; write the plan")
    _add_compile_args(p)
    p.add_argument("-o", "--output", default="plan.json")
    p.add_argument("--calibrate", action="store_true",
                   help="time the model's blocks on this machine at the plan's shapes and compile with those times "
                        "(written into --hardware when it is a file)")
    p.add_argument("--world-size", type=_positive, default=1, metavar="N",
                   help="data-parallel GPUs the plan is for (ZeRO-3 sharding of the host state; --batch is then "
                        "per GPU, --host-memory per host) (default 1)")
    p.add_argument("--nodes", type=_positive, default=1, help="hosts the --world-size GPUs are spread over (default 1)")
    p.add_argument("--compile-blocks", action="store_true",
                   help="the runtime compiles each distinct block program with Inductor (forward and backward; the "
                        "plan still keeps, offloads and recomputes what backward saves); off by default until "
                        "measured on a GPU")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="say on stderr what the compile is doing (tracing, each micro-batch's solve, the GPU-update "
                        "rule): auto (default) where stderr is a terminal")
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("show", help="print a plan as tables")
    p.add_argument("plan")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ops", action="store_true", help="the op list")
    g.add_argument("--summary", action="store_true", help="totals (default)")
    g.add_argument("--blocks", action="store_true", help="per-block decisions")
    p.add_argument("--limit", type=_positive, default=None, help="show at most this many ops")
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
    p = sub.add_parser("profile", help="measure this machine into a hardware profile")
    p.add_argument("-o", "--output", default="hw.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--disk-dir", default=None, help="where to time disk I/O (default: a temp folder)")
    p.add_argument("--model", default=None, metavar="M",
                   help="also time this model's block programs (forward, backward, recompute) at the shapes a plan "
                        "uses, into -o (added to it when it exists, else after measuring the machine)")
    p.add_argument("--seq", type=_positive, default=1024, help="with --model: sequence length (default 1024)")
    p.add_argument("--batch", type=_positive, default=8, help="with --model: the batch a plan is for (default 8)")
    p.add_argument("--micro-batch", type=_positive, default=None,
                   help="with --model: micro-batch to time (default: the one a plan for --batch chooses)")
    p.add_argument("--gpu-memory", type=_size, default=None, help="with --model: GPU budget of that plan")
    p.add_argument("--compile-blocks", action="store_true",
                   help="with --model: time the block programs compiled by Inductor, and each cut of a block the "
                        "compiler may choose, as plans compiled with --compile-blocks run them")
    p.add_argument("--step", nargs="+", default=None, metavar="PLAN PROFILE",
                   help="PLAN PROFILE [PROFILE ...]: write into -o (an existing profile) the host update, parameter "
                        "load and gradient offload rates and the measured blocks' in-step scales that PLAN's profiled "
                        "steps reached (from `train --profile`; each the median over the steps given); later "
                        "compiles price those ops at them")
    p.set_defaults(fn=cmd_profile)
    p = sub.add_parser("train", help="train on the built-in arithmetic task: compile, train, evaluate, save",
                       description="Train on generated arithmetic word problems: build the model, compile a plan "
                                   "for this machine (CUDA when there is a GPU, else the CPU), train until --steps or "
                                   "--time-limit-min, report exact match on held-out problems, and write "
                                   "metrics.json, loss.png and checkpoint/ into --output. Ctrl-C stops after the "
                                   "step in flight and saves; twice stops at once.")
    if command in (None, "train"):
        _add_train_args(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("export", help="a checkpoint as a Hugging Face folder (config, sharded safetensors, tokenizer)")
    p.add_argument("source", metavar="CHECKPOINT_DIR", help="a checkpoint folder, or the --output folder of a run")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the model folder to write")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="the model's config.json (or its folder; default: the run's)")
    p.add_argument("--tokenizer", default=None, metavar="T",
                   help="tokenizer to include: a folder, GGUF file or named model (default: the run's, if any)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the weights (default: the config's)")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("bench", help="side-by-side benchmark: lazytrain, FSDP2 + CPU offload, plain PyTorch")
    if command in (None, "bench"):
        from ..measure.bench import add_args as _add_bench_args
        _add_bench_args(p)
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    a = build_parser(args[0] if args and not args[0].startswith("-") else None).parse_args(args)
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
