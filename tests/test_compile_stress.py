"""100 random compiles across model shapes, batches, budgets, hardware, NVMe and policies: no crash,
every plan verified and within its budgets, the MILP never slower than any heuristic that fits, and
a budget too small is a ``PlanError`` that says so."""

import random
from functools import cache

import pytest

from lazytrain.compiler.api import Compiler, compile_model, make_budgets
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.resident import resident_request
from lazytrain.compiler.search import Search
from lazytrain.compiler.synthetic import chain
from lazytrain.frontend.presets import build_model
from lazytrain.frontend.trace import trace
from lazytrain.ir import GiB, PlanError, verify

N_CASES = 100
HEURISTICS = ("megatrain", "recompute-all", "keep-all")
HARDWARE = ("h200", "h100", "a100-80g", "rtx4090", "rtx3090")


@cache
def _traced(name: str, seq: int):
    return trace(build_model(name), seq_len=seq)


def _case(i: int) -> dict:
    rng = random.Random(1000 + i)
    if rng.random() < 0.2:
        graph = _traced(rng.choice(["tiny", "gpt2"]), rng.choice([128, 256]))
    else:
        graph = chain(rng.randint(2, 16), seed=rng.randint(0, 10**6), hidden=rng.choice([512, 1024, 2048]),
                      seq_len=rng.choice([256, 1024, 2048]), layer_params=rng.choice([5, 20, 60, 120]) * 10**6,
                      saved_per_token=rng.choice([20_000, 60_000, 150_000]), tied=rng.random() < 0.3)
    nvme = rng.random() < 0.25
    return {"graph": graph, "batch_size": rng.choice([1, 2, 3, 4, 6, 8, 12, 16]),
            "gpu_memory": f"{rng.choice([2, 3, 4, 6, 8, 12, 16, 24, 48, 80])}GiB",
            "host_memory": f"{rng.choice([16, 64, 256, 1024])}GiB",
            "nvme_dir": "/nvme" if nvme else None, "nvme_memory": "500GiB" if nvme else None,
            "hardware": rng.choice(HARDWARE), "resident": rng.choice(["auto", "auto", "none", 1, 3]),
            "micro_batch": None}


def _milp(case: dict):
    try:
        args = {k: v for k, v in case.items() if k != "graph"}
        return compile_model(case["graph"], policy="milp", time_limit=3, **args)
    except PlanError as e:
        assert str(e), "a PlanError must say what does not fit"
        return None


def _heuristics(case: dict) -> dict:
    """Each heuristic's best plan, from one compiler (shared memo: the three cost one compile)."""
    hw = get_profile(case["hardware"])
    fixed, _ = resident_request(case["graph"], "none" if case["resident"] == "auto" else case["resident"])
    budgets = make_budgets(hw, case["gpu_memory"], case["host_memory"], case["nvme_dir"], case["nvme_memory"])
    comp = Compiler(case["graph"], hw, budgets, param_dtype="bfloat16", optimizer="hybrid8bit", clip=True,
                    resident=fixed)
    return {pol: p for pol in HEURISTICS if (p := Search(comp).best(pol, case["batch_size"])) is not None}


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(10))
def test_random_compiles_never_crash_and_the_milp_wins(chunk):
    for i in range(chunk * N_CASES // 10, (chunk + 1) * N_CASES // 10):
        case = _case(i)
        milp = _milp(case)
        fitting = _heuristics(case)
        if fitting:
            assert milp is not None, (i, case)
        for p in ([milp] if milp else []) + list(fitting.values()):
            verify(p)
            assert p.predicted["peak_gpu_bytes"] <= p.budgets["gpu_bytes"], (i, p.decisions.policy)
            assert p.predicted["peak_host_bytes"] <= p.budgets["host_bytes"] + GiB, (i, p.decisions.policy)
        for name, p in fitting.items():
            assert milp.predicted["step_time_s"] <= p.predicted["step_time_s"] * (1 + 1e-9), (i, name)
