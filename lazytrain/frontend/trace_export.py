"""torch.export front end: a model -> one fx ``GraphModule`` per block (the code the runtime runs).

How it works (``docs/architecture.md``, "Front end"): the model is cloned onto the ``meta`` device
(no weights are copied), exported with ``torch.export`` (``strict=False``), and every node is assigned to a block by its
``nn_module_stack``: nodes inside layer ``k`` of the repeated ``ModuleList`` belong to that layer's
block, nodes before the first layer to the embedding block, nodes after the last layer to the head
block, and root-level nodes between layers to the partition in progress.  Parameters are lifted to
graph inputs, so a block runs on whatever tensors it is given.  Values crossing a cut (hidden
states, but also glue: rotary tables, masks, labels) become named block outputs / inputs.

The head stops at the input of the LM head's matmul; the cross-entropy that follows in the model
(verified to be a plain ``cross_entropy`` with ignore_index -100) is replaced by a chunked loss in
``program.py`` so the logits of a micro-batch never exist at once.

Hugging Face models get ``is_causal`` attention and a check of their logits path (``hf_export``).

The cut itself (nodes to blocks, one ``GraphModule`` each) is ``split.py``; this module prepares the model,
exports it and defines the records both share.

Large models are exported with only two layers when all layers are structurally identical, and the second
layer's code then serves every layer after the first (``program.expand``; three layers, first, one middle and
last, where the two layers' programs differ); with a few layers of each kind where there are several kinds
(``layer_kinds``, ``kinds_kept``).  The export records no stack trace per node
(``torch.fx.config.do_not_emit_stack_traces``): nothing reads them, and collecting them was about a tenth
of the export's CPU time [ledger: export-stack-traces].
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from . import hub_kernels
from .hf_export import TensorsFromData, export_hf, is_hf, node_arg
from .packing import check_document_mask, packed_inputs
from .trace_error import TraceError

aten = torch.ops.aten


@dataclass
class LossHead:
    """The head's tail replaced by a chunked cross-entropy over ``features @ weight.T (+ bias)``."""

    weight: str
    bias: str | None
    labels: str
    softcap: float | None = None    # Gemma-2's final_logit_softcapping: logits = c * tanh(logits / c)
    scale: float = 1.0              # a constant the head multiplies the logits by (Cohere, Granite)


@dataclass
class BlockCode:
    name: str
    kind: str
    gm: fx.GraphModule                  # forward(*params, *inputs) -> tuple(outputs)
    param_names: list[str]
    input_names: list[str]
    output_names: list[str]
    loss: LossHead | None = None        # head of a causal LM: outputs == [features]
    user_loss: bool = False             # last block of a Sequential: outputs == [loss]

    @functools.cached_property
    def random(self) -> bool:
        """Does the block draw random numbers (dropout, router noise)?  Its recomputation must then
        replay the forward's draws, or backward would differentiate a different function."""
        return draws_random(self.gm)


def _node_draws(n: fx.Node) -> bool:
    """Does this call draw from the generator?  Dropout with p = 0 (or outside training) does not."""
    if n.target is sdpa or n.target is aten.scaled_dot_product_attention.default:
        return node_arg(n, 4, "dropout_p", 0.0) != 0.0
    if not (isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags):
        return False
    if "dropout" in n.target.__name__:
        p, train = node_arg(n, 1, "p", 0.5), node_arg(n, 2, "train", True)
        return not (isinstance(p, (int, float)) and p == 0) and train is not False
    return True


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention``; on ``meta`` it runs the fused (flash-style) kernel's meta
    function so saved-for-backward bytes match a fused GPU kernel (O(s) per head, not O(s^2)).

    The flash kernels take one head dimension for Q, K and V (their output takes Q's).  Where V's differs
    (DeepSeek-V3's MLA: Q and K 192, V 128) the GPU runs a kernel that takes both, the output at V's
    (memory-efficient or cuDNN attention), and so does the trace: the memory-efficient kernel's meta
    function, which saves the same (Q, K, V, the output, the log-sum-exp) and gives V's gradient V's shape.
    So does a mask that is learned (Doge's dynamic mask needs its gradient; the flash kernel takes none)."""
    if q.device.type == "meta" and dropout_p == 0.0:
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
        if v.shape[-1] != q.shape[-1] or (attn_mask is not None and attn_mask.requires_grad):
            return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, 0.0, is_causal,
                                                                scale=scale)[0]
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=attn_mask,
                                                                scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def histc(x, bins=100, min=0, max=0):  # noqa: A002 - aten's argument names
    """``torch.histc`` wherever the block runs.  Models pick its input dtype by device at trace time
    (Hugging Face MoE routing: integer on CUDA, float on the CPU, which has no integer kernel); the
    trace runs on ``meta`` and so records the CUDA choice, which this undoes on the CPU."""
    if x.device.type != "cuda" and not x.is_floating_point():
        x = x.float()
    return torch.histc(x, bins=bins, min=min, max=max)


def draws_random(gm: fx.GraphModule) -> bool:
    """Does ``gm`` (or a graph module it holds) call an op that draws random numbers?"""
    for n in gm.graph.nodes:
        if n.op == "call_function" and _node_draws(n):
            return True
        if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), fx.GraphModule) and \
                draws_random(getattr(gm, n.target)):
            return True
    return False


@dataclass
class Split:
    blocks: list[BlockCode]
    values: dict[str, tuple[tuple[int, ...], torch.dtype, bool]]   # name -> (shape, dtype, needs grad)
    user_inputs: list[str]
    layers_prefix: str | None
    meta: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- model

def meta_clone(model: nn.Module, dtype: torch.dtype, keep: int | list[int] | None = None) -> nn.Module:
    """A structural copy on ``meta`` with floating parameters in ``dtype``; no weight is copied.

    ``keep``: the copy has only the layers ``reduce_layers`` keeps (the others are never copied: deep-copying
    the 80 layers of a 70B model to drop 78 of them was 0.26 s of its trace, 0.07 s of an 8B's).

    The copy is in training mode whatever mode ``model`` is in (``from_pretrained`` returns a model in
    eval mode): a plan is a training step, so dropout is on where the model's config asks for it, as
    ``model.train()`` would have it.  Set the config's dropout to 0 to train without."""
    memo: dict[int, object] = {}
    kept = None
    if keep:
        prefix, layers = find_layers(model)
        kept = kept_layers(len(layers), keep)
        memo.update({id(m): None for i, m in enumerate(layers) if i not in kept})    # left out of the copy
    for p in model.parameters(recurse=True):
        if id(p) not in memo:
            dt = dtype if p.is_floating_point() else p.dtype
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dt, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    clone = copy.deepcopy(model, memo)
    hub_kernels.strip(clone)           # the model's own torch code, which ``train()`` would kernelize again
    clone.train()
    if kept is not None:
        copied = clone.get_submodule(prefix)
        _set_layers(clone, prefix, [copied[i] for i in kept], kept, len(layers))
    return clone


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The repeated layers: the ModuleList holding the most parameters.  Its children may be of several classes (Jamba
    alternates attention and Mamba layers, each its own class): each is a block all the same, and ``reducible``
    keeps such a model whole."""
    best, best_n = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = (name, m), n
    return best


class _SequentialWithLoss(nn.Module):
    """``loss_fn(seq(x), target)`` with the Sequential's children at the same paths ("0", "1", ...)."""

    def __init__(self, seq: nn.Sequential, loss_fn):
        super().__init__()
        for name, child in seq.named_children():
            self.add_module(name, child)
        self.loss_fn = loss_fn

    def forward(self, input_ids, labels):
        x = input_ids
        for child in self.children():
            x = child(x)
        return self.loss_fn(x, labels)


def _layer_signature(m: nn.Module) -> tuple:
    return (type(m).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape)) for n, b in m.named_buffers()))


def per_layer_fields(cfg, n_layers: int) -> list[str]:
    """The config's per-layer lists: every public attribute that is a list of ``n_layers`` plain values
    (``layer_types``, GPT-Neo's ``attention_layers``, Llama-4's ``no_rope_layers``, ...).  A model may read
    them by a layer's index, so they tell layers apart that have the same parameters."""
    if cfg is None or n_layers <= 4:
        return []
    return [k for k, v in vars(cfg).items() if not k.startswith("_") and isinstance(v, (list, tuple))
            and len(v) == n_layers and all(x is None or isinstance(x, (str, int, float, bool)) for x in v)]


def layer_kinds(model: nn.Module) -> list | None:
    """Each layer's kind: its class, parameter and buffer shapes, and its entries in the config's per-layer
    lists (``per_layer_fields``); layers of one kind are assumed to run the same code (the trace checks
    two of each, ``program.same_code``).  None for a model without layers to stream or an ``nn.Sequential``."""
    found = find_layers(model)
    if found is None or isinstance(model, nn.Sequential):
        return None
    layers = found[1]
    cfg = getattr(model, "config", None)
    fields = per_layer_fields(cfg, len(layers))
    return [(_layer_signature(m), tuple(getattr(cfg, f)[i] for f in fields)) for i, m in enumerate(layers)]


def reducible(model: nn.Module, kinds: list | None = None) -> bool:
    """Are all layers structurally identical, so three of them stand for all?  ``kinds``: ``layer_kinds(model)``
    where the caller has them."""
    kinds = layer_kinds(model) if kinds is None else kinds
    return kinds is not None and len(kinds) > 4 and len(set(kinds)) == 1


def kinds_kept(kinds: list) -> list[int] | None:
    """The layers a reduced clone of a model with several kinds of layer keeps: the first and the last, and the
    first two of every kind after the first layer (one where a kind has one); None where that is every layer.  A
    layer replicates only code that a second layer of its kind was checked to share (``program._reduced``)."""
    n = len(kinds)
    if n <= 4 or len(set(kinds)) == 1:
        return None
    kept, seen = {0, n - 1}, {}
    for i in range(1, n - 1):
        if seen.setdefault(kinds[i], 0) < 2:
            seen[kinds[i]] += 1
            kept.add(i)
    return sorted(kept) if len(kept) < n else None


def kept_layers(n_layers: int, keep: int | list[int] = 3) -> list[int]:
    """The layers a reduced clone keeps: 0, 1 and the last; ``keep=2``: 0 and 1; a list: those."""
    return list(keep) if isinstance(keep, list) else [0, 1, n_layers - 1][:keep]


def reduce_layers(clone: nn.Module, keep: int | list[int] = 3) -> nn.Module:
    """Keep layers 0, 1 and the last (renumbered 0, 1, 2) of a meta clone, in place; ``keep=2``: layers 0
    and 1; a list: those layers."""
    prefix, layers = find_layers(clone)
    kept = kept_layers(len(layers), keep)
    return _set_layers(clone, prefix, [layers[i] for i in kept], kept, len(layers))


#: attributes in which a layer's modules keep its index (Hugging Face attention and decoder layers)
_INDEX_ATTRS = ("layer_idx", "layer_id")


def _set_layers(clone: nn.Module, prefix: str, kept: list[nn.Module], indices: list[int], n_layers: int) -> nn.Module:
    """``kept`` (the layers at ``indices`` of ``n_layers``) become the clone's layers (at ``prefix``), numbered
    from 0: its config says how many there are, and its per-layer lists keep their entries (a model may
    look a layer's type up by its position in the loop, or by the index the layer keeps, which is renumbered
    here too)."""
    parent_name, _, attr = prefix.rpartition(".")
    parent = clone.get_submodule(parent_name) if parent_name else clone
    setattr(parent, attr, nn.ModuleList(kept))
    for new, (old, layer) in enumerate(zip(indices, kept)):
        for m in layer.modules():
            for a in _INDEX_ATTRS:
                if getattr(m, a, None) == old and type(getattr(m, a)) is int:
                    setattr(m, a, new)
    cfg = getattr(clone, "config", None)
    if cfg is not None:
        for f in per_layer_fields(cfg, n_layers):
            object.__setattr__(cfg, f, [getattr(cfg, f)[i] for i in indices])
    if cfg is not None and hasattr(cfg, "num_hidden_layers"):
        cfg.num_hidden_layers = len(kept)
    elif cfg is not None and hasattr(cfg, "n_layer"):
        object.__setattr__(cfg, "n_layer", len(kept))
    return clone


# ---------------------------------------------------------------------------------------- export

def export(clone: nn.Module, micro_batch: int, seq_len: int, example_inputs=None, loss_fn=None, packed: bool = False):
    """``torch.export`` of the meta clone at (micro_batch, seq_len); returns (program, root module).
    ``packed``: the model also takes ``position_ids`` and attends within each packed example only
    (``frontend/packing.py``)."""
    if isinstance(clone, nn.Sequential):
        if example_inputs is None or loss_fn is None:
            raise TraceError("an nn.Sequential needs example_inputs=(x, target) and loss_fn(output, target): trace "
                             "it first, lazytrain.frontend.trace.trace(model, seq_len=..., example_inputs=(x, target), "
                             "loss_fn=...), and compile the graph that returns")
        root = _SequentialWithLoss(clone, loss_fn)
        x, target = (_to_meta_batch(t, micro_batch) for t in example_inputs)
        if x.is_floating_point():
            x = x.to(next(clone.parameters()).dtype)
        kwargs = {"input_ids": x, "labels": target}
    else:
        root = clone
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
        kwargs = {"input_ids": ids, "labels": torch.zeros_like(ids)}   # distinct, or export aliases them
        if is_hf(clone):
            kwargs["use_cache"] = False
        if packed:
            kwargs.update(packed_inputs(clone, ids))

    def run():
        with TensorsFromData(), _no_stack_traces():
            return torch.export.export(root, (), kwargs, strict=False)
    try:
        ep = export_hf(clone, seq_len, run) if is_hf(clone) and not packed else run()
    except Exception as e:  # noqa: BLE001 - re-raised with the failing module named
        raise TraceError(f"torch.export failed on {type(clone).__name__}: {_short(e)}{_data_dependent(e)}") from None
    if packed:
        check_document_mask(ep, type(clone).__name__)
    return ep, root


@contextlib.contextmanager
def _no_stack_traces():
    """Export without a stack trace on every node: they serve only debugging, and the block programs are
    built from the op graph alone.  A torch without the switch (2.11) exports with them."""
    import torch.fx.config as fx_config
    if not hasattr(fx_config, "do_not_emit_stack_traces"):
        yield
        return
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def _to_meta_batch(t: torch.Tensor, micro_batch: int) -> torch.Tensor:
    t = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return t[:1].expand(micro_batch, *t.shape[1:]).contiguous()


def _data_dependent(e: Exception) -> str:
    """What an export that failed on a value of the data means for the user ("" for other failures)."""
    text = f"{type(e).__name__} {e}"
    if "DataDependent" not in text and "data-dependent" not in text:
        return ""
    return (" -- the model's forward takes a branch or a shape from the values of its tensors (a mixture of "
            "experts that runs only the experts a batch routes to, `.item()`), and a plan is one program for "
            "every batch: this model cannot be compiled")


def _short(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


# ----------------------------------------------------------------------------------------- split
