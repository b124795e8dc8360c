"""Plan files fuzzed with hypothesis: whatever is in the file, ``Plan.load`` / ``Plan.from_json`` /
``verify`` either accept it or raise ``PlanError`` -- never another exception type -- before any runtime
starts.  The seed is a real compiled plan (the package's GPT, 3 layers, lagged updates, offloads to host
and NVMe), mutated at random paths: truncated text, wrong types anywhere, unknown op kinds, dependency
cycles and forward references, missing fields, huge numbers, NaN / inf, deeply nested junk.
"""

from __future__ import annotations

import copy
import json
import math
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain.compiler.simulate import simulate
from lazytrain.ir import Plan, PlanError, verify

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)


@lru_cache(maxsize=1)
def _seed_text() -> str:
    """A small, valid plan with every op kind and every tier (built once, kept as JSON text)."""
    import torch

    from lazytrain.compiler.api import Compiler
    from lazytrain.compiler.profiles import get_profile
    from lazytrain.frontend.presets import build_from_config
    from lazytrain.frontend.trace import trace
    from lazytrain.ir import Decisions, GiB, Place, Saved
    cfg = {"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 32, "n_layer": 3, "n_head": 2, "d_ff": 48,
           "max_seq": 32, "tie_weights": True}
    model = build_from_config(cfg, device="meta", dtype=torch.float32)
    graph = trace(model, seq_len=16, dtype="float32")
    dec = Decisions(policy="fuzz-seed", micro_batch=1, n_micro=2,
                    boundary=(Place.HOST, Place.NVME, Place.NONE, Place.HOST, Place.GPU),
                    saved=(Saved.HOST, Saved.RECOMPUTE, Saved.RECOMPUTE, Saved.NVME, Saved.RECOMPUTE))
    budgets = {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB, "nvme_bytes": GiB, "nvme_dir": "/tmp/lazytrain-nvme"}
    comp = Compiler(graph, get_profile("cpu"), budgets, param_dtype="float32", optimizer="adamw", clip=True)
    return json.dumps(comp.build(dec, 2).to_json())


def seed() -> dict:
    return json.loads(_seed_text())


def _paths(obj, prefix=()):
    """Every path (tuple of keys / indices) into a JSON value, the root included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


@lru_cache(maxsize=1)
def _all_paths() -> tuple:
    """Paths grouped by pattern (list indices as '*'): sampling a pattern first reaches every kind of
    field equally often, not mostly the thousands of op fields."""
    groups: dict[tuple, list] = {}
    for p in _paths(seed()):
        groups.setdefault(tuple("*" if isinstance(k, int) else k for k in p), []).append(p)
    return tuple(tuple(v) for _, v in sorted(groups.items(), key=lambda kv: str(kv[0])))


def _pick(i: int, j: int, nonempty: bool = False) -> tuple:
    groups = [g for g in _all_paths() if not nonempty or g[0]]
    g = groups[i % len(groups)]
    return g[j % len(g)]


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _deep(depth: int):
    v: object = 0
    for i in range(depth):
        v = [v] if i % 2 else {"x": v}
    return v


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**62, 2**63, 2**64 + 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 0.5]),
    st.text(max_size=12), st.sampled_from(["", "load", "teleport", "gpu", "nvme", "../../etc/passwd"]),
    st.lists(st.integers(min_value=-3, max_value=10**6), max_size=4),
    st.builds(_deep, st.integers(min_value=1, max_value=60)),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


def _accepts_or_plan_error(d) -> None:
    """The contract: from_json + verify accept ``d`` or raise PlanError, nothing else."""
    try:
        plan = Plan.from_json(d)
        verify(plan)
        simulate(plan)       # what `lazytrain simulate` / `trace` do next
        plan.summary()       # and `lazytrain show`
    except PlanError as e:
        assert str(e), "a PlanError must say what is wrong"


@settings(FUZZ, max_examples=150)
@given(i=st.integers(min_value=0), j=st.integers(min_value=0), junk=JUNK)
def test_any_field_replaced_by_junk(i, j, junk):
    path = _pick(i, j)
    d = seed()
    if not path:
        d = junk
    else:
        _get(d, path[:-1])[path[-1]] = copy.deepcopy(junk)
    _accepts_or_plan_error(d)


@settings(FUZZ, max_examples=100)
@given(i=st.integers(min_value=0), j=st.integers(min_value=0))
def test_any_field_missing(i, j):
    path = _pick(i, j, nonempty=True)
    d = seed()
    parent = _get(d, path[:-1])
    del parent[path[-1]]
    _accepts_or_plan_error(d)


@FUZZ
@given(op=st.integers(min_value=0), dep=st.integers(min_value=-5, max_value=10**4),
       kind=st.one_of(st.none(), st.sampled_from(["teleport", "LOAD", "", "load", "free", "update"])))
def test_dependency_cycles_forward_references_and_unknown_kinds(op, dep, kind):
    d = seed()
    o = d["ops"][op % len(d["ops"])]
    o["deps"] = [*o["deps"], dep]          # a forward reference, itself (a cycle), or a real earlier op
    if kind is not None:
        o["kind"] = kind
    _accepts_or_plan_error(d)


@FUZZ
@given(cut=st.integers(min_value=0))
def test_truncated_text(cut, tmp_path_factory):
    text = _seed_text()
    path = tmp_path_factory.mktemp("trunc") / "plan.json"
    path.write_text(text[: cut % len(text)])
    with pytest.raises(PlanError):
        Plan.load(path)


@FUZZ
@given(data=st.binary(max_size=64))
def test_binary_garbage(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("bin") / "plan.json"
    path.write_bytes(data)
    with pytest.raises(PlanError):
        Plan.load(path)


def test_seed_is_valid(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(_seed_text())
    verify(Plan.load(path))


@pytest.mark.parametrize("text", ["[" * 200_000, '{"a":' * 200_000, "NaN", '{"format": NaN}'])
def test_deeply_nested_and_non_json_numbers(text, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError):
        Plan.load(path)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_in_a_plan_file_are_refused(value, tmp_path):
    d = seed()
    d["ops"][3]["seconds"] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))          # json writes NaN / Infinity, which is not JSON
    with pytest.raises(PlanError, match="not valid JSON|NaN|Infinity"):
        Plan.load(path)


def test_self_dependency_is_a_cycle():
    d = seed()
    d["ops"][5]["deps"] = [5]
    with pytest.raises(PlanError, match="cycle"):
        Plan.from_json(d)
