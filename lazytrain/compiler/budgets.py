"""The memory budgets a plan must meet, in bytes (``Budgets``), from the sizes a caller gives and the hardware
profile's defaults (``make_budgets``), how to say which one a plan exceeds, and what to tell a caller whose search
found no plan within them (``budget_error``)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping

from ..ir import GiB, Plan, PlanError
from ..ir.semantics import static_host_bytes
from ..util.torch_free import is_module
from ..util.units import format_size, parse_size
from .progress import caller_stacklevel
from .solvers.heuristics import HEURISTICS
from .state_placement import fullest, placed_fit


class BudgetError(PlanError):
    """No plan fits the memory budgets; the message states the smallest budget that would."""


#: the budgets' keys in a plan's JSON (``Plan.budgets``), in the order ``make_budgets`` writes them
_JSON_ORDER = ("gpu_bytes", "gpu_total_bytes", "gpu_reserve_bytes", "host_bytes", "nvme_bytes", "nvme_dir")


@dataclasses.dataclass(frozen=True)
class Budgets:
    """The memory budgets of one compile, in bytes: what its plans must fit (``make_budgets``).  A plan records them
    as a dict (``Plan.budgets``, ``to_json``); a tier's budget is named by its field (``gpu_bytes``, ``host_bytes``,
    ``nvme_bytes``)."""

    #: GPU memory a plan may peak at: the GPU's memory less the reserve
    gpu_bytes: int | None = None
    #: host memory a plan may hold (its store, buffers and activations)
    host_bytes: int | None = None
    #: NVMe bytes a plan may spill (0 without an NVMe folder)
    nvme_bytes: int = 0
    #: the GPU memory the caller gave (or the profile's); None where the budget was given as ``gpu_bytes`` alone
    gpu_total_bytes: int | None = None
    #: GPU memory kept back for the CUDA context, workspaces and fragmentation
    gpu_reserve_bytes: int | None = None
    #: the folder of the NVMe tier, if any
    nvme_dir: str | None = None

    @classmethod
    def of(cls, budgets: Budgets | Mapping) -> Budgets:
        """``budgets`` as the record: a plan's dict (a key it lacks is unset), or the record itself."""
        if isinstance(budgets, Budgets):
            return budgets
        return cls(**{k: v for k, v in budgets.items() if k in _JSON_ORDER and (k != "nvme_bytes" or v is not None)})

    def to_json(self) -> dict:
        """The dict a plan records (``Plan.budgets``): ``make_budgets``' keys in its order; the GPU total and reserve
        only where known."""
        out = {k: getattr(self, k) for k in _JSON_ORDER}
        for key in ("gpu_total_bytes", "gpu_reserve_bytes"):
            if out[key] is None:
                del out[key]
        return out


def host_reserve(host_bytes: int) -> int:
    """Host memory a plan leaves to the rest of the process and the system when the budget is the machine's
    whole memory: 4 GiB + 5% (the OS and page cache, Python, CUDA's host side, the data pipeline)."""
    return int(4 * GiB + 0.05 * host_bytes)


def held_host_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers in host memory: the caller holds them while the
    runtime's store holds its own copy (a meta model, a preset name or a config holds none)."""
    if not is_module(model):
        return 0
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def binding(plan: Plan, budgets: Budgets) -> str | None:
    """The budget ``plan`` exceeds, with the figures (None: it fits them all)."""
    pred = plan.predicted
    for tier, key in (("GPU", "gpu_bytes"), ("host", "host_bytes"), ("NVMe", "nvme_bytes")):
        need = pred[f"peak_{key}"]
        cap = getattr(budgets, key) or 0
        if need > cap:
            left = (f" (what {budgets.gpu_total_bytes / GiB:.2f} GiB leaves after the "
                    f"{budgets.gpu_reserve_bytes / GiB:.2f} GiB reserve)" if tier == "GPU" else "")
            return (f"{tier} memory: its leanest plan ({plan.decisions.policy}, micro-batch {plan.micro_batch}) "
                    f"peaks at {need / GiB:.2f} GiB, over the budget of {cap / GiB:.2f} GiB{left}")
    return None


#: the GPU memory a budget keeps back unless told: this much, plus ``RESERVE_SHARE`` of the memory [ledger: gpu-reserve]
RESERVE_BASE = 1.5 * GiB
RESERVE_SHARE = 0.05


def default_reserve(gpu_bytes: int) -> int:
    """The GPU memory a budget keeps back unless told (``make_budgets``): 1.5 GiB + 5%."""
    return int(RESERVE_BASE + RESERVE_SHARE * gpu_bytes)


def gpu_memory_for(peak: int, budgets: Budgets) -> float:
    """GiB of GPU memory (``--gpu-memory``) whose budget holds a plan peaking at ``peak`` bytes, under ``budgets``'
    reserve: the default reserve grows with the memory (5%), so the memory that holds ``peak`` is more than ``peak``
    plus the reserve of a smaller budget.  Rounded up to 0.01 GiB: that figure itself compiles."""
    total, res = budgets.gpu_total_bytes, budgets.gpu_reserve_bytes
    if res == default_reserve(total):
        need = (peak + RESERVE_BASE) / (1 - RESERVE_SHARE)
        while need - default_reserve(int(need)) < peak:     # int() rounding in the reserve
            need += 1
    else:
        need = peak + res
    return math.ceil(need / GiB * 100) / 100


def make_budgets(hw, gpu_memory=None, host_memory=None, nvme_dir=None, nvme_memory=None, reserve=None,
                 held_bytes: int = 0) -> Budgets:
    """Budgets in bytes from sizes (``"24GiB"``) or byte counts; defaults from the hardware profile.
    The GPU budget the plan must meet is the given memory less ``reserve`` (CUDA context, cuBLAS
    workspaces, allocator fragmentation; default 1.5 GiB + 5% [ledger: gpu-reserve]).  The host budget defaults to
    the profile's host memory less ``host_reserve`` and less ``held_bytes`` (the model the caller holds:
    a 7B model's bf16 weights are 14 GiB beside the store); a given ``host_memory`` is taken as is."""

    def size(v, default, name):
        if v is None:
            return default
        try:
            return parse_size(v)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    gpu = size(gpu_memory, hw.gpu_memory_bytes, "gpu_memory")
    if gpu_memory is not None and hw.has_gpu and gpu > hw.gpu_memory_bytes:
        warnings.warn(f"GPU memory {format_size(gpu)} is more than the {format_size(hw.gpu_memory_bytes)} of the "
                      f"{hw.name} profile's {hw.gpu_name}: the plan will not run on that GPU (name the GPU's own "
                      f"profile with --hardware)", stacklevel=caller_stacklevel())
    if reserve is None:
        res = default_reserve(gpu)
    else:           # no reserve is a choice (a size of 0 is not: ``parse_size`` refuses it)
        res = 0 if reserve == 0 else size(reserve, 0, "reserve")
    budgets = Budgets(gpu_bytes=gpu - res, gpu_total_bytes=gpu, gpu_reserve_bytes=res,
                      host_bytes=size(host_memory, hw.host_memory_bytes - host_reserve(hw.host_memory_bytes)
                                      - held_bytes, "host_memory"),
                      nvme_bytes=size(nvme_memory, 0, "nvme_memory") if nvme_dir else 0, nvme_dir=nvme_dir)
    if budgets.gpu_bytes <= 0:
        bare = isinstance(gpu_memory, str) and gpu_memory.strip().replace("_", "").isdigit()
        raise BudgetError(f"GPU memory {format_size(gpu)} is below the reserve of {format_size(res)}"
                          + (f" ({gpu_memory!r} has no unit, so it is bytes: write e.g. {gpu_memory.strip()}GiB)"
                             if bare else ""))
    return budgets


def _count(n: int) -> str:
    """12_345_678 -> '12.3 M' (a parameter count readable at every model size)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def _gib(n: int) -> str:
    """Bytes in GiB to two places, as the budget errors state them; a size under 0.01 GiB in its own unit."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else format_size(n)


def state_error(comp) -> BudgetError | None:
    """Why the training state (parameters, gradients, optimizer state) does not fit the host budget with what the
    compile keeps on NVMe (``compiler/state_placement.py``), naming the smallest host memory and NVMe that would
    hold it; None where it fits."""
    b, n = comp.budgets, comp.graph.total_params
    per = comp.options["host_bytes_per_param"]
    need = placed_fit(comp)
    if need.host_bytes <= b.host_bytes and need.nvme_bytes <= (b.nvme_bytes or 0):
        return None
    least = fullest(comp)
    state = int(static_host_bytes(comp.graph, per, comp.param_dtype, comp.options.get("base_bits", 16)))
    frozen = comp.graph.frozen_params
    what = (f"the parameters and optimizer state of {_count(n)} parameters ({per} bytes each"
            f"{f' of the {_count(n - frozen)} that train' if frozen else ''}, {_gib(state // comp.world_size)})")
    if least.host_bytes > b.host_bytes or comp.world_size > 1:
        on_nvme = (f"; with all of it that can go to NVMe there ({_gib(least.nvme_bytes)} of --nvme-memory), "
                   f"{_gib(least.host_bytes)} of host memory" if least.nvme_bytes and comp.world_size == 1 else "")
        return BudgetError(f"needs at least {_gib(state // comp.world_size)} of host memory for {what}"
                           f"{on_nvme}; the budget is {_gib(b.host_bytes)}: raise --host-memory")
    if not b.nvme_dir or not b.nvme_bytes:
        return BudgetError(f"needs at least {_gib(state // comp.world_size)} of host memory for {what}; the "
                           f"budget is {_gib(b.host_bytes)}. With state on NVMe it fits: give --nvme-dir (a folder on "
                           f"a fast drive) and --nvme-memory of at least {_gib(least.nvme_bytes)} (the least host "
                           f"memory that can hold the rest is {_gib(least.host_bytes)})")
    return BudgetError(f"{what} does not fit {_gib(b.host_bytes)} of host memory with {_gib(b.nvme_bytes)} of "
                       f"NVMe: keeping enough of it on NVMe takes {_gib(need.nvme_bytes)} there; raise --nvme-memory "
                       f"(up to {_gib(least.nvme_bytes)} holds all of it that can go there) or --host-memory")


def budget_error(search, batch_size: int, micro_batch: int | None, policy: str = "milp") -> BudgetError:
    """Why no plan of ``policy`` fits the budgets at this batch (``search``: the ``search.Search`` that found none),
    with the memory that would make one fit where that can be said."""
    comp = search.comp
    state = state_error(comp)
    if state is not None:        # the state alone does not fit the host and NVMe budgets: say that first
        return state
    mb = micro_batch or 1
    leanest = search.leanest(batch_size, mb)
    need = leanest.predicted["peak_gpu_bytes"]
    why = binding(leanest, comp.budgets)

    def own_plan() -> Plan:
        """A heuristic policy's own plan at its leanest micro-batch: what that policy itself needs."""
        return comp.build(HEURISTICS[policy](comp.graph, mb, batch_size // mb), batch_size, check_budget=False)
    if why is None and policy in HEURISTICS:      # the MILP's leanest plan fits: this policy's own does not
        own = own_plan()
        return BudgetError(
            f"policy {policy} has no plan within the budgets for batch {batch_size}, seq {comp.graph.seq_len}: "
            f"{binding(own, comp.budgets) or 'its plan does not fit'}; the milp policy's leanest plan fits them: "
            f"use --policy milp, or lower the batch or the sequence")
    if need <= comp.budgets.gpu_bytes:     # the GPU is not what binds: the host or NVMe budget is
        return BudgetError(
            f"no plan fits every budget for batch {batch_size}, seq {comp.graph.seq_len}: the plan leanest on GPU "
            f"memory needs {gpu_memory_for(need, comp.budgets):.2f} of the "
            f"{comp.budgets.gpu_total_bytes / GiB:.2f} GiB, but "
            f"{why or 'the search found no plan within the budgets'}: raise --host-memory, give --nvme-dir for "
            f"activations, or lower the "
            f"batch or the sequence")
    if policy in HEURISTICS:
        own_need = own_plan().predicted["peak_gpu_bytes"]
        if own_need > need:
            budget = comp.budgets.gpu_total_bytes / GiB
            return BudgetError(
                f"policy {policy} needs at least {gpu_memory_for(own_need, comp.budgets):.2f} GiB of GPU memory for "
                f"batch {batch_size}, seq {comp.graph.seq_len} (micro-batch {mb}); the budget is {budget:.2f} GiB. "
                f"The milp policy needs only {gpu_memory_for(need, comp.budgets):.2f} GiB: use --policy milp, or "
                "lower the batch")
    held = ""
    if comp.resident:
        rb = comp.cost(1).sizes.resident_bytes()
        held = f", of it {rb / GiB:.2f} GiB for the {len(comp.resident)} resident blocks asked for"
    total = gpu_memory_for(need, comp.budgets)
    msg = (f"needs at least {total:.2f} GiB of GPU memory for batch {batch_size}, seq {comp.graph.seq_len} (plan "
           f"peak {need / GiB:.2f} GiB{held} + {total - need / GiB:.2f} GiB reserve); the budget "
           f"is {comp.budgets.gpu_total_bytes / GiB:.2f} GiB: lower the batch or the sequence"
           f"{', keep fewer blocks resident' if held else ''}, or raise --gpu-memory")
    return BudgetError(msg)
