"""The stochastic-rounding bf16 master of Hybrid 8-bit AdamW (``optimizer="hybrid8bit-sr"``).

The reference here is written in plain Python integers (the hash) and plain torch (the rounding), apart from
the module: the update of the exact optimizer, started from the same bf16 master, gives the fp32 value that
the stochastic one must round, with the random bits the reference computes.
"""

from __future__ import annotations

import pytest
import torch

import lazytrain
from lazytrain.frontend.presets import build_from_config
from lazytrain.ir import PlanError
from lazytrain.runtime.optim import Hybrid8bitAdamW, ckernel
from lazytrain.runtime.optim.sr import round_sr_, sr_bits, sr_key
from lazytrain.runtime.trainer import Trainer

HAVE_KERNEL = ckernel.load() is not None
KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler"))]
M32 = 0xFFFFFFFF
N_BIG, N_SMALL = 3 * 2048 + 300, 50          # two full chunks, a short one; one fp32-moment tensor
SEGS = [("w", 0, N_BIG, (N_BIG,)), ("b", N_BIG, N_SMALL, (N_SMALL,))]
N = N_BIG + N_SMALL


def ref_key(seed: int, block: int, step: int) -> int:
    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) % 2**64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
        return x ^ (x >> 31)
    return mix(mix(mix(seed % 2**64) ^ block) ^ step) >> 32


def ref_bits(i: int, key: int) -> int:
    x = ((i * 0x9E3779B9) & M32) ^ key
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x >> 16


def ref_round(p: torch.Tensor, key: int) -> torch.Tensor:
    """fp32 ``p`` (a block's elements 0..) rounded stochastically to bf16, one element at a time."""
    bits = p.view(torch.int32).tolist()
    out = [(((b & M32) + ref_bits(i, key)) >> 16) & 0xFFFF for i, b in enumerate(bits)]
    return torch.tensor(out, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _opt(kernel: bool, sr: bool = True, seed: int = 3) -> Hybrid8bitAdamW:
    return Hybrid8bitAdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, block_size=256, chunk_numel=2048,
                           min_8bit_numel=64, num_threads=2, kernel=kernel, stochastic_rounding=sr, seed=seed)


def _setup(opt: Hybrid8bitAdamW, init: torch.Tensor, block: int = 0) -> torch.Tensor:
    load = torch.empty(N, dtype=torch.bfloat16)
    opt.setup(block, init, load, SEGS)
    return load


def _grads(n: int, seed: int = 1, dtype=torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(N, generator=g) * 1e-2).to(dtype) for _ in range(n)]


def test_the_hash_and_the_key_match_the_reference():
    keys = [sr_key(s, b, t) for s, b, t in [(0, 0, 1), (3, 7, 2), (2**40 + 5, 123, 99999)]]
    assert keys == [ref_key(s, b, t) for s, b, t in [(0, 0, 1), (3, 7, 2), (2**40 + 5, 123, 99999)]]
    assert len(set(keys)) == 3 and all(0 <= k <= M32 for k in keys)
    idx = torch.tensor([0, 1, 2, 4095, 2**31 - 1, 2**32 - 1], dtype=torch.int64)
    for k in keys:
        assert sr_bits(idx, k).tolist() == [ref_bits(i, k) for i in idx.tolist()]


def test_rounding_is_unbiased_and_deterministic():
    """1.0 + f * ulp (f = 0.3, ulp 2^-7), 2^16 elements: rounded up in a fraction f of them (binomial: within
    5 sigma), so the mean is the fp32 value to ~2e-5 ulp...; negative values round in magnitude the same way;
    the same key gives the same bits, another key others."""
    n, ulp = 1 << 16, 2.0**-7
    for sign in (1.0, -1.0):
        p = torch.full((n,), sign * (1.0 + 0.3 * ulp))
        hi = torch.empty(n, dtype=torch.int16)
        round_sr_(p, hi, 0, sr_key(0, 0, 1))
        v = hi.view(torch.bfloat16).float()
        assert set(v.unique().tolist()) == {sign * 1.0, sign * (1.0 + ulp)}
        up = float((v.abs() > 1.0).float().mean())
        assert abs(up - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5
        assert abs(float(v.double().mean()) - float(p[0])) < 5 * ulp * (0.3 * 0.7 / n) ** 0.5
        again = torch.empty_like(hi)
        round_sr_(p, again, 0, sr_key(0, 0, 1))
        assert torch.equal(hi, again)
        round_sr_(p, again, 0, sr_key(0, 0, 2))
        assert not torch.equal(hi, again)
    exact = torch.tensor([1.0, -2.5, 0.0, 3.140625])       # bf16 values stay as they are
    hi = torch.empty(4, dtype=torch.int16)
    round_sr_(exact, hi, 10, 12345)
    assert torch.equal(hi.view(torch.bfloat16).float(), exact)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float32])
def test_the_update_is_the_exact_one_rounded_stochastically(kernel, gdtype):
    """Each step: the exact optimizer started from the stochastic one's state (its bf16 master, lo = 0) computes
    the fp32 master the stochastic one must round; its bf16 result is that value rounded with the reference's
    bits for (seed, block 2, step, element), and the moments are the exact optimizer's."""
    init = (torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16().float()
    sr, exact = _opt(kernel), _opt(kernel, sr=False)
    load = _setup(sr, init, block=2)
    _setup(exact, init, block=2)
    for t, g in enumerate(_grads(4, dtype=gdtype), start=1):
        exact.load_state_tensors(2, sr.state_tensors(2))
        exact.step(2, g, 0.8)
        sr.step(2, g, 0.8)
        want = exact.state_tensors(2)
        got = sr.state_tensors(2)
        assert torch.equal(load, ref_round(want["master"], ref_key(3, 2, t))), t
        assert torch.equal(got["master"], load.float())
        for k in ("mq", "vq", "m_absmax", "v_absmax", "m32", "v32", "step"):
            assert torch.equal(got[k], want[k]), k


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
def test_kernel_and_torch_path_agree():
    """The C kernel and the torch path: the same bf16 master (their fp32 results differ by an ulp at most, which
    moves a stochastic rounding only on a 2^-16 boundary) and the same codes."""
    init = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.05
    a, b = _opt(True), _opt(False)
    la, lb = _setup(a, init), _setup(b, init)
    for g in _grads(5):
        a.step(0, g, 0.9)
        b.step(0, g, 0.9)
    assert (la != lb).float().mean() < 1e-3
    sa, sb = a.state_tensors(0), b.state_tensors(0)
    for k in ("mq", "vq"):
        assert (sa[k] != sb[k]).float().mean() < 1e-3, k


def test_small_updates_add_up_where_round_to_nearest_loses_them():
    """lr 1e-4 on weights of 1.0 (a bf16 ulp is 2^-8 just below): each step is ~1/40 ulp.  A bf16 master rounded
    to nearest after each step never moves; rounded stochastically, its mean follows the fp32 master's to within
    a few percent."""
    n, steps = 8192, 40
    segs = [("w", 0, n, (n,))]
    g = torch.ones(n, dtype=torch.bfloat16)

    def run(sr: bool) -> tuple[torch.Tensor, torch.Tensor]:
        opt = Hybrid8bitAdamW(lr=1e-4, block_size=256, chunk_numel=2048, stochastic_rounding=sr, num_threads=1)
        load = torch.empty(n, dtype=torch.bfloat16)
        opt.setup(0, torch.ones(n), load, segs)
        for _ in range(steps):
            opt.step(0, g)
        return load.float(), opt.master(0)
    _, exact_master = run(False)
    sr_load, _ = run(True)
    moved = 1.0 - float(exact_master.mean())
    assert 0.9 * steps * 1e-4 < moved < 1.1 * steps * 1e-4
    nearest = torch.ones(n, dtype=torch.bfloat16)
    for _ in range(steps):      # each of Adam's steps is ~lr here (a constant gradient)
        nearest = (nearest.float() - 1e-4).bfloat16()
    assert torch.equal(nearest.float(), torch.ones(n))
    assert abs((1.0 - float(sr_load.mean())) - moved) < 0.05 * moved


@pytest.mark.parametrize("kernel", KERNELS)
def test_runs_and_resumes_repeat_bit_for_bit(kernel):
    """Same seed: the same bits; a resume from ``state_tensors`` after 2 steps continues as if uninterrupted (the
    random bits depend on the step counter, restored with the state); another seed: other bits."""
    init = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.05
    grads = _grads(5)

    def run(seed: int, steps) -> tuple[Hybrid8bitAdamW, torch.Tensor]:
        opt = _opt(kernel, seed=seed)
        load = _setup(opt, init)
        for g in steps:
            opt.step(0, g)
        return opt, load
    _, whole = run(3, grads)
    assert torch.equal(run(3, grads)[1], whole)
    assert not torch.equal(run(4, grads)[1], whole)
    first, _ = run(3, grads[:2])
    resumed = _opt(kernel)
    load = _setup(resumed, torch.zeros(N))
    resumed.load_state_tensors(0, first.state_tensors(0))
    for g in grads[2:]:
        resumed.step(0, g)
    assert torch.equal(load, whole)


def test_state_loads_into_the_exact_optimizer_and_back():
    """The same keys: the stochastic master (bf16 values as fp32) is the exact optimizer's master exactly (low half
    0); the exact optimizer's fp32 master loads into the stochastic one rounded to nearest; 2 bytes a parameter
    less (the low half) in host memory."""
    init = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.05
    sr, exact = _opt(False), _opt(False, sr=False)
    load_sr, load_exact = _setup(sr, init), _setup(exact, init)
    for g in _grads(2):
        sr.step(0, g)
        exact.step(0, g)
    s_sr, s_exact = sr.state_tensors(0), exact.state_tensors(0)
    assert s_sr.keys() == s_exact.keys()
    assert torch.equal(s_sr["master"], load_sr.float())
    assert {k: (v.dtype, v.shape) for k, v in s_sr.items()} == {k: (v.dtype, v.shape) for k, v in s_exact.items()}
    other = _opt(False, sr=False)
    _setup(other, torch.zeros(N))
    other.load_state_tensors(0, s_sr)
    assert torch.equal(other.master(0), s_sr["master"])
    back = _opt(False)
    load_back = _setup(back, torch.zeros(N))
    back.load_state_tensors(0, s_exact)
    assert torch.equal(load_back, s_exact["master"].bfloat16())
    assert torch.equal(load_back, load_exact)                 # the exact optimizer's load buffer: nearest too
    assert exact.host_bytes_per_param - sr.host_bytes_per_param == pytest.approx(2.0, abs=1e-12)


def test_device_blocks_are_refused():
    """No device path: a GPU-resident block (``_force_device``: a CPU buffer taken as one) and a GPU-updated
    streamed block are refused, naming the fix."""
    opt = _opt(False)
    opt._force_device = True
    with pytest.raises(PlanError, match="hybrid8bit-sr\\) updates on the host only: compile the plan with "
                                        "resident='none'.* \\(block 0 is GPU-resident\\)"):
        _setup(opt, torch.zeros(N))
    with pytest.raises(NotImplementedError):
        opt.device_bytes_per_param(2)
    host = _opt(False)
    _setup(host, torch.zeros(N))
    state = host.streamed_state(0)             # (the NVMe state tier's host copies are fine)
    host._force_device = True
    with pytest.raises(NotImplementedError, match="updates on the host only.*\\(block 0 is GPU-updated\\)"):
        host.step_streamed(0, torch.zeros(N), torch.zeros(N, dtype=torch.bfloat16), state)


def test_the_compiler_plans_host_updates_only_and_prices_6_25_bytes():
    model = _gpt()
    plan = lazytrain.compile(model, batch_size=4, seq_len=16, hardware="cpu", optimizer="hybrid8bit-sr",
                             param_dtype="bfloat16", gpu_memory="8GiB", host_memory="16GiB")
    assert plan.options["optimizer"] == "hybrid8bit-sr" and plan.options["host_bytes_per_param"] == 6.25
    assert not plan.decisions.resident_blocks and not plan.decisions.gpu_updated_blocks
    for name, value in (("resident", 2), ("gpu_update", 1)):
        with pytest.raises(ValueError, match=f"optimizer hybrid8bit-sr updates on the host only: {name}="):
            lazytrain.compile(model, batch_size=4, seq_len=16, hardware="cpu", optimizer="hybrid8bit-sr",
                              **{name: value})


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config({"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 64, "n_layer": 2, "n_head": 2,
                              "d_ff": 128, "max_seq": 32, "tie_weights": True}, device="cpu", dtype=torch.float32)


def test_a_short_training_run_through_the_trainer(tmp_path):
    """bf16 parameters on the CPU, 30 steps on one repeated batch: the stochastic master learns as the exact one
    does (the loss falls by the same order), and a checkpoint of one loads into the other (same class, keys)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 61, (4, 16), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    losses, trainers = {}, {}
    for sr in (False, True):
        model = _gpt()
        plan = lazytrain.compile(model, batch_size=4, seq_len=16, micro_batch=2, hardware="cpu", policy="megatrain",
                                 optimizer="hybrid8bit-sr" if sr else "hybrid8bit", param_dtype="bfloat16",
                                 gpu_memory="8GiB", host_memory="16GiB")
        opt = Hybrid8bitAdamW(lr=3e-3, max_grad_norm=1.0, block_size=256, min_8bit_numel=512,
                              stochastic_rounding=sr, seed=0)
        tr = Trainer(model, plan, optimizer=opt, device="cpu")
        losses[sr] = [tr.step(batch).loss for _ in range(30)]
        trainers[sr] = tr
    assert losses[True][-1] < 0.5 * losses[True][0]
    assert losses[True][-1] < 2 * losses[False][-1] + 0.1
    exact_master = trainers[False].optimizer.master(0)
    assert not torch.equal(exact_master, exact_master.bfloat16().float())     # the exact one keeps fp32 bits
    trainers[True].save_checkpoint(tmp_path / "ckpt")        # (applies a lagged update first)
    sr_master = trainers[True].optimizer.master(0)
    assert torch.equal(sr_master, sr_master.bfloat16().float())               # the stochastic one: bf16 values
    state = trainers[True].state_dict()
    for tr in trainers.values():
        tr.close()
    exact = Hybrid8bitAdamW(lr=3e-3, max_grad_norm=1.0, block_size=256, min_8bit_numel=512)
    resumed = Trainer.load_checkpoint(tmp_path / "ckpt", _gpt(), optimizer=exact, device="cpu")
    assert torch.equal(exact.master(0), sr_master)
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert resumed.step(batch).loss < losses[True][0]
    resumed.close()
