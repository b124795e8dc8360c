"""Checks of a training batch against the model, before any of it reaches the device.

A token id past the embedding, or a label past the head, fails deep inside an embedding or a
cross-entropy kernel (on the GPU as an asynchronous device assert that poisons the process), after
the step has half run.  These checks run on the batch as given, in microseconds, and say which
value is wrong.  An ``attention_mask`` is honoured where a plan can honour it exactly: right
padding (each row ones, then zeros).  Under causal attention no real token attends to a later pad,
so the padded positions only need their labels ignored; left padding would shift positions and
needs the mask inside attention, which the plan's causal kernels do not take.  For the same reason a
batch shorter than the plan (fewer rows, or shorter rows: the last batch of an epoch) is padded on
the right with ignored labels, which changes no gradient (the loss is a mean over counted tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from ..frontend.loss_head import IGNORE


def token_limits(model: nn.Module, plan) -> tuple[int, int] | None:
    """(input id bound, label bound) of a causal LM, or None for a model of other inputs."""
    if not plan.graph.blocks or plan.graph.blocks[0].kind != "embed":
        return None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    classes = head.out_features if isinstance(head, nn.Linear) else emb.num_embeddings
    return emb.num_embeddings, classes


def as_tokens(value, name: str) -> torch.Tensor:
    """``value`` as a tensor, or a ValueError naming the key (a string, a ragged list, None)."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be a [batch, seq] tensor of token ids, got {type(value).__name__} "
                         f"({str(e).splitlines()[0]})") from None


def check_shapes(ids: torch.Tensor, labels: torch.Tensor, batch: int, seq: int) -> None:
    """2-D, not empty, no longer and no wider than the plan's [batch, seq], and ids and labels alike."""
    for name, t in (("input_ids", ids), ("labels", labels)):
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D [batch, seq], got shape {tuple(t.shape)}")
        if t.shape[0] == 0 or t.shape[1] == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): a step needs at least one row of at "
                             f"least one token")
        if t.shape[1] > seq:
            raise ValueError(f"{name} has sequence length {t.shape[1]} but the plan was compiled for seq_len "
                             f"{seq}: recompile the plan with seq_len={t.shape[1]} (or truncate the batch)")
        if t.shape[0] > batch:
            raise ValueError(f"{name} has {t.shape[0]} rows but the plan was compiled for batch {batch}: split the "
                             f"batch, or recompile with batch_size={t.shape[0]}")
    if ids.shape != labels.shape:
        raise ValueError(f"input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} differ in shape")


def check_tokens(ids: torch.Tensor, labels: torch.Tensor, mask, n_ids: int, n_classes: int):
    """Validated (ids, labels); labels under a right-padding ``mask``'s zeros become ``IGNORE``."""
    for name, t in (("input_ids", ids), ("labels", labels)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n_ids:
        raise ValueError(f"input_ids must lie in [0, {n_ids}) (the model's vocabulary), got values in [{lo}, {hi}]")
    valid = labels != IGNORE
    if bool(valid.any()):
        lo, hi = int(labels[valid].min()), int(labels[valid].max())
        if lo < 0 or hi >= n_classes:
            raise ValueError(f"labels must lie in [0, {n_classes}) or be {IGNORE} (ignored), "
                             f"got values in [{lo}, {hi}]")
    if mask is None:
        return ids, labels
    mask = torch.as_tensor(mask)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 and 1 only")
    keep = mask.to(device=labels.device, dtype=torch.bool)
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError("attention_mask has a 1 after a 0 (left or inner padding): a plan runs causal attention, "
                         "so pad on the right (ones, then zeros) and the padding is exact")
    return ids, labels.masked_fill(~keep, IGNORE)


def pad_batch(ids: torch.Tensor, labels: torch.Tensor, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) padded on the right to [batch, seq]: id 0 and label ``IGNORE``."""
    b, s = ids.shape
    if (b, s) == (batch, seq):
        return ids, labels
    out_ids = ids.new_zeros((batch, seq))
    out_labels = labels.new_full((batch, seq), IGNORE)
    out_ids[:b, :s] = ids
    out_labels[:b, :s] = labels
    return out_ids, out_labels


def packed_keys(packed: bool) -> set[str]:
    """Batch keys a packed plan takes beyond input_ids, labels and attention_mask."""
    return {"position_ids"} if packed else set()


def check_positions(positions, ids: torch.Tensor) -> torch.Tensor:
    """``position_ids`` of a packed batch: integer, shaped like ``input_ids``, >= 0.  Each example of a row
    counts from 0 (``frontend/packing.py``: a position that does not grow by one starts an example)."""
    positions = torch.as_tensor(positions)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"position_ids must hold integer positions, got dtype {positions.dtype}")
    if tuple(positions.shape) != tuple(ids.shape):
        raise ValueError(f"position_ids has shape {tuple(positions.shape)}, input_ids {tuple(ids.shape)}")
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError("position_ids must be >= 0 (each packed example counts from 0)")
    return positions.long()


def pad_positions(positions: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """``position_ids`` padded like ``pad_batch`` pads the ids: the padding of a row continues its last
    example's count (ignored labels, and later than every real token, so no real token sees it); a
    padding row counts from 0."""
    b, s = positions.shape
    if (b, s) == (batch, seq):
        return positions
    out = torch.arange(seq, dtype=torch.long).repeat(batch, 1)
    out[:b, :s] = positions
    if s < seq and b:
        out[:b, s:] = positions[:, -1:] + torch.arange(1, seq - s + 1)
    return out
