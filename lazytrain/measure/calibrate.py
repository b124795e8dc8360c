"""Calibration on the real blocks: time the model's own block programs in LazyTrain's runtime.

The cost model prices a block from its FLOPs at rates fitted to one model's layer; a model with wider
layers, another attention kernel or another sequence length runs at other rates.  Measuring removes the guess:

1. a *timing model*: the model's structure with random weights, cut to its first, second and last
   layer when all layers are alike (``trace_export.reducible``; their programs are the same code, so
   the middle layer's time is every middle layer's), on the CPU, buffers rebuilt from the config (or
   copied from the model where they are real);
2. a recompute-all plan for it at the plan's micro-batch and sequence length, every block streamed (so
   forward, recompute and backward each run for every block), ``N_MICRO`` micro-batches a step, on a GPU as
   many as its forwards need to run ``SUSTAIN_S`` (``timing_plan``: the clocks a step runs at); near the
   longest sequence that fits, the MILP's plan and one micro-batch instead;
3. ``WARMUP`` + ``repeats`` steps with ``Trainer(profile=True)``: each op is timed on its stream as a plan
   runs it (CUDA events after its waits, so a transfer it waits for is not counted; in CPU mode,
   wall time);
4. per distinct block (``ModelGraph.block_signature``), the median forward, backward and recompute
   over every sample -> ``block_timing.BlockTiming``, added to the hardware profile;
5. compiled blocks (``compile_blocks``): every cut but the min-cut that the compiler may choose for a block
   (``Block.cuts``) timed the same way, one plan per cut index in which every block offering it saves at it
   (``cut_plan``: kept, else offloaded) -> ``BlockTiming.cuts``.  A cut's backward recomputes what its
   forward did not save, at a rate no FLOP count predicts well (pointwise and normalisation kernels), so it
   is measured rather than scaled from the min-cut's.

The cost model then uses the measured seconds for every block with that signature at that micro-batch
(``CostModel.measured``), and ``plan.summary()`` says which blocks are measured and which modelled.

``compile_calibrated`` is ``compile(..., calibrate=True)``: compile, time the blocks at the micro-batch
the plan chose if they are not in the profile yet, and compile again at that micro-batch with the
measured times (the choice of micro-batch itself was made on modelled times: comparing one measured
micro-batch with modelled others would favour whichever model errs low), then write the profile back
when it came from a file.  ``lazytrain profile --model M --seq S``
does the same into ``-o``.  Host memory: the timing model's parameters with fp32 AdamW state, ~16 bytes
each (a 7B model cut to three layers: 1.8 B parameters, 29 GB).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from ..compiler.api import Compiler, compile_model, compile_request
from ..compiler.block_timing import BlockTiming, CutTiming
from ..compiler.budgets import BudgetError
from ..compiler.fixed import calibrating
from ..compiler.hardware import HardwareProfile
from ..compiler.options import Optimizer
from ..compiler.profiles import get_profile
from ..compiler.request import CompileRequest
from ..frontend.presets import build_model
from ..frontend.trace import trace
from ..frontend.trace_export import find_layers, kept_layers, meta_clone, reducible
from ..ir import OpKind, PlanError, Saved
from ..ir.graph import ModelGraph
from ..ir.semantics import Sizes
from ..runtime.memtrack import compare, track
from ..runtime.optim.hybrid8bit import Hybrid8bitAdamW
from ..runtime.optim.torch_adamw import TorchAdamW
from ..runtime.trainer import Trainer
from . import step_rates
from .step_rates import StepRates

#: micro-batches a step of the timing plan at least: each block's forward, recompute and backward run this often
N_MICRO = 2
#: on a GPU, seconds of forwards a timing step runs at least (a step's clocks) [ledger: calibrate-sustain]
SUSTAIN_S = 0.5
MAX_MICRO = 32
#: steps run before timing (allocator warm-up, cuDNN autotuning, lazy initialisation)
WARMUP = 1


def _log(verbose: bool, text: str) -> None:
    if verbose:
        print(f"[lazytrain calibrate] {text}", file=sys.stderr, flush=True)


def timing_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model's structure with random weights on the CPU, cut to three layers when they are alike."""
    kept = None
    if reducible(model):
        prefix, layers = find_layers(model)
        kept = {f"{prefix}.{i}.": f"{prefix}.{k}." for i, k in enumerate(kept_layers(len(layers)))}
    clone = meta_clone(model, dtype, keep=3 if kept else None)
    fresh: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for m in clone.modules():
            for name, p in list(m._parameters.items()):
                if p is None:
                    continue
                if id(p) not in fresh:      # tied parameters stay tied
                    t = torch.empty(p.shape, dtype=p.dtype)   # times do not depend on the values
                    t.normal_(0.0, 0.02) if t.dim() > 1 and t.is_floating_point() else t.fill_(1)
                    fresh[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                m._parameters[name] = fresh[id(p)]
    real = {n: b for n, b in model.named_buffers() if b.device.type != "meta"}
    for name, _ in list(clone.named_buffers()):
        source = name
        for short, full in (kept or {}).items():
            if name.startswith(short):
                source = full + name[len(short):]
        if source in real:      # else left on meta: the program rebuilds it from the config
            owner, _, attr = name.rpartition(".")
            clone.get_submodule(owner)._buffers[attr] = real[source].detach().clone()
    return clone


def _vocab(model: nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb = emb or next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError("calibration needs a causal LM with a token embedding (input_ids, labels)")
    return emb.num_embeddings


def timing_plan(model: nn.Module, *, micro_batch: int, **shape):
    """The plan the blocks are timed in: recompute-all (every block's forward, recompute and backward run) at
    ``N_MICRO`` micro-batches, on a GPU at as many more as its forwards need to last ``SUSTAIN_S`` (``sustained``);
    where that does not fit (a length near ``--seq max``, whose boundaries must leave the GPU), the MILP's plan,
    and then one micro-batch (the shape the user's own plan has, so it fits wherever that plan did; a block the
    MILP keeps is timed without recompute: its forward stands in)."""
    tries = [(n, policy) for n in (N_MICRO, 1) for policy in ("recompute-all", "milp")]
    for k, (n_micro, policy) in enumerate(tries):
        try:
            plan = compile_model(model, policy=policy, batch_size=micro_batch * n_micro, micro_batch=micro_batch,
                                 loss_head="recompute", **shape)     # the head the search plans with
        except BudgetError:
            if k == len(tries) - 1:
                raise
            continue
        more = sustained(plan, shape["hardware"])
        if more > n_micro:
            try:
                return compile_model(model, policy=policy, batch_size=micro_batch * more, micro_batch=micro_batch,
                                     loss_head="recompute", **shape)
            except BudgetError:
                pass
        return plan


def sustained(plan, hw: HardwareProfile) -> int:
    """Micro-batches a timing step of ``plan``'s shape takes on ``hw`` for its forwards to last ``SUSTAIN_S`` as
    modelled (at least the plan's own, at most ``MAX_MICRO``); a CPU's: its own (no clocks to load)."""
    n_micro = plan.batch_size // plan.micro_batch
    if not hw.has_gpu:
        return n_micro
    forward = sum(op.seconds for op in plan.ops if op.kind is OpKind.COMPUTE) / n_micro
    want = math.ceil(SUSTAIN_S / forward) if forward > 0 else MAX_MICRO
    return max(n_micro, min(MAX_MICRO, want))


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the timing steps measured: the blocks' programs, and the rates the host optimizer's updates and the
    parameter loads and gradient offloads reached in those steps (``step_rates.StepRates``; None where none ran)."""

    timings: list[BlockTiming]
    rates: StepRates | None = None

    def priced(self, hw: HardwareProfile, copies: bool) -> HardwareProfile:
        """``hw`` with the block timings and the host update rate, and with ``copies`` (a GPU's timing steps) the
        loads' and offloads' rates too: a CPU's "copies" are memcpys, not the PCIe the profile prices."""
        hw = hw.with_timings(self.timings)
        if self.rates is None:
            return hw
        rates = self.rates if copies else dataclasses.replace(self.rates, param_load_gbps=None,
                                                              grad_offload_gbps=None)
        return rates.apply(hw, where="a calibration step")


def measure_blocks(model: nn.Module, hw: HardwareProfile, **kw) -> list[BlockTiming]:
    """Forward, backward and recompute seconds of each distinct block of ``model`` (``measure``)."""
    return measure(model, hw, **kw).timings


def measure(model: nn.Module, hw: HardwareProfile, *, seq_len: int, micro_batch: int, param_dtype: str,
            device=None, gpu_memory=None, host_memory=None, seq_tile: int | None = None, repeats: int = 3,
            verbose: bool = True, compile_blocks: bool = False, optimizer: str = "adamw") -> Measured:
    """Forward, backward and recompute seconds of each distinct block of ``model`` at this micro-batch and
    sequence length, measured in LazyTrain's runtime on ``device`` (module docstring); ``compile_blocks``: the
    blocks run compiled (``frontend/compiled.py``), as the plan they calibrate will run them, and each cut of a
    block the compiler may choose is timed too (``cut_timings``).

    The steps run ``optimizer`` (at learning rate 0) on the host, so its updates are timed as a step runs them:
    beside the PCIe copies and the GPU's work, which share the host's memory bandwidth with it (alone, the update
    and the copies run measurably faster: [ledger: step-rates]).  The parameter loads and gradient offloads are
    read from the same steps (``step_rates.measure``)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, param_dtype)
    tm = timing_model(model, dtype)
    plan = timing_plan(tm, micro_batch=micro_batch, seq_len=seq_len, hardware=hw, gpu_memory=gpu_memory,
                       host_memory=host_memory, resident="none", param_dtype=param_dtype, optimizer=optimizer,
                       seq_tile=seq_tile, compile_blocks=compile_blocks, gpu_update="none")
    n_micro = plan.batch_size // micro_batch
    _log(verbose, f"timing {plan.graph.n_blocks} blocks of a {type(model).__name__} on {device}: micro-batch "
                  f"{micro_batch}, seq {seq_len}, {repeats} steps of {n_micro} micro-batch(es) after {WARMUP}")
    kinds = {OpKind.COMPUTE: "forward_s", OpKind.BACKWARD: "backward_s", OpKind.RECOMPUTE: "recompute_s"}
    batches = _Batches(plan, _vocab(tm))
    choice = Optimizer(optimizer)
    opt = (Hybrid8bitAdamW(lr=0.0, stochastic_rounding=choice.stochastic_rounding, moment_bits=choice.moment_bits)
           if choice.eight_bit else TorchAdamW(lr=0.0))
    trainer = Trainer(tm, plan, optimizer=opt, device=device, profile=True, verbose=False)
    profiles: list = []
    try:
        samples = _samples(trainer, plan, batches, repeats, lambda op: kinds.get(op.kind), profiles)
        workspace = measured_transients(trainer, plan, batches.next())
    finally:
        trainer.close()
    cuts = cut_timings(tm, plan, hw, device, repeats, verbose) if compile_blocks else {}
    out, sizes = [], Sizes.of_plan(plan)
    for j, b in enumerate(plan.graph.blocks):
        sig = plan.graph.block_signature(j)
        if any(t.signature == sig for t in out) or (sig, "forward_s") not in samples:
            continue
        fig = {k: statistics.median(samples[(sig, k)]) for k in kinds.values() if (sig, k) in samples}
        fig.setdefault("recompute_s", fig["forward_s"])
        out.append(BlockTiming(signature=sig, block=f"{b.name} ({b.kind}) of {type(model).__name__}",
                               micro_batch=micro_batch, seq_len=seq_len, samples=len(samples[(sig, "forward_s")]),
                               workspace_bytes=workspace.get((sig, "forward"), 0),
                               backward_workspace_bytes=workspace.get((sig, "backward"), 0),
                               cuts=cuts.get(sig, ()), **{k: max(v, 1e-9) for k, v in fig.items()}))
        _log(verbose, f"  {b.name}: forward {fig['forward_s'] * 1e3:.3f} ms, backward {fig['backward_s'] * 1e3:.3f}"
                      f" ms, recompute {fig['recompute_s'] * 1e3:.3f} ms; workspace forward "
                      f"{workspace.get((sig, 'forward'), 0) / 2**20:.1f} MiB (traced {sizes.workspace(j) / 2**20:.1f}),"
                      f" backward {workspace.get((sig, 'backward'), 0) / 2**20:.1f} MiB (traced "
                      f"{sizes.backward_workspace(j) / 2**20:.1f})")
    # the blocks' own scales are what this calibration sets, not a rate of these steps
    rates = dataclasses.replace(step_rates.measure(plan, profiles), forward_ratio=None, backward_ratio=None)
    cpu_note = "" if device.type == "cuda" else " (on the CPU only the host update's is priced: its copies are memcpys)"
    _log(verbose, f"  in the timing steps: {rates.describe(hw)}{cpu_note}")
    return Measured(out, rates)


class _Batches:
    """Random token batches of the plan's shape, the same sequence every calibration (seeded)."""

    def __init__(self, plan, vocab: int):
        self.shape, self.vocab = (plan.batch_size, plan.seq_len), vocab
        self.g = torch.Generator().manual_seed(0)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, self.vocab, self.shape, generator=self.g)
        return ids, ids


def _samples(trainer: Trainer, plan, batches: _Batches, repeats: int, figure,
             profiles: list | None = None) -> dict[tuple[str, str], list[float]]:
    """Seconds of every op that ``figure(op)`` names a figure of (None: not timed), by (block signature, figure),
    over ``repeats`` steps after ``WARMUP``; each timed step's ``StepProfile`` appended to ``profiles``."""
    by_id = {op.id: op for op in plan.ops}
    samples: dict[tuple[str, str], list[float]] = {}
    for step in range(WARMUP + repeats):
        trainer.step(batches.next())
        if step < WARMUP:
            continue
        if profiles is not None:
            profiles.append(trainer.last_profile)
        for i, _res, t0, t1 in trainer.last_profile.trace:
            op = by_id[i]
            name = figure(op)
            if name is not None:
                samples.setdefault((plan.graph.block_signature(op.block), name), []).append(t1 - t0)
    return samples


def cut_plan(plan, hw: HardwareProfile, k: int):
    """The timing plan with every block that offers a cut ``k`` (``Block.cuts``) saving at it: kept on the GPU,
    or offloaded to the host where that does not fit (a recomputed block runs the min-cut, ``Decisions.cut``).
    None when no block offers cut ``k`` or neither fits."""
    at = {j for j, b in enumerate(plan.graph.blocks) if len(b.cuts) > k}
    if not at:
        return None
    comp = Compiler(plan.graph, hw, plan.budgets, param_dtype=plan.param_dtype, optimizer=plan.options["optimizer"],
                    clip=plan.options["clip"], compile_blocks=True, base_bits=plan.options.get("base_bits", 16))
    d = plan.decisions
    for place in (Saved.KEEP, Saved.HOST):
        dec = dataclasses.replace(d, policy=f"{d.policy}, cut {k}",
                                  saved=tuple(place if j in at else s for j, s in enumerate(d.saved)),
                                  cut=tuple(k if j in at else 0 for j in range(len(d.saved))))
        try:
            return comp.build(dec, plan.batch_size)
        except PlanError:
            continue
    return None


def _cut_figure(op) -> str | None:
    """What a cut plan's op times: a forward that saves (at the block's cut), or a backward."""
    if op.kind is OpKind.BACKWARD:
        return "backward_s"
    return "forward_s" if op.kind is OpKind.COMPUTE and op.save else None


def cut_timings(tm: nn.Module, plan, hw: HardwareProfile, device, repeats: int,
                verbose: bool) -> dict[str, tuple[CutTiming, ...]]:
    """Per block signature, the timings of its cuts other than the min-cut (``CutTiming``): for each cut index,
    ``repeats`` steps of ``cut_plan`` (a Trainer of its own: its blocks compiled at that cut), each cut's forward
    from the forwards that save at it and its backward from the backwards."""
    out: dict[str, list[CutTiming]] = {}
    graph = plan.graph
    for k in range(1, max(len(b.cuts) for b in graph.blocks)):
        cp = cut_plan(plan, hw, k)
        if cp is None:
            _log(verbose, f"  cut {k}: no timing plan fits; those cuts stay modelled")
            continue
        at = {graph.block_signature(j): graph.blocks[j].cuts[k] for j in range(graph.n_blocks)
              if cp.decisions.cut_of(j)}
        trainer = Trainer(tm, cp, optimizer=TorchAdamW(lr=0.0), device=device, profile=True, verbose=False)
        try:
            samples = _samples(trainer, cp, _Batches(cp, _vocab(tm)), repeats, _cut_figure)
        finally:
            trainer.close()
        for sig, c in at.items():
            fwd, bwd = samples[(sig, "forward_s")], samples[(sig, "backward_s")]
            t = CutTiming(budget=c.budget, saved_bytes=c.saved_bytes, forward_s=max(statistics.median(fwd), 1e-9),
                          backward_s=max(statistics.median(bwd), 1e-9), samples=len(bwd))
            out.setdefault(sig, []).append(t)
            _log(verbose, f"  cut {k} (budget {c.budget:g}) of {sig}: forward {t.forward_s * 1e3:.3f} ms, backward "
                          f"{t.backward_s * 1e3:.3f} ms")
    return {sig: tuple(ts) for sig, ts in out.items()}


def measured_transients(trainer: Trainer, plan, batch) -> dict[tuple[str, str], int]:
    """Per (block signature, "forward" | "backward"), the workspace its forward and recompute, or its backward,
    were seen to need in one step of ``plan`` (device memory recorded op by op, ``runtime/memtrack.py``), in the
    terms of ``Sizes.workspace`` / ``Sizes.backward_workspace``: the traced figure plus how far the op's measured
    transient (its peak above the larger of the memory before and after it) exceeded the plan's (the same from
    verify's curve).  The largest over the step."""
    sizes = Sizes.of_plan(plan)
    with track(trainer) as mem:
        trainer.step(batch)
    out: dict[tuple[str, str], int] = {}
    for row in compare(plan, mem):
        op = row.op
        if op.kind in (OpKind.COMPUTE, OpKind.RECOMPUTE, OpKind.BACKWARD):
            backward = op.kind is OpKind.BACKWARD
            key = (plan.graph.block_signature(op.block), "backward" if backward else "forward")
            traced = sizes.backward_workspace(op.block) if backward else sizes.workspace(op.block)
            out[key] = max(out.get(key, 0), traced + max(0, row.transient_excess))
    return out


def missing(graph: ModelGraph, hw: HardwareProfile, micro_batch: int) -> list[int]:
    """Blocks of ``graph`` with no measured timing at ``micro_batch`` in ``hw``, or that offer cuts (compiled blocks)
    and whose timing has none (measured before cuts were timed)."""
    def timed(j: int) -> bool:
        t = hw.measured(graph.block_signature(j), micro_batch)
        return t is not None and (len(graph.blocks[j].cuts) < 2 or bool(t.cuts))
    return [j for j in range(graph.n_blocks) if not timed(j)]


def compile_calibrated(model, req: CompileRequest, *, verbose: bool = True):
    """The plan of ``req`` (``calibrate=True``) with the model's blocks measured on this machine at the micro-batch
    the plan uses (module docstring); a profile given as a file gets the measurements written into it."""
    if isinstance(model, ModelGraph):
        raise ValueError("calibrate=True needs the model (a module, preset or config), not a traced ModelGraph")
    if isinstance(model, str):
        model = build_model(model)
    hardware = req.hardware
    hw = get_profile(hardware)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if hw.has_gpu != (device.type == "cuda"):
        raise ValueError(f"calibrate=True times the blocks on this machine's {device.type}, but the hardware profile "
                         f"{hw.name!r} is {'a GPU' if hw.has_gpu else 'the CPU'}'s: give this machine's profile "
                         f"(`lazytrain profile -o hw.json`, or 'cpu' without a GPU)")
    tile = req.seq_tile if isinstance(req.seq_tile, int) else None
    graph = trace(model, seq_len=req.seq_len, dtype=req.param_dtype, seq_tile=tile, compile_blocks=req.compile_blocks)
    plan = compile_request(graph, dataclasses.replace(req, hardware=hw, calibrate=False))
    if missing(plan.graph, hw, plan.micro_batch):      # the graph as compiled (its loss head chosen)
        mb = plan.micro_batch
        m = measure(model, hw, seq_len=req.seq_len, micro_batch=mb, param_dtype=req.param_dtype, device=device,
                    gpu_memory=req.gpu_memory, seq_tile=tile, host_memory=req.host_memory, verbose=verbose,
                    compile_blocks=req.compile_blocks, optimizer=req.optimizer.value)
        hw = m.priced(hw, copies=device.type == "cuda")
        plan = compile_request(graph, dataclasses.replace(req, hardware=hw, calibrate=False, micro_batch=mb))
    if isinstance(hardware, (str, Path)) and Path(hardware).is_file():
        hw.save(hardware)
    return plan


def compile_measured(model, **kwargs):
    """``compile_model(model, **kwargs)`` with ``calibrate=True`` answered by ``compile_calibrated`` (the compiler
    alone does not run models): what ``lazytrain.compile`` and the CLI call where calibration is asked for."""
    with calibrating(lambda m, req: compile_calibrated(m, req)):
        return compile_model(model, **kwargs)
