"""The arguments of ``Trainer(model, plan, optimizer, device)``, checked before anything is built.

A wrong argument (no plan, a plan's JSON dict instead of a ``Plan``, ``device="cuda"`` on a machine
without CUDA, a plan whose sequence is longer than the model's positions) would otherwise fail deep
inside torch or on the first step; here it is one error that names the argument and the fix.
"""

from __future__ import annotations

import torch

from ..frontend.validate import check_positions
from ..ir import Plan
from .optim.base import HostOptimizer


def check_trainer_args(model, plan, optimizer, device) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Trainer needs the model as a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(plan, Plan):
        how = ("Plan.from_json(d) builds one from its JSON" if isinstance(plan, dict)
               else "lazytrain.compile(model, ...) compiles one, Plan.load(path) reads one")
        raise TypeError(f"Trainer needs a Plan, got {type(plan).__name__}: {how}")
    if optimizer is not None and not isinstance(optimizer, HostOptimizer):
        raise TypeError(f"Trainer's optimizer must be a lazytrain optimizer (lazytrain.optim.TorchAdamW, "
                        f"Hybrid8bitAdamW), got {type(optimizer).__name__}")
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"Trainer device {device!r} is not a device: use 'cuda' or 'cpu'") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"Trainer device {device!r}: LazyTrain runs on 'cuda' or 'cpu'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"Trainer device {device!r}: no CUDA GPU is visible to torch (use device='cpu')")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"Trainer device {device!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    check_positions(model, plan.seq_len)
