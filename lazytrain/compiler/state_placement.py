"""Which parts of the training state live on NVMe (``Decisions.nvme_state``), chosen once per compile before the
search: host RAM is a cache of the state, and the placement keeps in it as much as the host budget allows.

The host store holds, per parameter, the parameters (2 B in bf16), the host gradient (2 B) and the optimizer
state beyond them (``ostate``: 4.25 B for the 8-bit optimizer).  A component kept on NVMe costs NVMe traffic each
step, per byte it frees: the optimizer state is read and written once (2 bytes moved per byte freed), the
gradient written after its offload and read by the next update (2), the parameters written after the update and
read for the backward's load (the forward's load reuses the update's copy: 2 reads and 1 write, 3).  So the
placement moves optimizer state first, then gradients, then parameters, block by block, until what stays fits:

    host store left + host copies in flight + activation headroom <= host budget

where the host copies in flight are the ``lower.NVME_STATE_SLOTS`` largest placed blocks' of each component and the
headroom is what the search may offload to the host (every boundary of the batch, at most ``ACT_SHARE`` of the
budget).  Blocks are taken evenly spread, so the NVMe traffic interleaves with the blocks whose state stays.

Placeable blocks: streamed (not resident), sharing no tied parameter, owning parameters, in a world of one.  The
gradient is placed only with exact clipping, where it waits on the host from one step's backward to the next
step's update; without clipping it lives only from its offload to its update.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import TensorId, TensorKind, Tier
from ..ir.semantics import static_host_bytes, tie_closure
from .lower import NVME_STATE_SLOTS

#: the share of the host budget held back for offloaded activations when the state does not fit
#: [ledger: nvme-state-act-share]
ACT_SHARE = 0.25

#: components in the order the placement moves them (NVMe bytes moved per host byte freed: 2, 2, 3)
ORDER = (TensorKind.OPT_STATE, TensorKind.GRADS, TensorKind.PARAMS)


@dataclass(frozen=True)
class StateFit:
    """What a placement leaves: the state in the host store, the host copies in flight, the files on NVMe."""

    placed: dict[str, tuple[int, ...]]
    host_store_bytes: int
    in_flight_bytes: int
    nvme_bytes: int

    @property
    def host_bytes(self) -> int:
        return self.host_store_bytes + self.in_flight_bytes


def placeable(comp) -> list[int]:
    """Blocks whose state may go to NVMe, evenly spread (the middle ones first, then halves, ...)."""
    g = comp.graph
    if comp.world_size > 1 or g.frozen_params:     # (a frozen base's state is its load buffer: not placed)
        return []
    ok = [j for j in range(g.n_blocks) if j not in comp.resident and g.blocks[j].trainable_numel
          and tie_closure(g, {j}) == {j}]
    return _spread(ok)


def _spread(items: list[int]) -> list[int]:
    """``items`` in an order whose every prefix is spread evenly over the list (bit-reversal of positions)."""
    n = len(items)
    if n <= 1:
        return list(items)
    bits = (n - 1).bit_length()
    keyed = sorted(range(n), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))
    return [items[i] for i in keyed]


def fit(comp, placed: dict[TensorKind, list[int]]) -> StateFit:
    """The host and NVMe bytes of one placement (``placed``: component -> blocks)."""
    sizes = comp.cost(1, frozenset(), nvme=frozenset()).sizes
    total = int(static_host_bytes(comp.graph, comp.options["host_bytes_per_param"], comp.param_dtype,
                                  comp.options.get("base_bits", 16))) // comp.world_size
    on_nvme = in_flight = 0
    for kind, blocks in placed.items():
        each = [sizes.of(TensorId(kind=kind, index=j), Tier.HOST) for j in blocks]
        on_nvme += sum(each)
        in_flight += sum(sorted(each)[-NVME_STATE_SLOTS:])     # (at most that many of them at once)
    return StateFit(placed={k.value: tuple(sorted(v)) for k, v in placed.items() if v},
                    host_store_bytes=total - on_nvme, in_flight_bytes=in_flight, nvme_bytes=on_nvme)


def placed_fit(comp) -> StateFit:
    """``fit`` of the placement ``comp`` carries (``Compiler.nvme_state``)."""
    return fit(comp, {TensorKind(k): list(v) for k, v in comp.nvme_state.items()})


def activation_headroom(comp, batch_size) -> int:
    """Host bytes the placement leaves for offloaded activations: every boundary of the batch (what keeping each
    one on the host takes), at most ``ACT_SHARE`` of the host budget."""
    host = comp.budgets.host_bytes or 0
    per_sample = sum(comp.graph.boundary_bytes)
    batch = batch_size if isinstance(batch_size, int) else 1
    return int(min(per_sample * batch, ACT_SHARE * host))


def place(comp, batch_size) -> dict[str, tuple[int, ...]]:
    """The state to keep on NVMe for ``comp``'s budgets (empty: the host store holds it all, or there is no NVMe
    folder).  The fewest bytes, in ``ORDER``, that bring the host within its budget; all it can place where even
    that does not (the search then says what host memory would do, ``budgets.budget_error``)."""
    b = comp.budgets
    if not b.nvme_dir or not b.nvme_bytes or b.host_bytes is None:
        return {}
    blocks = placeable(comp)
    cap = b.host_bytes - activation_headroom(comp, batch_size)
    placed: dict[TensorKind, list[int]] = {}
    if fit(comp, placed).host_bytes <= cap:
        return {}
    for kind in ORDER:
        if kind is TensorKind.GRADS and not comp.clip:
            continue
        placed[kind] = []
        for j in blocks:
            placed[kind].append(j)
            now = fit(comp, placed)
            if now.host_bytes <= cap:
                return now.placed
    return fit(comp, placed).placed


def fullest(comp) -> StateFit:
    """Every placeable component of every placeable block on NVMe: the least host memory the state can take."""
    blocks = placeable(comp)
    return fit(comp, {k: list(blocks) for k in ORDER if k is not TensorKind.GRADS or comp.clip})
