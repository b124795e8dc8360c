"""What a policy decides; every solver returns this and one lowering turns it into ops.

Windows (the unit the MILP reasons in) are numbered in step order:
``F_0 .. F_{L-1}`` (forward of block j = window j), ``B_{L-1} .. B_0`` (backward of block j =
window 2L-1-j), and ``X = 2L``, the gap between steps for work that cannot hide anywhere.

Per boundary i (0..L-1) ``boundary[i]`` says where act[i] is kept from the forward until the
backward needs it: GPU / HOST / NVME, or NONE when backward does not need it or regenerates it by
recomputing from an earlier kept boundary (a recompute *segment*).  Per block j ``saved[j]`` says
what happens to what its backward needs: KEEP it on the GPU, offload to HOST or NVME and reload,
or RECOMPUTE it in the backward from the nearest kept boundary at or before j.

When transfers and updates run is the lowering's: each offload right after the forward that made
it, each reload one backward segment ahead, and each update at the earliest legal window (with exact
clipping: lagged into the next step's start, since the global norm is known only after the backward).

``cut[j]`` (compiled blocks only, ``frontend/cuts.py``) chooses which of block j's cuts its forward saves:
an index into ``Block.cuts``, 0 (the min-cut, ``Block.saved_bytes``) when empty.  A cut other than 0 saves
fewer bytes (kept, offloaded or reloaded as ``saved[j]`` says) and its backward recomputes the rest; a
RECOMPUTE block runs the min-cut (its saved tensors live only from its recompute to its backward).

``resident[j]`` keeps block j on the GPU for the whole run: its parameters, its optimizer state
and its gradient accumulator live there, nothing of it crosses PCIe, and its update runs on the GPU
at the start of the next step (after the clip coefficient is known).  It trades GPU memory
(``Sizes.resident_bytes``) for host update time, which at small per-block compute is what the
forward waits for.  Blocks that share a tied parameter are resident together (``tie_closure``).

``gpu_update[j]`` makes a streamed block *GPU-updated*: its fp32 gradient accumulator stays on the GPU
from its backward to the next step's start; there, once the global norm is known, its parameters and
optimizer state are copied host -> GPU (``state_load``), updated on the GPU stream with the resident
blocks' kernel just before its forward, written back GPU -> host (``state_store``, on the D2H stream,
idle then), and the new parameters serve its forward without a load.  The host worker's queue loses
the block, so the remaining host updates overlap these forwards.  It costs GPU memory (the kept
accumulator, 4 bytes a parameter, for the whole gap) and H2D / D2H traffic (parameters and state,
~6 bytes a parameter each way with the 8-bit optimizer).  Not for a resident block, nor one sharing a
tied parameter, nor with several ranks.

``nvme_state`` keeps parts of streamed blocks' training state in files on NVMe instead of the host store, by
component: ``params`` (the host parameters a load copies and the update rewrites), ``grads`` (the host gradient a
``grad_offload`` fills and the next update reads) and ``ostate`` (the optimizer's master low half and moments).
Host memory then holds them only while an op needs them (``state_read`` .. ``free``), at the price of NVMe
traffic each step: a placed component is read before each use and written after each change.  Not for a
resident or GPU-updated block, nor one sharing a tied parameter, nor with several ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

#: the components of a block's state ``Decisions.nvme_state`` may keep on NVMe: the tensor kinds (``TensorKind``
#: values) of their host copies
STATE_COMPONENTS = ("params", "grads", "ostate")


class Place(str, Enum):
    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"
    NONE = "none"


class Saved(str, Enum):
    KEEP = "keep"
    HOST = "host"
    NVME = "nvme"
    RECOMPUTE = "recompute"


@dataclass(frozen=True, kw_only=True)
class Decisions:
    policy: str
    micro_batch: int
    n_micro: int
    boundary: tuple[Place, ...]
    saved: tuple[Saved, ...]
    resident: tuple[bool, ...] = ()
    notes: dict = field(default_factory=dict)
    cut: tuple[int, ...] = ()
    gpu_update: tuple[bool, ...] = ()
    #: component (``STATE_COMPONENTS``) -> the blocks whose copy of it lives on NVMe (sorted)
    nvme_state: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def on_nvme(self, component: str) -> frozenset[int]:
        """The blocks whose ``component`` (``"params"``, ``"grads"``, ``"ostate"``) lives on NVMe."""
        return frozenset(self.nvme_state.get(component, ()))

    @property
    def nvme_state_blocks(self) -> frozenset[int]:
        """Blocks with any component on NVMe."""
        return frozenset(j for blocks in self.nvme_state.values() for j in blocks)

    def cut_of(self, j: int) -> int:
        """Block j's cut (an index into ``Block.cuts``; 0: the min-cut)."""
        return self.cut[j] if self.cut else 0

    def is_resident(self, j: int) -> bool:
        return bool(self.resident) and self.resident[j]

    @property
    def resident_blocks(self) -> frozenset[int]:
        return frozenset(j for j, r in enumerate(self.resident) if r)

    def is_gpu_updated(self, j: int) -> bool:
        return bool(self.gpu_update) and self.gpu_update[j]

    @property
    def gpu_updated_blocks(self) -> frozenset[int]:
        return frozenset(j for j, g in enumerate(self.gpu_update) if g)

    @property
    def n_blocks(self) -> int:
        return len(self.saved)

    def segments(self) -> list[tuple[int, int]]:
        """Backward units [s, e): runs of RECOMPUTE blocks that start at a kept boundary, and
        every other block alone.  A block in a multi-block segment regenerates its input from
        the segment's start, so all the segment's parameters are on the GPU together."""
        segs: list[tuple[int, int]] = []
        j = 0
        L = self.n_blocks
        while j < L:
            e = j + 1
            if self.saved[j] is Saved.RECOMPUTE:
                while e < L and self.saved[e] is Saved.RECOMPUTE and self.boundary[e] is Place.NONE:
                    e += 1
            segs.append((j, e))
            j = e
        return segs

    def check(self) -> None:
        """Structural validity (not memory): raises ValueError naming the first problem."""
        L = self.n_blocks
        if len(self.boundary) != L:
            raise ValueError(f"boundary has {len(self.boundary)} entries, expected {L}")
        if self.micro_batch < 1 or self.n_micro < 1:
            raise ValueError("micro_batch and n_micro must be >= 1")
        if self.saved and self.saved[0] is Saved.RECOMPUTE and self.boundary[0] is Place.NONE:
            raise ValueError("block 0 is recomputed but boundary 0 (the inputs) is not kept")
        for j in range(1, L):
            if self.saved[j] is Saved.RECOMPUTE and self.boundary[j] is Place.NONE \
                    and self.saved[j - 1] is not Saved.RECOMPUTE:
                raise ValueError(f"block {j} is recomputed from boundary {j}, which is not kept, "
                                 f"and block {j - 1} is not recomputed")
        if self.resident and len(self.resident) != L:
            raise ValueError(f"resident has {len(self.resident)} entries, expected {L}")
        if self.gpu_update and len(self.gpu_update) != L:
            raise ValueError(f"gpu_update has {len(self.gpu_update)} entries, expected {L}")
        both = sorted(self.gpu_updated_blocks & self.resident_blocks)
        if both:
            raise ValueError(f"blocks {both} are both resident and GPU-updated (a resident block is updated on the "
                             "GPU already)")
        if self.cut and len(self.cut) != L:
            raise ValueError(f"cut has {len(self.cut)} entries, expected {L}")
        for comp, blocks in self.nvme_state.items():
            if comp not in STATE_COMPONENTS:
                raise ValueError(f"nvme_state names {comp!r}; the components are {', '.join(STATE_COMPONENTS)}")
            bad = sorted(j for j in blocks if not 0 <= j < L)
            if bad:
                raise ValueError(f"nvme_state {comp} names blocks {bad} out of range 0..{L - 1}")
            both = sorted(set(blocks) & (self.gpu_updated_blocks | self.resident_blocks))
            if both:
                raise ValueError(f"blocks {both} keep {comp} on NVMe but are resident or GPU-updated (their state "
                                 "lives on the host or the GPU)")
        for j in range(L):
            if self.cut_of(j) and self.saved[j] is Saved.RECOMPUTE:
                raise ValueError(f"block {j} is recomputed and has cut {self.cut_of(j)}: a recomputed block "
                                 "runs the min-cut (cut 0)")

    def to_json(self) -> dict:
        return {"policy": self.policy, "micro_batch": self.micro_batch, "n_micro": self.n_micro,
                "boundary": [p.value for p in self.boundary], "saved": [s.value for s in self.saved],
                "resident": [bool(r) for r in self.resident], "notes": self.notes,
                **({"cut": list(self.cut)} if any(self.cut) else {}),
                **({"gpu_update": [bool(g) for g in self.gpu_update]} if any(self.gpu_update) else {}),
                **({"nvme_state": {k: list(v) for k, v in self.nvme_state.items() if v}}
                   if any(self.nvme_state.values()) else {})}

    @staticmethod
    def from_json(d: dict) -> Decisions:
        return Decisions(policy=str(d["policy"]), micro_batch=int(d["micro_batch"]), n_micro=int(d["n_micro"]),
                         boundary=tuple(Place(x) for x in d["boundary"]),
                         saved=tuple(Saved(x) for x in d["saved"]),
                         resident=tuple(bool(x) for x in d.get("resident", ())), notes=dict(d.get("notes", {})),
                         cut=tuple(d.get("cut", ())), gpu_update=tuple(d.get("gpu_update", ())),
                         nvme_state={str(k): tuple(sorted(int(j) for j in v))
                                     for k, v in dict(d.get("nvme_state", {})).items()})
