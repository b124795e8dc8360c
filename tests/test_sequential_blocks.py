"""An ``nn.Sequential`` whose blocks include some without parameters (an activation, a dropout): their backward
makes an empty gradient, which no update reads, so the lowering frees it on the GPU and emits no
``grad_offload``, ``reduce_scatter`` or ``update`` for it (before, its gradient was offloaded and left pending
on the host: ``PlanError: gradients of blocks [1] are left pending at the end of the step``).

Each plan is verified and trained on the CPU through the runtime beside eager PyTorch (fp32 AdamW, clipped as
the trainer clips): losses, gradient norms and, after the steps, every parameter agree.  The ``Trainer`` takes
token batches of a causal LM; a Sequential of float inputs runs through the same runtime once its program is
built with the model's ``example_inputs`` and ``loss_fn`` (``_sequential_trainer``)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lazytrain
from lazytrain.frontend.trace import build_program, trace
from lazytrain.ir import Decisions, GiB, OpKind, Place, PlanError, Saved, TensorKind, Tier, verify

B, STEPS, LR, EPS, CLIP = 4, 3, 1e-2, 1e-8, 1.0
POLICIES = ["milp", "megatrain", "recompute-all", "keep-all"]

MODELS = {
    # the report's model: GELU between two linears
    "middle": lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)),
    # a run of parameterless blocks inside a deeper chain (Dropout(0): no random draw changes a value)
    "deep": lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(0.0), nn.Tanh(),
                                  nn.Linear(16, 4)),
    # the last block, whose output goes to the loss
    "end": lambda: nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4), nn.ReLU()),
}


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, 8, generator=g), torch.randint(0, 4, (B,), generator=g)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


_GRAPHS: dict[str, object] = {}


def _graph(name: str):
    if name not in _GRAPHS:
        _GRAPHS[name] = trace(_model(name), seq_len=1, dtype="float32", example_inputs=_data(),
                              loss_fn=F.cross_entropy)
    return _GRAPHS[name]


def _compile(name: str, **kw):
    opts = dict(batch_size=B, seq_len=1, micro_batch=2, gpu_memory="2GiB", param_dtype="float32",
                optimizer="adamw")
    return lazytrain.compile(_graph(name), **{**opts, **kw})


def _empty_blocks(plan) -> list[int]:
    return [j for j, b in enumerate(plan.graph.blocks) if not b.params]


def _check_gradient_ops(plan) -> None:
    """No gradient traffic or update for a block without parameters: its empty accumulator is freed on the GPU.
    A resident one's, in a world of one, is no plan tensor; with several ranks it is reduce-scattered into the
    (empty) resident shard once a step, like every resident block's."""
    empty = _empty_blocks(plan)
    assert empty, "the model must have a block without parameters"
    for j in empty:
        mine = [op for op in plan.ops if op.block == j]
        kinds = [op.kind for op in mine]
        for k in (OpKind.GRAD_OFFLOAD, OpKind.UPDATE, OpKind.STATE_LOAD, OpKind.STATE_STORE):
            assert k not in kinds, [str(op) for op in mine if op.kind is k]
        freed = [op for op in mine if op.kind is OpKind.FREE and op.tensor.kind is TensorKind.GRADS]
        if not plan.decisions.is_resident(j):
            assert [(op.src, op.tensor.index) for op in freed] == [(Tier.GPU, j)]
            assert OpKind.REDUCE_SCATTER not in kinds
        else:
            assert not freed and kinds.count(OpKind.REDUCE_SCATTER) == (plan.world_size > 1)
    owners = {j for j, b in enumerate(plan.graph.blocks) if b.owned_numel}
    assert {op.block for op in plan.ops if op.kind is OpKind.UPDATE} == owners


class _SequentialTrainer(lazytrain.Trainer):
    """A ``Trainer`` stepping on ``(x, target)``: the batch goes to the program as it is (no token checks)."""

    def _batch(self, batch):
        return batch[0], batch[1], None


@pytest.fixture
def sequential_trainer(monkeypatch):
    """Build a trainer for a Sequential: its program is built with ``example_inputs`` and ``loss_fn``."""
    x, y = _data()

    def program(model, plan, device):
        mb = plan.micro_batch
        return build_program(model, micro_batch=mb, seq_len=plan.seq_len, device=device, dtype=torch.float32,
                             example_inputs=(x[:mb], y[:mb]), loss_fn=F.cross_entropy)
    monkeypatch.setattr("lazytrain.runtime.trainer._program", program)

    def make(model, plan, clip=CLIP, nvme_dir=None):
        return _SequentialTrainer(model, plan, optimizer=lazytrain.optim.TorchAdamW(lr=LR, eps=EPS, max_grad_norm=clip),
                                  device="cpu", verbose=False, nvme_dir=nvme_dir)
    return make


def _train_beside_eager(make, name: str, plan, clip=CLIP, nvme_dir=None) -> None:
    model = _model(name)
    ref = copy.deepcopy(model)
    trainer = make(model, plan, clip=clip, nvme_dir=nvme_dir)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    x, y = _data()
    try:
        for _ in range(STEPS):
            stats = trainer.step((x, y))
            loss = F.cross_entropy(ref(x), y)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip is not None else float("inf"))
            opt.step()
            torch.testing.assert_close(stats.loss, loss.item(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(stats.grad_norm, norm.item(), rtol=1e-4, atol=1e-6)
            assert not stats.skipped
        got = trainer.state_dict()
    finally:
        trainer.close()
    want = dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for n, p in want.items():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert any(not torch.equal(got[n], p) for n, p in _model(name).named_parameters())   # it did train


@pytest.mark.parametrize("hardware", ["cpu", "h200"])
@pytest.mark.parametrize("policy", POLICIES)
def test_reported_model_compiles_with_defaults(policy, hardware):
    """The report's call (bf16 parameters, the 8-bit optimizer), with every policy, with and without resident
    blocks."""
    for resident in ("auto", "none"):
        plan = lazytrain.compile(_graph("middle"), batch_size=B, seq_len=1, hardware=hardware, gpu_memory="2GiB",
                                 policy=policy, resident=resident)
        verify(plan)
        _check_gradient_ops(plan)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("hardware", ["cpu", "h200"])
@pytest.mark.parametrize("policy", POLICIES)
def test_trains_like_eager(name, policy, hardware, sequential_trainer):
    plan = _compile(name, hardware=hardware, policy=policy)
    verify(plan)
    _check_gradient_ops(plan)
    _train_beside_eager(sequential_trainer, name, plan)


@pytest.mark.parametrize("policy", ["milp", "recompute-all"])
def test_without_clipping(policy, sequential_trainer):
    """Each update right after its last gradient: a block without parameters has none to place."""
    plan = _compile("deep", hardware="h200", policy=policy, clip=False)
    verify(plan)
    _check_gradient_ops(plan)
    _train_beside_eager(sequential_trainer, "deep", plan, clip=None)


@pytest.mark.parametrize("resident", [[1], 2, [1, 3, 4]])
def test_resident_blocks_without_parameters(resident, sequential_trainer):
    plan = _compile("deep", hardware="h200", policy="milp", resident=resident)
    assert plan.decisions.is_resident(1)
    verify(plan)
    _check_gradient_ops(plan)
    _train_beside_eager(sequential_trainer, "deep", plan)


def test_gpu_updated_blocks_beside_blocks_without_parameters(sequential_trainer):
    # a count takes the first streamed blocks that own parameters: 0 and 2, past the empty block 1
    plan = _compile("deep", hardware="h200", policy="recompute-all", gpu_update=2)
    assert plan.decisions.gpu_updated_blocks == {0, 2}
    verify(plan)
    _check_gradient_ops(plan)
    _train_beside_eager(sequential_trainer, "deep", plan)
    with pytest.raises(ValueError, match=r"blocks \[1\] own no parameters"):
        _compile("deep", hardware="h200", policy="recompute-all", gpu_update=[1])


def _build(name: str, dec: Decisions, nvme_dir=None):
    from lazytrain.compiler.api import Compiler
    from lazytrain.compiler.profiles import get_profile
    budgets = {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB}
    if nvme_dir is not None:
        budgets.update(nvme_bytes=GiB, nvme_dir=str(nvme_dir))
    comp = Compiler(_graph(name), get_profile("cpu"), budgets, param_dtype="float32", optimizer="adamw", clip=True)
    return comp.build(dec, B)


@pytest.mark.parametrize("case", ["nvme", "host"])
def test_offloads_of_blocks_without_parameters(case, sequential_trainer, tmp_path):
    """Boundaries and saved activations of parameterless blocks on the host and NVMe, recompute segments through
    them (blocks: linear, relu, linear, dropout, tanh, linear)."""
    P, S = Place, Saved
    if case == "nvme":
        dec = Decisions(policy="test", micro_batch=2, n_micro=2,
                        boundary=(P.HOST, P.NVME, P.NONE, P.NONE, P.NVME, P.GPU),
                        saved=(S.HOST, S.RECOMPUTE, S.RECOMPUTE, S.NVME, S.RECOMPUTE, S.KEEP))
    else:
        dec = Decisions(policy="test", micro_batch=2, n_micro=2,
                        boundary=(P.NONE, P.HOST, P.NONE, P.HOST, P.NONE, P.NONE),
                        saved=(S.KEEP, S.RECOMPUTE, S.HOST, S.RECOMPUTE, S.RECOMPUTE, S.HOST))
    nvme = tmp_path if case == "nvme" else None
    plan = _build("deep", dec, nvme)
    verify(plan)
    _check_gradient_ops(plan)
    if case == "nvme":
        assert any(op.dst is Tier.NVME and op.block in _empty_blocks(plan) for op in plan.ops)
    _train_beside_eager(sequential_trainer, "deep", plan, nvme_dir=nvme)


@pytest.mark.parametrize("resident", ["none", [1], 2])
@pytest.mark.parametrize("policy", ["milp", "megatrain"])
def test_sharded_lowering(policy, resident):
    """Two ranks: a streamed block without parameters has no reduce_scatter (nothing to sum) and no offload."""
    plan = _compile("deep", hardware="h200", policy=policy, resident=resident, world_size=2)
    assert plan.world_size == 2
    verify(plan)
    _check_gradient_ops(plan)
    assert [j for j in _empty_blocks(plan) if not plan.decisions.is_resident(j)]


def _world_rank(rank: int, world: int, port: int, folder: str) -> None:
    """One gloo rank (spawned): train ``plan.json`` of ``folder`` on its rows of the global batch, rank 0 writing
    the losses and final parameters (one trainer a process: a second world in one process may not connect)."""
    import json
    import os
    from pathlib import Path

    import lazytrain.runtime.trainer as rt
    from lazytrain.ir import Plan
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LAZYTRAIN_COLLECTIVE_TIMEOUT="60")
    torch.set_num_threads(1)
    x, y = _data()

    def program(model, plan, device):
        mb = plan.micro_batch
        return build_program(model, micro_batch=mb, seq_len=1, device=device, dtype=torch.float32,
                             example_inputs=(x[:mb], y[:mb]), loss_fn=F.cross_entropy)
    rt._program = program

    class Ranked(lazytrain.Trainer):
        def _batch(self, batch):       # this rank's rows; the loss is the mean over the global micro-batches
            self._global_tokens = self.plan.n_micro * self.world.size
            rows = slice(self.world.rank * self.plan.batch_size, (self.world.rank + 1) * self.plan.batch_size)
            return batch[0][rows], batch[1][rows], None
    tr = Ranked(_model("deep"), Plan.load(Path(folder) / "plan.json"),
                optimizer=lazytrain.optim.TorchAdamW(lr=LR, eps=EPS, max_grad_norm=CLIP), device="cpu", verbose=False)
    losses = [tr.step((x, y)).loss for _ in range(STEPS)]
    params = {k: v.tolist() for k, v in tr.state_dict().items()}
    if rank == 0:
        (Path(folder) / "out.json").write_text(json.dumps({"losses": losses, "params": params}))


def test_two_ranks_train_like_eager(tmp_path):
    """Two gloo ranks on the CPU, blocks 1, 3 and 4 without parameters: 1 resident (gathered and reduce-scattered
    as every resident block), 3 and 4 streamed (their empty gradients freed, no reduce_scatter)."""
    import json
    import multiprocessing as mp

    from lazytrain.util.local_processes import free_port, join_all
    plan = _compile("deep", batch_size=B // 2, micro_batch=1, hardware="h200", policy="milp", resident=[1],
                    world_size=2)
    assert plan.decisions.resident_blocks == {1}
    verify(plan)
    _check_gradient_ops(plan)
    plan.save(tmp_path / "plan.json")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_world_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    assert join_all(procs, 300) == [0, 0]
    got = json.loads((tmp_path / "out.json").read_text())
    ref = _model("deep")
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        loss = F.cross_entropy(ref(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
    torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(torch.tensor(got["params"][n]), p.detach(), rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_verify_refuses_an_offloaded_empty_gradient():
    """A plan that offloads a parameterless block's gradient (as the old lowering did) is refused by name."""
    plan = _compile("middle", hardware="cpu", policy="keep-all")
    i = next(op.id for op in plan.ops if op.kind is OpKind.FREE and op.tensor.kind is TensorKind.GRADS)
    ops = list(plan.ops)
    ops[i] = dataclasses.replace(ops[i], kind=OpKind.GRAD_OFFLOAD, dst=Tier.HOST)
    with pytest.raises(PlanError, match="block 1 has no parameters"):
        verify(dataclasses.replace(plan, ops=ops))
    bad = dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, gpu_update=(False, True, False)))
    with pytest.raises(PlanError, match=r"blocks \[1\] are GPU-updated .* own no parameters"):
        verify(bad)
