"""4-bit moments of Hybrid 8-bit AdamW (``optimizer="hybrid4bit"`` / ``"hybrid4bit-sr"``, ``quant4.py``).

The reference here decodes and encodes the codes with their tables of values (nearest value, ties aside) and
runs AdamW's step in float64, apart from the module's bit tricks: one step from the optimizer's own state must
give its master, absmax and codes.
"""

from __future__ import annotations

import pytest
import torch

import lazytrain
from lazytrain.frontend.presets import build_from_config
from lazytrain.ir import PlanError
from lazytrain.runtime.manifest import CheckpointError
from lazytrain.runtime.optim import Hybrid8bitAdamW, ckernel
from lazytrain.runtime.trainer import Trainer

HAVE_KERNEL = ckernel.load() is not None
KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler"))]
BS = 128
#: an odd-sized tensor (its last quantization block short, its codes padded to a byte), a second one after it,
#: and a small one (fp32 moments)
N1, N2, NS = 3 * 2048 + 301, 5000, 50
SEGS = [("w", 0, N1, (N1,)), ("u", N1, N2, (N2,)), ("b", N1 + N2, NS, (NS,))]
N = N1 + N2 + NS
#: the codes' magnitudes, as fractions of the block absmax
M_TABLE = torch.tensor([0, 0.5, 1, 2, 3, 5, 7, 11], dtype=torch.float64) / 11
V_TABLE = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 9, 11, 13], dtype=torch.float64) / 13
LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.99, 1e-8, 0.1


def _opt(kernel: bool, sr: bool = False, **kw) -> Hybrid8bitAdamW:
    return Hybrid8bitAdamW(lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, chunk_numel=2048, min_8bit_numel=64,
                           num_threads=2, kernel=kernel, stochastic_rounding=sr, moment_bits=4, **kw)


def _setup(opt: Hybrid8bitAdamW, init: torch.Tensor, block: int = 0) -> torch.Tensor:
    load = torch.empty(N, dtype=torch.bfloat16)
    opt.setup(block, init, load, SEGS)
    return load


def _grads(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(N, generator=g) * 1e-2 * (1 + torch.rand(N, generator=g) * 10)).bfloat16() for _ in range(n)]


def _init() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.05


def unpack(b: torch.Tensor) -> torch.Tensor:
    b = b.to(torch.int64)
    return torch.stack([b & 15, b >> 4], 1).reshape(-1)


def nearest(r: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return (r[:, None] - table[None, :]).abs().argmin(dim=1)


def ref_step(state: dict, g: torch.Tensor, clip: float) -> dict:
    """One step of the 4-bit optimizer from ``state`` (its ``state_tensors``), in float64 with the code tables."""
    t = int(state["step"][0]) + 1
    p = state["master"].double().clone()
    g = g.double() * clip
    mc, vc = unpack(state["mq"]), unpack(state["vq"])
    m_am, v_am = state["m_absmax"].double(), state["v_absmax"].double()
    new = {k: state[k].clone() for k in ("m32", "v32")}
    new_mc, new_vc, new_mam, new_vam = mc.clone(), vc.clone(), m_am.clone(), v_am.clone()
    p.mul_(1 - LR * WD)
    step, bc2 = LR / (1 - B1**t), (1 - B2**t) ** 0.5
    q = s = 0
    for _name, off, n, _shape in SEGS:
        gs = g[off:off + n]
        if n < 64:
            m = new["m32"].double() * B1 + (1 - B1) * gs
            v = new["v32"].double() * B2 + (1 - B2) * gs * gs
            p[off:off + n] -= step * m / (v.sqrt() / bc2 + EPS)
            new["m32"], new["v32"] = m.float(), v.float()
            continue
        for a in range(0, n, BS):
            k = min(BS, n - a)
            c, d = mc[q + a:q + a + k], vc[q + a:q + a + k]
            m = torch.where(c & 8 > 0, -1.0, 1.0).double() * M_TABLE[c & 7] * m_am[s]
            m = B1 * m + (1 - B1) * gs[a:a + k]
            sq = (B2 * (V_TABLE[d] * v_am[s]) ** 2 + (1 - B2) * gs[a:a + k] ** 2).sqrt()
            p[off + a:off + a + k] -= step * m / (sq / bc2 + EPS)
            new_mam[s], new_vam[s] = m.abs().max(), sq.max()
            mag = nearest(m.abs() / new_mam[s] if new_mam[s] > 0 else m.abs(), M_TABLE)
            new_mc[q + a:q + a + k] = mag | torch.where(torch.signbit(m), 8, 0)
            new_vc[q + a:q + a + k] = nearest(sq / new_vam[s], V_TABLE[1:]) + 1
            s += 1
        q += n + n % 2
    return {"master": p, "mc": new_mc, "vc": new_vc, "m_absmax": new_mam, "v_absmax": new_vam, **new}


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_step_matches_the_table_reference(kernel):
    """Each of 4 steps, from the optimizer's own state: master, absmax and small-tensor moments as the float64
    reference's to fp32 rounding, the codes the nearest table values (a value at a tie between two codes, after
    fp32 rounding, may take the other: a few in 10^4)."""
    opt = _opt(kernel)
    _setup(opt, _init())
    for g in _grads(4):
        before = opt.state_tensors(0)
        want = ref_step(before, g, 0.8)
        opt.step(0, g, 0.8)
        got = opt.state_tensors(0)
        moved = want["master"] - before["master"].double()
        assert torch.allclose(got["master"].double() - before["master"].double(), moved, rtol=1e-4, atol=1e-6)
        for k in ("m_absmax", "v_absmax", "m32", "v32"):
            w = want[k].double()
            assert torch.allclose(got[k].double(), w, rtol=1e-5, atol=1e-6 * float(w.abs().max())), k
        for k, key in (("mc", "mq"), ("vc", "vq")):
            assert (unpack(got[key]) != want[k]).float().mean() < 2e-3, k


def test_the_state_is_half_the_8_bit_codes_and_one_byte_less():
    """mq / vq: one byte per two elements of each quantized tensor (an odd one padded); 128-element blocks;
    host bytes a parameter: the 8-bit optimizer's less 1 (the codes) plus the smaller blocks' extra absmax."""
    opt, eight = _opt(False), Hybrid8bitAdamW(lr=LR, chunk_numel=2048, min_8bit_numel=64, kernel=False)
    _setup(opt, _init())
    _setup(eight, _init())
    st = opt.state_tensors(0)
    assert opt.block_size == 128 and eight.block_size == 2048
    assert st["mq"].shape == st["vq"].shape == ((N1 + 1) // 2 + N2 // 2,)
    assert st["m_absmax"].numel() == -(-N1 // BS) + -(-N2 // BS)
    extra_absmax = 8 * (st["m_absmax"].numel() - eight.state_tensors(0)["m_absmax"].numel()) / N
    assert eight.host_bytes_per_param - opt.host_bytes_per_param == pytest.approx(1 - (NS + 1) / N - extra_absmax)
    with pytest.raises(ValueError, match="even"):
        _opt(False, block_size=127)


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C compiler")
@pytest.mark.parametrize("sr", [False, True])
def test_kernel_and_torch_path_agree(sr):
    """The C kernel and the torch path from the same state each step: the same codes but at fp32 ties, masters
    within an fp32 rounding of the step (or, rounded stochastically, the same bf16 values but at a few)."""
    a, b = _opt(True, sr), _opt(False, sr)
    la, _ = _setup(a, _init()), _setup(b, _init())
    for g in _grads(5):
        b.load_state_tensors(0, a.state_tensors(0))
        a.step(0, g, 0.9)
        b.step(0, g, 0.9)
        sa, sb = a.state_tensors(0), b.state_tensors(0)
        for k in ("mq", "vq"):
            assert (unpack(sa[k]) != unpack(sb[k])).float().mean() < 2e-3, k
        if sr:
            assert (sa["master"] != sb["master"]).float().mean() < 2e-3
            assert torch.equal(sa["master"], la.float())
        else:
            assert torch.allclose(sa["master"], sb["master"], rtol=1e-6, atol=1e-6)


def test_the_stochastic_master_rounds_the_exact_update():
    """hybrid4bit-sr: the same moments as hybrid4bit from the same state, and a master that is the exact one's
    fp32 value rounded to one of its two bf16 neighbours."""
    sr, exact = _opt(False, True), _opt(False)
    load = _setup(sr, _init())
    _setup(exact, _init())
    for g in _grads(3):
        exact.load_state_tensors(0, sr.state_tensors(0))
        sr.step(0, g)
        exact.step(0, g)
        want, got = exact.state_tensors(0), sr.state_tensors(0)
        for k in ("mq", "vq", "m_absmax", "v_absmax", "m32", "v32", "step"):
            assert torch.equal(got[k], want[k]), k
        bits = want["master"].view(torch.int32) & -65536      # truncated to bf16 (toward zero), and one bf16 up
        toward, away = bits.view(torch.float32), (bits + 65536).view(torch.float32)
        assert ((load.float() == toward) | (load.float() == away)).all()
        assert not torch.equal(load, want["master"].bfloat16())     # not all rounded to nearest
    assert exact.host_bytes_per_param - sr.host_bytes_per_param == pytest.approx(2.0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_state_round_trip_resumes_bit_for_bit(kernel):
    """``state_tensors`` after 2 steps loaded into a fresh optimizer continues as if uninterrupted; an 8-bit
    state (other shapes) is refused, naming the moment width."""
    grads = _grads(5)

    def run(steps, opt=None) -> tuple[Hybrid8bitAdamW, torch.Tensor]:
        opt = opt or _opt(kernel, seed=3)
        load = _setup(opt, _init())
        for g in steps:
            opt.step(0, g)
        return opt, load
    _, whole = run(grads)
    first, _ = run(grads[:2])
    resumed = _opt(kernel, seed=3)
    load = _setup(resumed, torch.zeros(N))
    resumed.load_state_tensors(0, first.state_tensors(0))
    for g in grads[2:]:
        resumed.step(0, g)
    assert torch.equal(load, whole)
    eight = Hybrid8bitAdamW(lr=LR, chunk_numel=2048, min_8bit_numel=64, block_size=BS, kernel=False)
    _setup(eight, _init())
    with pytest.raises(ValueError, match="state mq has shape .*4-bit moments, block_size 128"):
        resumed.load_state_tensors(0, eight.state_tensors(0))
    with pytest.raises(CheckpointError, match="has 8-bit moments, this optimizer 4-bit ones"):
        resumed.load_hyperparameters({"lr": 1.0})


def test_streamed_state_steps_on_host_copies_and_refuses_a_device():
    """The NVMe state tier's path: ``step_streamed`` on CPU copies of ``streamed_state`` gives what ``step``
    gives on the optimizer's own tensors, bit for bit; on a device (a CPU copy taken as one) it is refused."""
    grads = _grads(3)
    own, placed = _opt(False), _opt(False)
    load_own, load_placed = _setup(own, _init()), _setup(placed, _init())
    for g in grads:
        own.step(0, g, 0.7)
        params = load_placed.clone()
        state = {k: v.clone() for k, v in placed.streamed_state(0).items()}
        assert set(state) == {"lo", "mq", "vq", "m_absmax", "v_absmax", "m32", "v32"}
        placed.step_streamed(0, g, params, state, 0.7)
        load_placed.copy_(params)
        placed.set_streamed_state(0, state)
    assert torch.equal(load_placed, load_own)
    for k, v in own.state_tensors(0).items():
        assert torch.equal(placed.state_tensors(0)[k], v), k
    placed._force_device = True
    with pytest.raises(NotImplementedError, match="4-bit moments .* update on the host only.*GPU-updated"):
        placed.step_streamed(0, grads[0], load_placed.clone(), placed.streamed_state(0))
    with pytest.raises(PlanError, match="4-bit moments .* update on the host only.*GPU-resident"):
        _setup(placed, _init(), block=1)
    with pytest.raises(NotImplementedError):
        placed.device_bytes_per_param(2)


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config({"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 64, "n_layer": 2, "n_head": 2,
                              "d_ff": 128, "max_seq": 32, "tie_weights": True}, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("option,per", [("hybrid4bit", 7.25), ("hybrid4bit-sr", 5.25)])
def test_the_compiler_plans_host_updates_only(option, per):
    model = _gpt()
    plan = lazytrain.compile(model, batch_size=4, seq_len=16, hardware="cpu", optimizer=option,
                             param_dtype="bfloat16", gpu_memory="8GiB", host_memory="16GiB")
    assert plan.options["optimizer"] == option and plan.options["host_bytes_per_param"] == per
    assert not plan.decisions.resident_blocks and not plan.decisions.gpu_updated_blocks
    with pytest.raises(ValueError, match=f"optimizer {option} updates on the host only: resident="):
        lazytrain.compile(model, batch_size=4, seq_len=16, hardware="cpu", optimizer=option, resident=2)


def test_a_training_run_its_checkpoint_and_the_other_width_refused(tmp_path):
    """bf16 parameters on the CPU, 30 steps on one repeated batch: 4-bit moments learn as 8-bit ones do; the
    checkpoint resumes bit for bit (into the -sr master too: the same layout), and into 8-bit moments is refused
    with the reason."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 61, (4, 16), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}

    def trainer(bits: int, sr: bool = False, ckpt=None) -> Trainer:
        opt = Hybrid8bitAdamW(lr=3e-3, max_grad_norm=1.0, min_8bit_numel=512, moment_bits=bits,
                              stochastic_rounding=sr)
        if ckpt is not None:
            return Trainer.load_checkpoint(ckpt, _gpt(), optimizer=opt, device="cpu", verbose=False)
        model = _gpt()
        plan = lazytrain.compile(model, batch_size=4, seq_len=16, micro_batch=2, hardware="cpu", policy="megatrain",
                                 optimizer="hybrid4bit" if bits == 4 else "hybrid8bit", param_dtype="bfloat16",
                                 gpu_memory="8GiB", host_memory="16GiB")
        return Trainer(model, plan, optimizer=opt, device="cpu", verbose=False)
    losses = {}
    for bits in (8, 4):
        tr = trainer(bits)
        losses[bits] = [tr.step(batch).loss for _ in range(30)]
        if bits == 4:
            tr.save_checkpoint(tmp_path / "ckpt")
            after = [tr.step(batch).loss for _ in range(3)]
        tr.close()
    assert losses[4][-1] < 0.5 * losses[4][0]
    assert losses[4][-1] < 2 * losses[8][-1] + 0.1
    resumed = trainer(4, ckpt=tmp_path / "ckpt")
    assert [resumed.step(batch).loss for _ in range(3)] == after
    resumed.close()
    trainer(4, sr=True, ckpt=tmp_path / "ckpt").close()
    with pytest.raises(CheckpointError, match="the optimizer's moment_bits is 8, the state was saved with "
                                              "moment_bits=4"):
        trainer(8, ckpt=tmp_path / "ckpt")


def test_resharding_is_refused():
    """Two codes a byte: a rank's piece of a tensor need not start at a byte, so a checkpoint of 4-bit moments
    resumes only at the world size it was saved with."""
    from lazytrain.runtime.reshard import check_reshardable
    check_reshardable(Hybrid8bitAdamW(lr=LR))
    with pytest.raises(CheckpointError, match="4-bit moments cannot be resharded"):
        check_reshardable(_opt(False))
