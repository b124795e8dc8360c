"""Rotary tables whose frequencies depend on the sequence length, decided at trace time.

Hugging Face's ``dynamic_rope_update`` decorates a rotary module's forward: for dynamic NTK
(``rope_type`` "dynamic") it recomputes the inverse frequencies when ``max(position_ids) + 1`` exceeds
the length it cached, and for longrope it picks the long or the short factors by that length.  Both
read a value of the positions tensor, which ``torch.export`` cannot decide on ``meta`` ("Could not
guard on data-dependent expression").  A plan's sequence length is fixed and its position ids are
``arange(seq_len)`` for every micro-batch (a shorter batch is padded on the right), so the branch is
decided here instead: each such module of the meta clone gets the frequencies a freshly loaded model
computes at ``seq_len``, as a constant with its values (computed on the CPU from the config, with the
model's own ``rope_init_fn``), and a forward without the update.

What eager computes depends on history for dynamic NTK (its cache only grows past the pretrained
length and resets below it); the plan computes what a fresh model computes at the plan's length,
which is what eager training at one fixed length does from its first step on.  Rope types without a
length-dependent update (linear, YaRN, llama3) are fixed at the model's construction and traced as
they are.
"""

from __future__ import annotations

import torch
from torch import nn


def _update_wrapper_code():
    """The code object of ``dynamic_rope_update``'s wrapper (one for every decorated forward), or None."""
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:
        return None
    return getattr(dynamic_rope_update(lambda self, x, position_ids: None), "__code__", None)


def _length_dependent(rope_type) -> bool:
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def fix_rope_length(clone: nn.Module, seq_len: int) -> list[str]:
    """Replace length-dependent rotary updates in a meta clone by the tables of ``seq_len`` (see the
    module docstring); returns the module paths changed.  The original model is not touched."""
    code = _update_wrapper_code()
    if code is None:
        return []
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    changed = []
    for path, m in clone.named_modules():
        fwd = type(m).__dict__.get("forward")
        if getattr(fwd, "__code__", None) is not code or not hasattr(m, "rope_type"):
            continue
        per_layer = isinstance(m.rope_type, dict)
        kinds = m.rope_type.items() if per_layer else [(None, m.rope_type)]
        todo = [(lt, rt) for lt, rt in kinds if _length_dependent(rt)]
        if not todo:
            continue
        for layer_type, rope_type in todo:
            kwargs = {"layer_type": layer_type} if layer_type is not None else {}
            length = seq_len
            if "dynamic" in rope_type:
                # eager passes max(position_ids) + 1, an int64 tensor (its arithmetic then runs in fp32), and
                # only past the pretrained length; below it the table is the one built at construction
                grows = seq_len > getattr(m, "original_max_seq_len", m.config.max_position_embeddings)
                length = torch.tensor(seq_len, dtype=torch.int64) if grows else None
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](m.config, torch.device("cpu"), seq_len=length,
                                                               **kwargs)
            name = f"{layer_type}_inv_freq" if layer_type is not None else "inv_freq"
            m._buffers.pop(name, None)
            # a plain tensor attribute: torch.export lifts it as a constant that keeps its values
            object.__setattr__(m, name, inv_freq.float())
            if "dynamic" in rope_type:   # eager's update sets the module-wide scaling (1.0 for dynamic NTK)
                m.attention_scaling = scaling
        m.forward = fwd.__wrapped__.__get__(m)
        changed.append(path)
    return changed
