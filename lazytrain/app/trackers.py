"""``report_to``: a run's scalars, evaluations and settings sent to TensorBoard, Weights & Biases or MLflow, through
their own libraries (optional extras), as Hugging Face's ``report_to`` does.

Both loops (``train.py``'s ``_train``, ``finetune/run.py``'s ``run``) call one small interface, ``Trackers``:

    check(report_to)                        before the model loads: each library imported, or a one-line error
    with Trackers.open(cfg, out, main) as t:    (``main``: rank 0 of several; the other ranks get no tracker)
        t.start(settings)                   the run's settings as hyperparameters
        t.step(step, stats, lr)             every ``logging_steps`` steps: the interval's means (below)
        t.evaluate(step, ev)                exact match, eval loss, the sample replies as text
        t.end(metrics)                      the final metrics
    (leaving the block closes each tracker: on an exception or a second Ctrl-C too, a W&B run marked failed,
    an MLflow run FAILED or KILLED, TensorBoard's events flushed)

A resumed run logs to the trackers its run named (``report_to``, ``logging_steps`` and ``run_name`` are carried)
unless its command line names others.  Where each writes: TensorBoard ``OUTPUT/tensorboard/`` (one events file an
invocation: a resumed run's steps continue the curves; a W&B or MLflow resume starts a new run of the same name),
W&B ``OUTPUT/wandb/`` (``WANDB_MODE=offline`` writes there only; ``wandb sync`` uploads it later), MLflow
``file:OUTPUT/mlruns`` unless ``MLFLOW_TRACKING_URI`` names another store (experiment
``lazytrain`` or ``MLFLOW_EXPERIMENT_NAME``).  The file store is the one ``mlflow-skinny`` (the ``mlflow`` extra) writes
without a database; MLflow 3 keeps it in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``, which the run sets for
itself when it uses that store (``MLFLOW_TRACKING_URI=sqlite:///...`` with the full ``mlflow`` uses a database).
A tracker that cannot start its run (W&B without a login or ``WANDB_MODE=offline``) is a one-line error when the
loop starts, after the compile; its library missing is one before anything (``check``).

A step's scalars (names as each tracker shows them): ``train/loss`` (mean over the interval), ``train/learning_rate``,
``train/grad_norm`` (the last step's), ``train/tokens_per_s`` (every token the model runs, batch x seq, padding
included: what ``train/model_tflops`` counts too), ``train/loss_tokens_per_s`` (the tokens with a label),
``train/model_tflops``, ``train/step_s``, ``memory/host_rss_gib`` and ``memory/host_peak_rss_gib`` (this process),
and on a GPU ``memory/gpu_max_allocated_gib`` and ``memory/gpu_max_reserved_gib`` (torch's peaks).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..measure.bench_worker import host_peak_rss_bytes, host_rss_bytes

#: the trackers, and the pip extra of lazytrain that installs each one's library
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
#: the module each one imports
_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
#: what ``pip install`` takes for each (the library alone: a clone's editable install has no ``lazytrain[...]`` on
#: the registry to ask for)
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}
GIB = 1 << 30


def parse(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """``report_to`` as given (``tensorboard,wandb``, a list, ``none``) -> the trackers' names, in order, once each.
    ``all`` is refused: Hugging Face's ``all`` means whichever libraries happen to be installed, so the same command
    would log elsewhere on another machine (and start a W&B run that asks for a login)."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    names = [str(x).strip().lower() for x in items if str(x).strip()]
    if "all" in names:
        raise ValueError(f"report_to all: name the trackers to use ({', '.join(EXTRAS)}); 'all' would depend on "
                         f"what is installed")
    unknown = [n for n in names if n not in EXTRAS and n != "none"]
    if unknown:
        raise ValueError(f"report_to {unknown[0]!r}: not a tracker; choose from {', '.join(EXTRAS)} or none")
    if "none" in names and len(names) > 1:
        raise ValueError(f"report_to {','.join(names)}: 'none' with trackers named; give one or the other")
    return tuple(dict.fromkeys(n for n in names if n != "none"))


def check(report_to) -> None:
    """Each tracker's library imported now, before the model loads: a missing one is a one-line error naming the
    pip extra, not a crash after minutes of loading and compiling."""
    import importlib
    for name in parse(report_to):
        try:
            importlib.import_module(_MODULES[name])
        except ImportError as e:
            raise ValueError(f"report_to {name}: its library is not installed ({e}); pip install {_PACKAGES[name]} "
                             f"(lazytrain's '{EXTRAS[name]}' extra)") from None


class Trackers:
    """The run's trackers, all sent the same calls (see the module docstring); none: every call does nothing."""

    def __init__(self, backends: list, logging_steps: int = 1):
        self.backends = backends
        self.logging_steps = max(1, int(logging_steps))
        self._window: list[tuple[Any, float]] = []

    @classmethod
    def open(cls, cfg, out: Path, main: bool = True) -> Trackers:
        """The trackers ``cfg.report_to`` names, their runs started (``main``: only rank 0 of several reports)."""
        names = parse(cfg.report_to) if main else ()
        check(names)
        name = cfg.run_name or str(cfg.output)
        opened: list = []
        try:
            for n in names:
                try:
                    opened.append(_BACKENDS[n](Path(out), name))
                except Exception as e:      # (each library has its own errors: a login, a store it refuses)
                    raise ValueError(f"report_to {n}: could not start its run ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''})") from None
        except BaseException:
            for b in opened:
                b.close(ok=False)
            raise
        return cls(opened, cfg.logging_steps)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close(ok=kind is None, killed=kind is not None and issubclass(kind, KeyboardInterrupt))

    def start(self, settings: dict) -> None:
        """The run's settings, as each tracker keeps hyperparameters."""
        flat = {k: v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str)
                for k, v in settings.items()}
        for b in self.backends:
            b.hparams(flat)

    def step(self, step: int, stats, lr: float) -> None:
        """One training step done (``stats``: the trainer's ``StepStats``); every ``logging_steps`` steps the
        interval's scalars are written."""
        if not self.backends:
            return
        self._window.append((stats, lr))
        if step % self.logging_steps == 0:
            self.flush_window(step)

    def flush_window(self, step: int) -> None:
        """The scalars of the steps since the last write (none: nothing)."""
        if not self._window or not self.backends:
            return
        window, self._window = self._window, []
        scalars = step_scalars([s for s, _ in window], window[-1][1])
        for b in self.backends:
            b.scalars(step, scalars)

    def evaluate(self, step: int, ev: dict) -> None:
        """An evaluation: ``exact_match``, ``eval_loss`` (where measured) and ``samples`` (prompt, reference,
        reply, correct)."""
        if not self.backends:
            return
        self.flush_window(step)
        scalars = {f"eval/{k}": float(ev[k]) for k in ("exact_match", "eval_loss") if ev.get(k) is not None}
        samples = [{k: s.get(k) for k in ("prompt", "reference", "reply", "correct")} for s in ev.get("samples", ())]
        for b in self.backends:
            b.scalars(step, scalars)
            if samples:
                b.samples(step, samples)
            b.flush()

    def end(self, metrics: dict) -> None:
        """The run's final metrics (numbers among ``metrics``'s top-level keys)."""
        if not self.backends:
            return
        self.flush_window(int(metrics.get("steps_done") or 0))
        final = {f"final/{k}": float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for b in self.backends:
            b.final(int(metrics.get("steps_done") or 0), final)

    def close(self, ok: bool = True, killed: bool = False) -> None:
        """Every tracker's run ended and its files flushed; one that fails to close does not stop the others."""
        backends, self.backends = self.backends, []
        errors = []
        for b in backends:
            try:
                b.close(ok=ok, killed=killed)
            except Exception as e:      # (noqa: one tracker's error must not leave the others open)
                errors.append(f"{type(b).__name__}: {e}")
        if errors and ok:
            raise RuntimeError(f"report_to: closing a tracker failed ({'; '.join(errors)})")


def step_scalars(stats: list, lr: float) -> dict[str, float]:
    """The scalars of the steps ``stats`` (``StepStats``, oldest first): means over them, rates as their tokens over
    their time, the last step's learning rate and gradient norm, memory now."""
    import torch
    secs = sum(s.step_s for s in stats) or float("nan")
    out = {
        "train/loss": sum(s.loss for s in stats) / len(stats),
        "train/learning_rate": float(lr),
        "train/grad_norm": float(stats[-1].grad_norm),
        "train/tokens_per_s": sum(s.input_tokens for s in stats) / secs,
        "train/loss_tokens_per_s": sum(s.tokens for s in stats) / secs,
        "train/model_tflops": sum(s.model_tflops * s.step_s for s in stats) / secs,
        "train/step_s": secs / len(stats),
        "memory/host_rss_gib": host_rss_bytes() / GIB,
        "memory/host_peak_rss_gib": host_peak_rss_bytes() / GIB,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["memory/gpu_max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["memory/gpu_max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return out


def samples_text(step: int, samples: list[dict]) -> str:
    """The sample replies of an evaluation as Markdown (TensorBoard renders it; MLflow keeps it as a file)."""
    lines = [f"step {step}", "", "| correct | prompt | reference | reply |", "| --- | --- | --- | --- |"]
    for s in samples:
        cells = [str(s.get(k)).replace("|", "\\|").replace("\n", " ") for k in ("prompt", "reference", "reply")]
        lines.append(f"| {'yes' if s.get('correct') else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the trackers, one class each: hparams, scalars, samples, final, flush, close ------------------------------

class TensorBoard:
    """``OUTPUT/tensorboard/`` through ``torch.utils.tensorboard.SummaryWriter`` (flushed every 10 s, at each
    evaluation and at the end)."""

    def __init__(self, out: Path, name: str):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), flush_secs=10)
        self.name = name

    def hparams(self, settings: dict) -> None:
        self.writer.add_text("settings", "```\n" + json.dumps({"run_name": self.name, **settings}, indent=1,
                                                              default=str) + "\n```")

    def scalars(self, step: int, scalars: dict) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def samples(self, step: int, samples: list[dict]) -> None:
        self.writer.add_text("eval/samples", samples_text(step, samples), step)

    def final(self, step: int, final: dict) -> None:
        self.scalars(step, final)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, ok: bool = True, killed: bool = False) -> None:
        self.writer.close()


class WandB:
    """A W&B run in ``OUTPUT/wandb/`` (project ``WANDB_PROJECT``, default ``lazytrain``); ``WANDB_MODE=offline``
    needs no network.  Sample replies are a ``wandb.Table``."""

    def __init__(self, out: Path, name: str):
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lazytrain"), name=name, dir=str(out),
                              reinit="create_new")

    def hparams(self, settings: dict) -> None:
        self.run.config.update(settings, allow_val_change=True)

    def scalars(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def samples(self, step: int, samples: list[dict]) -> None:
        cols = ["step", "prompt", "reference", "reply", "correct"]
        table = self.wandb.Table(columns=cols, data=[[step] + [s.get(c) for c in cols[1:]] for s in samples])
        self.run.log({"eval/samples": table}, step=step)

    def final(self, step: int, final: dict) -> None:
        self.run.summary.update(final)

    def flush(self) -> None:
        pass

    def close(self, ok: bool = True, killed: bool = False) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MLflow:
    """An MLflow run (experiment ``MLFLOW_EXPERIMENT_NAME``, default ``lazytrain``) in the store
    ``MLFLOW_TRACKING_URI`` names, else ``file:OUTPUT/mlruns``; sample replies are text artifacts
    ``eval/step_NNNNNN.md``."""

    def __init__(self, out: Path, name: str):
        from mlflow.tracking import MlflowClient
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:     # the store mlflow-skinny can write without a database; MLflow 3 asks for an opt-in to it
            uri = (out / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "lazytrain")
        exp = self.client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(exp_name)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id

    def hparams(self, settings: dict) -> None:
        from mlflow.entities import Param
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in settings.items()])

    def scalars(self, step: int, scalars: dict) -> None:
        import time

        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()
                                                    if math.isfinite(v)])

    def samples(self, step: int, samples: list[dict]) -> None:
        self.client.log_text(self.run_id, samples_text(step, samples), f"eval/step_{step:06d}.md")

    def final(self, step: int, final: dict) -> None:
        self.scalars(step, final)

    def flush(self) -> None:
        pass

    def close(self, ok: bool = True, killed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "KILLED" if killed else "FAILED")


_BACKENDS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
