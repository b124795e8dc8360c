"""GPU-resident blocks in the host optimizers (lazytrain.runtime.optim): a load buffer on the device
keeps the optimizer state there and ``step`` queues the update without synchronising.

- the Triton kernel equals the C kernel bit for bit, checked on CPU tensors under Triton's
  interpreter (in a subprocess: ``TRITON_INTERPRET`` must be set before Triton is first used);
- the device path's torch fallback (no Triton) equals the host torch path bit for bit;
- TorchAdamW's device path equals its host path; checkpoints move between placements;
- on CUDA (``-m cuda``): a CUDA block against an identical CPU block, round trips, no sync in step.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from lazytrain.runtime.optim import Hybrid8bitAdamW, TorchAdamW, ckernel
from lazytrain.runtime.optim import quant as Q

HAVE_TRITON = importlib.util.find_spec("triton") is not None
HAVE_KERNEL = ckernel.load() is not None
HAVE_CUDA = torch.cuda.is_available()
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _layout(bs: int):
    """Segments in a scrambled order (as a tied / packed block may list them): a whole number of
    quantization blocks, one with a short last block, a small (fp32-moment) tensor, a second 8-bit."""
    sizes = [("w1", 4 * bs), ("w2", 5 * bs + 77), ("bias", 100), ("w3", 2 * bs + 1)]
    segs, off = [], 0
    for name, k in sizes:
        segs.append((name, off, k, (k,)))
        off += k
    return [segs[2], segs[0], segs[3], segs[1]], off


def _grads(n: int, steps: int, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Random gradients; step 2 is ~1e6 so the next decode of m overflows the one-multiplication
    factor (the host then takes the two-multiplication form: pre = 2^112)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * (1e6 if t == 2 else 1.0)).to(dtype) for t in range(steps)]


def _pair(bs: int, dtype, host_kernel: bool, **dev_flags):
    """A host optimizer and a forced-device optimizer (CPU tensors) on the same block."""
    segs, n = _layout(bs)
    init = torch.randn(n, generator=torch.Generator().manual_seed(1))
    kw = dict(HP, block_size=bs, min_8bit_numel=2 * bs, chunk_numel=4 * bs)
    host = Hybrid8bitAdamW(**kw, kernel=host_kernel)
    dev = Hybrid8bitAdamW(**kw, kernel=False)
    dev._force_device = True
    for k, v in dev_flags.items():
        setattr(dev, k, v)
    lh, ld = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    host.setup(0, init, lh, segs)
    dev.setup(0, init, ld, segs)
    return host, dev, lh, ld, n


def _run_and_compare(host, dev, lh, ld, grads, clip: float = 0.7) -> None:
    overflowed = False
    for t, gr in enumerate(grads):
        host.step(0, gr, clip)
        dev.step(0, gr, clip)
        sh, sd = host.state_tensors(0), dev.state_tensors(0)
        for k in sh:
            assert torch.equal(sh[k], sd[k]), (t, k, (sh[k] != sd[k]).sum().item())
        bits = torch.int16 if lh.dtype == torch.bfloat16 else torch.int32  # bitwise, NaN-proof
        assert torch.equal(lh.view(bits), ld.view(bits))
        overflowed |= Q.decode_ratio(sh["m_absmax"], Q.SIGNED_TOP, HP["betas"][0])[1] != 1.0
    assert overflowed, "the test should exercise the overflow-safe decode"


# -- Triton kernel under the interpreter -------------------------------------------------------------
_CASES = {
    "bf16-buffer": dict(bs=256, dtype="bfloat16", gdtype="float32"),
    "fp32-buffer": dict(bs=256, dtype="float32", gdtype="float32"),
    "bf16-grad": dict(bs=128, dtype="bfloat16", gdtype="bfloat16"),
    "odd-block-size": dict(bs=96, dtype="bfloat16", gdtype="float32"),
}


_NO_EXACT_FMA = 77  # the subprocess's exit code when the interpreter cannot be bit-exact


def _interpreter_fma_is_exact() -> bool:
    """Whether this Triton's interpreter rounds ``tl.fma`` once (3.9 does; older ones compute
    ``a * b + c`` in fp32 with two roundings, which the C kernel's ``fmaf`` does not)."""
    import triton
    import triton.language as tl

    @triton.jit
    def fma_probe(x_ptr, out_ptr):
        x = tl.load(x_ptr + tl.arange(0, 2))
        tl.store(out_ptr + tl.arange(0, 2), tl.fma(x, x, -1.0))

    x = torch.full((2,), 1 + 2**-12)
    out = torch.empty(2)
    fma_probe[(1,)](x, out)
    return out[0].item() == 2**-11 + 2**-24  # two roundings give 2**-11


def _interp_case(name: str) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: Triton device path vs the host C kernel."""
    from lazytrain.runtime.optim import triton_kernel as TK

    assert TK.usable_for(torch.device("cpu")), "Triton's interpreter is not active"
    if not _interpreter_fma_is_exact():
        sys.exit(_NO_EXACT_FMA)
    c = _CASES[name]
    host, dev, lh, ld, n = _pair(c["bs"], getattr(torch, c["dtype"]), host_kernel=True)
    _run_and_compare(host, dev, lh, ld, _grads(n, 5, seed=3, dtype=getattr(torch, c["gdtype"])))
    assert not dev._warned_slow  # the kernel ran, not the fallback


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler (the reference)")
@pytest.mark.parametrize("case", list(_CASES))
def test_triton_kernel_matches_c_kernel_bit_exact(case):
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), case], env=env, capture_output=True, text=True, timeout=600
    )
    if r.returncode == _NO_EXACT_FMA:
        pytest.skip("this Triton's interpreter rounds tl.fma twice (the GPU does not): no bit-exact reference")
    assert r.returncode == 0, r.stdout + r.stderr


# -- the torch fallback on "device" tensors ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_fallback_matches_host_torch_path(dtype, caplog):
    host, dev, lh, ld, n = _pair(256, dtype, host_kernel=False, _no_triton=True)
    with caplog.at_level("WARNING"):
        _run_and_compare(host, dev, lh, ld, _grads(n, 5, seed=4))
    assert sum("Triton is not available" in r.message for r in caplog.records) == 1  # once


def test_hybrid_checkpoints_move_between_placements():
    host, dev, lh, ld, n = _pair(256, torch.bfloat16, host_kernel=False, _no_triton=True)
    gr = _grads(n, 2, seed=5)
    host.step(0, gr[0], 1.0)
    dev.load_state_tensors(0, host.state_tensors(0))
    assert torch.equal(ld, lh)
    host.step(0, gr[1], 1.0)
    dev.step(0, gr[1], 1.0)
    sh, sd = host.state_tensors(0), dev.state_tensors(0)
    assert all(torch.equal(sh[k], sd[k]) and sh[k].device.type == "cpu" for k in sh)
    host.load_state_tensors(0, sd)
    assert torch.equal(host.master(0), dev.master(0))


def test_hybrid_memory_accounting():
    bs = 256
    opt = Hybrid8bitAdamW(**HP, block_size=bs, min_8bit_numel=2 * bs, chunk_numel=4 * bs, kernel=False)
    assert opt.device_bytes_per_param(2) == 4 + 32 / bs
    assert opt.device_bytes_per_param(4) == 2 + 32 / bs
    host_before = opt.host_bytes_per_param
    opt._force_device = True
    n = 8 * bs
    opt.setup(0, torch.randn(n), torch.empty(n, dtype=torch.bfloat16), [("w", 0, n, (n,))])
    assert opt.device_bytes_per_param() == 4 + 32 / bs  # exact for an all-8-bit block
    assert opt.host_bytes_per_param == host_before  # a device block keeps no host memory
    opt._force_device = False
    opt.setup(1, torch.randn(n), torch.empty(n, dtype=torch.bfloat16), [("w", 0, n, (n,))])
    assert opt.host_bytes_per_param == 8 + 8 / bs and opt.device_bytes_per_param() == 4 + 32 / bs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_adamw_device_path_matches_host(dtype):
    n = 3000
    init = torch.randn(n, generator=torch.Generator().manual_seed(6))
    host, dev = TorchAdamW(**HP, chunk_numel=1024), TorchAdamW(**HP, chunk_numel=1024)
    dev._force_device = True
    lh, ld = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    host.setup(0, init, lh, [])
    dev.setup(0, init, ld, [])
    for t, gr in enumerate(_grads(n, 4, seed=7)):
        clip = 0.5 if t % 2 else 1.0
        host.step(0, gr, clip)
        dev.step(0, gr, clip)
        sh, sd = host.state_tensors(0), dev.state_tensors(0)
        for k in sh:
            torch.testing.assert_close(sd[k], sh[k], rtol=1e-6, atol=0)
        assert torch.equal(lh, ld)
    assert dev.device_bytes_per_param() == (8.0 if dtype == torch.float32 else 12.0)
    assert TorchAdamW(**HP).device_bytes_per_param(2) == 12.0 and TorchAdamW(**HP).device_bytes_per_param(4) == 8.0
    host.load_state_tensors(0, dev.state_tensors(0))
    dev.load_state_tensors(0, host.state_tensors(0))
    assert torch.equal(host.master(0), dev.master(0))


# -- CUDA ------------------------------------------------------------------------------------------
def _cuda_vs_cpu(opt_cpu, opt_gpu, dtype, grads, mode: str):
    """Step a CPU and a CUDA block together.  mode "exact": bit-exact; "codes": the torch fallback
    on CUDA vs torch on the CPU (CUDA's elementwise kernels may contract or round differently in the
    last bit), restarted from the CPU state each step, codes agreeing but for rounding-boundary
    flips, as the C kernel vs the torch path in test_optim.py; "close": allclose(rtol 1e-6)."""
    n = grads[0].numel()
    segs, _ = _layout(256) if isinstance(opt_cpu, Hybrid8bitAdamW) else ([], None)
    init = torch.randn(n, generator=torch.Generator().manual_seed(8))
    lc, lg = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype, device="cuda")
    opt_cpu.setup(0, init, lc, segs)
    opt_gpu.setup(0, init, lg, segs)
    stream = torch.cuda.Stream()
    for t, gr in enumerate(grads):
        clip = 0.7 if t % 2 else 1.0
        if mode == "codes":
            opt_gpu.load_state_tensors(0, opt_cpu.state_tensors(0))
        opt_cpu.step(0, gr, clip)
        gd = gr.to("cuda", torch.float32)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda.set_sync_debug_mode("error")
            try:
                opt_gpu.step(0, gd, clip, lr=HP["lr"])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sc, sg = opt_cpu.state_tensors(0), opt_gpu.state_tensors(0)
        for k in sc:
            assert sg[k].device.type == "cpu" and sg[k].dtype == sc[k].dtype and sg[k].shape == sc[k].shape
            if mode == "exact":
                assert torch.equal(sc[k], sg[k]), (t, k, (sc[k] != sg[k]).sum().item())
            elif mode == "codes" and k in ("mq", "vq"):
                assert (sc[k] != sg[k]).float().mean() < 1e-3, (t, k)
            else:
                torch.testing.assert_close(sg[k], sc[k], rtol=1e-6, atol=1e-6)
        if mode == "exact":
            assert torch.equal(lc, lg.cpu())
    # checkpoints move both ways
    opt_cpu.load_state_tensors(0, opt_gpu.state_tensors(0))
    assert torch.equal(lc, lg.cpu())
    opt_gpu.load_state_tensors(0, opt_cpu.state_tensors(0))
    assert all(torch.equal(a, b) for a, b in zip(opt_cpu.state_tensors(0).values(), opt_gpu.state_tensors(0).values()))


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fast", [True, False], ids=["triton", "torch-fallback"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hybrid8bit_cuda_block_matches_cpu_block(fast, dtype):
    if fast and not (HAVE_TRITON and HAVE_KERNEL):
        pytest.skip("needs triton and the C kernel")
    kw = dict(HP, block_size=256, min_8bit_numel=512, chunk_numel=1024)
    # the Triton kernel mirrors the C kernel, the device fallback mirrors the host torch path
    opt_cpu, opt_gpu = Hybrid8bitAdamW(**kw, kernel=fast), Hybrid8bitAdamW(**kw, kernel=False)
    opt_gpu._no_triton = not fast
    _, n = _layout(256)
    _cuda_vs_cpu(opt_cpu, opt_gpu, dtype, _grads(n, 5, seed=9), "exact" if fast else "codes")
    assert opt_gpu._warned_slow == (not fast)


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_adamw_cuda_block_matches_cpu_block(dtype):
    kw = dict(HP, chunk_numel=1024)
    _cuda_vs_cpu(
        TorchAdamW(**kw),
        TorchAdamW(**kw),
        dtype,
        [g / 1e6 if t == 2 else g for t, g in enumerate(_grads(3000, 5, seed=10))],
        "close",
    )


if __name__ == "__main__":  # the interpreter cases, run by test_triton_kernel_matches_c_kernel_bit_exact
    _interp_case(sys.argv[1])
