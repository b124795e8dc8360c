"""GPU-updated streamed blocks (``Decisions.gpu_update``): the accumulator stays on the GPU into the next
step, where ``state_load`` / ``update`` (gpu) / ``state_store`` replace the host update and the forward's load.

In CPU mode the plan trains exactly like the same plan with every block updated on the host (fp32 plans: the
host gradient is the fp32 accumulator, so the arithmetic is the same and the results are bit for bit), with
fp32 AdamW and the Hybrid 8-bit optimizer, over micro-batches, with a tied model, across a checkpoint and a
resume; against eager PyTorch as the other runtime tests check.  ``verify`` refuses the broken plans.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import warnings
from functools import cache

import pytest
import torch
from eager_ref import assert_same_parameters, step_beside_eager

from lazytrain.compiler.api import Compiler
from lazytrain.compiler.budgets import Budgets
from lazytrain.compiler.gpu_update import candidates
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.solvers.heuristics import HEURISTICS
from lazytrain.frontend.presets import build_from_config
from lazytrain.frontend.trace import trace
from lazytrain.ir import GiB, Op, OpKind, Plan, PlanError, Resource, TensorId, TensorKind, Tier, verify
from lazytrain.runtime.optim import Hybrid8bitAdamW
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

B, SEQ, STEPS = 4, 16, 4
LR, EPS = 1e-3, 1e-6
CONFIGS = {
    "llama": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 67, "tie_word_embeddings": False,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6},
    "gpt": {"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 32, "n_layer": 3, "n_head": 2, "d_ff": 48,
            "max_seq": 32, "tie_weights": True},
}
VOCAB = {"llama": 67, "gpt": 61}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = build_from_config(CONFIGS[kind], device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m


@cache
def _graph(kind: str):
    return trace(_model(kind), seq_len=SEQ, dtype="float32")


def _compiler(kind: str, optimizer: str = "adamw") -> Compiler:
    budgets = {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB, "nvme_bytes": 0, "nvme_dir": None}
    return Compiler(_graph(kind), get_profile("cpu"), budgets, param_dtype="float32", optimizer=optimizer, clip=True)


def _plan(kind: str, gpu: tuple[int, ...], *, policy: str = "megatrain", mb: int = 2, optimizer: str = "adamw",
          resident: tuple[int, ...] = ()) -> Plan:
    comp = _compiler(kind, optimizer)
    L = comp.graph.n_blocks
    dec = HEURISTICS[policy](comp.graph, mb, B // mb)
    dec = dataclasses.replace(dec, gpu_update=tuple(j in gpu for j in range(L)) if gpu else (),
                              resident=tuple(j in resident for j in range(L)) if resident else ())
    return comp.build(dec, B)


def _batches(kind: str, n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(n):
        ids = torch.randint(0, VOCAB[kind], (B, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : 3 + s] = -100      # micro-batches count different numbers of tokens
        out.append((ids, labels))
    return out


def _optimizer(name: str):
    if name == "adamw":
        return TorchAdamW(lr=LR, eps=EPS, max_grad_norm=1.0)
    return Hybrid8bitAdamW(lr=LR, eps=EPS, max_grad_norm=1.0)


def _train(kind: str, plan: Plan, opt: str, batches) -> tuple[list[float], dict]:
    tr = Trainer(_model(kind), plan, optimizer=_optimizer(opt), device="cpu", verbose=False)
    losses = [tr.step(b).loss for b in batches]
    sd = tr.state_dict()
    tr.close()
    return losses, sd


def _assert_equal_runs(a, b) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("kind,opt,gpu,mb,policy", [
    ("llama", "adamw", (1, 2), 2, "megatrain"),
    ("llama", "hybrid8bit", (1, 2, 3, 4), 1, "keep-all"),     # four micro-batches accumulate on the GPU
    ("gpt", "hybrid8bit", (1, 2), 2, "recompute-all"),       # tied embedding and head, streamed and host-updated
])
def test_gpu_updated_blocks_train_like_host_updated(kind, opt, gpu, mb, policy):
    """The same plan with and without GPU-updated blocks: equal losses and parameters, bit for bit."""
    plan = _plan(kind, gpu, policy=policy, mb=mb, optimizer=opt)
    kinds = {op.kind for op in plan.ops if op.block in gpu}
    assert OpKind.GRAD_OFFLOAD not in kinds and {OpKind.STATE_LOAD, OpKind.STATE_STORE} <= kinds
    assert all(op.resource is Resource.GPU for op in plan.ops if op.kind is OpKind.UPDATE and op.block in gpu)
    batches = _batches(kind)
    _assert_equal_runs(_train(kind, plan, opt, batches), _train(kind, _plan(kind, (), policy=policy, mb=mb,
                                                                            optimizer=opt), opt, batches))


def test_gpu_updated_blocks_match_eager_with_resident_ones():
    plan = _plan("llama", (2, 3), resident=(1,))
    model = _model("llama")
    ref = copy.deepcopy(model)
    opt = _optimizer("adamw")
    tr = Trainer(model, plan, optimizer=opt, device="cpu", verbose=False)
    step_beside_eager(tr, ref, _batches("llama"), lambda m, ids, labels: m(input_ids=ids, labels=labels).loss,
                      lr=LR, eps=EPS, clip=1.0, fused=opt.fused or None)
    tr.sync_to_model()
    tr.close()
    assert_same_parameters(model, ref)


@pytest.mark.parametrize("opt", ["adamw", "hybrid8bit"])
def test_checkpoint_and_resume_apply_the_pending_gpu_update(opt, tmp_path):
    """A checkpoint after step 2 holds what the host-updated plan's holds; a trainer resumed from it ends
    where the uninterrupted one does."""
    batches = _batches("llama", 5)
    plans = {g: _plan("llama", g, optimizer=opt) for g in ((), (1, 2, 3))}
    saved = {}
    for g, plan in plans.items():
        tr = Trainer(_model("llama"), plan, optimizer=_optimizer(opt), device="cpu", verbose=False)
        for b in batches[:2]:
            tr.step(b)
        tr.save_checkpoint(tmp_path / f"ck{len(g)}")
        saved[g] = tr.state_dict()
        rest = [tr.step(b).loss for b in batches[2:]]
        saved[g, "end"] = (rest, tr.state_dict())
        tr.close()
    for k in saved[()]:
        assert torch.equal(saved[()][k], saved[(1, 2, 3)][k]), k
    _assert_equal_runs(saved[(1, 2, 3), "end"], saved[(), "end"])
    tr = Trainer.load_checkpoint(tmp_path / "ck3", _model("llama"), optimizer=_optimizer(opt), device="cpu",
                                 verbose=False)
    assert tr.plan.decisions.gpu_updated_blocks == {1, 2, 3}
    resumed = ([tr.step(b).loss for b in batches[2:]], tr.state_dict())
    tr.close()
    _assert_equal_runs(resumed, saved[(1, 2, 3), "end"])


# ---- verify ---------------------------------------------------------------------------------------
def _rebuilt(plan: Plan, ops: list[Op]) -> Plan:
    """``plan`` with ``ops`` (taken from it, reordered or some left out) renumbered, deps following them."""
    new = {op.id: i for i, op in enumerate(ops)}
    out = [dataclasses.replace(op, id=i, deps=tuple(sorted({new[d] for d in op.deps if d in new and new[d] < i})))
           for i, op in enumerate(ops)]
    return dataclasses.replace(plan, ops=out)


def _find(plan: Plan, kind: OpKind, block: int) -> Op:
    return next(op for op in plan.ops if op.kind is kind and op.block == block)


def test_verify_refuses_broken_gpu_update_plans():
    plan = _plan("llama", (1, 2))
    verify(plan)
    ops = plan.ops
    up, load, store = (_find(plan, k, 2) for k in (OpKind.UPDATE, OpKind.STATE_LOAD, OpKind.STATE_STORE))
    cases = {
        # the forward without the kept parameters: freed after the store, never loaded again
        "not resident": [*ops[:store.id + 1], dataclasses.replace(
            store, kind=OpKind.FREE, tensor=TensorId(kind=TensorKind.PARAMS, index=2), dst=None,
            resource=Resource.NONE, nbytes=0, seconds=0.0, deps=(store.id,)), *ops[store.id + 1:]],
        # the update after the block's backward: this step's gradient, before the global norm
        "before its forward": [op for op in ops if op.id not in (up.id, store.id)] + [up, store],
        # no state load: the update reads a state that is not on the GPU
        "one state_load": [op for op in ops if op.id != load.id],
        # the update waits for nothing: it may read the state before it has arrived
        "without depending": [*ops[:up.id], dataclasses.replace(up, deps=()), *ops[up.id + 1:]],
    }
    for why, bad in cases.items():
        with pytest.raises(PlanError, match=why):
            verify(_rebuilt(plan, bad) if why != "without depending" else dataclasses.replace(plan, ops=bad))
    cpu = [dataclasses.replace(op, resource=Resource.CPU) if op.id == up.id else op for op in ops]
    with pytest.raises(PlanError, match="must run on the GPU"):
        verify(dataclasses.replace(plan, ops=cpu))


def test_verify_refuses_a_tied_gpu_updated_block():
    with pytest.raises(PlanError, match="shares tied parameters"):
        _plan("gpt", (0,))


def test_state_ops_print_as_one_line_golden():
    load = Op(id=5, kind=OpKind.STATE_LOAD, block=1, tensor=TensorId(kind=TensorKind.OPT_STATE, index=1),
              src=Tier.HOST, dst=Tier.GPU, nbytes=int(0.43 * GiB), resource=Resource.H2D, seconds=0.008376)
    store = dataclasses.replace(load, id=14, kind=OpKind.STATE_STORE, src=Tier.GPU, dst=Tier.HOST,
                                resource=Resource.D2H, deps=(5, 13))
    assert str(load) == "#5 state_load   ostate[1]          host->gpu    0.43 GiB    8.376 ms"
    assert str(store) == "#14 state_store  ostate[1]          gpu->host    0.43 GiB    8.376 ms after #5,#13"


def test_plan_json_keeps_gpu_update_and_old_plans_load(tmp_path):
    plan = _plan("llama", (1, 2))
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back.decisions.gpu_updated_blocks == {1, 2} and [str(o) for o in back.ops] == [str(o) for o in plan.ops]
    assert "gpu_update" not in _plan("llama", ()).to_json()["decisions"]    # a plan without: the old file


@pytest.mark.slow     # a MILP search, the rule's scan and its re-solve: 6-10 s on a shared 2-core machine
def test_the_rule_chooses_gpu_updated_blocks_where_host_updates_pace_the_step():
    """A host whose optimizer is slow (a thousandth of the H200's rate): the rule GPU-updates streamed blocks,
    the simulated step is shorter than the solved plan's, within the budget, and ``show`` says so; ``"none"``,
    a count and the refusals as documented."""
    import lazytrain
    hw = dataclasses.replace(get_profile("h200"), cpu_adam8_gparams=5e-3, cpu_adam_gparams=5e-3)
    kw = dict(batch_size=B, seq_len=SEQ, micro_batch=2, hardware=hw, gpu_memory="8GiB", resident="none", time_limit=0.5,
              param_dtype="float32", seq_tile=None)
    model = _graph("llama")
    auto = lazytrain.compile(model, **kw)
    note = auto.decisions.notes["gpu_update"]
    assert auto.decisions.gpu_updated_blocks and auto.predicted["step_time_s"] < note["baseline_step_s"]
    assert auto.predicted["peak_gpu_bytes"] <= auto.budgets["gpu_bytes"]
    assert "rule:" in auto.summary() and "updated on the GPU (streamed)" in auto.summary()
    assert not lazytrain.compile(model, gpu_update="none", policy="megatrain", **kw).decisions.gpu_update
    two = lazytrain.compile(model, gpu_update=2, policy="megatrain", **kw)
    assert two.decisions.gpu_updated_blocks == set(candidates(two.graph, two.decisions)[:2])
    with pytest.raises(ValueError, match="gpu_update must be"):
        lazytrain.compile(model, gpu_update="some", **kw)
    with pytest.raises(ValueError, match="GPU-updated streamed blocks need a world of one"):
        lazytrain.compile(model, gpu_update=2, world_size=2, **kw)


def test_the_rule_stops_at_the_compiles_deadline(monkeypatch):
    """The rule's scans count inside the compile's deadline: with nothing of it left after the search, the rule
    builds no plan, says it ran out of time, and the solved plan is returned as it was."""
    import lazytrain
    from lazytrain.compiler.deadline import Deadline
    hw = dataclasses.replace(get_profile("h200"), cpu_adam8_gparams=5e-3, cpu_adam_gparams=5e-3)
    kw = dict(batch_size=B, seq_len=SEQ, micro_batch=2, hardware=hw, gpu_memory="8GiB", resident="none", time_limit=0.5,
              param_dtype="float32", seq_tile=None)
    monkeypatch.setattr(Deadline, "after_cpu_left", lambda self: 0.0)
    plan = lazytrain.compile(_graph("llama"), **kw)
    note = plan.decisions.notes["gpu_update"]
    assert note["tried"][-1] == ["out of time"] and len(note["tried"]) == 2     # the baseline, then nothing built
    assert not plan.decisions.gpu_update
    assert plan.predicted["step_time_s"] == pytest.approx(note["baseline_step_s"], abs=1e-5)


@pytest.mark.filterwarnings("ignore:micro-batch")     # the re-solves at less memory may fall back to a heuristic
def test_a_fixed_count_that_does_not_fit_the_solved_plan_re_solves():
    """Asked-for GPU-updated blocks whose accumulators do not fit beside the solved plan's kept activations: the
    search runs again with less GPU memory and the blocks go on that plan, within the budget; a count that fits
    no plan is refused with what it lacks (not a budget error from deep in verify)."""
    import lazytrain
    from lazytrain.compiler.synthetic import chain
    graph = chain(6, layer_params=300_000_000, saved_per_token=200_000)
    kw = dict(batch_size=8, micro_batch=8, hardware="h200", time_limit=2, resident=[0, 1, 2], seq_tile=None,
              gpu_memory="16GiB")
    base = lazytrain.compile(graph, gpu_update="none", **kw)
    two = lazytrain.compile(graph, gpu_update=2, **kw)
    assert sorted(two.decisions.gpu_updated_blocks) == [3, 4]
    assert two.predicted["peak_gpu_bytes"] <= two.budgets["gpu_bytes"] == base.budgets["gpu_bytes"]
    as_solved = dataclasses.replace(base.decisions, gpu_update=two.decisions.gpu_update, notes={})
    assert base.budgets["gpu_bytes"] < Compiler(graph, get_profile("h200"), {**base.budgets, "gpu_bytes": 2**50},
                                                param_dtype="bfloat16", optimizer="hybrid8bit", clip=True
                                                ).build(as_solved, 8).predicted["peak_gpu_bytes"]
    with pytest.raises(PlanError, match=r"GPU-updated blocks \[3, 4, 5\] do not fit .* ask for fewer"):
        lazytrain.compile(graph, gpu_update=3, **kw)


def test_a_fixed_count_that_slows_the_plan_is_returned_with_a_warning():
    """A host fast enough that its updates never pace the step: GPU-updated blocks only add PCIe traffic and
    memory, and two of them fit only beside a plan re-solved with less memory; the caller gets that plan and one
    warning with both predicted steps (not a silently slower plan)."""
    import lazytrain
    from lazytrain.compiler.synthetic import chain
    hw = dataclasses.replace(get_profile("h200"), cpu_adam8_gparams=1e3, cpu_adam_gparams=1e3)
    graph = chain(6, layer_params=300_000_000, saved_per_token=200_000)
    kw = dict(batch_size=8, hardware=hw, time_limit=2, resident=[0, 1, 2], seq_tile=None, gpu_memory="16GiB")
    base = lazytrain.compile(graph, gpu_update="none", **kw)
    with pytest.warns(UserWarning, match=r"with the 2 GPU-updated blocks asked for, which fit only beside a plan "
                                         r"re-solved with .* GiB less .* ask for fewer") as caught:
        two = lazytrain.compile(graph, gpu_update=2, **kw)
    assert two.predicted["step_time_s"] > 1.1 * base.predicted["step_time_s"]
    assert len(two.decisions.gpu_updated_blocks) == 2
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert lazytrain.compile(graph, gpu_update=1, **kw).decisions.gpu_updated_blocks      # 3% slower: no warning


def _counts(steps: list[float | None]):
    """``gpu_update._Counts`` over a table: k -> step (None: does not fit), and the ks it built."""
    from types import SimpleNamespace

    from lazytrain.compiler import gpu_update as gu
    built: list[int] = []

    def build(k):
        if steps[k - 1] is None:
            raise PlanError("over budget")
        return SimpleNamespace(predicted={"step_time_s": steps[k - 1]})
    return gu._Counts(build, [float("inf")], lambda k, p: built.append(k)), built


@pytest.mark.parametrize("fits", [0, 1, 3, 16, 30])
@pytest.mark.parametrize("hint", [1, 5, 30])
def test_the_scan_finds_the_largest_count_that_fits_and_the_fastest_below_it(fits, hint):
    """The rule's search over k (``_best_count``, ``_largest_fitting``, ``_lowest``) against building every
    count: the same largest count that fits, from any hint, and the same fastest count, whether the step still
    falls where memory stops it or turns back up before; each count built at most once, fewer than all."""
    from lazytrain.compiler import gpu_update as gu
    n = 30
    for turn in (None, 4, 11):            # the step falls by 1 a block, then (past `turn`) rises by 0.5
        steps = [None if k > fits else (100.0 - k if turn is None or k <= turn else 100.0 - turn + 0.5 * (k - turn))
                 for k in range(1, n + 1)]
        counts, built = _counts(steps)
        kmax = gu._largest_fitting(counts, n, hint)
        assert kmax == fits
        if kmax:
            want = min(range(1, kmax + 1), key=lambda k: steps[k - 1])
            assert gu._lowest(counts, 1, kmax) == want
        assert len(built) == len(set(built)) and (len(built) < n or fits == n)
        best, _ = gu._best_count(_counts(steps)[0], n, hint)
        assert best == (min(range(1, fits + 1), key=lambda k: steps[k - 1]) if fits else 0)
    assert gu._largest_fitting(_counts([None] * n)[0], n, hint) == 0


class _TableCompiler:
    """A stand-in for the ``Search`` and its ``Compiler`` in ``gpu_update.choose``: a plan's step is ``step(d, k)`` for
    d resident blocks given back and k GPU-updated, over the GPU budget where ``fits(d, k)`` is False; built without the
    budgets (what ``_room`` asks), ``free(k)`` at d = 0 (default ``step(0, k)``), peaking ``room`` bytes over it.
    ``built`` counts the builds."""

    def __init__(self, resident: int, step, fits, free=None, room: int = GiB):
        from lazytrain.compiler.deadline import Deadline
        from lazytrain.compiler.synthetic import chain
        from lazytrain.ir import Decisions, Place, Saved
        self.graph = chain(30, layer_params=1000, saved_per_token=10)
        L = self.graph.n_blocks
        self.resident, self.step, self.fits, self.room, self.built = resident, step, fits, room, 0
        self.resolved: list[int] = []
        self.free = free or (lambda k: step(0, k))
        self.budgets, self.time_limit = Budgets(gpu_bytes=100 * GiB), None
        self.comp, self.deadline = self, Deadline(None)
        dec = Decisions(policy="milp", micro_batch=1, n_micro=1, boundary=(Place.GPU,) * L,
                        saved=(Saved.KEEP,) * L, resident=tuple(j < resident for j in range(L)))
        self.plan = self.build(dec, 1)
        self.plan.predicted["busy_s"] = {"gpu": 0.5 * self.plan.predicted["step_time_s"]}    # the host paces it
        self.built = 0

    def with_gpu_budget(self, gpu_bytes, deadline=None):
        """The re-solve: recorded in ``resolved``; it finds no plan."""
        self.resolved.append(gpu_bytes)
        return types.SimpleNamespace(best=lambda *a: None)

    def build(self, dec, batch_size, *, check_budget=True):
        self.built += 1
        d, k = self.resident - len(dec.resident_blocks), len(dec.gpu_updated_blocks)
        if check_budget and not self.fits(d, k):
            raise PlanError("over budget")
        step, peak = (self.step(d, k), self.budgets.gpu_bytes) if check_budget else \
            (self.free(k), self.budgets.gpu_bytes + self.room)
        return _TablePlan(self.graph, dec, batch_size, {"step_time_s": step, "peak_gpu_bytes": peak})


@dataclasses.dataclass
class _TablePlan:
    graph: object
    decisions: object
    batch_size: int
    predicted: dict
    solver: object = None
    history: list = dataclasses.field(default_factory=list)
    budgets: dict = dataclasses.field(default_factory=lambda: {"gpu_bytes": 100 * GiB})


def test_the_scan_stops_giving_back_resident_blocks_where_the_step_turns_before_memory_stops_it():
    """Each resident block given back makes room for one more GPU-updated block, but the step turns back up
    past k = d (qwen2.5-7b at 80 GiB, batch 8, on the h200 profile): more room buys nothing, and the scan stops
    after ``D_PATIENCE`` (2) values of d instead of giving all 20 back; where memory is what stops the count
    (the step still falls there), giving blocks back goes on until the step shortens."""
    from lazytrain.compiler import gpu_update as gu
    comp = _TableCompiler(20, lambda d, k: 10.0 + 0.5 * d - 0.5 * min(k, d) + 0.01 * max(0, k - d),
                          lambda d, k: k <= d + 2)
    plan = gu.choose(comp, comp.plan)
    assert not plan.decisions.gpu_update and len(plan.decisions.resident_blocks) == 20
    assert {t[0] for t in plan.decisions.notes["gpu_update"]["tried"] if len(t) == 3} == {20, 19}
    assert comp.built <= 20        # the rule before: every d to 20, ~80 builds
    # three blocks fit per resident block given back, each shortens the step by 0.2 until memory stops it: the
    # first four resident blocks given back bring nothing (1, 4, 7, 10 blocks fit), the fifth does
    comp = _TableCompiler(20, lambda d, k: 10.0 + 0.5 * d - 0.2 * k, lambda d, k: k <= max(0, 3 * d - 2))
    plan = gu.choose(comp, comp.plan)
    assert len(plan.decisions.resident_blocks) <= 15 and plan.predicted["step_time_s"] < 10.0


@pytest.mark.parametrize("free_gain,room_gib,resolves", [(0.005, 10, False), (0.05, 10, True), (0.05, 40, False)])
def test_the_rule_re_solves_only_for_a_gain_that_can_pay_for_the_memory(free_gain, room_gib, resolves):
    """Two GPU-updated blocks fit; without the budget, four would shorten the step by ``free_gain`` more.  The rule
    re-solves with that memory set aside only where the gain reaches ``RESOLVE_GAIN`` (1%) and the memory is at
    most ``MAX_ROOM_SHARE`` of the budget (a third)."""
    from lazytrain.compiler import gpu_update as gu
    best = 10.0 - 0.2
    comp = _TableCompiler(0, lambda d, k: 10.0 - 0.1 * k, lambda d, k: k <= 2,
                          free=lambda k: 10.0 - 0.1 * min(k, 2) - (best * free_gain if k >= 4 else 0),
                          room=room_gib * GiB)
    plan = gu.choose(comp, comp.plan)
    assert comp.resolved == ([100 * GiB - room_gib * GiB] if resolves else [])
    assert sorted(plan.decisions.gpu_updated_blocks) == [0, 1]
    assert (["no re-solve", room_gib] in plan.decisions.notes["gpu_update"]["tried"]) == (room_gib > 100 / 3)


def test_the_room_for_a_re_solve_is_none_when_the_rules_time_runs_out_inside_it():
    """The measure of the room builds the plan one count below the first that did not fit, which the search
    before it may not have built: with the rule's time spent there it finds no room (it escaped as an internal
    exception, failing llama3-70b and qwen2.5-72b at 24 GiB, batch 32, 2 of the 117 grid compiles)."""
    from lazytrain.compiler import gpu_update as gu
    comp = _TableCompiler(0, lambda d, k: 10.0 - 0.1 * k, lambda d, k: True)
    over = len(gu.candidates(comp.graph, comp.plan.decisions)) + 1       # ``_lowest`` builds nothing from there
    assert gu._room(comp, comp.plan, over, [0.0], best_step=9.0) == 0 and comp.built == 0


# ---- on a real GPU (run on the lent machine; skipped without CUDA) --------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("opt", ["adamw", "hybrid8bit"])
def test_gpu_updated_blocks_on_cuda_match_host_updated(opt, tmp_path):
    """The device path (state copies over the H2D / D2H streams, the update on the compute stream: fused CUDA
    AdamW or the Triton 8-bit kernel) against the host-updated plan on the GPU: fp32, TF32 off, equal to GPU
    reduction order (rtol 1e-4 as ``test_runtime_cuda``'s fp32 test); the checkpoint after ``flush`` equal to
    the trainer's state, and a resumed trainer's next step equal to the uninterrupted one's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batches = _batches("llama", 5)
    runs = {}
    for gpu in ((), (1, 2, 3)):
        tr = Trainer(_model("llama"), _plan("llama", gpu, optimizer=opt), optimizer=_optimizer(opt), device="cuda",
                     verbose=False)
        losses = [tr.step(b).loss for b in batches[:4]]
        tr.save_checkpoint(tmp_path / f"ck{len(gpu)}")
        sd = tr.state_dict()
        losses.append(tr.step(batches[4]).loss)
        runs[gpu] = (losses, sd)
        tr.close()
    # the 8-bit moments: a gradient an ulp apart (GPU reductions) may round to the neighbouring code, a step of
    # up to lr / 127 of a quantization block's largest moment: 1e-5 at lr 1e-3
    atol = 1e-6 if opt == "adamw" else 2e-5
    torch.testing.assert_close(runs[(1, 2, 3)][0], runs[()][0], rtol=1e-4, atol=1e-6)
    for k, v in runs[()][1].items():
        torch.testing.assert_close(runs[(1, 2, 3)][1][k], v, rtol=1e-4, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    again = Trainer.load_checkpoint(tmp_path / "ck3", _model("llama"), optimizer=_optimizer(opt), device="cuda",
                                    verbose=False)
    for k, v in runs[(1, 2, 3)][1].items():
        assert torch.equal(again.state_dict()[k], v), k
    torch.testing.assert_close(again.step(batches[4]).loss, runs[(1, 2, 3)][0][4], rtol=1e-5, atol=1e-6)
    again.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_updated_blocks_bf16_on_cuda():
    """bf16 parameters, the 8-bit optimizer (its low master halves cross PCIe with the codes): the same losses
    as the host-updated plan within bf16 tolerance (the GPU update reads the fp32 accumulator, the host one its
    bf16 copy)."""
    import lazytrain
    losses = {}
    for mode in ("none", 3):
        model = _model("llama").to(torch.bfloat16)
        plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="h200", policy="megatrain",
                                 param_dtype="bfloat16", gpu_memory="8GiB", resident="none", gpu_update=mode)
        assert len(plan.decisions.gpu_updated_blocks) == (0 if mode == "none" else 3)
        tr = Trainer(model, plan, optimizer=Hybrid8bitAdamW(lr=LR, eps=EPS, max_grad_norm=1.0), device="cuda",
                     verbose=False)
        losses[mode] = [tr.step(b).loss for b in _batches("llama", 5)]
        tr.close()
    torch.testing.assert_close(losses[3], losses["none"], rtol=2e-2, atol=1e-3)
