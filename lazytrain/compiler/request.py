"""What one compile is asked for: ``compile_model``'s arguments, checked once and frozen.

``CompileRequest.of(model, **kwargs)`` builds it from the caller's arguments (the model only resolves the host
memory a caller's model holds); every field is then valid, the named choices as enums (``compiler/options.py``).
An outer search (the longest sequence, the tiling, the seeded search, the calibration) makes its next request with
``dataclasses.replace(request, ...)``, which checks the changed fields again.  ``seq_len="max"`` and
``seq_tile="auto"`` are requests for such a search; the pipeline's own stages (``compiler/pipeline.py``) see
requests of one length and one tiling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..frontend.lora import parse_lora
from ..util.torch_free import is_dtype
from . import gpu_update as gpu_update_rule
from .budgets import held_host_bytes, make_budgets
from .options import LossHead, Optimizer, Policy, Solver
from .profiles import get_profile
from .progress import log
from .world import check_world

#: the profile a compile plans for when the caller names none (said once per request, ``CompileRequest.of``)
DEFAULT_HARDWARE = "h200"
#: host bytes per parameter by optimizer (load buffer + grad buffer + master + states)
HOST_BYTES_PER_PARAM = {Optimizer.HYBRID8BIT: 8.25, Optimizer.HYBRID8BIT_SR: 6.25, Optimizer.HYBRID4BIT: 7.25,
                        Optimizer.HYBRID4BIT_SR: 5.25, Optimizer.ADAMW: 16.0}
#: the dtypes a plan keeps its parameters in on the GPU (bf16 on a GPU; fp32 for CPU runs, eager's references)
PARAM_DTYPES = ("bfloat16", "float16", "float32")


def param_dtype_name(d) -> str:
    """``d`` (a name or a ``torch.dtype``) as the name a plan records, or ``ValueError``."""
    name = str(d).removeprefix("torch.") if isinstance(d, str) or is_dtype(d) else None
    if name not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {', '.join(PARAM_DTYPES)} (or the torch dtype), got {d!r}")
    return name



def _positive(v, allow_none: bool = True) -> bool:
    """Is ``v`` a positive number (not a bool), or None where allowed?"""
    if v is None:
        return allow_none
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """``compile_model``'s arguments (its docstring says what each means), checked (``__post_init__``)."""

    batch_size: int | str = 8
    seq_len: int | str = 1024
    micro_batch: int | None = None
    gpu_memory: Any = None
    host_memory: Any = None
    nvme_dir: str | None = None
    nvme_memory: Any = None
    #: a profile name, a profile file's path or a ``HardwareProfile`` (``hardware.get_profile``)
    hardware: Any = DEFAULT_HARDWARE
    policy: Policy = Policy.MILP
    optimizer: Optimizer = Optimizer.HYBRID8BIT
    param_dtype: str = "bfloat16"
    clip: bool = True
    solver: Solver = Solver.HIGHS
    time_limit: float | None = None
    reserve: Any = None
    max_batch_limit: int = 1 << 16
    resident: Any = "auto"
    calibrate: bool = False
    packed: bool = False
    seq_tile: int | str | None = "auto"
    world_size: int = 1
    nodes: int = 1
    compile_blocks: bool = False
    deadline: float | None = None
    #: "auto", "none", a number of streamed blocks or a sorted tuple of block indices (``gpu_update.request``)
    gpu_update: Any = "auto"
    loss_head: LossHead = LossHead.AUTO
    #: LoRA adapters on a named model (``frontend/lora.py``: a ``LoraSpec``, its text or mapping; None: none)
    lora: Any = None
    #: bits the frozen base is held in on the host and moved in (16, 8 or 4: ``ir.semantics.frozen_bytes_per_param``)
    base_bits: int = 16

    @classmethod
    def of(cls, model, **kwargs) -> CompileRequest:
        """The request for compiling ``model`` with ``compile_model``'s keyword arguments: without ``hardware``, the
        ``DEFAULT_HARDWARE`` profile (said on the compile's progress log); without ``host_memory``, the profile's
        less what ``model`` itself holds in host memory (resolved here, once: the searches compile a traced graph,
        which holds none)."""
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"compile_model() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        if "hardware" not in kwargs:
            kwargs["hardware"] = DEFAULT_HARDWARE
            log.info("no hardware given: planning for the %s profile (name another with hardware=, or "
                     "--hardware: a built-in profile or a file from `lazytrain profile`)", DEFAULT_HARDWARE)
        kwargs["param_dtype"] = param_dtype_name(kwargs.get("param_dtype", cls.param_dtype))
        held = held_host_bytes(model) if kwargs.get("host_memory") is None else 0
        if held:
            kwargs["host_memory"] = make_budgets(get_profile(kwargs["hardware"]), held_bytes=held).host_bytes
        return cls(**kwargs)

    def __post_init__(self) -> None:
        """The arguments' own checks, in the order their errors are said; the sizes and the model's are the
        pipeline's (``frontend/validate.py``), at the length and tiling a compile runs at."""
        param_dtype_name(self.param_dtype)
        if not _positive(self.time_limit):
            raise ValueError(f"time_limit must be a positive number of seconds per solve or None, "
                             f"got {self.time_limit!r}")
        if self.loss_head not in LossHead.names():
            raise ValueError(f"loss_head must be one of {', '.join(map(repr, LossHead.names()))}, "
                             f"got {self.loss_head!r}")
        if not isinstance(self.compile_blocks, bool):
            raise ValueError(f"compile_blocks must be True or False, got {self.compile_blocks!r}")
        self._set("policy", Policy.parse(self.policy, "unknown policy"))
        self._set("optimizer", Optimizer.parse(self.optimizer, "unknown optimizer"))
        self._set("solver", Solver.parse(self.solver, "unknown solver"))
        self._set("loss_head", LossHead(self.loss_head))
        self._set("lora", parse_lora(self.lora))
        if self.base_bits not in (16, 8, 4):
            raise ValueError(f"base_bits must be 16, 8 or 4, got {self.base_bits!r}")
        seq, mb, tile = self.seq_len, self.micro_batch, self.seq_tile
        if seq != "max" and (not isinstance(seq, int) or seq < 1):
            raise ValueError(f"seq_len must be a positive integer or 'max', got {seq!r}")
        if mb is not None and (not isinstance(mb, int) or mb < 1):
            raise ValueError(f"micro_batch must be a positive integer, got {mb!r}")
        if tile not in (None, "auto") and (not isinstance(tile, int) or isinstance(tile, bool) or tile < 1):
            raise ValueError(f"seq_tile must be a positive number of tokens, 'auto' or None, got {tile!r}")
        if not _positive(self.deadline):
            raise ValueError(f"deadline must be a positive number of seconds or None, got {self.deadline!r}")
        self._set("gpu_update", gpu_update_rule.request(self.gpu_update))
        if self.gpu_update not in ("auto", "none", 0, ()) and self.world_size > 1:
            raise ValueError(f"GPU-updated streamed blocks need a world of one (gpu_update={self.gpu_update!r}, "
                             f"world_size {self.world_size}): use gpu_update='none' (or 'auto', which chooses none "
                             f"there)")
        if self.world_size != 1 or self.nodes != 1:
            check_world(self.world_size, self.nodes)
        if self.optimizer.host_only:
            self._host_updates_only()

    def _host_updates_only(self) -> None:
        """An optimizer that updates on the host only: "auto" chooses no GPU-resident and no GPU-updated block,
        and asking for some is an error."""
        for name, none in (("resident", (None, "none", "auto", 0, [], ())), ("gpu_update", ("none", "auto", 0, ()))):
            if getattr(self, name) not in none:
                raise ValueError(f"optimizer {self.optimizer.value} updates on the host only: {name}="
                                 f"{getattr(self, name)!r} asks for blocks updated on the GPU; use {name}='none' "
                                 f"(or 'auto', which chooses none for it)")
            self._set(name, "none")

    def _set(self, name: str, value) -> None:
        """A field normalised in ``__post_init__`` (the dataclass is frozen to everyone else)."""
        object.__setattr__(self, name, value)
