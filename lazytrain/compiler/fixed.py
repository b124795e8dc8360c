"""A request of one length and one tiling (``compiler/pipeline.py``'s module docstring has the order of the
levels): calibrated where it asks for it, by the stage the layer that runs models supplies (``calibrating``), else
``compile_one``: searched on a preset's seed while it is traced elsewhere (``background_trace.py``), or the
pipeline's stages (``pipeline.run``)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from ..frontend.validate import check_compile_args
from ..ir import Plan
from . import background_trace, pipeline
from .budgets import make_budgets
from .profiles import get_profile
from .request import CompileRequest

#: the calibration stage of this call, where the caller supplied one (``calibrating``)
_calibration: contextvars.ContextVar[Callable[[object, CompileRequest], Plan] | None] = contextvars.ContextVar(
    "calibration", default=None)


@contextlib.contextmanager
def calibrating(stage: Callable[[object, CompileRequest], Plan]) -> Iterator[None]:
    """Within the block, a request with ``calibrate=True`` is answered by ``stage(model, request)``: calibration runs
    the model in the runtime, a layer above the compiler, which supplies it (``measure.calibrate.compile_measured``)
    and compiles each of its requests with ``calibrate=False``."""
    token = _calibration.set(stage)
    try:
        yield
    finally:
        _calibration.reset(token)


def compile_fixed(model, req: CompileRequest) -> Plan:
    """The plan of a request of one length and one tiling: calibrated where it asks for it, else ``compile_one``."""
    if req.calibrate:
        stage = _calibration.get()
        if stage is None:
            raise ValueError("calibrate=True times the model's blocks on this machine, which the compiler alone does "
                             "not: use lazytrain.compile(..., calibrate=True) (or lazytrain.measure.calibrate."
                             "compile_measured)")
        return stage(model, req)
    return compile_one(model, req)


def compile_one(model, req: CompileRequest) -> Plan:
    """The plan of a request of one length, one tiling and no calibration: its sizes checked against the model
    (``frontend/validate.py``), then searched on a preset's seed while it is traced elsewhere, else ``pipeline.run``."""
    check_compile_args(model, batch_size=req.batch_size, seq_len=req.seq_len, micro_batch=req.micro_batch,
                       nvme_dir=req.nvme_dir)
    bg = background_trace.start(model, seq_len=req.seq_len, dtype=req.param_dtype, packed=req.packed,
                                seq_tile=req.seq_tile, compile_blocks=req.compile_blocks, check=lambda: make_budgets(
                                    get_profile(req.hardware), req.gpu_memory, req.host_memory, req.nvme_dir,
                                    req.nvme_memory, req.reserve))
    if bg is not None:          # a preset's first compile: searched on its seed while it is traced elsewhere
        return background_trace.compile_seeded(model, bg, req)
    return pipeline.run(model, req)
