"""A compiled block (``frontend/compiled.py``) in the runtime: forward, and the gradients of its backward.

The compiled forward returns the block's outputs and the tensors its backward needs; those are packed into
``saved[j] mb`` exactly as an eager block's saved tensors are (``saved.Packer``), so keep, offload to host or
NVMe, reload, free and recompute handle them the same way and ``verify``'s accounting holds.  The backward
takes them, unpacked, with the gradients of the outputs that need one (zeros for an output no later block
differentiated), and returns one gradient per argument: what ``handlers.backward`` accumulates, as it does
the gradients ``torch.autograd.grad`` gives an eager block.
"""

from __future__ import annotations

import torch

from ..frontend.compiled import CompiledBlock
from .context import GpuParams, Step
from .saved import Packer, SavedRecord, unpack


def _args(ctx: Step, j: int, params: dict, inputs: dict) -> list[torch.Tensor]:
    bc = ctx.run.program.blocks[j]
    try:
        return [params[n] for n in bc.param_names] + [inputs[n] for n in bc.input_names]
    except KeyError as e:
        raise KeyError(f"block {j} ({bc.name}) needs {e.args[0]!r}") from None


def forward(ctx: Step, j: int, cb: CompiledBlock, params: GpuParams, a_in: dict,
            save: bool) -> tuple[dict, SavedRecord | None, dict]:
    """(outputs by name, the record backward reads, ``saved[j]``'s entries) of one forward of block ``j``;
    without ``save`` the forward that returns no saved tensors (``cb.infer``) and no record."""
    bc = ctx.run.program.blocks[j]
    args = _args(ctx, j, params.views, a_in)
    if not save:
        return dict(zip(bc.output_names, cb.forward_only(args))), None, {}
    outs, saved = cb.forward(args)
    rec = SavedRecord(block=j)
    entries: dict = {}
    packer = Packer(rec, entries, params.flats)
    rec.handles = [packer.pack(t) for t in saved]
    names = [*bc.param_names, *bc.input_names]
    for k in cb.part.tangents:
        rec.roots.append((bc.output_names[k], None, tuple(outs[k].shape), outs[k].dtype))
    for k, i in cb.part.passthrough.items():
        if cb.specs[i].grad:
            rec.direct[bc.output_names[k]] = names[i]
    return dict(zip(bc.output_names, outs)), rec, entries


def gradients(ctx: Step, rec: SavedRecord, dout: dict) -> tuple[list[str], list[str], list]:
    """(trained parameter names, input names, their gradients in that order) of a compiled block's backward."""
    j = rec.block
    cb: CompiledBlock = ctx.run.program.compiled[j]
    bc = ctx.run.program.blocks[j]
    saved = [unpack(rec, h) for h in rec.handles]
    tangents = []
    for name, _, shape, dtype in rec.roots:
        g = dout.get(name)
        tangents.append(torch.zeros(shape, dtype=dtype, device=ctx.run.device) if g is None else g)
    grads = cb.backward(saved, tangents)
    del saved, tangents
    n_p = len(bc.param_names)
    pidx = [i for i in range(n_p) if cb.specs[i].grad]
    lidx = [i for i in range(n_p, len(cb.specs)) if cb.specs[i].grad]
    return ([bc.param_names[i] for i in pidx], [bc.input_names[i - n_p] for i in lidx],
            [grads[i] for i in (*pidx, *lidx)])
