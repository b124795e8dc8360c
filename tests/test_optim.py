"""Host optimizers (lazytrain.runtime.optim): exactness of TorchAdamW, error bounds of the 8-bit
codes and of Hybrid8bitAdamW's update, training parity, checkpoints, clipping."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lazytrain.runtime.optim import (
    GradNormTracker,
    Hybrid8bitAdamW,
    NonFiniteGradError,
    TorchAdamW,
    ckernel,
    clip_coefficient,
)
from lazytrain.runtime.optim import quant as Q

HAVE_KERNEL = ckernel.load() is not None
# Hybrid8bitAdamW has two implementations of the same update: the compiled one-pass kernel and torch ops
PATHS = [
    pytest.param(False, id="torch"),
    pytest.param(True, id="kernel", marks=pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")),
]

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _flat(params):
    segs, off = [], 0
    for i, p in enumerate(params):
        segs.append((f"p{i}", off, p.numel(), tuple(p.shape)))
        off += p.numel()
    return torch.cat([p.detach().reshape(-1) for p in params]), segs


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in [(64, 96), (96,), (33, 17), (5000,)]]


@pytest.mark.parametrize("fused", [True, False])
def test_torch_adamw_matches_torch_optim(fused):
    ref = [p.clone().requires_grad_() for p in _params()]
    ropt = torch.optim.AdamW(ref, fused=fused, foreach=None if fused else True, **HP)
    init, segs = _flat(ref)
    load = torch.empty_like(init)
    opt = TorchAdamW(**HP, chunk_numel=4000)  # several chunks, boundaries inside tensors
    opt.setup(0, init.clone(), load, segs)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        grads = [torch.randn(p.shape, generator=g) for p in ref]
        for p, gr in zip(ref, grads):
            p.grad = gr
        ropt.step()
        opt.step(0, torch.cat([gr.reshape(-1) for gr in grads]))
    want = torch.cat([p.detach().reshape(-1) for p in ref])
    if opt.fused == fused:
        assert torch.equal(opt.master(0), want)
    torch.testing.assert_close(opt.master(0), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(load, opt.master(0))  # fp32 load buffer is the master


def test_torch_adamw_bf16_buffers():
    init, segs = _flat(_params())
    load = torch.empty(init.numel(), dtype=torch.bfloat16)
    opt = TorchAdamW(**HP)
    opt.setup(0, init, load, segs)
    opt.step(0, torch.randn(init.numel()).to(torch.bfloat16))
    assert torch.equal(load, opt.master(0).to(torch.bfloat16))
    assert opt.host_bytes_per_param == 16.0


def test_master_split_is_exact_and_rounds_to_nearest():
    from lazytrain.runtime.optim.hybrid8bit import _join_master, _split_master_

    x = torch.randn(100_000) * torch.logspace(-30, 30, 100_000)
    x[:4] = torch.tensor([0.0, -0.0, 1.0, -3.0])
    hi, lo = torch.empty(x.numel(), dtype=torch.int16), torch.empty(x.numel(), dtype=torch.int16)
    _split_master_(x, hi, lo)
    assert torch.equal(_join_master(hi, lo).view(torch.int32), x.view(torch.int32))
    assert (
        torch.equal(hi.view(torch.bfloat16), x.to(torch.bfloat16))
        or ((hi.view(torch.bfloat16).float() - x).abs() <= (x.to(torch.bfloat16).float() - x).abs()).all()
    )


def test_code_roundtrip_error_bounds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2048, generator=g) * torch.logspace(-4, 0, 2048)
    q = torch.empty(64, 2048, dtype=torch.uint8)
    am = Q.absmax_rows(x)
    Q.encode_signed_(x.clone(), Q.encode_factor(am, Q.SIGNED_TOP)[:, None], q)
    f, pre = Q.decode_factor(am, Q.SIGNED_TOP)
    y = Q.decode_signed(q, f[:, None], pre)
    inrange = x.abs() > am[:, None] * 2.0**-14
    rel = (y - x).abs() / x.abs()
    assert rel[inrange].max() <= 1 / 16 + 1e-6  # 3 mantissa bits
    below = ((y - x).abs() <= am[:, None] * 2.0**-13)[~inrange]
    assert below.all()  # below the 16-binade range: absolute error <= 2^-13 of the block absmax
    assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))
    # an all-zero block and exact zeros stay zero
    z = torch.zeros(1, 2048)
    Q.encode_signed_(z.clone(), Q.encode_factor(torch.zeros(1), Q.SIGNED_TOP)[:, None], q[:1])
    assert (Q.decode_signed(q[:1], torch.zeros(1, 1)) == 0).all()
    # unsigned code on sqrt(v): 4 mantissa bits, never flushed to zero
    s = x.abs()
    amu = s.amax(1)
    Q.encode_unsigned_(s.clone(), Q.encode_factor(amu, Q.UNSIGNED_TOP)[:, None], q)
    f, pre = Q.decode_factor(amu, Q.UNSIGNED_TOP)
    y = Q.decode_unsigned(q, f[:, None], pre)
    rel = (y - s).abs() / s
    assert rel[s > amu[:, None] * 2.0**-14].max() <= 1 / 32 + 1e-6
    assert (y[s > 0] > 0).all()
    # huge scales (absmax beyond ~6e4) take the two-multiplication path and stay exact in range
    big = torch.tensor([[1e6, -3e5, 7.0]])
    Q.encode_signed_(big.clone(), Q.encode_factor(Q.absmax_rows(big), Q.SIGNED_TOP)[:, None], q[:1, :3])
    f, pre = Q.decode_factor(Q.absmax_rows(big), Q.SIGNED_TOP)
    assert pre != 1.0
    torch.testing.assert_close(Q.decode_signed(q[:1, :3], f[:, None], pre)[0, :2], big[0, :2], rtol=1 / 16, atol=0)


def _direction_error(steps: int, seed: int = 0, kernel: bool = False) -> list[float]:
    """Relative error ||d8 - d32|| / ||d32|| of the per-step update d, both optimizers fed the same
    params and gradients each step (the 8-bit state tracks its own history)."""
    g = torch.Generator().manual_seed(seed)
    n = 3 * 8192 + 100
    init = torch.randn(n, generator=g)
    segs = [("w", 0, n - 100, (n - 100,)), ("b", n - 100, 100, (100,))]
    a, b = TorchAdamW(**HP), Hybrid8bitAdamW(**HP, chunk_numel=8192, num_threads=2, kernel=kernel)
    la, lb = init.clone(), init.clone()
    a.setup(0, init, la, segs)
    b.setup(0, init, lb, segs)
    scale = torch.logspace(-3, 0, n)[torch.randperm(n, generator=g)]  # per-coordinate gradient scales
    errs = []
    for _ in range(steps):
        grad = (torch.randn(n, generator=g) + 0.3) * scale
        before = la.clone()
        a.step(0, grad)
        b.step(0, grad)
        da, db = la - before, lb - before
        errs.append(float((db - da).norm() / da.norm()))
        lb.copy_(la)  # same parameters for the next step
    return errs


@pytest.mark.parametrize("kernel", PATHS)
def test_hybrid8bit_update_error_bounded(kernel):
    errs = _direction_error(30, kernel=kernel)
    # bound: 3-bit m and 4-bit sqrt(v) mantissas give <= ~9% per element, a few % in norm
    assert max(errs) < 0.10, errs
    assert sum(errs) / len(errs) < 0.05, errs


@pytest.mark.parametrize("kernel", PATHS)
def test_hybrid8bit_memory_and_bf16_master(kernel):
    n = 4 * 2048 * 8 + 300
    init = torch.randn(n)
    load = torch.empty(n, dtype=torch.bfloat16)
    opt = Hybrid8bitAdamW(**HP, chunk_numel=4096, kernel=kernel)
    opt.setup(0, init, load, [("w", 0, n - 300, (n - 300,)), ("b", n - 300, 300, (300,))])
    assert torch.equal(opt.master(0), init)  # exact fp32 master from bf16 + 16 low bits
    opt.step(0, torch.randn(n).to(torch.bfloat16))
    m = opt.master(0)
    assert ((load.float() - m).abs() <= (m.to(torch.bfloat16).float() - m).abs()).all()  # nearest (ties away)
    expect = (n * (2 + 2 + 2 + 1 + 1) - 300 * 2 + 300 * 8 + 2 * 4 * (n - 300) // 2048) / n
    assert opt.host_bytes_per_param == pytest.approx(expect)
    assert opt.host_bytes_per_param < 8.5


class _TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 128),
            torch.nn.LayerNorm(128),
            torch.nn.GELU(),
            torch.nn.Linear(128, 128),
            torch.nn.GELU(),
            torch.nn.Linear(128, 8),
        )

    def forward(self, x):
        return self.net(x)


@functools.cache
def _train_fp32(lr, weight_decay):
    return _train(lambda: TorchAdamW(lr=lr, weight_decay=weight_decay))


def _train(make_opt, steps=300, seed=0):
    torch.manual_seed(seed)
    model = _TinyMLP()
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    params = list(model.parameters())
    init, segs = _flat(params)
    load = init.clone()
    opt = make_opt()
    opt.setup(0, init, load, segs)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 32, generator=g)
        with torch.no_grad():
            y = teacher(x)
        off = 0
        for p in params:  # load buffer -> model
            p.data.copy_(load[off : off + p.numel()].view_as(p))
            off += p.numel()
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        opt.step(0, torch.cat([p.grad.reshape(-1) for p in params]))
        losses.append(loss.item())
    return sum(losses[-20:]) / 20


@pytest.mark.parametrize("kernel", PATHS)
def test_hybrid8bit_training_matches_fp32(kernel):
    hp = dict(lr=3e-3, weight_decay=0.01)
    ref = _train_fp32(**hp)
    q8 = _train(lambda: Hybrid8bitAdamW(**hp, min_8bit_numel=1024, chunk_numel=4096, kernel=kernel))
    print(f"final loss fp32 {ref:.5f}  8-bit {q8:.5f}  ({(q8 / ref - 1) * 100:+.2f}%)")
    assert abs(q8 / ref - 1) < 0.02


@pytest.mark.parametrize(
    "cls",
    [TorchAdamW, functools.partial(Hybrid8bitAdamW, kernel=False)]
    + ([functools.partial(Hybrid8bitAdamW, kernel=True)] if HAVE_KERNEL else []),
    ids=["torch_adamw", "8bit_torch"] + (["8bit_kernel"] if HAVE_KERNEL else []),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_roundtrip_is_bit_exact(cls, dtype):
    n = 3 * 4096 + 77
    segs = [("w", 0, n - 77, (n - 77,)), ("b", n - 77, 77, (77,))]
    init = torch.randn(n)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(6)]

    def run(load_at):
        opt = cls(**HP)
        load = torch.empty(n, dtype=dtype)
        opt.setup(0, init.clone(), load, segs)
        for i, gr in enumerate(grads):
            if i == load_at:
                saved = {k: v.clone() for k, v in opt.state_tensors(0).items()}
                hp = opt.hyperparameters()
                opt = cls(lr=1.0)
                load = torch.empty(n, dtype=dtype)
                opt.setup(0, torch.zeros(n), load, segs)
                opt.load_hyperparameters(hp)
                opt.load_state_tensors(0, saved)
            opt.step(0, gr, 0.7)
        return opt.master(0), load

    m1, l1 = run(-1)
    m2, l2 = run(3)
    assert torch.equal(m1, m2) and torch.equal(l1, l2)


@pytest.mark.parametrize("cls", [TorchAdamW, Hybrid8bitAdamW])
def test_clip_coef_equals_clip_grad_norm(cls):
    params = [p.requires_grad_() for p in _params()]
    ref = [p.detach().clone().requires_grad_() for p in params]
    ropt = torch.optim.AdamW(ref, **HP)
    init, segs = _flat(params)
    load = init.clone()
    extra = {"min_8bit_numel": 10**9} if cls is Hybrid8bitAdamW else {}  # all-fp32 states: only clipping differs
    opt = cls(**HP, **extra)
    opt.setup(0, init, load, segs)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) * 10 for p in ref]
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
        ropt.step()
        flat = torch.cat([gr.reshape(-1) for gr in grads])
        coef = clip_coefficient(float(flat.double().pow(2).sum()), 1.0)
        assert coef < 0.1
        opt.step(0, flat, coef)
    torch.testing.assert_close(opt.master(0), torch.cat([p.detach().reshape(-1) for p in ref]), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_path(dtype):
    """One step from the same state: same codes and scales, master within an fp32 ulp or two
    (torch's vectorized addcdiv may round differently); states are interchangeable."""
    n = 3 * 8192 + 2048 + 300  # full chunks, a short chunk, a short last quantization block
    segs = [("w", 0, n - 100, (n - 100,)), ("b", n - 100, 100, (100,))]
    g = torch.Generator().manual_seed(7)
    init = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(3)]
    a = Hybrid8bitAdamW(**HP, chunk_numel=8192, kernel=False)
    b = Hybrid8bitAdamW(**HP, chunk_numel=8192, kernel=True)
    la, lb = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    a.setup(0, init, la, segs)
    b.setup(0, init, lb, segs)
    for gr in grads:
        b.load_state_tensors(0, a.state_tensors(0))  # restart b from a's state each step
        a.step(0, gr, 0.8)
        b.step(0, gr, 0.8)
        sa, sb = a.state_tensors(0), b.state_tensors(0)
        for k in ("m32", "v32", "m_absmax", "v_absmax"):
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=0)
        for k in ("mq", "vq"):  # codes agree except where a value sits on a rounding boundary
            assert (sa[k] != sb[k]).float().mean() < 1e-3, k
        torch.testing.assert_close(sa["master"], sb["master"], rtol=1e-6, atol=1e-6)


def test_a_large_host_gradient_has_its_squared_norm_to_double_precision_rounding():
    """8M fp32 elements of one sign's magnitude: ``vector_norm`` on the CPU is off by ~4e-4 here (2.4e-3 at a
    25M-element layer), ``squared_norm`` within 1e-7 of the fp64 sum, as a 0-d tensor; a bf16 tensor too."""
    from lazytrain.runtime.optim.clipping import squared_norm
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1 << 23, generator=g) * 1e-4
    want = float(t.double().square().sum())
    got = squared_norm(t)
    assert got.dim() == 0 and abs(float(got) - want) <= 1e-7 * want
    half = t.bfloat16()
    assert abs(float(squared_norm(half)) - float(half.double().square().sum())) <= 1e-7 * want


def test_clip_coefficient():
    assert clip_coefficient(4.0, None) == 1.0
    assert clip_coefficient(0.25, 1.0) == 1.0
    assert clip_coefficient(16.0, 2.0) == pytest.approx(2.0 / (4.0 + 1e-6))
    with pytest.raises(ValueError):
        clip_coefficient(math.inf, 1.0)


def test_grad_norm_tracker():
    t = GradNormTracker(max_grad_norm=1.0)
    t.begin_step()
    t.add(0, 9.0)
    t.add(1, torch.tensor(16.0))
    assert t.global_norm() == 5.0
    assert t.finish_step() == pytest.approx(1 / (5 + 1e-6))
    with pytest.raises(ValueError):
        t.add(1, 1.0)
    for _ in range(2):  # two non-finite steps are skipped, a finite one resets the count
        t.begin_step()
        t.add(0, math.nan)
        assert t.finish_step() is None
    assert t.consecutive_nonfinite == 2
    t.begin_step()
    t.add(0, 0.25)
    assert t.finish_step() == 1.0 and t.consecutive_nonfinite == 0 and t.total_nonfinite == 2
    for i in range(3):
        t.begin_step()
        t.add(0, math.inf)
        if i < 2:
            assert t.finish_step() is None
        else:
            with pytest.raises(NonFiniteGradError):
                t.finish_step()


@pytest.mark.parametrize("cls", [TorchAdamW, Hybrid8bitAdamW])
def test_concurrent_steps_on_different_blocks(cls):
    from concurrent.futures import ThreadPoolExecutor

    n, nblocks = 3 * 4096 + 50, 4
    segs = [("w", 0, n - 50, (n - 50,)), ("b", n - 50, 50, (50,))]
    g = torch.Generator().manual_seed(11)
    inits = [torch.randn(n, generator=g) for _ in range(nblocks)]
    grads = [[torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(3)] for _ in range(nblocks)]

    def run(parallel):
        opt = cls(**HP, block_size=4096) if cls is Hybrid8bitAdamW else cls(**HP)
        loads = [torch.empty(n, dtype=torch.bfloat16) for _ in range(nblocks)]
        for b in range(nblocks):
            opt.setup(b, inits[b], loads[b], segs)
        for s in range(3):
            if parallel:
                with ThreadPoolExecutor(nblocks) as ex:
                    list(ex.map(lambda b, s=s: opt.step(b, grads[b][s], 0.9), range(nblocks)))
            else:
                for b in range(nblocks):
                    opt.step(b, grads[b][s], 0.9)
        return [opt.master(b) for b in range(nblocks)]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
