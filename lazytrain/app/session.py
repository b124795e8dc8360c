"""What a ``lazytrain train`` run needs around its loop, for the built-in task (``train.py``) and a data file
(``finetune/run.py``) alike: the device and its hardware profile, the progress bar and notes printed beside it,
Ctrl-C handling, whether plots can be drawn."""

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


def note(bar, text: str) -> None:
    """``text`` on the console, above the progress bar when there is one."""
    if bar is not None:
        bar.write(text)
    else:
        print(text)


def can_plot() -> bool:
    """Is matplotlib installed (the ``plot`` extra)?  Without it the run writes no PNGs."""
    return importlib.util.find_spec("matplotlib") is not None


class StopFlag:
    """First SIGINT: ask the loop to stop after the step in flight; second: raise KeyboardInterrupt.
    Once ``immediate`` (the state is committed: the final eval), the first one raises at once."""

    def __init__(self):
        self.set = False
        self.immediate = False
        self._prev = None

    def __enter__(self):
        try:
            self._prev = signal.signal(signal.SIGINT, self._handle)
        except ValueError:          # not the main thread: Ctrl-C keeps its default behaviour
            self._prev = None
        return self

    def _handle(self, signum, frame):
        if self.set or self.immediate:
            self.set = True
            raise KeyboardInterrupt
        self.set = True

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)
