"""Runtime: executes a ``Plan`` with parameters and optimizer state on the host
(``docs/architecture.md``, "The runtime").

``Trainer`` (trainer.py) owns a host store (store.py), streams (streams.py), an NVMe tier
(nvme.py), the update path (updates.py) and the interpreter (interpreter.py: one handler per op kind,
handlers.py and gradients.py, sharing the run's and the step's state of context.py).
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("Trainer", "StepStats"):
        from . import trainer  # on first use: `import lazytrain.runtime.optim` need not build the Trainer
        return getattr(trainer, name)
    raise AttributeError(name)


__all__ = ["StepStats", "Trainer"]
