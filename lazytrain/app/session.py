"""What a ``lazytrain train`` run needs around its loop, for the built-in task (``train.py``) and a data file
(``finetune/run.py``) alike: the device and its hardware profile, the progress bar and notes printed beside it,
Ctrl-C and a scheduler's SIGTERM (``StopFlag``), whether plots can be drawn."""

from __future__ import annotations

import importlib.util
import signal

import torch
from tqdm import tqdm

from ..compiler.profiles import PROFILES


def choose_device(requested: str | None) -> torch.device:
    """``--device`` (refused when it names CUDA and none is visible), else CUDA when there is a GPU, else the CPU."""
    if requested:
        dev = torch.device(requested)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA GPU is visible to torch")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def hardware_for(dev: torch.device) -> str:
    """The built-in profile whose GPU name matches this GPU (H200 when none does), or ``cpu``."""
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower()
    for key, prof in PROFILES.items():
        if key != "cpu" and (key.replace("-", " ").split()[0] in name or prof.gpu_name.lower() in name):
            return key
    return "h200"


def progress_bar(total: int, start: int, shown: bool):
    """The run's progress bar from step ``start`` to ``total``; None when not ``shown`` (``--no-progress``, a rank
    other than 0)."""
    if not shown:
        return None
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def follow_total(bar, total: int | None) -> None:
    """The bar's total (and so its ETA) at the steps the run will reach (``loop.StepBudget``: under a time limit,
    the steps its pace allows, re-estimated every step)."""
    if bar is not None and total and bar.total != total:
        bar.total = total


def note(bar, text: str) -> None:
    """``text`` on the console, above the progress bar when there is one."""
    if bar is not None:
        bar.write(text)
    else:
        print(text)


def can_plot() -> bool:
    """Is matplotlib installed (the ``plot`` extra)?  Without it the run writes no PNGs."""
    return importlib.util.find_spec("matplotlib") is not None


def say_no_plot(name: str) -> None:
    """The one line a run prints where it would write the PNG ``name`` but matplotlib is missing."""
    print(f"no {name}: matplotlib is not installed (pip install matplotlib, or the plot extra); metrics.json has "
          f"the numbers")


#: the signals that stop a run after the step in flight, as Ctrl-C does: a scheduler's (SLURM, Kubernetes, a
#: preemptible VM: SIGTERM) and a closed terminal's (SIGHUP)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopFlag:
    """The first of ``signals`` (default ``STOP_SIGNALS``): ask the loop to stop after the step in flight (``set``;
    ``signal`` names it); a second: raise KeyboardInterrupt.  Once ``immediate`` (the state is committed: the final
    eval), the first one raises at once.  Outside the main thread, and where a signal is ignored (``nohup``'s SIGHUP, a
background job's SIGINT), the signals keep their behaviour."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.set = False
        self.immediate = False
        self.signal: signal.Signals | None = None
        self._signals = signals
        self._prev: dict = {}

    def __enter__(self):
        for s in self._signals:
            try:
                if signal.getsignal(s) is not signal.SIG_IGN:      # ignored (``nohup``: SIGHUP) stays ignored
                    self._prev[s] = signal.signal(s, self._handle)
            except ValueError:          # not the main thread
                break
        return self

    def _handle(self, signum, frame):
        first, self.set = not self.set, True
        if first:
            self.signal = signal.Signals(signum)
        if not first or self.immediate:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        for s, prev in self._prev.items():
            signal.signal(s, prev)
        self._prev = {}


def stop_signals(world_size: int) -> tuple[signal.Signals, ...]:
    """``STOP_SIGNALS`` for a run of one process; SIGINT alone for a rank of several: torchrun ends the ranks of a
    run one of which failed with SIGTERM, and a rank waiting in a collective for the failed one must end then."""
    return STOP_SIGNALS if world_size == 1 else (signal.SIGINT,)


def stop_status(metrics: dict) -> int:
    """The exit status of a finished run: 0, or for a run a signal stopped (saved, resumable) 128 + its number, as a
    shell reports a process that signal ended (130 for Ctrl-C, 143 for SIGTERM): a scheduler sees it did not finish."""
    name = metrics.get("stopped_by")
    return 128 + signal.Signals[name].value if name else 0
