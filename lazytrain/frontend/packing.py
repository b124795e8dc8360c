"""Packed batches in the traced program: per-example positions and a document mask.

A packed row holds several examples back to back.  Trained as the same examples unpadded, each
token must see only the earlier tokens of its own example, at the position it would have alone.
Hugging Face causal LMs (transformers 5) already do this when they are given ``position_ids`` and no
2-D attention mask: ``masking_utils.find_packed_sequence_indices`` numbers the examples of a row
where the position does not grow by one (``cumsum(diff(position_ids) != 1)``), and the causal mask is
intersected with "same example".  Under ``torch.export`` that detection cannot ask whether a row is
packed, so it is always built: the exported program takes ``position_ids`` as an input, computes the
boolean ``(b, 1, s, s)`` mask in the embedding block, and every layer's attention reads it.

What that costs the plan is counted like any other value: the mask crosses block boundaries
(``s * s`` bytes a sample, in ``ModelGraph.boundary_bytes``), rotary tables become per-sample
(``(b, s, head_dim)``), and attention runs with a mask instead of ``is_causal`` (no flash kernel on
the GPU; the memory-efficient kernel takes the mask).  ``use_causal_flag`` (``hf_export``) is not
applied to packed exports, since the flag's ``is_causal`` would attend across examples.

``check_document_mask`` makes sure the exported attention really reads a mask derived from
``position_ids``: an architecture that builds its mask some other way would otherwise silently
attend across examples.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from .hf_export import is_hf
from .trace_error import TraceError

aten = torch.ops.aten

_ATTENTION = {aten.scaled_dot_product_attention.default}
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}


def packed_inputs(clone: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The extra example inputs of a packed export: ``position_ids`` like ``ids`` (a distinct tensor,
    or export would alias the two)."""
    if not is_hf(clone):
        raise TraceError(f"{type(clone).__name__}: packing needs a Hugging Face causal LM (its attention builds "
                         f"the per-example mask from position_ids); train this model unpacked")
    return {"position_ids": torch.zeros(ids.shape, dtype=torch.long, device=ids.device)}


def check_document_mask(ep, name: str) -> None:
    """Every attention of the exported program reads a mask computed from ``position_ids``: SDPA's
    ``attn_mask``, or, for eager attention, the scores that reach a softmax over ``(s, s)``."""
    g: fx.Graph = ep.graph_module.graph
    pos = next((n for n in g.nodes if n.op == "placeholder" and n.name == "position_ids"), None)
    if pos is None:
        raise TraceError(f"{name}: the packed export does not read position_ids")
    from_pos: set[fx.Node] = {pos}
    for n in g.nodes:            # topological order: one pass finds everything derived from the positions
        if n not in from_pos and any(a in from_pos for a in n.all_input_nodes):
            from_pos.add(n)
    checked = 0
    for n in g.nodes:
        if n.op != "call_function":
            continue
        if n.target in _ATTENTION:
            mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            ok = isinstance(mask, fx.Node) and mask in from_pos
        elif n.target in _SOFTMAX and _square_scores(n):
            ok = n in from_pos and _mask_reaches(n, from_pos)
        else:
            continue
        checked += 1
        if not ok:
            raise TraceError(f"{name}: attention {n.name} does not take a mask derived from position_ids, so "
                             f"packed examples would attend to each other; train this model without --pack")
    if not checked:
        raise TraceError(f"{name}: found no attention in the exported program to give the per-example mask; "
                         f"train this model without --pack")


def _square_scores(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == val.shape[-2] and val.shape[-1] > 1


def _mask_reaches(softmax: fx.Node, from_pos: set[fx.Node]) -> bool:
    """Is a ``(…, s, s)`` tensor derived from the positions (the mask, not the rotary tables) an
    ancestor of these attention scores?"""
    stack, seen = [softmax], set()
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a in from_pos and a.op == "call_function" and _square_scores(a) and a.meta["val"].dtype == torch.bool:
                return True
            stack.append(a)
    return False
