"""The step loop ``lazytrain train`` runs, on the built-in task (``train.py``) and on a data file
(``finetune/run.py``): one place for when a run stops and what its learning rate is.

``steps`` yields each step to run and stops at ``--steps`` (a total: a resumed run continues from
``start``), at ``--time-limit-min``, or after the step in flight when Ctrl-C was pressed once (the
caller's ``StopFlag``); before each step it sets the optimizer's learning rate (``lr_at``: warm-up,
then cosine to ``min_lr_ratio * lr``, by steps or, under a time limit, by time, whichever is further).
The caller runs the step, and ``Progress.record`` writes it into the loss curve.

Also shared by both: the output folder, the optimizer and Trainer (compiled or resumed), the thread tuner.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..compiler.options import Optimizer
from ..util.host import cpu_cores
from .config import TrainConfig
from .disk_check import slow_disk_warning
from .ranks import Ranks
from .session import choose_device
from .threads import ThreadTuner, cpu_threads


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Warm-up over ``cfg.warmup`` steps, then cosine from ``lr`` to ``min_lr_ratio * lr`` as
    ``progress`` goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def schedule_progress(step: int, start: int, steps: int, elapsed_s: float, limit_s: float | None) -> float:
    """How far the learning-rate schedule is: by steps, or, under a time limit, by this invocation's
    share of the remaining schedule in time, whichever is further (so the schedule anneals by the clock)."""
    progress = step / steps
    if limit_s is not None:
        progress = max(progress, (start + (steps - start) * elapsed_s / limit_s) / steps)
    return progress


@dataclass
class Progress:
    """Where a run is; a resumed run starts from what its metrics committed."""
    step: int
    tokens: int = 0
    history: list[dict] = field(default_factory=list)
    stop_reason: str = "steps"
    interrupted: bool = False
    #: the signal that stopped it (``StopFlag.signal``'s name: SIGINT, SIGTERM, SIGHUP), None when none did
    stopped_by: str | None = None
    #: seconds of this invocation's loop (set when it ends)
    train_s: float = 0.0

    def stop(self, flag) -> None:
        """Stopped by a signal (``flag``: the ``StopFlag``; with several ranks another rank's may have been)."""
        self.interrupted, self.stop_reason = True, "interrupted"
        self.stopped_by = flag.signal.name if getattr(flag, "signal", None) else "SIGINT"

    def record(self, stats, lr: float, t_start: float, *, tokens: bool = False) -> None:
        """One step done: its loss, learning rate, gradient norm, time and tokens a second (``tok_s``: every token
        the step ran, batch x seq; ``loss_tok_s``: those with a label) on the loss curve (with its tokens where the
        batches vary in length)."""
        self.step += 1
        self.tokens += stats.tokens
        self.history.append({"step": self.step, "loss": round(stats.loss, 5), "lr": lr,
                             **({"tokens": stats.tokens} if tokens else {}),
                             "grad_norm": round(stats.grad_norm, 4), "step_s": round(stats.step_s, 4),
                             "tok_s": round(stats.input_tokens / stats.step_s), "loss_tok_s": round(
                                 stats.tokens / stats.step_s),
                             "t": round(time.perf_counter() - t_start, 2)})


def steps(cfg: TrainConfig, opt, run: Progress, flag, *, start: int, ranks: Ranks | None = None) -> Iterator[int]:
    """Each step to run, with ``opt.lr`` set for it (see the module docstring); ``run`` says why it
    stopped and how long the loop took.  With several ranks the rate, the time limit and a stop are
    agreed before each step (``Ranks.agree``): every rank runs the same steps."""
    limit_s = cfg.time_limit_min * 60 if cfg.time_limit_min else None
    t_train = time.perf_counter()
    world = ranks is not None and ranks.size > 1
    while run.step < cfg.steps:
        elapsed = time.perf_counter() - t_train
        over = limit_s is not None and elapsed >= limit_s
        lr = lr_at(cfg, run.step, schedule_progress(run.step, start, cfg.steps, elapsed, limit_s))
        if world:
            lr, over, stop = ranks.agree(lr, over, flag.set)
            if stop:
                run.stop(flag)
                break
        if over:
            run.stop_reason = "time limit"
            break
        opt.lr = lr
        yield run.step
        if flag.set and not world:
            run.stop(flag)
            break
    run.train_s = time.perf_counter() - t_train


def open_run(cfg: TrainConfig) -> tuple[torch.device, Ranks, Path, float]:
    """What every run starts with: its device, its world of ranks (this process's place in it), the host update's
    threads set, and its output folder; with the wall clock at that point (the run's ``wall_s`` counts from it)."""
    dev = choose_device(cfg.device)
    ranks = Ranks.join(dev.type)
    if dev.type == "cpu" or ranks.size > 1:      # (torchrun sets OMP_NUM_THREADS=1: the host update's threads)
        torch.set_num_threads(cfg.threads or ranks.cpu_threads(cpu_threads))
    return dev, ranks, output_folder(cfg.output), time.perf_counter()


def output_folder(path: str) -> Path:
    """``--output``, created: a folder (a file of that name is an error, not overwritten)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out}: a file of that name exists; --output is a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output {out}: cannot create the folder ({e.strerror or e})") from None
    return out


def start_trainer(cfg: TrainConfig, model, dev: torch.device, *, resumed: bool, seq_len: int, hardware,
                  param_dtype: str, packed: bool = False, ranks: Ranks | None = None, weights=None):
    """Hybrid 8-bit AdamW and the Trainer: a resumed run loads its checkpoint (which carries its plan: no
    recompile, the same schedule, unless it was saved by another number of processes), a new one
    compiles a plan for this machine (with several ranks: rank 0 compiles it for all, ``Ranks.share``).
    ``weights``: where the trainer's initial parameters come from (``model_loading.shard_loadable``,
    ``random_init.RandomWeights``, or for a resumed one ``weights.CheckpointFilled``; the model is then on the
    meta device).  Returns (trainer, optimizer, seconds)."""
    # the compiler and the runtime load when a run starts, not when the CLI builds its parser (0.5 s)
    from ..runtime.checkpoint import read_meta
    from ..runtime.optim import Hybrid8bitAdamW
    from ..runtime.trainer import Trainer
    ranks = ranks or Ranks()
    opt = Hybrid8bitAdamW(lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                          num_threads=torch.get_num_threads() if dev.type == "cpu" else None,
                          stochastic_rounding=Optimizer(cfg.optimizer).stochastic_rounding, seed=cfg.seed,
                          moment_bits=Optimizer(cfg.optimizer).moment_bits)
    t = time.perf_counter()
    plan = None
    if resumed:
        saved = read_meta(Path(cfg.resume) / "checkpoint")[1]["plan"].get("world_size", 1)
        if saved != ranks.size:     # the global batch is kept: a plan for this world's share of it
            print(f"the checkpoint was saved by {saved} process(es), this run has {ranks.size}: compiling a plan for "
                  f"{ranks.size} (global batch {cfg.batch} kept)")
    if not resumed or saved != ranks.size:
        plan = _shared_plan(cfg, model, ranks, seq_len=seq_len, hardware=hardware, param_dtype=param_dtype,
                            packed=packed)
    if resumed:
        trainer = Trainer.load_checkpoint(Path(cfg.resume) / "checkpoint", model, optimizer=opt, device=dev, plan=plan,
                                          verbose=ranks.main, weights=weights, nvme_dir=cfg.nvme_dir)
    else:
        trainer = Trainer(model, plan, optimizer=opt, device=dev, verbose=ranks.main, weights=weights,
                          nvme_dir=cfg.nvme_dir)
    ranks.world = trainer.world
    if ranks.main and trainer.ctx.nvme_state is not None:       # a drive slower than planned: said before step 1
        warning = slow_disk_warning(trainer.plan, str(trainer.ctx.nvme.root))
        if warning:
            print(warning, file=sys.stderr)
    return trainer, opt, time.perf_counter() - t


def _shared_plan(cfg: TrainConfig, model, ranks: Ranks, *, seq_len: int, hardware, param_dtype: str, packed: bool):
    """The plan every rank runs: compiled by rank 0 for this world (``Ranks``'s docstring says why)."""
    from ..compiler.api import compile_model
    from ..compiler.cost import hint_uncalibrated
    from ..ir import Plan
    batch = ranks.per_rank_batch(cfg.batch)

    def compiled() -> dict:
        plan = compile_model(model, batch_size=batch, seq_len=seq_len, hardware=hardware, gpu_memory=cfg.gpu_memory,
                             host_memory=cfg.host_memory, nvme_dir=cfg.nvme_dir, nvme_memory=cfg.nvme_memory,
                             policy=cfg.policy, optimizer=cfg.optimizer,
                             param_dtype=param_dtype, resident=cfg.resident, packed=packed, world_size=ranks.size,
                             nodes=ranks.nodes)
        return hint_uncalibrated(plan, model).to_json()     # as ``lazytrain.compile`` does
    return Plan.from_json(ranks.share("plan", compiled))


def thread_tuner(dev: torch.device, cfg: TrainConfig, opt, **probe) -> ThreadTuner | None:
    """On the CPU without ``--threads``: the thread count measured, not guessed once (``threads.py``)."""
    if dev.type != "cpu" or cfg.threads:
        return None

    def set_threads(n: int) -> None:
        torch.set_num_threads(n)
        opt.num_threads = n
    return ThreadTuner(cpu_cores(), set_threads, start=torch.get_num_threads(), **probe)
