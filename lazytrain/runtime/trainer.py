"""``Trainer``: runs a plan, step after step, with parameters and optimizer state on the host.

One ``step`` = stage the batch on the host, run the op list (``interpreter.run``) with a fresh
``handlers.Step``, then wait for the device, read the loss and finish the global gradient norm.  The
op list is one period of the steady state: an ``update`` placed before its block's ``grad_offload``
is *lagged* and applies the previous step's gradients (nothing on the first step); ``flush()``
applies what is still pending (call it before evaluating or saving; ``sync_to_model`` does).  All of
that is ``updates.Updates``'s; the trainer builds the run (``handlers.Run``) in named steps.

Exactness: with the same optimizer the parameters after n steps + ``flush`` equal those of eager
PyTorch training to rounding: gradients accumulate in fp32 per block over micro-batches, the head's
gradient is ``1 / valid tokens of the whole batch``, tied parameters get every reader's share
before their owner's update, and the clip coefficient comes from the global norm of the step.
Random draws (dropout): a recomputation replays its forward's generator state (``rng``), so the
gradients are those of the function that produced the loss; the masks differ from eager training's,
which draws them for the whole batch at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

from ..frontend.trace import build_program
from ..ir import OpKind, Plan, PlanError, TensorId, TensorKind, Tier, verify
from ..ir.ops import tensor_id
from ..ir.order import UpdateOrder
from ..ir.semantics import Sizes
from . import checkpoint, interpreter
from .batch import (
    as_tokens,
    check_positions,
    check_shapes,
    check_tokens,
    packed_keys,
    pad_batch,
    pad_positions,
    token_limits,
)
from .compute_device import compute_device, device_type
from .context import GpuParams, H, Run, Step
from .distributed import World, global_tokens
from .gpu_update import pin_state
from .interpreter import Schedule
from .nvme import NvmeStore
from .nvme_state import NvmeState
from .optim.clipping import GradNormTracker
from .optim.torch_adamw import TorchAdamW
from .profiling import Profiler, StepProfile
from .quantized import QuantizedSegment
from .shards import gathered_layouts, gathered_masters, init_shards, shard_layouts
from .store import BlockLayout, HostCopy, HostPool, HostStore, frozen_segment, layouts
from .streams import Streams
from .updates import Updates, check_clipping
from .validate import check_trainer_args
from .weights import ModelWeights, materialize

log = logging.getLogger("lazytrain")


@dataclass(frozen=True)
class StepStats:
    loss: float
    tokens: int            # tokens counted in the loss (labels not -100)
    step_s: float
    model_tflops: float    # 6 * active_params * batch * seq / step_s / 1e12 (all parameters but idle experts)
    grad_norm: float
    skipped: bool          # the step's update was skipped (non-finite gradient norm)
    tokens_per_s: float = 0.0  # input_tokens / step_s
    #: tokens the model ran forward and backward: batch x seq of the global batch, padding included (a batch has no
    #: attention mask to tell it, and a padded row costs the compute of a full one: what model_tflops counts)
    input_tokens: int = 0


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise PlanError(f"unknown dtype {name!r} in the plan")
    return dt


def _canonical_names(model: torch.nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


class Trainer:
    """Train ``model`` with ``plan``.  ``optimizer``: a ``HostOptimizer`` (default fp32 AdamW, lr 1e-5).
    ``device``: "cuda" (default when available) or "cpu" (CPU mode: same handlers, streams are
    no-ops; used to test every schedule against eager training)."""

    def __init__(self, model: torch.nn.Module, plan: Plan, optimizer=None, device=None, nvme_dir=None,
                 profile: bool = False, verbose: bool = True, weights=None):
        """``verbose``: print the host memory estimate (before allocating) and, for a plan with compiled blocks,
        what compiling them took, to stderr.  ``weights``: where the initial parameters come from
        (``weights.SafetensorsWeights``: only this rank's pieces are read, so ``model`` may be on the meta
        device); default, the model's own."""
        check_trainer_args(model, plan, optimizer, device)
        #: the data-parallel world (``distributed.World``; None for one process): joined before the
        #: device is chosen (a rank's GPU is its LOCAL_RANK's)
        self.world = World.start(device_type(device))
        plan.check_world_size(1 if self.world is None else self.world.size)
        self.device = compute_device(device)
        verify(plan)                  # a plan read back from a file or checkpoint is checked like a fresh one
        self.plan = plan
        self.model = model
        nvme = _nvme_store(plan, nvme_dir, None if self.world is None else self.world.rank)
        if weights is None and any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("the model's parameters are on the meta device: build it with real weights to train, "
                             "or pass weights= (a SafetensorsWeights of its folder)")
        weights = ModelWeights(model) if weights is None else weights
        param_dtype = _torch_dtype(plan.param_dtype)
        self._token_limits = token_limits(model, plan)
        self.program = _program(model, plan, self.device)
        if optimizer is None:
            optimizer = TorchAdamW(lr=1e-5)
        self.optimizer = optimizer
        frozen = _frozen(model, optimizer)
        order = UpdateOrder.of(plan.ops, Sizes.of_plan(plan))
        check_clipping(order, optimizer.max_grad_norm)
        gathered = None
        if self.world is not None:      # ZeRO-3: the host store holds this rank's shard of every block
            gathered = gathered_layouts(plan.graph, self.world.size)
            lays = shard_layouts(gathered, self.world.size, self.world.rank)
        else:
            lays = layouts(plan.graph, _canonical_names(model))
        self._gathered = gathered
        resident = plan.decisions.resident_blocks
        placed = Sizes.of_plan(plan).nvme if self.world is None else frozenset()
        self.store = _host_store(plan, lays, param_dtype, optimizer, pin=self.device.type == "cuda", verbose=verbose,
                                 placed=placed)
        pool = HostPool(self.device.type == "cuda")
        nvme_state = NvmeState(nvme, placed, self.store, optimizer, pool) if placed else None
        # a resident block's "load buffer" is its parameters on the GPU: the optimizer keeps its state
        # next to it and updates it in place there
        gpu_params = {j: torch.empty(lay.owned_numel, dtype=param_dtype, device=self.device)
                      for j, lay in enumerate(lays) if j in resident}
        buffers = {j: gpu_params.get(j, self.store.load[j]) for j in range(len(lays))}
        self._buffers = buffers             # each block's parameters (a frozen one's only copy)
        #: where a frozen base came from, as the caller says (``lazytrain train``: the model's name and files): a
        #: checkpoint records it beside the base's SHA-256 (``checkpoint.base_identity``), computed once
        self.base_source: dict | None = None
        self._base_sha256: str | None = None
        self._frozen_digests: dict[int, str] = {}
        self._dequantized: tuple[int, torch.Tensor] | None = None
        self.init_seconds = 0.0
        if self.world is not None:
            init_shards(weights, gathered, lays, self.world.size, self.world.rank, optimizer, buffers)
            # a resident block's shard stays on the GPU; gathered every step, it is a plan tensor
            params, targets = {}, {}
            grads = {j: torch.zeros(lays[j].owned_numel, dtype=torch.float32, device=self.device) for j in gpu_params}
        else:
            t_quant = time.perf_counter()
            #: each block's SHA-256 of its frozen values before quantizing (``checkpoint.base_identity``)
            self._frozen_digests = _init_parameters(weights, lays, optimizer, buffers, nvme_state, self.store,
                                                    int(plan.options.get("base_bits", 16)), self.device)
            #: seconds setting up the parameters, quantizing a quantized base included (``benchmarks/qlora_gpu.py``)
            self.init_seconds = time.perf_counter() - t_quant
            params, targets, grads = _resident(lays, gpu_params, self.device)
        streams = Streams(self.device, collectives=self.world is not None)
        tracker = GradNormTracker(optimizer.max_grad_norm)
        pin_state(plan, optimizer, pin=self.device.type == "cuda")    # GPU-updated blocks' state: page-locked
        updates = Updates(order, streams=streams, optimizer=optimizer, tracker=tracker, store=self.store,
                          resident_grad=grads, gpu_updated=plan.decisions.gpu_updated_blocks)
        updates.world = self.world
        updates.nvme_state = nvme_state
        rg = frozenset(t.name for b in self.program.graph.blocks for t in (*b.inputs, *b.outputs) if t.requires_grad)
        #: what compiling the block programs did (``frontend/compiled.py``); None when the plan runs them eager
        self.compile_report = _compile_blocks(self.program, plan, self.device, param_dtype, frozen, rg, verbose)
        self.ctx = Run(plan=plan, program=self.program, device=self.device, streams=streams, store=self.store,
                       pool=pool, nvme=nvme, nvme_state=nvme_state, optimizer=optimizer, tracker=tracker,
                       requires_grad=rg, frozen=frozen, resident=params, resident_targets=targets, updates=updates,
                       schedule=Schedule(plan, updates), world=self.world, gpu_layouts=gathered,
                       resident_shards=gpu_params if self.world is not None else {})
        self._profiler = Profiler(self.device.type == "cuda") if profile else None
        self.steps = 0
        self.last_profile: StepProfile | None = None
        self._broken: Exception | None = None

    @property
    def profile(self) -> bool:
        return self._profiler is not None

    @profile.setter
    def profile(self, on: bool) -> None:
        """Turn per-op timing on or off between steps (``last_profile`` keeps the last measured step)."""
        self._profiler = Profiler(self.device.type == "cuda") if on else None

    # ---- the step --------------------------------------------------------------------------------
    def _batch(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        mask = positions = None
        if isinstance(batch, dict):
            try:
                ids, labels = batch["input_ids"], batch["labels"]
            except KeyError as e:
                raise ValueError(f"batch dict needs 'input_ids' and 'labels' (missing {e.args[0]!r})") from None
            extra = sorted(set(batch) - {"input_ids", "labels", "attention_mask"} - packed_keys(self.program.packed))
            if extra:
                raise ValueError(f"batch has keys the plan does not take: {', '.join(extra)} (a plan runs the model on "
                                 "input_ids and labels, with an optional right-padding attention_mask; position_ids "
                                 "need a plan compiled with packed=True)")
            mask, positions = batch.get("attention_mask"), batch.get("position_ids")
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            ids, labels = batch
        else:
            raise ValueError("batch must be a dict with input_ids and labels, or an (input_ids, labels) tuple")
        ids, labels = as_tokens(ids, "input_ids"), as_tokens(labels, "labels")
        W = 1 if self.world is None else self.world.size
        B, S = self.plan.batch_size * W, self.plan.seq_len      # the global batch: every rank gets all of it
        check_shapes(ids, labels, B, S)
        if self._token_limits is not None:
            ids, labels = check_tokens(ids, labels, mask, *self._token_limits)
        if positions is not None:
            positions = pad_positions(check_positions(positions, ids), B, S)
        ids, labels = pad_batch(ids.long(), labels.long(), B, S)
        if self.world is not None:
            self._global_tokens = global_tokens(self.program, labels, self.plan.n_micro * W)
            rows = slice(self.world.rank * self.plan.batch_size, (self.world.rank + 1) * self.plan.batch_size)
            ids, labels = ids[rows], labels[rows]
            positions = None if positions is None else positions[rows]
        return ids, labels, positions

    def step(self, batch) -> StepStats:
        if self._broken is not None:
            raise RuntimeError("a previous step failed; the trainer's state is inconsistent: "
                               "build a new Trainer") from self._broken
        ids, labels, positions = self._batch(batch)
        if self.world is not None:
            self.world.mark_step(self.steps + 1)
        run = self.ctx
        t0 = time.perf_counter()
        step = Step(run=run, profiler=self._profiler)
        run.updates.begin_step(getattr(self.optimizer, "lr", None), step)
        if step.profiler is not None:
            step.profiler.begin_step()
            t0 = time.perf_counter()
        batch_ids = self._stage_batch(step, ids, labels, positions)
        if self.world is not None:       # the head's gradient is 1 / valid tokens of the global batch
            step.inv_tokens = 1.0 / torch.as_tensor(self._global_tokens, dtype=torch.float64).clamp_min(1)
        try:
            interpreter.run(step)
            run.streams.synchronize()     # the step's device work (updates may still run on the host)
            for i in run.schedule.host_io:   # NVMe work of this step (writes, deletes) must be done
                fut = step.done.get(i)
                if fut is not None:
                    fut.result()
            coef = run.updates.coefficient(step)
            run.updates.carry(step)
        except Exception as e:
            self._broken = e
            raise
        for t in batch_ids:
            for v in step.copies.pop((t, H)).values():
                if isinstance(v, HostCopy):
                    run.pool.release(v.buf)
        leftovers = [f"{t} on {tier.value}" for t, tier in step.copies]
        if leftovers:
            self._broken = RuntimeError(f"step ended with copies still resident: {leftovers[:5]}")
            raise self._broken
        skipped = run.updates.end_step(coef)
        parts = torch.stack([torch.as_tensor(x, device=self.device).to(torch.float64)
                             for pair in step.loss_parts.values() for x in pair]).tolist()   # one read
        loss_sum, n_tok = sum(parts[0::2]), int(sum(parts[1::2]))
        if self.world is not None:       # the global batch's loss (reporting only)
            loss_sum, n_tok = self.world.sum_floats([loss_sum, n_tok], "all_reduce of the step's loss")
            n_tok = int(n_tok)
        step_s = time.perf_counter() - t0
        self.steps += 1
        B, S = self.plan.batch_size * (1 if self.world is None else self.world.size), self.plan.seq_len
        if step.profiler is not None:
            self.last_profile = step.profiler.finish(step_s)
        norm = run.tracker.last_norm
        return StepStats(loss=loss_sum / max(n_tok, 1), tokens=n_tok, step_s=step_s,
                         model_tflops=6 * self.plan.graph.active_params * B * S / step_s / 1e12,
                         grad_norm=float("nan") if norm is None else norm, skipped=skipped,
                         tokens_per_s=B * S / step_s, input_tokens=B * S)

    def _stage_batch(self, step: Step, ids: torch.Tensor, labels: torch.Tensor,
                     positions: torch.Tensor | None) -> list[TensorId]:
        """The batch's micro-batches onto the host, as ``act[0] mbM`` (what ``reload act[0]`` copies)."""
        mb = self.plan.micro_batch
        out = []
        for m in range(self.plan.n_micro):
            part = slice(m * mb, (m + 1) * mb)
            vals = self.program.batch_inputs(ids[part], labels[part], None if positions is None else positions[part])
            t = tensor_id(TensorKind.ACT, 0, m)
            step.put(t, H, {k: self._stage(v) for k, v in vals.items()})
            out.append(t)
        return out

    def _stage(self, v):
        """A batch value into a (pinned) pool buffer on the host: what ``reload act[0]`` copies."""
        if not isinstance(v, torch.Tensor):
            return v
        v = v.contiguous()
        buf = self.ctx.pool.acquire(v.numel() * v.element_size())
        typed = buf.view(v.dtype).view(v.shape)
        typed.copy_(v)
        return HostCopy(buf, typed)

    # ---- between steps ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply the pending lagged updates (last step's gradients) now and wait for every update."""
        self.ctx.updates.flush()

    def state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Current fp32 master weights by parameter name (pending updates applied first).  With several
        ranks every rank must call it (the shards are gathered); ``keep`` False: an empty dict (this rank
        takes part but needs no copy)."""
        self.flush()
        if self.world is not None:
            return gathered_masters(self.world, self._gathered, self.optimizer.master, keep)
        out = {}
        for j, lay in enumerate(self.store.layouts):
            if not lay.owned_numel:
                continue
            with self._installed(j):        # (state kept on NVMe: brought in for the read)
                master = self.optimizer.master(j) if lay.trainable_numel else None
                for s in lay.segments:
                    if s.offset < lay.trainable_numel:
                        out[s.name] = master[s.offset:s.offset + s.numel].view(s.shape).clone()
                    elif s.offset < lay.owned_numel:     # frozen: its load buffer is all there is of it
                        out[s.name] = self.frozen_param(j, s).to("cpu", torch.float32)
        return out

    def frozen_param(self, j: int, seg) -> torch.Tensor:
        """Frozen parameter ``seg`` (a ``store.Segment`` of block j's layout) as the blocks compute with it, in the
        parameter dtype: a quantized base's dequantized values (the last block's kept, so reading a block's
        parameters one after another dequantizes it once)."""
        lay = self.store.layouts[j]
        if j not in self.store.quant:
            return self._buffers[j][seg.offset:seg.offset + seg.numel].view(seg.shape)
        if self._dequantized is None or self._dequantized[0] != j:
            self._dequantized = (j, self.store.frozen_values(j))
        at = seg.offset - lay.trainable_numel
        return self._dequantized[1][at:at + seg.numel].view(seg.shape)

    def _installed(self, j: int, write_back: bool = False):
        """Block j's state in the host store and the optimizer while the ``with`` lasts, wherever it lives
        (``nvme_state.NvmeState.installed``)."""
        ns = self.ctx.nvme_state
        return contextlib.nullcontext() if ns is None else ns.installed(j, write_back=write_back)

    def sync_to_model(self, keep: bool = True) -> None:
        """Write the current master weights into the model's parameters (after ``flush``); a model built on
        the meta device is made real first (``weights.materialize``).  With several ranks a collective:
        ``keep`` False on a rank that needs no model (it holds one block at a time, its model untouched)."""
        sd = self.state_dict(keep)
        if not keep:
            return
        materialize(self.model)
        named = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, v in sd.items():
                named[name].copy_(v)

    def save_checkpoint(self, directory) -> None:
        """Flush pending updates and write the training state to ``directory`` atomically (safetensors + JSON)."""
        checkpoint.save(self, directory)

    @classmethod
    def load_checkpoint(cls, directory, model: torch.nn.Module, *, optimizer=None, device=None,
                        plan: Plan | None = None, verbose: bool = True, weights=None, nvme_dir=None) -> Trainer:
        """A trainer for ``model`` resumed from ``directory`` (parameters, optimizer state, step, RNGs).
        ``optimizer``: default, rebuilt from the checkpoint; ``plan``: default, the checkpoint's own; ``weights``:
        ``weights.CheckpointFilled`` for a model on the meta device (nothing of it is read); ``nvme_dir``: the NVMe
        folder, default the plan's (state kept there is rebuilt from the checkpoint)."""
        return checkpoint.load(cls, directory, model, optimizer=optimizer, device=device, plan=plan, verbose=verbose,
                               weights=weights, nvme_dir=nvme_dir)

    def close(self) -> None:
        self.flush()
        self.ctx.streams.close()
        if self.world is not None:
            self.world.close()
        self.ctx.updates.close()
        if self.ctx.nvme_state is not None:     # scratch: a checkpoint holds what they held
            self.ctx.nvme_state.close()
        if self.ctx.nvme is not None:
            self.ctx.nvme.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- the trainer's construction, in steps ----------------------------------------------------------
def _nvme_store(plan: Plan, nvme_dir, rank: int | None) -> NvmeStore | None:
    """The NVMe folder, checked (writable, room for the plan's NVMe peak) before anything is allocated.  Each
    of several ranks writes into its own ``rankRRRR`` folder in it: they run one plan, so they would name
    their files alike."""
    if not any(Tier.NVME in (op.src, op.dst) for op in plan.ops) and not plan.decisions.nvme_state:
        return None
    root = nvme_dir or plan.budgets.get("nvme_dir")
    if root is not None and rank is not None:
        root = os.path.join(root, f"rank{rank:04d}")
    return NvmeStore(root, need_bytes=int(plan.predicted.get("peak_nvme_bytes", 0)))


def _program(model: torch.nn.Module, plan: Plan, device: torch.device):
    """The model's per-block program (``frontend.program``), refused unless it is the plan's model."""
    program = build_program(model, micro_batch=plan.micro_batch, seq_len=plan.seq_len, device=device,
                            dtype=_torch_dtype(plan.graph.dtype), packed=bool(plan.graph.meta.get("packed")),
                            seq_tile=(plan.graph.meta.get("seq_tile") or {}).get("tokens"),
                            **_loss_chunk(plan))
    have = program.graph.fingerprint()
    if have != plan.fingerprint:
        raise PlanError(f"the plan was compiled for another model (plan {plan.graph.name}, fingerprint "
                        f"{plan.fingerprint}; this model's fingerprint is {have}): compile a plan for this model")
    return program


def _compile_blocks(program, plan: Plan, device: torch.device, param_dtype: torch.dtype, frozen: frozenset[str],
                    requires_grad: frozenset[str], verbose: bool):
    """Compile the program's blocks when the plan asks for it (``compile(..., compile_blocks=True)``), each at
    the cut the plan chose for it (``Decisions.cut``), with the forward that saves nothing for the blocks the plan
    runs so (a recomputed block's first forward)."""
    if not plan.options.get("compile_blocks"):
        return None
    infer = {op.block for op in plan.ops if op.kind is OpKind.COMPUTE and not op.save}
    dec, blocks = plan.decisions, plan.graph.blocks
    budgets = {j: blocks[j].cuts[dec.cut_of(j)].budget for j in range(len(blocks)) if dec.cut_of(j)}
    report = program.compile(device, param_dtype=param_dtype, frozen=frozen, requires_grad=requires_grad,
                             infer=infer, budgets=budgets)
    report.saved_vs_plan = _saved_vs_plan(program, plan)
    log.info("%s", report.line())
    if verbose:
        print(f"[lazytrain] {report.line()}", file=sys.stderr)
    return report


def _saved_vs_plan(program, plan: Plan) -> float:
    """The largest ratio of what a compiled block's partition on this device saves to what the plan counted for
    ``saved[j]`` (traced on ``meta``: grouped-query attention there repeats K and V, so it counts more)."""
    from ..frontend.compiled import saved_bytes
    sizes = Sizes.of_plan(plan)
    ratios = [saved_bytes(cb.part, len(program.blocks[j].param_names))
              / max(sizes.of(TensorId(kind=TensorKind.SAVED, index=j)), 1) for j, cb in program.compiled.items()]
    return max(ratios, default=0.0)


def _loss_chunk(plan: Plan) -> dict:
    """The fused loss head's chunk and pass the compiler chose (``compiler/loss_chunk.py``), where the plan names
    them."""
    head = plan.graph.meta.get("loss_head")
    chunk = head.get("chunk_logits") if isinstance(head, dict) else None
    if type(chunk) is not int or chunk < 1:
        return {}
    return {"loss_chunk_logits": chunk, "loss_single_pass": head.get("single_pass") is True}


def _frozen(model: torch.nn.Module, optimizer) -> frozenset[str]:
    """Parameters with requires_grad=False.  They get no gradient: a zero gradient leaves AdamW's state at
    zero and the weight as it is, unless weight decay shrinks it (eager AdamW skips them): refused.  (A plan
    compiled with them frozen has no state or gradient buffer for them: its fingerprint names them, so a model
    that trains them is refused as another model.)"""
    frozen = frozenset(n for n, p in model.named_parameters() if not p.requires_grad)
    if frozen and getattr(optimizer, "weight_decay", 0.0):
        names = sorted(frozen)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise ValueError(f"the model has frozen parameters ({', '.join(names[:3])}{more}) "
                         f"and the optimizer decays weights (weight_decay={optimizer.weight_decay}): the "
                         "plan's update would shrink them; use weight_decay=0, or unfreeze them")
    return frozen


def _host_store(plan: Plan, lays: list[BlockLayout], param_dtype: torch.dtype, optimizer, *, pin: bool,
                verbose: bool, placed: frozenset = frozenset()) -> HostStore:
    """The host buffers, sized for the optimizer and the plan's offloaded activations (and host copies of the state
    it keeps on NVMe, ``placed``), checked first."""
    pred = plan.predicted
    act_bytes = max(0, int(pred.get("peak_host_bytes", 0)) - int(pred.get("host_static_bytes", 0)))
    pb = torch.empty((), dtype=param_dtype).element_size()
    opt_bpp = max(0.0, float(getattr(optimizer, "host_bytes_per_param", 16.0)) - 2 * min(pb, 2))
    return HostStore(lays, param_dtype, pin=pin, optimizer_bytes_per_param=opt_bpp, activation_bytes=act_bytes,
                     resident=plan.decisions.resident_blocks, placed=placed,
                     announce=(lambda line: print(line, file=sys.stderr)) if verbose else None,
                     base_bits=int(plan.options.get("base_bits", 16)))


def _init_parameters(weights, lays: list[BlockLayout], optimizer, buffers: dict[int, torch.Tensor],
                     nvme_state: NvmeState | None = None, store: HostStore | None = None,
                     base_bits: int = 16, device: torch.device | None = None) -> dict[int, str]:
    """Each block's owned parameters (``weights.piece``) into its load buffer (``buffers``: host, or a
    resident block's GPU buffer), and the optimizer's state for it; a block with state kept on NVMe gets a load
    buffer for its set-up only, and its placed state goes to its files (one block's state in memory at a time).

    A quantized base (``base_bits`` 8 or 4): a streamed block's frozen segment is quantized into the store's packed
    buffer (``HostStore.fill_frozen``, on ``device`` when it is a GPU, one block's temporaries at a time); a
    resident block's holds the same values dequantized (what a load would give it).  Returns each block's SHA-256
    of its frozen values in the parameter dtype before quantizing: the base's identity (``checkpoint``), the same
    whatever ``base_bits``, and deterministic quantization makes a resume's packed base the saved run's."""
    digests: dict[int, str] = {}
    quant_device = device if device is not None and device.type == "cuda" else None
    for j, lay in enumerate(lays):
        if not lay.owned_numel:
            continue
        init = torch.empty(lay.owned_numel, dtype=torch.float32)
        for s in lay.segments:
            if s.offset >= lay.owned_numel:
                break
            init[s.offset:s.offset + s.numel].copy_(weights.piece(s.name, 0, s.numel))
        buf = buffers[j]
        placed = nvme_state is not None and j in nvme_state.blocks
        if placed and nvme_state.has(TensorKind.PARAMS, j):
            buf = nvme_state.store.load[j] = torch.empty(lay.owned_numel, dtype=buf.dtype)
        if base_bits != 16 and lay.owned_numel > lay.trainable_numel:
            n = lay.trainable_numel
            frozen = init[n:].to(buf.dtype)
            digests[j] = hashlib.sha256(frozen.contiguous().view(torch.uint8).numpy()).hexdigest()
            if j in store.quant:
                store.fill_frozen(j, frozen, quant_device)
            else:               # resident: the values a load of the quantized segment would write
                seg = frozen_segment(lay, base_bits, buf.dtype)
                frozen = QuantizedSegment.quantize(frozen, base_bits, seg.block_size, seg.pieces,
                                                   device=quant_device).dequantize(buf.device)
                buf[n:].copy_(frozen)
            buf[:n].copy_(init[:n])
        else:
            buf.copy_(init)
        n = lay.trainable_numel            # the optimizer keeps state for the trainable prefix only
        if n:
            optimizer.setup(j, init[:n], buf[:n], lay.opt_segments())
        if placed:
            nvme_state.take_block(j)
    return digests


def _resident(lays: list[BlockLayout], gpu_params: dict[int, torch.Tensor], device: torch.device):
    """Resident blocks' parameters, gradient targets and accumulators: own parameters are views of the
    block's GPU buffer, tied links views of the owner's; gradients add into the owner's accumulator."""
    grads = {j: torch.zeros(lays[j].trainable_numel, dtype=torch.float32, device=device) for j in gpu_params}
    params: dict[int, GpuParams] = {}
    targets: dict[int, dict[str, torch.Tensor]] = {}
    for j, flat in gpu_params.items():
        lay = lays[j]
        views = {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in lay.segments
                 if s.offset < lay.owned_numel}
        targets[j] = {s.name: grads[j][s.offset:s.offset + s.numel] for s in lay.segments
                      if s.offset < lay.trainable_numel}
        extra = []
        for seg, owner, off in lay.links:
            views[seg.name] = gpu_params[owner][off:off + seg.numel].view(seg.shape)
            if off < lays[owner].trainable_numel:
                targets[j][seg.name] = grads[owner][off:off + seg.numel]
            if all(t is not gpu_params[owner] for t in extra):
                extra.append(gpu_params[owner])
        params[j] = GpuParams(flat, views, tuple(extra))
    return params, targets, grads
