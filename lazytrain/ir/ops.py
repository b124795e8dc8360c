"""The op list: a plan is a flat program of these, one line each (see ``lazytrain.ir`` for the grammar)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache


class OpKind(str, Enum):
    # parameters stream in
    LOAD = "load"                  # params[j] host -> gpu
    # work on the GPU
    COMPUTE = "compute"            # forward of block j, micro-batch m
    RECOMPUTE = "recompute"        # forward again during backward (saves for backward)
    BACKWARD = "backward"          # backward of block j, micro-batch m; accumulates grads[j]
    # activations move between tiers
    OFFLOAD = "offload"            # copy gpu -> host, or host -> nvme
    RELOAD = "reload"              # copy nvme -> host, or host -> gpu
    # gradients and the optimizer
    GRAD_OFFLOAD = "grad_offload"  # grads[j] gpu -> host
    UPDATE = "update"              # optimizer step of block j on the host (on the GPU if resident or GPU-updated)
    STATE_LOAD = "state_load"      # a GPU-updated block's parameters and optimizer state host -> gpu
    STATE_STORE = "state_store"    # ... and back gpu -> host after its update on the GPU
    STATE_READ = "state_read"      # a block's params / grads / ostate kept on NVMe: its file -> a host copy
    STATE_WRITE = "state_write"    # ... and a host copy back into its file (after an update or a grad_offload)
    # memory
    FREE = "free"                  # drop one copy of a tensor on one tier
    # collectives between the ranks of a data-parallel world (``world_size > 1``; ``ir.sharding``)
    ALL_GATHER = "all_gather"          # every rank's pshard[j] -> params[j] on every GPU
    REDUCE_SCATTER = "reduce_scatter"  # grads[j] summed over ranks -> gshard[j], this rank's slice
    ALL_REDUCE = "all_reduce"          # the ranks' squared gradient norms summed (the global clip norm)


class Tier(str, Enum):
    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"


class Resource(str, Enum):
    """What an op occupies; each resource runs its ops in list order (a CUDA stream, a thread)."""

    GPU = "gpu"
    H2D = "h2d"
    D2H = "d2h"
    CPU = "cpu"
    NVME = "nvme"
    NET = "net"      # the collective stream (NCCL between GPUs, gloo on the CPU)
    NONE = "none"


class TensorKind(str, Enum):
    PARAMS = "params"      # a block's parameters (streaming dtype)
    GRADS = "grads"        # a block's gradient accumulator
    ACT = "act"            # boundary i: the values entering block i, per micro-batch
    SAVED = "saved"        # what block j's backward needs, per micro-batch
    GRAD_ACT = "dact"      # gradient w.r.t. boundary i, per micro-batch
    PARAM_SHARD = "pshard"  # this rank's slice of a block's parameters on the GPU, before its all_gather
    GRAD_SHARD = "gshard"   # this rank's slice of a block's summed gradient, after its reduce_scatter
    OPT_STATE = "ostate"    # a block's optimizer state beyond its parameters (master low halves, moments)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorId:
    kind: TensorKind
    index: int
    mb: int | None = None

    def __str__(self) -> str:
        s = f"{self.kind.value}[{self.index}]"
        return s if self.mb is None else f"{s} mb{self.mb}"

    def to_json(self) -> list:
        return [self.kind.value, self.index, self.mb]

    @staticmethod
    def from_json(v: list) -> TensorId:
        return TensorId(kind=TensorKind(v[0]), index=int(v[1]), mb=None if v[2] is None else int(v[2]))

    def __lt__(self, other: TensorId) -> bool:  # enums do not order; order by value
        return (self.kind.value, self.index, -1 if self.mb is None else self.mb) < (
            other.kind.value, other.index, -1 if other.mb is None else other.mb)


@lru_cache(maxsize=1 << 17, typed=True)
def tensor_id(kind: TensorKind, index: int, mb: int | None = None) -> TensorId:
    """``TensorId(kind=kind, index=index, mb=mb)``, one instance per value: the lowering and ``effects`` name
    the same few tensors again and again (~10^5 times a compile of 80 blocks), and a frozen dataclass is built
    in Python where a cache hit is a C call.  ``typed``: ``TensorKind.ACT == "act"``, but only the enum is a
    kind."""
    return TensorId(kind=kind, index=index, mb=mb)


GiB = 1024**3


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One instruction.  Fields are the same for every kind; unused ones are None / 0.

    ``tensor`` is the value the op produces or moves (compute: its output boundary act[j+1];
    backward: dact[j]; load: params[j]; free: what is dropped from ``src``).  ``save`` marks a
    forward that records what backward needs (saved[j]).  ``seconds`` is the cost model's
    predicted duration on ``resource``; ``window`` the schedule window it was placed in.
    """

    id: int
    kind: OpKind
    block: int
    mb: int | None = None
    tensor: TensorId | None = None
    src: Tier | None = None
    dst: Tier | None = None
    nbytes: int = 0
    save: bool = False
    resource: Resource = Resource.NONE
    seconds: float = 0.0
    window: int = 0
    deps: tuple[int, ...] = ()

    def __str__(self) -> str:
        what = operand_text(self)
        move = f"{self.src.value}->{self.dst.value}" if self.src and self.dst else (self.src.value if self.src else "")
        size = f"{self.nbytes / GiB:.2f} GiB" if self.nbytes else ""
        after = "after " + ",".join(f"#{d}" for d in self.deps) if self.deps else ""
        width = max(12, len(self.kind.value))
        parts = [f"#{self.id}", f"{self.kind.value:<{width}}", f"{what:<18}", f"{move:<10}", f"{size:>10}",
                 f"{self.seconds * 1e3:8.3f} ms" if self.seconds else " " * 11, after]
        return " ".join(parts).rstrip()

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind.value, "block": self.block, "mb": self.mb,
                "tensor": None if self.tensor is None else self.tensor.to_json(),
                "src": None if self.src is None else self.src.value,
                "dst": None if self.dst is None else self.dst.value,
                "nbytes": self.nbytes, "save": self.save, "resource": self.resource.value,
                "seconds": self.seconds, "window": self.window, "deps": list(self.deps)}

    @staticmethod
    def from_json(d: dict) -> Op:
        return Op(id=int(d["id"]), kind=OpKind(d["kind"]), block=int(d["block"]),
                  mb=None if d.get("mb") is None else int(d["mb"]),
                  tensor=None if d.get("tensor") is None else TensorId.from_json(d["tensor"]),
                  src=None if d.get("src") is None else Tier(d["src"]),
                  dst=None if d.get("dst") is None else Tier(d["dst"]),
                  nbytes=int(d.get("nbytes", 0)), save=bool(d.get("save", False)),
                  resource=Resource(d.get("resource", "none")), seconds=float(d.get("seconds", 0.0)),
                  window=int(d.get("window", 0)), deps=tuple(int(x) for x in d.get("deps", ())))


def _tensor_or_block(op: Op) -> str:
    return str(op.tensor) if op.tensor is not None else f"block[{op.block}]"


def _block_mb(op: Op) -> str:
    what = f"block[{op.block}] mb{op.mb}"
    return what + " +saved" if op.save and op.kind is OpKind.COMPUTE else what


def _grad_norms(op: Op) -> str:
    return "grad norms"


#: the operand column of an op's printed line (``Op.__str__``), by kind where it is not the op's tensor (or its
#: block); the op registry (``ir.kinds``) names it as each kind's printer
OPERAND_TEXT = {OpKind.COMPUTE: _block_mb, OpKind.RECOMPUTE: _block_mb, OpKind.BACKWARD: _block_mb,
                OpKind.ALL_REDUCE: _grad_norms}


def operand_text(op: Op) -> str:
    """The operand column of ``op``'s printed line."""
    return OPERAND_TEXT.get(op.kind, _tensor_or_block)(op)
