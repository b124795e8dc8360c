"""``Trainer``: runs a plan, step after step, with parameters and optimizer state on the host.

One ``step`` = stage the batch on the host, run the op list (``interpreter.run``), then wait for
the device, read the loss and finish the global gradient norm.  The op list is one period of the
steady state: an ``update`` placed before its block's ``grad_offload`` is *lagged* and applies the
previous step's gradients (nothing on the first step); ``flush()`` applies what is still pending
(call it before evaluating or saving; ``sync_to_model`` does).

Exactness: with the same optimizer the parameters after n steps + ``flush`` equal those of eager
PyTorch training to rounding: gradients accumulate in fp32 per block over micro-batches, the head's
gradient is ``1 / valid tokens of the whole batch``, tied parameters get every reader's share
before their owner's update, and the clip coefficient comes from the global norm of the step.
Random draws (dropout): a recomputation replays its forward's generator state (``rng``), so the
gradients are those of the function that produced the loss; the masks differ from eager training's,
which draws them for the whole batch at once.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import torch

from ..ir import OpKind, Plan, PlanError
from . import gradients as gr
from . import handlers as h
from .batch import check_tokens, pad_batch, token_limits
from .handlers import Ctx, HostCopy
from .interpreter import run
from .nvme import NvmeStore
from .optim.clipping import GradNormTracker
from .profiling import Profiler, StepProfile
from .store import HostPool, HostStore, layouts

log = logging.getLogger("lazytrain")


@dataclass(frozen=True)
class StepStats:
    loss: float
    tokens: int            # tokens counted in the loss (labels not -100)
    step_s: float
    model_tflops: float    # 6 * total_params * batch * seq / step_s / 1e12
    grad_norm: float
    skipped: bool          # the step's update was skipped (non-finite gradient norm)
    tokens_per_s: float = 0.0


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
                 profile: bool = False, verbose: bool = True):
        """``verbose``: print the host memory estimate (before allocating) to stderr."""
        from ..compiler.program import build_program
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            _expandable_segments()
        from ..ir import verify
        verify(plan)                  # a plan read back from a file or checkpoint is checked like a fresh one
        self.plan = plan
        self.model = model
        uses_nvme = any("nvme" in (op.src and op.src.value, op.dst and op.dst.value) for op in plan.ops)
        # the NVMe folder is checked (writable, room for the plan's NVMe peak) before anything is allocated
        nvme = NvmeStore(nvme_dir or plan.budgets.get("nvme_dir"),
                         need_bytes=int(plan.predicted.get("peak_nvme_bytes", 0))) if uses_nvme else None
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("the model's parameters are on the meta device: build it with real weights to train")
        param_dtype = _torch_dtype(plan.param_dtype)
        self._token_limits = token_limits(model, plan)
        self.program = build_program(model, micro_batch=plan.micro_batch, seq_len=plan.seq_len, device=self.device,
                                     dtype=_torch_dtype(plan.graph.dtype),
                                     seq_tile=(plan.graph.meta.get("seq_tile") or {}).get("tokens"))
        have = self.program.graph.fingerprint()
        if have != plan.fingerprint:
            raise PlanError(f"the plan was compiled for another model (plan {plan.graph.name}, fingerprint "
                            f"{plan.fingerprint}; this model's fingerprint is {have}): compile a plan for this model")
        if optimizer is None:
            from .optim.torch_adamw import TorchAdamW
            optimizer = TorchAdamW(lr=1e-5)
        self.optimizer = optimizer
        # frozen parameters get no gradient: a zero gradient leaves AdamW's state at zero and the weight
        # as it is, unless weight decay shrinks it (eager AdamW skips them), so that case is refused
        frozen = frozenset(n for n, p in model.named_parameters() if not p.requires_grad)
        if frozen and getattr(optimizer, "weight_decay", 0.0):
            names = sorted(frozen)
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise ValueError(f"the model has frozen parameters ({', '.join(names[:3])}{more}) "
                             f"and the optimizer decays weights (weight_decay={optimizer.weight_decay}): the "
                             "plan's update would shrink them; use weight_decay=0, or unfreeze them")
        g = plan.graph
        L = g.n_blocks
        # which updates are lagged, and is the global norm known before every update?
        pos = {op.block: op.id for op in plan.ops if op.kind is OpKind.GRAD_OFFLOAD}
        last_grad = max(pos.values(), default=-1)
        lagged, norm_first = {}, True
        resident = plan.decisions.resident_blocks
        for op in plan.ops:
            if op.kind is OpKind.UPDATE and op.block in resident:
                lagged[op.block] = True          # at the next step's start, on the GPU
            elif op.kind is OpKind.UPDATE:
                contrib = [b.index for b in g.blocks if any(p.owner == op.block for p in b.params)]
                lagged[op.block] = all(pos[c] > op.id for c in contrib)
                if not lagged[op.block] and op.id < last_grad:
                    norm_first = False
        if optimizer.max_grad_norm is not None and not norm_first:
            raise PlanError("the optimizer clips gradients (max_grad_norm set) but this plan updates some blocks "
                            "before the whole backward is done, when the global norm is not known yet: compile "
                            "the plan with clip=True")
        lays = layouts(g, _canonical_names(model))
        pin = self.device.type == "cuda"
        pred = plan.predicted
        act_bytes = max(0, int(pred.get("peak_host_bytes", 0)) - int(pred.get("host_static_bytes", 0)))
        pb = torch.empty((), dtype=param_dtype).element_size()
        opt_bpp = max(0.0, float(getattr(optimizer, "host_bytes_per_param", 16.0)) - 2 * min(pb, 2))
        self.store = HostStore(lays, param_dtype, pin=pin, optimizer_bytes_per_param=opt_bpp,
                               activation_bytes=act_bytes, resident=resident,
                               announce=(lambda line: print(line, file=sys.stderr)) if verbose else None)
        # a resident block's "load buffer" is its parameters on the GPU: the optimizer keeps its state
        # next to it and updates it in place there
        gpu_params = {j: torch.empty(lay.owned_numel, dtype=param_dtype, device=self.device)
                      for j, lay in enumerate(lays) if j in resident}
        named = dict(model.named_parameters(remove_duplicate=False))
        sd = None
        for j, lay in enumerate(lays):
            if not lay.owned_numel:
                continue
            init = torch.empty(lay.owned_numel, dtype=torch.float32)
            for s in lay.segments:
                if s.offset >= lay.owned_numel:
                    break
                src = named.get(s.name)
                if src is None:
                    sd = sd if sd is not None else model.state_dict()
                    src = sd[s.name]
                init[s.offset:s.offset + s.numel].copy_(src.detach().reshape(-1))
            buf = gpu_params.get(j, self.store.load[j])
            buf.copy_(init)
            optimizer.setup(j, init, buf, lay.opt_segments())
        from .streams import Streams
        rg = {t.name for b in self.program.graph.blocks for t in (*b.inputs, *b.outputs) if t.requires_grad}
        self.ctx = Ctx(plan=plan, program=self.program, device=self.device, streams=Streams(self.device),
                       store=self.store, pool=HostPool(pin), nvme=nvme, optimizer=optimizer,
                       tracker=GradNormTracker(optimizer.max_grad_norm), lagged=lagged, norm_first=norm_first,
                       requires_grad=rg, frozen=frozen,
                       profiler=Profiler(self.device.type == "cuda") if profile else None)
        self._setup_resident(gpu_params)
        self.steps = 0
        self.last_profile: StepProfile | None = None
        self._broken: Exception | None = None
        self._L = L

    def _setup_resident(self, gpu_params: dict[int, torch.Tensor]) -> None:
        """Views and gradient targets of resident blocks: own parameters are views of the block's
        GPU buffer, tied links views of the owner's; gradients add into the owner's accumulator."""
        ctx, lays = self.ctx, self.store.layouts
        for j in gpu_params:
            ctx.resident_grad[j] = torch.zeros(lays[j].owned_numel, dtype=torch.float32, device=self.device)
        for j in gpu_params:
            lay = lays[j]
            flat = gpu_params[j]
            views = {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in lay.segments
                     if s.offset < lay.owned_numel}
            targets = {s.name: ctx.resident_grad[j][s.offset:s.offset + s.numel] for s in lay.segments
                       if s.offset < lay.owned_numel}
            extra = []
            for seg, owner, off in lay.links:
                views[seg.name] = gpu_params[owner][off:off + seg.numel].view(seg.shape)
                targets[seg.name] = ctx.resident_grad[owner][off:off + seg.numel]
                if all(t is not gpu_params[owner] for t in extra):
                    extra.append(gpu_params[owner])
            ctx.resident[j] = h.GpuParams(flat, views, tuple(extra))
            ctx.resident_targets[j] = targets

    @property
    def profile(self) -> bool:
        return self.ctx.profiler is not None

    @profile.setter
    def profile(self, on: bool) -> None:
        """Turn per-op timing on or off between steps (``last_profile`` keeps the last measured step)."""
        self.ctx.profiler = Profiler(self.device.type == "cuda") if on else None

    # ---- the step --------------------------------------------------------------------------------
    def _batch(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        mask = None
        if isinstance(batch, dict):
            try:
                ids, labels = batch["input_ids"], batch["labels"]
            except KeyError as e:
                raise ValueError(f"batch dict needs 'input_ids' and 'labels' (missing {e.args[0]!r})") from None
            extra = sorted(set(batch) - {"input_ids", "labels", "attention_mask"})
            if extra:
                raise ValueError(f"batch has keys the plan does not take: {', '.join(extra)} (a plan runs the model on "
                                 "input_ids and labels, with an optional right-padding attention_mask)")
            mask = batch.get("attention_mask")
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            ids, labels = batch
        else:
            raise ValueError("batch must be a dict with input_ids and labels, or an (input_ids, labels) tuple")
        ids, labels = torch.as_tensor(ids), torch.as_tensor(labels)
        B, S = self.plan.batch_size, self.plan.seq_len
        for name, t in (("input_ids", ids), ("labels", labels)):
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D [batch, seq], got shape {tuple(t.shape)}")
            if t.shape[1] > S:
                raise ValueError(f"{name} has sequence length {t.shape[1]} but the plan was compiled for seq_len "
                                 f"{S}: recompile the plan with seq_len={t.shape[1]} (or truncate the batch)")
            if t.shape[0] > B:
                raise ValueError(f"{name} has {t.shape[0]} rows but the plan was compiled for batch {B}: split the "
                                 f"batch, or recompile with batch_size={t.shape[0]}")
        if ids.shape != labels.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} differ in shape")
        if self._token_limits is not None:
            ids, labels = check_tokens(ids, labels, mask, *self._token_limits)
        return pad_batch(ids.long(), labels.long(), B, S)

    def step(self, batch) -> StepStats:
        if self._broken is not None:
            raise RuntimeError("a previous step failed; the trainer's state is inconsistent: "
                               "build a new Trainer") from self._broken
        ids, labels = self._batch(batch)
        ctx = self.ctx
        t0 = time.perf_counter()
        ctx.step_lr = getattr(self.optimizer, "lr", None)   # this step's gradients are applied at this rate
        # an assembled tied gradient is last step's: only a lagged update (of last step's) may use it
        ctx.tied_ready = {o for o in ctx.tied_ready if ctx.lagged[o]}
        if ctx.profiler is not None:
            ctx.profiler.begin_step()
            t0 = time.perf_counter()
        mb = self.plan.micro_batch
        batch_ids = []
        for m in range(self.plan.n_micro):
            vals = self.program.batch_inputs(ids[m * mb:(m + 1) * mb], labels[m * mb:(m + 1) * mb])
            t = h._tid(h.TensorKind.ACT, 0, m)
            ctx.put(t, h.H, {k: self._stage(v) for k, v in vals.items()})
            batch_ids.append(t)
        ctx.done, ctx.grad_sq, ctx.loss_parts, ctx.rng_states = {}, {}, {}, {}
        ctx.inv_tokens, ctx.coef, ctx.norm_done = None, None, False
        try:
            run(ctx, self.plan.ops)
            ctx.streams.synchronize()     # the step's device work (updates may still run on the host)
            for i in ctx.schedule.host_io:   # NVMe work of this step (writes, deletes) must be done
                fut = ctx.done.get(i)
                if fut is not None:
                    fut.result()
            coef = gr.finish_norm(ctx)
        except Exception as e:
            self._broken = e
            raise
        for t in batch_ids:
            for v in ctx.copies.pop((t, h.H)).values():
                if isinstance(v, HostCopy):
                    ctx.pool.release(v.buf)
        leftovers = [f"{t} on {tier.value}" for t, tier in ctx.copies]
        if leftovers:
            self._broken = RuntimeError(f"step ended with copies still resident: {leftovers[:5]}")
            raise self._broken
        lagged_owners = {b for b, lag in ctx.lagged.items() if lag}
        skipped = coef is None and ctx.norm_first
        ctx.pending = set() if coef is None else lagged_owners
        ctx.pending_coef, ctx.pending_lr = coef, ctx.step_lr
        parts = torch.stack([torch.as_tensor(x, device=self.device).to(torch.float64)
                             for pair in ctx.loss_parts.values() for x in pair]).tolist()   # one read
        loss_sum, n_tok = sum(parts[0::2]), int(sum(parts[1::2]))
        step_s = time.perf_counter() - t0
        self.steps += 1
        B, S = self.plan.batch_size, self.plan.seq_len
        if ctx.profiler is not None:
            self.last_profile = ctx.profiler.finish(step_s)
        norm = ctx.tracker.last_norm
        return StepStats(loss=loss_sum / max(n_tok, 1), tokens=n_tok, step_s=step_s,
                         model_tflops=6 * self.plan.graph.total_params * B * S / step_s / 1e12,
                         grad_norm=float("nan") if norm is None else norm, skipped=skipped,
                         tokens_per_s=B * S / step_s)

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
        ctx = self.ctx
        if ctx.pending and ctx.pending_coef is not None:
            from ..ir import Op, Resource
            for o in sorted(ctx.pending):
                if o in ctx.resident_grad:
                    gr.resident_update(ctx, o, ctx.pending_coef, ctx.pending_lr)
                    continue
                op = Op(id=-1 - o, kind=OpKind.UPDATE, block=o, resource=Resource.CPU)
                gr.run_update(ctx, op, o, ctx.pending_coef, ctx.pending_lr)
            ctx.streams.synchronize()
        ctx.pending = set()
        for fut in list(ctx.update_futures.values()):
            fut.result()
        ctx.update_futures.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current fp32 master weights by parameter name (pending updates applied first)."""
        self.flush()
        out = {}
        for j, lay in enumerate(self.store.layouts):
            if not lay.owned_numel:
                continue
            master = self.optimizer.master(j)
            for s in lay.segments:
                if s.offset < lay.owned_numel:
                    out[s.name] = master[s.offset:s.offset + s.numel].view(s.shape).clone()
        return out

    def sync_to_model(self) -> None:
        """Write the current master weights into the model's parameters (after ``flush``)."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, v in self.state_dict().items():
                named[name].copy_(v)

    def save_checkpoint(self, directory) -> None:
        """Flush pending updates and write the whole training state to ``directory`` atomically
        (safetensors + JSON, never pickle; see ``runtime/checkpoint.py``)."""
        from . import checkpoint
        checkpoint.save(self, directory)

    @classmethod
    def load_checkpoint(cls, directory, model: torch.nn.Module, *, optimizer=None, device=None,
                        plan: Plan | None = None) -> Trainer:
        """A trainer for ``model`` resumed from ``directory`` (parameters, optimizer state, step, RNGs).
        ``optimizer``: default, rebuilt from the checkpoint; ``plan``: default, the checkpoint's own."""
        from . import checkpoint
        return checkpoint.load(cls, directory, model, optimizer=optimizer, device=device, plan=plan)

    def close(self) -> None:
        self.flush()
        self.ctx.streams.close()
        if self.ctx.host_pool is not None:
            self.ctx.host_pool.shutdown()
            self.ctx.host_pool = None
        if self.ctx.nvme is not None:
            self.ctx.nvme.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _expandable_segments() -> None:
    """Ask the CUDA caching allocator for expandable segments unless the user configured it: blocks
    of many sizes (parameters, activations, loss chunks) otherwise fragment it, and a plan near its
    budget met 1.6 GiB of reserved-but-unusable memory on the H200.  Only effective before the
    process's first CUDA allocation; harmless after."""
    import os
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except Exception:  # noqa: BLE001 - an allocator without the option: keep the default
        pass
