"""``check_plan(plan)``: a plan built from JSON is well-typed and self-consistent, or a ``PlanError``.

``check_plan_json`` (in ``verify.py``) looks at the raw JSON before anything is built; this module
looks at the objects ``Plan.from_json`` built from it, so that ``verify``, the simulator and the
runtime only ever see plans whose every field has the type its dataclass declares and whose every
cross-reference (op -> block, micro-batch, tensor; parameter -> owner; decisions -> blocks) is in
range.  A plan file is untrusted input: without this, a hand-edited or corrupted file could surface
as a ``TypeError`` or ``IndexError`` deep inside ``verify`` instead of a message naming the field.

Rules: integers are whole, not bool, and in ``[0, 2**62)`` (every count, size, index and id in the
IR is non-negative); floats are finite and non-negative; enums are members; a path-like string
(``nvme_dir``) is a string.  The check walks the dataclass type hints, so a field added to the IR
is checked without editing this file.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from enum import Enum
from functools import cache
from typing import TYPE_CHECKING

from .format import PlanError
from .graph import DTYPE_BYTES
from .kinds import COLLECTIVES, COPY_KINDS
from .limits import MAX_BATCH, MAX_SEQ_LEN, MAX_TOKENS
from .ops import OpKind, Resource, TensorKind
from .tiers import COPIES, TIERS

if TYPE_CHECKING:      # annotations only: plan.py imports this module to check what it reads
    from .plan import Plan

LIMIT = 1 << 62
_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


@cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def check_value(v, hint, where: str) -> None:
    """Raise PlanError unless ``v`` has the type ``hint`` (recursively into tuples, unions, dataclasses)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for h in typing.get_args(hint):
            try:
                check_value(v, h, where)
                return
            except PlanError as e:
                errors.append(e)
        raise errors[-1]
    if hint is type(None):
        if v is not None:
            raise PlanError(f"plan field {where} must be null, got {type(v).__name__}")
        return
    if origin is tuple:
        if not isinstance(v, tuple):
            raise PlanError(f"plan field {where} must be a list, got {type(v).__name__}")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            for i, x in enumerate(v):
                check_value(x, args[0], f"{where}[{i}]")
        else:
            if len(v) != len(args):
                raise PlanError(f"plan field {where} must have {len(args)} entries, got {len(v)}")
            for i, (x, h) in enumerate(zip(v, args)):
                check_value(x, h, f"{where}[{i}]")
        return
    if origin is dict or hint is dict:
        if not isinstance(v, dict):
            raise PlanError(f"plan field {where} must be an object, got {type(v).__name__}")
        return
    if hint is typing.Any:
        return
    if isinstance(hint, type) and issubclass(hint, Enum):
        if not isinstance(v, hint):
            raise PlanError(f"plan field {where} must be one of {[m.value for m in hint]}, got {v!r}")
        return
    if hint is bool:
        if not isinstance(v, bool):
            raise PlanError(f"plan field {where} must be true or false, got {v!r}")
        return
    if hint is int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise PlanError(f"plan field {where} must be a whole number, got {type(v).__name__}")
        if not 0 <= v < LIMIT:
            raise PlanError(f"plan field {where} out of range: {v} (must be in 0 .. 2**62)")
        return
    if hint is float:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise PlanError(f"plan field {where} must be a number, got {type(v).__name__}")
        if not (math.isfinite(v) and 0 <= v < 1e18):
            raise PlanError(f"plan field {where} must be a finite non-negative number, got {v!r}")
        return
    if hint is str:
        if not isinstance(v, str):
            raise PlanError(f"plan field {where} must be a string, got {type(v).__name__}")
        return
    if dataclasses.is_dataclass(hint):
        if not isinstance(v, hint):
            raise PlanError(f"plan field {where} must be a {hint.__name__}, got {type(v).__name__}")
        for f in dataclasses.fields(hint):
            check_value(getattr(v, f.name), _hints(hint)[f.name], f"{where}.{f.name}")
        return
    raise PlanError(f"plan field {where}: cannot check type {hint!r}")   # pragma: no cover - IR grew a type


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise PlanError(msg)


def check_plan(plan: Plan) -> None:
    """Types, ranges and cross-references of a plan built from JSON (see the module docstring)."""
    g, dec = plan.graph, plan.decisions
    check_value(g, type(g), "graph")
    check_value(dec, type(dec), "decisions")
    for i, op in enumerate(plan.ops):
        check_value(op, type(op), f"ops[{i}]")
    for key in ("batch_size", "seq_len"):
        check_value(getattr(plan, key), int, key)
    for key, most in (("batch_size", MAX_BATCH), ("seq_len", MAX_SEQ_LEN)):
        _need(1 <= getattr(plan, key) <= most, f"plan field {key} out of range: {getattr(plan, key)} (must be in "
                                                f"1 .. {most:,})")
    tokens = plan.batch_size * plan.seq_len
    _need(tokens <= MAX_TOKENS, f"plan field batch_size x seq_len out of range: {tokens:,} tokens (at most "
                                f"{MAX_TOKENS:,})")
    L = g.n_blocks
    _need(L >= 1, "plan graph has no blocks")
    _need(plan.param_dtype in _FLOAT_DTYPES, f"plan param_dtype {plan.param_dtype!r} is not one of {_FLOAT_DTYPES}")
    _need(g.dtype in _FLOAT_DTYPES, f"plan graph dtype {g.dtype!r} is not one of {_FLOAT_DTYPES}")
    _need(g.seq_len == plan.seq_len, f"plan seq_len {plan.seq_len} differs from its graph's {g.seq_len}")
    names: dict[int, set[str]] = {}
    for j, b in enumerate(g.blocks):
        _need(b.index == j, f"graph block at position {j} has index {b.index}")
        names[j] = {p.name for p in b.params}
        for t in (*b.inputs, *b.outputs):
            _need(t.dtype in DTYPE_BYTES, f"block {j}: value {t.name!r} has unknown dtype {t.dtype!r}")
    for b in g.blocks:
        for p in b.params:
            _need(p.owner < L, f"block {b.index}: parameter {p.name!r} owned by block {p.owner}, out of range")
            _need(p.name in names[p.owner],
                  f"block {b.index}: parameter {p.name!r} is owned by block {p.owner}, which does not list it")
    for a, b in g.edges:
        _need(a < L and b < L, f"graph edge ({a}, {b}) out of range 0..{L - 1}")
    _need(len(dec.saved) == L, f"decisions cover {len(dec.saved)} blocks, the graph has {L}")
    try:
        dec.check()
    except ValueError as e:
        raise PlanError(f"plan decisions: {e}") from None
    for j, k in enumerate(dec.cut):
        _need(k == 0 or k < len(g.blocks[j].cuts), f"plan decisions: block {j} has cut {k}, but its graph block "
                                                   f"offers {len(g.blocks[j].cuts)} cuts")
    _need(not any(dec.cut) or plan.options.get("compile_blocks") is True,
          "plan decisions choose cuts but the plan does not compile its blocks (options.compile_blocks)")
    _need(dec.micro_batch * dec.n_micro == plan.batch_size,
          f"plan batch_size {plan.batch_size} is not micro_batch {dec.micro_batch} x n_micro {dec.n_micro}")
    _check_budgets(plan.budgets)
    for key, v in plan.predicted.items():
        if key == "busy_s":               # the only table among the predicted figures
            _need(isinstance(v, dict), f"plan field predicted.busy_s must be an object, got {type(v).__name__}")
            for k2, x in v.items():
                check_value(x, float, f"predicted.{key}.{k2}")
        else:
            check_value(v, float, f"predicted.{key}")
    if "host_bytes_per_param" in plan.options:
        check_value(plan.options["host_bytes_per_param"], float, "options.host_bytes_per_param")
    _need(type(plan.options.get("compile_blocks", False)) is bool,
          f"plan field options.compile_blocks must be true or false, got {plan.options.get('compile_blocks')!r}")
    if plan.solver is not None:
        check_value(plan.solver, type(plan.solver), "solver")
    _check_world(plan)
    M = dec.n_micro
    moves = COPY_KINDS
    for op in plan.ops:
        where = f"op #{op.id}"
        _need(op.block < L, f"{where}: block {op.block} out of range 0..{L - 1}")
        _need(op.mb is None or op.mb < M, f"{where}: micro-batch {op.mb} out of range 0..{M - 1}")
        t = op.tensor
        if t is not None:
            top = L if t.kind in (TensorKind.ACT, TensorKind.GRAD_ACT) else L - 1
            _need(t.index <= top, f"{where}: tensor {t} out of range (index 0..{top})")
            _need(t.mb is None or t.mb < M, f"{where}: tensor {t} micro-batch out of range 0..{M - 1}")
        if op.kind in moves or op.kind is OpKind.FREE:
            _need(t is not None and op.src is not None, f"{where}: {op.kind.value} needs a tensor and a source tier")
        if op.kind in moves:
            _need(op.dst is not None and op.dst is not op.src,
                  f"{where}: {op.kind.value} needs a destination tier other than its source")
            a, b = sorted((op.src, op.dst), key=_TIER_ORDER.index)
            _need((op.src, op.dst) in COPIES, f"{where}: moves between {TIERS[a].noun} and {TIERS[b].noun} go "
                                              "through the host")


_TIER_ORDER = list(TIERS)


#: the most ranks a plan may name (a sanity bound on an untrusted file: 8 hosts of 8 GPUs is 64)
MAX_WORLD = 1 << 16


def _check_world(plan: Plan) -> None:
    """World size in range; collectives only in a world of several ranks, on the collective stream."""
    w = plan.world_size
    _need(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_WORLD,
          f"plan field world_size must be an integer in 1..{MAX_WORLD}, got {w!r}")
    for op in plan.ops:
        if op.kind in COLLECTIVES:
            _need(w > 1, f"op #{op.id}: {op.kind.value} in a plan for world size 1")
            _need(op.resource is Resource.NET, f"op #{op.id}: {op.kind.value} must run on the net resource")


def check_nvme_dir(v, what: str = "nvme_dir") -> None:
    """An NVMe folder is a plain path: a string without NUL bytes that never climbs out with ``..``
    (a plan file from elsewhere must not make the runtime write outside the folder it names)."""
    _need(isinstance(v, str), f"{what} must be a path or null, got {v!r}")
    _need("\x00" not in v, f"{what} contains a NUL byte")
    _need(".." not in v.replace("\\", "/").split("/"),
          f"{what} {v!r} climbs out with '..': the NVMe folder must be a plain path")


def _check_budgets(b: dict) -> None:
    for key, v in b.items():
        if key == "nvme_dir":
            if v is not None:
                check_nvme_dir(v, "plan budget nvme_dir")
        elif v is not None:
            check_value(v, int, f"budgets.{key}")
