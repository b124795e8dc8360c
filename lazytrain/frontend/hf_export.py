"""What a Hugging Face causal LM needs around ``torch.export`` (``trace_export``): attention called with
``is_causal`` instead of a mask tensor where that is the same thing, tensors the forward builds from
Python data traced as ops (the trace runs on ``meta``, where their values would be lost), and a check
of what the head does to the logits before the cross-entropy, which the chunked loss (``program.py``)
must reproduce."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode

from .rope import fix_rope_length


def is_hf(model: nn.Module) -> bool:
    """Is ``model`` a Hugging Face model (a ``config`` with a ``model_type``, input embeddings)?"""
    return hasattr(getattr(model, "config", None), "model_type") and hasattr(model, "get_input_embeddings")


aten = torch.ops.aten


CAUSAL_ATTENTION = "lazytrain_causal"


def _every_layer_full_causal(cfg, seq_len: int) -> bool:
    """Would a plain causal mask equal the mask this config builds for an unpadded sequence of ``seq_len``?
    A sliding window or an attention chunk at least ``seq_len`` long changes nothing; an ALiBi bias
    (Falcon's ``alibi``), which the model adds to the mask, does."""
    if getattr(cfg, "alibi", False):
        return False
    window = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    short_window = window is not None and window < seq_len
    short_chunk = chunk is not None and chunk < seq_len
    types = getattr(cfg, "layer_types", None)
    if not types:
        return not (short_window and getattr(cfg, "use_sliding_window", True)) and not short_chunk
    plain = {"full_attention": True, "sliding_attention": not short_window, "chunked_attention": not short_chunk}
    return all(plain.get(t, False) for t in types)


class _CausalName(str):
    """``CAUSAL_ATTENTION`` as a config's attention implementation, noting whether model code compares it
    with ``"sdpa"`` (``== "sdpa"``, ``in ("eager", "sdpa")``, ``"sdpa" in name``): such a model picks its
    SDPA code by that name, not through ``AttentionInterface``, and the new name sends it down another
    path (Falcon: the eager one, which adds the mask that is now ``None``).  Also whether the attention
    function got a mask all the same (``mask_given``, ``_causal_attention``).  Copies are the same object,
    so a copied config notes into the same place."""

    def __new__(cls, value: str):
        self = super().__new__(cls, value)
        self.sdpa_compared = False
        self.mask_given = False
        return self

    def _note(self, other) -> None:
        if isinstance(other, str) and "sdpa" in str.__str__(other):
            self.sdpa_compared = True

    def __eq__(self, other):
        self._note(other)
        return str.__eq__(self, other)

    def __ne__(self, other):
        self._note(other)
        return str.__ne__(self, other)

    def __contains__(self, sub):
        self._note(sub)
        return str.__contains__(self, sub)

    def startswith(self, prefix, *args):
        for p in prefix if isinstance(prefix, tuple) else (prefix,):
            self._note(p)
        return str.startswith(self, prefix, *args)

    __hash__ = str.__hash__

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def use_causal_flag(clone: nn.Module, seq_len: int) -> bool:
    """Make a Hugging Face meta clone call SDPA with ``is_causal=True`` and no mask tensor.

    Exported as is, the model builds its mask from the position ids (packed-sequence detection cannot
    be decided at trace time) and passes a boolean ``(b, 1, s, s)`` tensor to SDPA, which rules out the
    flash kernel on the GPU and makes the mask a value that crosses block boundaries.  We train on
    unpadded (right-padded, ``-100``-labelled) sequences without an attention mask, so the mask is the
    causal one; an attention implementation that Hugging Face has no mask function for gets
    ``attention_mask=None`` and its SDPA path sets ``is_causal``.  Only for SDPA models whose every
    layer is plainly causal at this length (no sliding window or chunk shorter than ``seq_len``, no
    ALiBi).  Only sound for a model that reaches SDPA through ``AttentionInterface``: ``export_hf``
    checks that and exports again without the flag where it does not hold."""
    cfg = getattr(clone, "config", None)
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not _every_layer_full_causal(cfg, seq_len):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:   # an older transformers: keep the mask
        return False
    def causal_attention(module, query, key, value, attention_mask, *args, **kwargs):
        """SDPA, ``is_causal`` where no mask comes.  A mask that comes anyway was built by the model on the causal
        mask it was told it does not need (Doge adds a learned bias to it): without the causal part it attends to
        later tokens, so the flag is noted unsound for this model."""
        name = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if attention_mask is not None and isinstance(name, _CausalName):
            name.mask_given = True
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)
    cfg._attn_implementation = _CausalName(CAUSAL_ATTENTION)
    return True


def export_hf(clone: nn.Module, seq_len: int, run):
    """``run()``, the ``torch.export`` of the meta clone of a Hugging Face model, with ``is_causal``
    attention (``use_causal_flag``) where the model honours it.

    The flag renames the attention implementation, which changes nothing for a model that looks its
    attention function up in ``AttentionInterface``, but a model that compares the name with ``"sdpa"``
    itself takes another path under the new name (Falcon: its eager attention, adding a ``None`` mask;
    with ALiBi the bias would be lost), and one that passes its attention a mask of its own making (Doge:
    a learned bias, which it would have added to the causal mask).  Such a model, or one whose export
    fails with the flag, is exported again with its own mask (``"sdpa"``).  Rotary tables that depend on the
    sequence length are fixed at ``seq_len`` first (``rope.fix_rope_length``)."""
    fix_rope_length(clone, seq_len)
    cfg = clone.config
    original = cfg._attn_implementation
    if not use_causal_flag(clone, seq_len):
        return run()
    name = cfg._attn_implementation
    try:
        ep = run()
    except Exception:  # noqa: BLE001 - exported again without the flag; that export's error is the one raised
        ep = None
    if ep is not None and not name.sdpa_compared and not name.mask_given:
        return ep
    cfg._attn_implementation = original
    return run()


#: up to this many elements, a tensor built from Python data on ``meta`` is traced as ``full`` / ``stack`` of
#: its values; a larger one becomes a constant built on the CPU (a value of its block)
MAX_LITERAL_ELEMENTS = 64


def _shape_and_values(data) -> tuple[list[int], list] | None:
    """The shape and the flat values of Python numbers or (nested) lists / tuples of them; ``None`` for
    anything else (tensors, ragged lists)."""
    if type(data) in (int, float, bool):
        return [], [data]
    if not isinstance(data, (list, tuple)):
        return None
    parts = [_shape_and_values(v) for v in data]
    if any(p is None for p in parts) or len({tuple(p[0]) for p in parts}) > 1:
        return None
    return [len(data), *(parts[0][0] if parts else [])], [v for p in parts for v in p[1]]


def _kind(dtype: torch.dtype) -> int:
    """bool < integer < floating point: casting data down a kind truncates it, which ``full`` refuses."""
    return 2 if dtype.is_floating_point else 0 if dtype == torch.bool else 1


def _from_data(data, dtype, device):
    """``torch.tensor(data, dtype=dtype, device=device)`` for a ``meta`` device, as traced ops on the literal
    values (no constant), or, when large or cast to another kind of number, built on the CPU and moved;
    ``None`` if ``data`` is not plain Python numbers."""
    found = _shape_and_values(data)
    if found is None:
        return None
    shape, values = found
    kinds = {type(v) for v in values}
    inferred = torch.get_default_dtype() if not kinds or float in kinds else torch.bool if kinds == {bool} \
        else torch.long
    dtype = dtype or inferred
    if len(values) > MAX_LITERAL_ELEMENTS or dtype.is_complex or _kind(dtype) < _kind(inferred):
        return torch.tensor(data, dtype=dtype).to(device)      # a constant with its value
    if not values:
        return torch.empty(shape, dtype=dtype, device=device)
    if all(repr(v) == repr(values[0]) for v in values):
        return torch.full(shape, values[0], dtype=dtype, device=device)
    return torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values]).view(shape)


def _data_index(idx, device):
    """An index with its lists of ints (or of bools) as tensors (the same index: ``x[:, [-2]]`` is
    ``x[:, tensor([-2])]``)."""
    def conv(i):
        if isinstance(i, list) and i and (all(type(v) is int for v in i) or all(type(v) is bool for v in i)):
            return _from_data(i, None, device)
        return i
    if isinstance(idx, tuple):
        return tuple(conv(i) for i in idx)
    return conv(idx)


def _is_meta(device) -> bool:
    try:
        return device is not None and torch.device(device).type == "meta"
    except (TypeError, RuntimeError):
        return False


class TensorsFromData(TorchFunctionMode):
    """While exporting on ``meta``: tensors the forward builds from Python data on the activations' device
    (``torch.tensor(x, device=h.device)``, ``h.new_tensor(x)``, a list index ``h[..., [-2]]``) are traced
    as ops on their values (``full``, ``stack``).  Built on ``meta`` they would become lifted constants
    without a value (the data is dropped on the way to ``meta``), which no block can run; as ops they are
    code, like any Python number the forward uses, and a layer's code still serves every middle layer."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = None
        if func in (torch.tensor, torch.as_tensor) and len(args) == 1 and set(kwargs) <= {"dtype", "device"} \
                and _is_meta(kwargs.get("device")):
            out = _from_data(args[0], kwargs.get("dtype"), kwargs["device"])
        elif func is torch.Tensor.new_tensor and len(args) == 2 and set(kwargs) <= {"dtype", "device"} \
                and _is_meta(kwargs.get("device") or args[0].device):
            out = _from_data(args[1], kwargs.get("dtype") or args[0].dtype, kwargs.get("device") or args[0].device)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], torch.Tensor) \
                and args[0].device.type == "meta":
            args = (args[0], _data_index(args[1], args[0].device), *args[2:])
        return func(*args, **kwargs) if out is None else out


#: what may happen to the logits between the LM head and the cross-entropy: casts and reshapes
_LOGIT_PLUMBING = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.view.default, aten.reshape.default,
                   aten._unsafe_view.default, aten.slice.Tensor, aten.contiguous.default, aten.clone.default,
                   aten.alias.default, aten.expand.default, aten.squeeze.dim, aten.unsqueeze.default,
                   aten.flatten.using_ints, aten._assert_tensor_metadata.default}
_SOFTCAP_OPS = {aten.div.Tensor, aten.tanh.default, aten.mul.Tensor}
_SCALE_OPS = {aten.mul.Tensor: 1, aten.mul.Scalar: 1, aten.div.Tensor: -1, aten.div.Scalar: -1}


def _reachable(start: fx.Node, step) -> set[fx.Node]:
    """Every node reached from ``start`` by repeatedly following ``step`` (users, or inputs), not ``start``."""
    seen, stack = set(), [start]
    while stack:
        for m in step(stack.pop()):
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def node_arg(n: fx.Node, i: int, name: str, default=None):
    """Argument ``i`` (keyword ``name``) of a call node, or ``default`` when the call left it out."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def labels_shifted(ce: fx.Node, labels: fx.Node) -> bool:
    """Does the model's loss score each position against the *next* token, as the chunked loss does?
    Causal LMs shift the labels on their way to the cross-entropy (``labels[..., 1:]``, after Hugging
    Face's pad by one); an encoder-decoder's decoder-as-causal-LM head (BART, Marian, Whisper, ...)
    compares logits and labels position by position, which a plan would silently train differently."""
    target = node_arg(ce, 1, "target")
    if not isinstance(target, fx.Node):
        return False
    on_path = _reachable(labels, lambda n: n.users) & _reachable(target, lambda n: n.all_input_nodes)
    return any(n.target is aten.slice.Tensor and len(n.args) > 2 and n.args[2] == 1 for n in on_path)


def logits_path(lm: fx.Node, ce: fx.Node, softcap) -> tuple[float, set[str]]:
    """The chunked loss recomputes ``features @ W.T (+ b)`` (``lm``) and feeds it to the cross-entropy
    (``ce``): what the model does to the logits on the way must be plumbing, the tanh soft-capping the
    config announces (``softcap``), or multiplications or divisions by constants, which the chunked
    loss applies itself.  Returns the constant scale and the targets of any other op on the way
    (the caller refuses the model if there are any)."""
    down = _reachable(lm, lambda n: n.users)
    up = _reachable(ce, lambda n: n.all_input_nodes)
    allowed = _LOGIT_PLUMBING | (_SOFTCAP_OPS if softcap else set())
    scale, odd = 1.0, set()
    for n in down & up:
        if n.target in allowed:
            continue
        if n.target in _SCALE_OPS and isinstance(n.args[1], (int, float)) and not isinstance(n.args[1], bool) \
                and (n.args[0] in down or n.args[0] is lm) and n.args[1] != 0:
            scale *= float(n.args[1]) ** _SCALE_OPS[n.target]
            continue
        odd.add(str(n.target))
    return scale, odd
