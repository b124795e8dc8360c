"""LazyTrain: compile a training schedule for a model too large for its GPU, then run it.

``lazytrain.compile(model, ...)`` -> ``ir.Plan``; ``lazytrain.Trainer(model, plan, optimizer=...)``.
"""

from __future__ import annotations

from .ir import Plan, PlanError

__version__ = "0.1.0"


def compile(model, **kwargs):  # noqa: A001 - the product's verb
    """Trace, cost, solve, lower and verify; see ``lazytrain.compiler.api.compile_model``.  ``calibrate=True``
    times the model's blocks in the runtime first (``lazytrain.measure.calibrate.compile_measured``).  On a GPU, a
    plan whose block times are all modelled gets a one-line hint on how to measure them."""
    # on first use: `import lazytrain` stays light (the IR); the compiler and the runtime load when asked for
    from .compiler.cost import hint_uncalibrated
    if kwargs.get("calibrate"):
        from .measure.calibrate import compile_measured as compile_model
    else:
        from .compiler.api import compile_model
    return hint_uncalibrated(compile_model(model, **kwargs), model)


def __getattr__(name: str):
    if name == "Trainer":
        from .runtime.trainer import Trainer
        return Trainer
    if name == "optim":
        from .runtime import optim
        return optim
    raise AttributeError(name)


__all__ = ["Plan", "PlanError", "compile", "Trainer", "optim"]
