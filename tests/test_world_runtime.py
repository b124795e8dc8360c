"""Several ranks on the CPU (gloo): N-process training equals one process on the same global batch,
and a rank that dies makes the others fail with a message naming it.  Each test spawns its processes
once (a few seconds: every rank imports torch and exports the model)."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import numpy as np
import pytest
import torch
import world_worker as W

from lazytrain.hf.export import checkpoint_weights
from lazytrain.ir import PlanError
from lazytrain.util.local_processes import free_port, join_all


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    W.compile_plans(folder)
    return folder


def _spawn(fn, world: int, out) -> list:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def _close(got: dict, want: dict, what: str, eight_bit: bool = False) -> None:
    """Losses within rtol 1e-5; parameters within rtol 1e-4.  ``eight_bit``: the ranks' gradients are summed
    in another order (each rank's micro-batches, then the ranks'), and the clip norm too (per-shard norms, not
    per-block ones), so a moment that falls on a boundary between two 8-bit codes may round to the other
    one: such elements (at most 0.1 % of a tensor) may differ, by less than the steps' updates can move an
    element (lr per step: Adam's step is at most about lr).  Where the arithmetic is one process's
    (``W.EXACT``), the 8-bit results are bit for bit."""
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, err_msg=what)
    assert got["params"].keys() == want["params"].keys()
    for k, v in want["params"].items():
        _same(got["params"][k], v, f"{what} {k}", eight_bit)


def _same(got, want, what: str, eight_bit: bool) -> None:
    if not eight_bit:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=what)
        return
    a, b = np.asarray(got), np.asarray(want)
    off = ~np.isclose(a, b, rtol=1e-4, atol=1e-6)
    assert off.mean() <= 1e-3, f"{what}: {off.sum()} of {off.size} elements differ"
    assert np.abs(a - b)[off].max(initial=0.0) < W.LR * W.STEPS, f"{what}: {np.abs(a - b).max()}"


def test_two_ranks_train_like_one_process_resume_at_another_size_and_name_a_dead_rank(plans):
    """fp32 AdamW and Hybrid 8-bit, clipped: losses within rtol 1e-5 and the final parameters equal
    (the ranks' gradients are summed in another order, so not bit for bit).  Checkpoints: the 8-bit
    case saved at step 2 in one process and resumed by 2 ranks, and saved by 2 ranks and resumed in
    one process, end where training on did.  Then rank 1 dies while the world saves: rank 0's save and
    its next step fail at once naming it, and the previous checkpoint still loads.  A config's random init and a
    resume load only a rank's shard (``W.sources``) like one process (one spawn for all: each costs seconds)."""
    t0 = time.time()
    procs = _spawn(W.equivalence_rank, 2, plans)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as each rank runs (``W.join``): a backward's sums over rows split as theirs
    try:
        one, _ = W.train(1, str(plans), plans / "ck1")
    finally:
        torch.set_num_threads(threads)
    assert join_all(procs, 120) == [0, 3]
    two = json.loads((plans / "out.json").read_text())
    for name, *_ in W.CASES:
        _close(two[name], one[name], name, W.eight_bit(name))
    assert two[W.EXACT] == one[W.EXACT]       # losses and every parameter, bit for bit
    last = W.CASES[-1][0]
    after = {"losses": one[last]["losses"][W.SAVED_AT:], "params": one[last]["params"]}
    _close(two["from_ck1"], after, "saved in 1 process, resumed by 2", True)
    # shard loading (test_shard_loading.py tests the safetensors folder's): a config's random weights computed a
    # piece at a time are one process's bit for bit; the checkpoint they save resumes on a meta-device model
    ref, got = W.sources(1, str(plans)), two["sources"]
    assert got["meta"] and not ref["meta"] and got["init"] == ref["init"]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    save_err, step_err = (plans / "err.txt").read_text().split("\n")
    assert "checkpoint's second barrier" in save_err and "rank 1 (" in save_err, save_err
    assert "rank 1 (" in step_err and "resume from the last checkpoint" in step_err, step_err
    meta = json.loads((plans / "ck2" / "checkpoint.json").read_text())
    assert meta["step"] == W.SAVED_AT and meta["world"]["size"] == 2
    assert {"block_0001.rank0000.safetensors", "block_0001.rank0001.safetensors"} <= set(meta["files"])
    one_w, two_w = ({w.name: w.read() for w in checkpoint_weights(plans / ck)} for ck in ("ck1", "ck2"))
    assert one_w.keys() == two_w.keys()
    for k, v in one_w.items():        # export's view of the sharded checkpoint: each tensor's pieces joined
        _same(two_w[k].numpy(), v.numpy(), k, True)
    _close(W.resume(plans / "ck2", str(plans / f"{last}_1.json")),
           {"losses": two[last]["losses"][W.SAVED_AT:], "params": two[last]["params"]}, "saved by 2, resumed in 1",
           True)
    assert time.time() - t0 < 100


def test_four_ranks_train_like_one_process_and_their_checkpoint_resumes_at_two_and_one(plans):
    """4 gloo ranks (per-rank batch 1) train like one process (``W.CASES4``): a tied GPT under recompute-all,
    and under the MILP's plan with its tie group resident; activations on the host and on NVMe (each rank
    in its own NVMe folder); the 8-bit case.  The 8-bit case saved at 4 ranks after step 2 and resumed at 2
    and at 1 ends where the 4 ranks ended."""
    W.compile_plans(plans, worlds=(1, 4), cases=W.CASES4)
    procs = _spawn(W.world4_rank, 4, plans)
    one, _ = W.train(1, str(plans), cases=W.CASES4)
    assert join_all(procs, 240) == [0, 0, 0, 0]
    four = json.loads((plans / "out4.json").read_text())
    for name, *_ in W.CASES4:
        _close(four[name], one[name], name, W.eight_bit(name))
    assert sorted(p.name for p in (plans / "nvme").iterdir()) == [f"rank{r:04d}" for r in range(4)]
    last = W.CASES[-1][0]
    want = {"losses": four[last]["losses"][W.SAVED_AT:], "params": four[last]["params"]}
    procs = _spawn(W.resume4_rank, 2, plans)
    _close(W.resume(plans / "ck4", str(plans / f"{last}_1.json")), want, "saved by 4, resumed in 1", True)
    assert join_all(procs, 120) == [0, 0]
    _close(json.loads((plans / "resumed4_2.json").read_text()), want, "saved by 4, resumed by 2", True)


def test_ranks_whose_heartbeats_are_never_stopped_still_exit_cleanly(tmp_path):
    procs = _spawn(W.hot_heartbeat_rank, 2, tmp_path)
    assert join_all(procs, 60) == [0, 0]


def test_a_plan_for_another_world_size_is_refused(plans):
    with pytest.raises(PlanError, match="compiled for world size 2 but the runtime has 1 process"):
        W.trainer(str(plans / "adamw_2.json"), "adamw")


def test_a_rank_alive_but_behind_is_named_as_hung(monkeypatch):
    """No rank gone (its process alive, its heartbeat fresh), but one never entered this rank's step: the
    failure names it as hung (the store is a local HashStore; the heartbeat period shortened)."""
    import os
    import socket

    import torch
    import torch.distributed as dist

    from lazytrain.runtime import distributed as D
    monkeypatch.setattr(D, "HEARTBEAT_S", 0.02)
    store = dist.HashStore()
    me = D.World(rank=0, size=2, local_rank=0, device=torch.device("cpu"), _store=store)
    store.set("lazytrain/rank/1", f"{socket.gethostname()}:{os.getpid()}")
    store.set("lazytrain/rank/1/beat", repr(time.time() + 60))
    store.set("lazytrain/rank/1/step", "3")
    me.mark_step(4)
    assert me.culprits() == f"rank 1 ({socket.gethostname()}:{os.getpid()}) is alive but still in step 3 while this " \
                            "rank is in step 4: it hangs"
    me.mark_step(3)
    assert me.culprits() == "another rank failed (every rank still answers)"


def test_the_others_wait_for_rank_0s_evaluation_as_at_a_barrier_with_a_timeout(monkeypatch):
    """Rank 1 waits for what rank 0 shares (``Ranks.share``): it gets the value rank 0 stored; a rank 0 whose
    heartbeat stopped is named within seconds; one alive that never answers fails the wait after the
    collective timeout (the store is a local HashStore, the timeout shortened)."""
    import os
    import socket

    import torch
    import torch.distributed as dist

    from lazytrain.app.ranks import Ranks
    from lazytrain.runtime import distributed as D
    from lazytrain.runtime.distributed import RankFailure
    monkeypatch.setattr("lazytrain.app.ranks.WAIT_SLICE_S", 0.05)
    monkeypatch.setenv("LAZYTRAIN_COLLECTIVE_TIMEOUT", "0.3")
    store = dist.HashStore()
    me = Ranks(rank=1, size=2, _store=store,
               world=D.World(rank=1, size=2, local_rank=1, device=torch.device("cpu"), _store=store))
    who = f"{socket.gethostname()}:{os.getpid()}"
    store.set("lazytrain/rank/0", who)
    store.set("lazytrain/rank/0/beat", repr(time.time() + 60))       # alive
    store.set("lazytrain/shared/0", json.dumps({"value": 0.75}))
    assert me.share("evaluation", lambda: None) == 0.75
    t0 = time.time()
    with pytest.raises(RankFailure, match=r"rank 0's evaluation failed on rank 1 of 2: rank 0 is alive but did not "
                                          r"answer within 0.3 s"):
        me.share("evaluation", lambda: None)
    assert time.time() - t0 >= 0.3      # it waited for the answer (no upper bound: the machine may be loaded)
    store.set("lazytrain/rank/0/beat", repr(time.time() - 60))       # its heartbeat stopped
    with pytest.raises(RankFailure, match=f"rank 0's evaluation failed on rank 1 of 2: rank 0 \\({who}\\) "
                                          "stopped answering"):
        me.share("evaluation", lambda: None)
