"""trace: a model -> ``ir.ModelGraph`` (blocks with per-sample bytes and FLOPs).

Figures come from running each block's program (``program.py``) on ``meta`` tensors at micro-batch
``TRACE_MICRO_BATCH`` (2) and dividing by it, so values without a batch dimension (rotary tables)
are amortised rather than counted once per sample:
- FLOPs: ``FlopCounterMode`` over the forward, and over ``autograd.backward`` of the block's
  outputs (the head's backward includes recomputing each chunk of logits);
- saved bytes: every tensor ``saved_tensors_hooks`` sees, deduplicated by storage, parameters
  excluded (a block input that backward reads *is* counted); for a block traced to run compiled
  (``compile_blocks``), what its partitioned forward saves, at each of its cuts (``compiled.propose``);
- workspace: the forward's peak of live values (fx liveness, plus what autograd has saved so far)
  above what survives it (saved + outputs), or the largest single op's gradient footprint
  (its output and inputs), whichever is larger; the fused loss head (``loss_head.py``) adds per token
  its row bytes, and one chunk of logits as a fixed cost, which the compiler sets when it chooses the
  chunk (``compiler/loss_chunk.py``, from ``graph.meta["loss_head"]``).  Attention is costed as a fused
  kernel (O(seq) saved per head, an fp32 dQ accumulator in its backward's footprint);
- attention FLOPs apart (``attention.AttentionCount``): causal attention as half the square, backward
  2.5x forward (the kernel recomputes the scores); they are part of the block's FLOPs, and the block
  records them with the head dimension and key length the cost model prices them by.
Structurally identical layers are measured once (``Split.meta["replicated_from"]``).

``build_program`` is the runtime's side: the same split at the plan's micro-batch, on the device, with the
graph's structure but no measurement (a ``program.BlockProgram``).
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import asdict, is_dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..ir import Block, Cut, ModelGraph, ParamSpec, TensorSpec
from ..ir.graph import DTYPE_BYTES, LOSS_MIN_COLUMNS
from .attention import DQ_ACCUMULATOR_BYTES, AttentionCount, is_attention
from .compiled import contiguous_spec, propose, structure_key, why_eager
from .cuts import CUT_BUDGETS
from .loss_head import DEFAULT_CHUNK_LOGITS, bytes_per_logit, fused_next_token_loss, row_bytes
from .program import BlockProgram, build_split
from .tiling import TiledTail, run_tail
from .trace_export import Split, TraceError

TRACE_MICRO_BATCH = 2
__all__ = ["TraceError", "trace"]


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a grouped matmul, with which Hugging Face's mixture-of-experts layers run their experts
    (``aten._grouped_mm`` in bf16, transformers' own fallback op otherwise; torch's ``FlopCounterMode`` knows
    neither: a MoE layer's experts counted no FLOPs, 40% of a Qwen3-MoE layer's): 2 per output element per element
    of the dimension it contracts; a 2-D x 2-D call (a weight gradient, whose contracted rows are split among the
    groups) contracts each group's share of them."""
    groups = out_shape[0] if len(a_shape) == 2 and len(b_shape) == 2 else 1
    return 2 * math.prod(out_shape) * a_shape[-1] // groups


def _grouped_mm_backward_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """transformers' fallback grouped matmul's backward: the input's and the weights' gradients, each as many FLOPs
    as the forward, ``input (S, K) @ weight[e] (K, N)``."""
    return 4 * input_shape[0] * input_shape[1] * weight_shape[-1]


def _flop_formulas(attn: AttentionCount) -> dict:
    """``custom_mapping`` for ``FlopCounterMode``: the fused attention ops and the grouped matmuls there are (an
    op namespace is looked into only once a library made it: asking ``torch.ops`` for another makes one)."""
    mapping = attn.mapping()
    for space, name, formula in (("aten", "_grouped_mm", _grouped_mm_flops),
                                 ("transformers", "grouped_mm_fallback", _grouped_mm_flops),
                                 ("transformers", "grouped_mm_fallback_backward", _grouped_mm_backward_flops)):
        if space in dir(torch.ops) and hasattr(getattr(torch.ops, space), name):
            mapping[getattr(getattr(torch.ops, space), name)] = formula
    return mapping


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    try:
        return getattr(torch, str(d).replace("torch.", ""))
    except AttributeError:
        raise ValueError(f"unknown dtype {d!r}") from None


def _dname(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def trace(model: nn.Module, *, seq_len: int, dtype="bfloat16", example_inputs=None, loss_fn=None,
          packed: bool = False, seq_tile: int | None = None, compile_blocks: bool = False) -> ModelGraph:
    """Blocks of ``model`` (embedding, each layer, head + loss) with per-sample costs at ``seq_len``.

    ``model``: our GPT, a Hugging Face Qwen2 / Llama / Qwen3 causal LM, or an ``nn.Sequential``
    (each child a block; ``example_inputs=(x, target)`` and ``loss_fn(output, target)`` required).
    Real weights are never touched: everything runs on a meta clone.  ``packed``: the program takes
    ``position_ids`` and attends within each packed example (``packing.py``).  ``seq_tile``: the
    layers' position-wise tails run in chunks of that many tokens (``tiling.py``), and are measured so.
    ``compile_blocks``: the blocks will run compiled (``compiled.py``): a compiled block's saved bytes are what
    its partitioned forward saves.
    """
    t0 = time.perf_counter()
    dt = _dtype(dtype)
    sp = build_split(model, micro_batch=TRACE_MICRO_BATCH, seq_len=seq_len, device="meta", dtype=dt,
                     example_inputs=example_inputs, loss_fn=loss_fn, packed=packed, seq_tile=seq_tile)
    g = graph_from_split(sp, model, seq_len=seq_len, dtype=dt, micro_batch=TRACE_MICRO_BATCH, measure=True,
                         compile_blocks=compile_blocks)
    g.meta["trace_seconds"] = round(time.perf_counter() - t0, 3)
    return g


def build_program(model: nn.Module, *, micro_batch: int, seq_len: int, device: str | torch.device,
                  dtype: torch.dtype, example_inputs=None, loss_fn=None,
                  loss_chunk_logits: int = DEFAULT_CHUNK_LOGITS, loss_single_pass: bool = False,
                  packed: bool = False, seq_tile: int | None = None) -> BlockProgram:
    """Export ``model`` (never touching its weights) and split it into per-block programs; ``seq_tile``:
    layers' position-wise tails run in chunks of that many tokens (``tiling.py``); ``packed``: with
    ``position_ids`` and the per-example mask (``packing.py``); ``loss_chunk_logits``: logits per chunk of
    the fused loss head (``loss_head.py``), ``loss_single_pass``: its gradients formed in its forward."""
    sp = build_split(model, micro_batch=micro_batch, seq_len=seq_len, device=device, dtype=dtype,
                     example_inputs=example_inputs, loss_fn=loss_fn, packed=packed, seq_tile=seq_tile)
    graph = graph_from_split(sp, model, seq_len=seq_len, dtype=dtype, micro_batch=micro_batch, measure=False)
    return BlockProgram(graph=graph, blocks=sp.blocks, micro_batch=micro_batch, seq_len=seq_len,
                        loss_chunk_logits=loss_chunk_logits, loss_single_pass=loss_single_pass, packed=packed,
                        values=dict(sp.values))


def _config_summary(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    if hasattr(cfg, "to_dict"):
        keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps",
                "max_position_embeddings")
        d = cfg.to_dict()
        return {k: d[k] for k in keys if k in d}
    return asdict(cfg) if is_dataclass(cfg) else {}


def _boundaries(sp: Split, mb: int) -> tuple[list[int], list[list[str]], list[tuple[int, int]]]:
    """(bytes per sample, value names) live at each boundary 0..L, and the edges that skip blocks: a value
    crosses every boundary from the block that produces it to the last that reads it."""
    L = len(sp.blocks)
    produced = {n: 0 for n in sp.user_inputs if n in sp.values}
    last_use: dict[str, int] = {}
    for j, b in enumerate(sp.blocks):
        for n in b.output_names:
            produced[n] = j + 1
        for n in b.input_names:
            last_use[n] = max(last_use.get(n, -1), j)
    live: list[list[str]] = [[] for _ in range(L + 1)]
    for n, p in produced.items():
        for i in range(p, last_use.get(n, p - 1) + 1):
            live[i].append(n)

    def nbytes(name: str) -> int:
        shape, dt, _ = sp.values[name]
        return math.prod(shape) * DTYPE_BYTES.get(_dname(dt), 4)
    boundary_bytes = [math.ceil(sum(nbytes(n) for n in vs) / mb) for vs in live]
    boundary_bytes[L] = 12   # loss_sum (fp32) + n_tokens (int64)
    live[L] = ["loss_sum", "n_tokens"]
    edges = sorted({(produced[n] - 1, j) for j, b in enumerate(sp.blocks) for n in b.input_names
                    if produced.get(n, 0) > 0 and j > produced[n]})
    return boundary_bytes, live, edges


def graph_from_split(sp: Split, model: nn.Module, *, seq_len: int, dtype: torch.dtype, micro_batch: int,
                     measure: bool, compile_blocks: bool = False) -> ModelGraph:
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    trains = {n: p.requires_grad for n, p in model.named_parameters()}
    owner: dict[str, int] = {}
    for j, b in enumerate(sp.blocks):
        for n in b.param_names:
            owner.setdefault(n, j)
    mb = micro_batch

    def spec(name: str) -> TensorSpec:
        shape, dt, rg = sp.values[name]
        per = shape[1:] if shape and shape[0] == mb else shape
        return TensorSpec(name=name, shape=tuple(per), dtype=_dname(dt), requires_grad=rg)

    L = len(sp.blocks)
    boundary_bytes, live, edges = _boundaries(sp, mb)
    cache: dict[tuple, tuple] = {}
    partitioned: dict = {}     # block program -> its compiled cuts, min-cut first (None: it would run eager)
    compiled: list[int] = []
    blocks = []
    for j, b in enumerate(sp.blocks):
        figs = (0, 0, 0, 0, 0, AttentionCount(), 0)
        cuts: tuple[Cut, ...] = ()
        if measure:
            key = (id(b.gm), b.loss is not None, tuple(trains[n] for n in b.param_names))
            if key not in cache:
                try:
                    cache[key] = _measure(b, sp, shapes, dtype, mb, seq_len, trains)
                except TraceError:
                    raise
                except Exception as e:  # noqa: BLE001 - name the block, not a deep traceback
                    raise TraceError(f"measuring block {j} ({b.name}) failed: {type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''}") from None
            figs = cache[key]
            if compile_blocks and why_eager(b) is None:
                pkey = _partition_key(b, sp, model, dtype)
                if pkey not in partitioned:
                    partitioned[pkey] = _partition_saved(b, sp, model, dtype)
                if partitioned[pkey] is not None:
                    cuts = tuple(Cut(budget=bg, saved_bytes=math.ceil(n / mb), recompute_flops=math.ceil(f / mb),
                                     recompute_attn_flops=math.ceil(a / mb)) for bg, n, f, a in partitioned[pkey])
                    figs = (partitioned[pkey][0][1], *figs[1:])
                    cuts = cuts if len(cuts) > 1 else ()
                    compiled.append(j)
        saved, ws, fixed, ff, bf, attn, bws = figs
        outputs = tuple(spec(n) for n in b.output_names)
        if b.loss is not None or b.user_loss:
            outputs = (TensorSpec(name="loss_sum", shape=(), dtype="float32", requires_grad=True),
                       TensorSpec(name="n_tokens", shape=(), dtype="int64"))
        blocks.append(Block(
            index=j, name=b.name, kind=b.kind,
            params=tuple(ParamSpec(name=n, shape=shapes[n][0], owner=owner[n], trainable=trains[n])
                         for n in b.param_names),
            inputs=tuple(spec(n) for n in b.input_names), outputs=outputs,
            saved_bytes=math.ceil(saved / mb), workspace_bytes=math.ceil(ws / mb), workspace_fixed_bytes=fixed,
            backward_workspace_bytes=math.ceil(bws / mb),
            fwd_flops=math.ceil(ff / mb), bwd_flops=math.ceil(bf / mb), fwd_ops=_op_count(b.gm),
            attn_fwd_flops=math.ceil(attn.fwd_flops / mb), attn_bwd_flops=math.ceil(attn.bwd_flops / mb),
            attn_head_dim=attn.head_dim, attn_kv_len=attn.kv_len, cuts=cuts))
    meta = {"architecture": type(model).__name__, "config": _config_summary(model), "traced_micro_batch": mb,
            "replicated_layers": bool(sp.meta.get("replicated_from")),
            "unused_params": list(sp.meta.get("unused_params", []))}
    if compile_blocks:          # the blocks whose saved bytes are the partition's (the others run eager)
        meta["compiled_blocks"] = {"partition": "min_cut", "blocks": compiled, "cut_budgets": list(CUT_BUDGETS)}
    if sp.meta.get("packed"):
        meta["packed"] = True       # the Trainer builds the program with position_ids
    if sp.meta.get("seq_tile"):
        meta["seq_tile"] = dict(sp.meta["seq_tile"])
    head = sp.blocks[-1].loss
    if head is not None:   # the fused loss head's figures; the compiler chooses its chunk
        meta["loss_head"] = {"block": L - 1, **loss_head_figures(head, shapes[head.weight][0], dtype, seq_len)}
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return ModelGraph(name=name, seq_len=seq_len, dtype=_dname(dtype), blocks=tuple(blocks),
                      boundary_bytes=tuple(boundary_bytes), boundary_values=tuple(tuple(v) for v in live),
                      edges=tuple(e for e in edges if e[1] != e[0] + 1), meta=meta)


def _specs(b, sp: Split, model: nn.Module, dtype: torch.dtype) -> list:
    """Block ``b``'s arguments as the trace's meta program passes them (``compiled.ArgSpec``)."""
    params = dict(model.named_parameters())
    specs = [contiguous_spec(params[n].shape, dtype if params[n].is_floating_point() else params[n].dtype,
                             params[n].requires_grad) for n in b.param_names]
    for n in b.input_names:
        shape, dt, rg = sp.values[n]
        specs.append(contiguous_spec(shape, dt, rg and dt.is_floating_point))
    return specs


def _partition_key(b, sp: Split, model: nn.Module, dtype: torch.dtype) -> str:
    """Blocks of the same program code and arguments (identical layers) are partitioned once, as the runtime
    compiles them once (``compiled.structure_key``)."""
    return structure_key(b.gm, _specs(b, sp, model, dtype), torch.device("meta"))


def _partition_saved(b, sp: Split, model: nn.Module, dtype: torch.dtype) -> list | None:
    """Block ``b``'s cuts when compiled (``compiled.propose`` on meta tensors: budget, saved bytes, recomputed
    FLOPs, of them attention, at the trace's micro-batch), or None when it cannot be partitioned (the runtime
    then runs it eager: its hook-measured figure stands)."""
    specs = _specs(b, sp, model, dtype)
    try:
        return propose(b.gm, specs, "meta", len(b.param_names))
    except Exception:  # noqa: BLE001 - not compiled: the runtime's compile fails the same way and runs it eager
        return None


def _op_count(gm) -> int:
    """Calls a block's forward issues (tuple indexing is not one); nested graphs count their own, a tiled
    tail once per chunk."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem and node.target is not run_tail:
            n += 1
        elif node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.fx.GraphModule):
            n += _op_count(getattr(gm, node.target))
        elif node.op == "get_attr" and isinstance(getattr(gm, node.target, None), TiledTail):
            tail = getattr(gm, node.target)
            n += tail.n_chunks * _op_count(tail.full_graph)
    return n


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - tensor subclasses without storage
        return id(t)


def _tbytes(t) -> int:
    return t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0


class _Liveness(fx.Interpreter):
    """Runs a block on meta and records the peak of live values (plus what autograd saved so far)."""

    def __init__(self, gm, saved: dict, exclude: set, dtype: torch.dtype | None = None):
        super().__init__(gm, garbage_collect_values=True)
        self.saved, self.exclude, self.peak, self.op_peak = saved, exclude, 0, 0
        # the model's element size: an op computing wider (a norm's fp32) holds its gradients next to its values
        self.element_size = torch.empty((), dtype=dtype).element_size() if dtype is not None else 8
        self.backward_op_peak = 0   # the largest op's footprint in backward: ``_backward_footprint``
        self.tails: list = []   # (tiled tail, footprint of its call) seen

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function":
            live = {}
            for v in list(self.env.values()) + [out]:
                for t in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(t, torch.Tensor) and _storage_key(t) not in self.exclude:
                        live[_storage_key(t)] = _tbytes(t)
            live.update(self.saved)
            self.peak = max(self.peak, sum(live.values()))
            ins = [a for a in n.all_input_nodes if a in self.env]
            outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
            fp = sum(_tbytes(t) for t in outs)
            fp += sum(_tbytes(self.env[a]) for a in ins if isinstance(self.env[a], torch.Tensor)
                      and self.env[a].is_floating_point() and _storage_key(self.env[a]) not in self.exclude)
            wide = any(t.element_size() > self.element_size for t in outs) or any(
                isinstance(self.env[a], torch.Tensor) and self.env[a].is_floating_point()
                and self.env[a].element_size() > self.element_size for a in ins)
            accum = 0
            if is_attention(n.target) and ins and isinstance(self.env[ins[0]], torch.Tensor):
                accum = self.env[ins[0]].numel() * DQ_ACCUMULATOR_BYTES    # the backward's fp32 dQ accumulator
            if n.target is run_tail:             # one chunk's backward is added after the run (``_measure``)
                self.tails.append((self.env[n.args[0]], fp))
            else:
                self.backward_op_peak = max(self.backward_op_peak, _backward_footprint(fp, accum, wide))
            self.op_peak = max(self.op_peak, fp + accum)
        return out


def _backward_footprint(forward: int, accumulator: int, wide: bool) -> int:
    """An op's footprint in backward, plus a kernel's own accumulator: for an op computing wider than the model
    (a norm's fp32 in a bf16 model) its inputs and outputs next to their gradients, twice the forward's; else the
    forward's.  The forward's alone underestimates a wide op's backward; twice every op's overestimates the
    rest [ledger: backward-workspace]."""
    return (2 * forward if wide else forward) + accumulator


def _tail_transient(tail: TiledTail) -> tuple[int, int]:
    """(bytes, fixed bytes) of a tiled tail's backward of one chunk: the chunk's share of what the whole tail
    saves and of its largest op's footprint, and fp32 accumulators of its parameters' gradients."""
    inputs = [torch.empty(t.shape, dtype=t.dtype, device="meta", requires_grad=t.is_floating_point())
              for t in tail.ext_vals]
    keys = {_storage_key(t) for t in inputs}
    saved: dict = {}

    def pack(t):
        if _storage_key(t) not in keys:
            saved[_storage_key(t)] = _tbytes(t)
        return t
    interp = _Liveness(tail.full_graph, saved, keys)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        interp.run(*inputs)
    share = min(tail.tokens, tail.seq) / tail.seq
    accum = sum(t.numel() * 4 for t in tail.ext_vals[tail.n_act:] if t.is_floating_point())
    return math.ceil((sum(saved.values()) + interp.op_peak) * share), accum


def loss_head_figures(lh, weight_shape: tuple, dtype: torch.dtype, seq_len: int) -> dict:
    """What the compiler needs to choose the fused loss head's chunk (``graph.meta["loss_head"]``)."""
    return {"vocab": int(weight_shape[0]), "hidden": int(weight_shape[1]), "seq_len": seq_len,
            "bytes_per_logit": bytes_per_logit(dtype, lh.softcap), "row_bytes": row_bytes(dtype, weight_shape[1]),
            "param_bytes": torch.empty((), dtype=dtype).element_size(), "chunk_logits": DEFAULT_CHUNK_LOGITS}


def _measure(b, sp: Split, shapes: dict, dtype: torch.dtype, mb: int, seq_len: int, trains: dict | None = None):
    """(saved bytes, workspace bytes, fixed workspace bytes, fwd FLOPs, bwd FLOPs, attention count, backward
    workspace bytes) of one block at micro-batch ``mb``; the fixed part does not scale with the micro-batch (a
    loss chunk).  A frozen parameter (``trains[n]`` False) is traced without ``requires_grad``, so autograd takes
    no gradient for it and the FLOP counter counts what backward really runs: a frozen matmul weight's share is
    the input gradient alone (2 x tokens x its elements, not 4), and nothing is saved only for its gradient."""
    params = {}
    for n in b.param_names:
        shape, dt = shapes[n]
        dt = dtype if dt.is_floating_point else dt
        params[n] = torch.empty(shape, dtype=dt, device="meta",
                                requires_grad=dt.is_floating_point and (trains or {}).get(n, True))
    inputs = {}
    for n in b.input_names:
        shape, dt, rg = sp.values[n]
        inputs[n] = torch.empty(shape, dtype=dt, device="meta", requires_grad=rg)
    pkeys = {_storage_key(p) for p in params.values()}
    in_keys = {_storage_key(t) for t in inputs.values()}
    saved: dict = {}

    def pack(t):
        k = _storage_key(t)
        if k not in pkeys:
            saved[k] = _tbytes(t)
        return t

    args = [params[n] for n in b.param_names] + [inputs[n] for n in b.input_names]
    interp = _Liveness(b.gm, saved, pkeys | in_keys, dtype)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    attn = AttentionCount()
    formulas = _flop_formulas(attn)
    with hooks, FlopCounterMode(display=False, custom_mapping=formulas) as fc:
        outs = interp.run(*args)
        if b.loss is not None:
            lh = b.loss
            loss, _ = fused_next_token_loss(outs[0], params[lh.weight],
                                            None if lh.bias is None else params[lh.bias], inputs[lh.labels],
                                            DEFAULT_CHUNK_LOGITS, softcap=lh.softcap, scale=lh.scale)
            outs = (loss,)
    fwd = fc.get_total_flops()
    fixed = 0
    for tail, fp in interp.tails:    # measured outside the FLOP count and the saved-tensor hooks
        chunk, accum = _tail_transient(tail)
        interp.op_peak, fixed = max(interp.op_peak, fp + chunk), max(fixed, accum)
    keep = dict(saved)
    for t in outs:
        if isinstance(t, torch.Tensor):
            keep[_storage_key(t)] = _tbytes(t)
    ws = max(interp.peak - sum(keep.values()), interp.op_peak, 0)
    if b.loss is not None:   # the fused loss head (``loss_head.py``): one chunk of logits whatever the
        # micro-batch, a fixed cost the compiler sets with the chunk (``compiler/loss_chunk.py``); per token its
        # row bytes, and at most ``LOSS_MIN_COLUMNS`` logits beyond the chunk where the chunk's columns bottom out
        head = loss_head_figures(b.loss, tuple(params[b.loss.weight].shape), params[b.loss.weight].dtype, seq_len)
        fixed = DEFAULT_CHUNK_LOGITS * head["bytes_per_logit"]
        ws = max(ws, mb * seq_len * (head["row_bytes"] + LOSS_MIN_COLUMNS * head["bytes_per_logit"]))
    grad_outs = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
    with FlopCounterMode(display=False, custom_mapping=formulas) as fc2:
        if grad_outs:
            torch.autograd.backward(grad_outs, [torch.ones_like(t) for t in grad_outs])
    return sum(saved.values()), ws, fixed, fwd, fc2.get_total_flops(), attn, max(ws, interp.backward_op_peak)
