"""The step loop ``lazytrain train`` runs, on the built-in task (``train.py``) and on a data file
(``finetune/run.py``): one place for when a run stops and what its learning rate is.

``steps`` yields each step to run and stops at ``--steps`` (a total: a resumed run continues from
``start``), at ``--time-limit-min``, or after the step in flight when Ctrl-C was pressed once (the
caller's ``StopFlag``); before each step it sets the optimizer's learning rate (``lr_at``: warm-up, then the decay to
``min_lr_ratio * lr``, planned in steps against the steps the run will reach: ``--steps``, or under a time limit
the steps the measured pace allows, ``StepBudget``).
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

#: the learning-rate schedules after the warm-up (Hugging Face's ``lr_scheduler_type`` names): ``cosine`` to
#: ``min_lr_ratio * lr``, ``linear`` to it, ``constant_with_warmup``; ``constant`` has no warm-up
SCHEDULES = ("cosine", "linear", "constant_with_warmup", "constant")
#: the largest share of the run's steps the warm-up takes when ``--warmup`` asks more than the run will make (a
#: time limit that allows 12 steps with ``--warmup 10``): half, so the decay still has as many [ledger: warmup-share]
MAX_WARMUP_SHARE = 0.5


def warmup_steps(cfg: TrainConfig, total: int) -> int:
    """The warm-up, in steps, of a run of ``total`` steps: ``warmup_ratio * total`` when given, else ``warmup``;
    at most ``MAX_WARMUP_SHARE`` of ``total``; none for the ``constant`` schedule."""
    if cfg.lr_scheduler_type == "constant":
        return 0
    asked = round(cfg.warmup_ratio * total) if cfg.warmup_ratio is not None else cfg.warmup
    return min(asked, int(total * MAX_WARMUP_SHARE))


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """The learning rate of step ``step`` (0-based) of a run of ``total`` steps: a linear warm-up to ``lr`` over
    ``warmup_steps``, then the decay (``cfg.lr_scheduler_type``) from ``lr`` at the first step after it to
    ``min_lr_ratio * lr`` at the last.  The warm-up ends before any decay starts."""
    warm = warmup_steps(cfg, total)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.lr_scheduler_type.startswith("constant"):
        return cfg.lr
    progress = min(1.0, (step - warm) / max(1, total - warm - 1))
    shape = (1 - progress) if cfg.lr_scheduler_type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


class StepBudget:
    """How many steps the run will reach: ``--steps``, or under ``--time-limit-min`` the steps done plus the
    time left over the pace, re-estimated after every step, whichever is fewer.  The warm-up and the decay are
    planned in steps against it, and the progress bar's total follows it.

    The pace is the larger of the recent one (the mean of the last ``WINDOW`` steps: a machine that slows down
    is seen within them) and this invocation's mean since its first step (evaluations every N steps, which a
    window may miss, are in it); this invocation's first step is left out of both (it builds the CUDA context's
    kernels or lets the CPU's threads settle: seconds more than the rest).  Taking the larger ends the schedule a
    little early rather than cut it at a high learning rate."""

    WINDOW = 16
    #: steps timed before the pace counts: two or three steps of a loaded machine gave a budget half the final one
    #: (the demonyms run of issue #43: 14 steps estimated after 3, 38 made) [ledger: step-budget-min-timed]
    MIN_TIMED = 4

    def __init__(self, steps: int, limit_s: float | None):
        self.steps, self.limit_s = steps, limit_s
        self._ends: list[float] = []        # the clock at the end of each of this invocation's steps

    def step_done(self, now: float) -> None:
        self._ends.append(now)

    def total(self, done: int, elapsed_s: float) -> int:
        """The steps the run will have made when it ends, ``done`` made ``elapsed_s`` into this invocation."""
        if self.limit_s is None or len(self._ends) <= self.MIN_TIMED:
            return self.steps
        ends = self._ends
        recent = (ends[-1] - ends[max(0, len(ends) - 1 - self.WINDOW)]) / min(self.WINDOW, len(ends) - 1)
        overall = (ends[-1] - ends[0]) / (len(ends) - 1)
        pace = max(recent, overall, 1e-9)
        return max(done + 1, min(self.steps, done + int(max(0.0, self.limit_s - elapsed_s) / pace)))


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
    #: the steps the run will reach (``StepBudget``): ``--steps``, or fewer under a time limit
    total: int | None = None
    #: the highest learning rate this invocation set
    peak_lr: float = 0.0

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
    stopped, how long the loop took and how many steps the run will reach (``run.total``).  With several ranks the
    rate, the time limit and a stop are agreed before each step (``Ranks.agree``): every rank runs the same
    steps."""
    limit_s = cfg.time_limit_min * 60 if cfg.time_limit_min else None
    budget = StepBudget(cfg.steps, limit_s)
    t_train = time.perf_counter()
    world = ranks is not None and ranks.size > 1
    while run.step < cfg.steps:
        elapsed = time.perf_counter() - t_train
        over = limit_s is not None and elapsed >= limit_s
        run.total = budget.total(run.step, elapsed)
        lr = lr_at(cfg, run.step, run.total)
        if run.step < warmup_steps(cfg, run.total):
            lr = max(lr, opt.lr if run.step > start else 0.0)    # a warm-up never steps down as the budget moves
        if world:
            lr, over, stop = ranks.agree(lr, over, flag.set)
            if stop:
                run.stop(flag)
                break
        if over:
            run.stop_reason = "time limit"
            break
        opt.lr = lr
        run.peak_lr = max(run.peak_lr, lr)
        yield run.step
        budget.step_done(time.perf_counter())
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
    from .runfiles import resume_checkpoint
    ranks = ranks or Ranks()
    opt = Hybrid8bitAdamW(lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                          num_threads=torch.get_num_threads() if dev.type == "cpu" else None,
                          stochastic_rounding=Optimizer(cfg.optimizer).stochastic_rounding, seed=cfg.seed,
                          moment_bits=Optimizer(cfg.optimizer).moment_bits)
    t = time.perf_counter()
    plan = None
    if resumed:
        saved = read_meta(resume_checkpoint(cfg))[1]["plan"].get("world_size", 1)
        if saved != ranks.size:     # the global batch is kept: a plan for this world's share of it
            print(f"the checkpoint was saved by {saved} process(es), this run has {ranks.size}: compiling a plan for "
                  f"{ranks.size} (global batch {cfg.batch} kept)")
    if not resumed or saved != ranks.size:
        plan = _shared_plan(cfg, model, ranks, seq_len=seq_len, hardware=hardware, param_dtype=param_dtype,
                            packed=packed)
    if resumed:
        trainer = Trainer.load_checkpoint(resume_checkpoint(cfg), model, optimizer=opt, device=dev, plan=plan,
                                          verbose=ranks.main, weights=weights, nvme_dir=cfg.nvme_dir)
    else:
        trainer = Trainer(model, plan, optimizer=opt, device=dev, verbose=ranks.main, weights=weights,
                          nvme_dir=cfg.nvme_dir)
    if cfg.lora:        # what its checkpoints record of the frozen base (``checkpoint.base_identity``)
        trainer.base_source = {"model": cfg.model}
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
                             nodes=ranks.nodes, base_bits=cfg.base_bits)
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
