"""Several ranks on the CPU (gloo): N-process training equals one process on the same global batch,
and a rank that dies makes the others fail with a message naming it.  Each test spawns its processes
once (a few seconds: every rank imports torch and exports the model)."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time

import numpy as np
import pytest
import world_worker as W

from lazytrain.ir import PlanError


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    W.compile_plans(folder)
    return folder


def _spawn(fn, world: int, out) -> list:
    ctx = mp.get_context("spawn")
    port = _port()
    procs = [ctx.Process(target=fn, args=(r, world, port, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def _join(procs, timeout: float) -> list[int | None]:
    """Exit codes; the last rank is joined (reaped) first, so a rank that exits early is gone at once."""
    end = time.time() + timeout
    for p in reversed(procs):
        p.join(max(0.1, end - time.time()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


def test_two_ranks_train_like_one_process_and_name_a_dead_rank(plans):
    """fp32 AdamW and Hybrid 8-bit, clipped: losses within rtol 1e-5 and the final parameters equal
    (the ranks' gradients are summed in another order, so not bit for bit).  Then rank 1 dies: rank 0's
    next step fails at once with an error naming it (one spawn for both: each costs seconds)."""
    t0 = time.time()
    procs = _spawn(W.equivalence_rank, 2, plans)
    one, _ = W.train(1, str(plans))
    assert _join(procs, 120) == [0, 3]
    two = json.loads((plans / "out.json").read_text())
    for name, _, _ in W.CASES:
        np.testing.assert_allclose(two[name]["losses"], one[name]["losses"], rtol=1e-5)
        assert two[name]["params"].keys() == one[name]["params"].keys()
        for k, v in one[name]["params"].items():
            np.testing.assert_allclose(two[name]["params"][k], v, rtol=1e-4, atol=1e-6, err_msg=f"{name} {k}")
    msg = (plans / "err.txt").read_text()
    assert "rank 1 (" in msg and "resume from the last checkpoint" in msg, msg
    assert time.time() - t0 < 100


def test_a_plan_for_another_world_size_is_refused(plans):
    with pytest.raises(PlanError, match="compiled for world size 2 but the runtime has 1 process"):
        W.trainer(str(plans / "adamw_2.json"), "adamw")
