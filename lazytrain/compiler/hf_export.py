"""What a Hugging Face causal LM needs around ``torch.export`` (``trace_export``): attention called with
``is_causal`` instead of a mask tensor where that is the same thing, and a check of what the head does
to the logits before the cross-entropy, which the chunked loss (``program.py``) must reproduce."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

aten = torch.ops.aten


CAUSAL_ATTENTION = "lazytrain_causal"


def _every_layer_full_causal(cfg, seq_len: int) -> bool:
    """Would a plain causal mask equal the mask this config builds for an unpadded sequence of ``seq_len``?
    A sliding window or an attention chunk at least ``seq_len`` long changes nothing."""
    window = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    short_window = window is not None and window < seq_len
    short_chunk = chunk is not None and chunk < seq_len
    types = getattr(cfg, "layer_types", None)
    if not types:
        return not (short_window and getattr(cfg, "use_sliding_window", True)) and not short_chunk
    plain = {"full_attention": True, "sliding_attention": not short_window, "chunked_attention": not short_chunk}
    return all(plain.get(t, False) for t in types)


def use_causal_flag(clone: nn.Module, seq_len: int) -> bool:
    """Make a Hugging Face meta clone call SDPA with ``is_causal=True`` and no mask tensor.

    Exported as is, the model builds its mask from the position ids (packed-sequence detection cannot
    be decided at trace time) and passes a boolean ``(b, 1, s, s)`` tensor to SDPA, which rules out the
    flash kernel on the GPU and makes the mask a value that crosses block boundaries.  We train on
    unpadded (right-padded, ``-100``-labelled) sequences without an attention mask, so the mask is the
    causal one; an attention implementation that Hugging Face has no mask function for gets
    ``attention_mask=None`` and its SDPA path sets ``is_causal``.  Only for SDPA models whose every
    layer is plainly causal at this length (no sliding window or chunk shorter than ``seq_len``)."""
    cfg = getattr(clone, "config", None)
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not _every_layer_full_causal(cfg, seq_len):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:   # an older transformers: keep the mask
        return False
    AttentionInterface.register(CAUSAL_ATTENTION, sdpa_attention_forward)
    cfg._attn_implementation = CAUSAL_ATTENTION
    return True


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
