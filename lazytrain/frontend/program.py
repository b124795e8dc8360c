"""The executable form of a model: one function per block, run on whatever tensors it is given.

``build_split(model, ...)`` exports a meta clone of the model (``trace_export``) and keeps one fx
``GraphModule`` per block, parameters lifted to inputs, so the runtime passes each block the buffers
it streamed in and never mutates the model; ``trace.build_program`` adds the model's graph (unmeasured)
and makes them a ``BlockProgram``.  The program is specialised to (micro_batch, seq_len)
and to ``dtype`` (casts inside the model, e.g. RMSNorm's, are recorded in that dtype).

The last block of a causal LM returns ``{"loss_sum", "n_tokens"}``: the summed next-token
cross-entropy of the micro-batch and the number of labels that are not -100, fused with the LM head's
matmul over vocabulary chunks of about ``loss_chunk_logits`` logits (``loss_head.py``; the compiler
chooses the chunk, ``compiler/loss_chunk.py``), so at most one chunk of logits (and its gradient)
exists at a time.  The last block of an ``nn.Sequential`` returns
``loss_fn(output, target)`` as ``loss_sum`` with ``n_tokens = 1``, so the runtime's normalisation
averages the micro-batch losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from ..ir import ModelGraph
from .loss_head import DEFAULT_CHUNK_LOGITS, fused_next_token_loss
from .loss_kernels import LossKernels, compiled_loss_kernels
from .split import split as split_graph
from .tiling import tile_split
from .trace_export import BlockCode, Split, TraceError, export, kinds_kept, layer_kinds, meta_clone, reducible


@dataclass
class BlockProgram:
    """Per-block code of one model at one (micro_batch, seq_len, dtype, device)."""

    graph: ModelGraph
    blocks: list[BlockCode] = field(default_factory=list, repr=False)
    micro_batch: int = 1
    seq_len: int = 0
    loss_chunk_logits: int = DEFAULT_CHUNK_LOGITS
    #: the fused loss head forms its gradients in the forward (``loss_head.py``; the compiler's choice)
    loss_single_pass: bool = False
    packed: bool = False                # takes position_ids: examples packed into rows (``packing.py``)
    #: name -> (shape at ``micro_batch``, dtype, needs grad) of every value crossing a block boundary
    values: dict = field(default_factory=dict, repr=False)
    #: block -> its Inductor-compiled forward and backward (``compiled.py``; set by the runtime when the plan
    #: asks for compiled blocks); a block not in it runs ``run_block``
    compiled: dict = field(default_factory=dict, repr=False)
    #: the fused loss head's per-chunk work compiled (``loss_kernels.py``; set with the blocks unless ``compile`` is
    #: told ``loss_kernels=False``), else eager; set to None at any time, the eager passes run (an A/B of the two)
    loss_kernels: LossKernels | None = field(default=None, repr=False)

    def run_block(self, j: int, params: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> dict:
        """Forward of block j with the given parameter tensors; inputs by name (extra keys ignored)."""
        bc = self.blocks[j]
        try:
            args = [params[n] for n in bc.param_names] + [inputs[n] for n in bc.input_names]
        except KeyError as e:
            raise KeyError(f"block {j} ({bc.name}) needs {e.args[0]!r}") from None
        outs = bc.gm(*args)
        if bc.loss is not None:
            lh = bc.loss
            loss, n = fused_next_token_loss(outs[0], params[lh.weight], None if lh.bias is None else params[lh.bias],
                                            inputs[lh.labels], self.loss_chunk_logits, lh.softcap, lh.scale,
                                            self.loss_kernels, self.loss_single_pass)
            return {"loss_sum": loss, "n_tokens": n}
        if bc.user_loss:
            return {"loss_sum": outs[0], "n_tokens": torch.ones((), dtype=torch.int64, device=outs[0].device)}
        return dict(zip(bc.output_names, outs))

    def compile(self, device: torch.device, *, param_dtype: torch.dtype, frozen: frozenset[str],
                requires_grad: frozenset[str], infer: set[int] = frozenset(), compile_fn=None,
                budgets: dict[int, float] | None = None, loss_kernels: bool = True):
        """Compile the block programs (``compiled.py``) on ``device`` for arguments as the runtime passes them:
        parameters in ``param_dtype`` (gradients unless ``frozen``), inputs at this program's shapes (gradients
        for floating inputs in ``requires_grad``); ``infer``: blocks also run forward without saving; ``budgets``:
        each block's cut as the partitioner's activation memory budget (``cuts.py``; absent: the min-cut);
        ``loss_kernels``: the fused loss head's per-chunk work compiled too (False: its eager passes).
        -> ``CompileReport``."""
        from .compiled import compile_blocks, contiguous_spec, inductor
        shapes = {p.name: p.shape for b in self.graph.blocks for p in b.params}
        specs = []
        for bc in self.blocks:
            sp = [contiguous_spec(shapes[n], param_dtype, n not in frozen) for n in bc.param_names]
            for n in bc.input_names:
                shape, dt, _ = self.values[n]
                sp.append(contiguous_spec(shape, dt, n in requires_grad and dt.is_floating_point))
            specs.append(sp)
        self.compiled, report = compile_blocks(self.blocks, specs, device, infer=set(infer),
                                               compile_fn=compile_fn or inductor, budgets=budgets)
        if loss_kernels and compile_fn is None and any(bc.loss is not None for bc in self.blocks):
            self.loss_kernels = compiled_loss_kernels()
        return report

    def param_names(self, j: int) -> list[str]:
        return [p.name for p in self.graph.blocks[j].params]

    def batch_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor,
                     position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The values of boundary 0 (the model's inputs) for one micro-batch; a packed program's
        ``position_ids`` default to one example a row (0, 1, 2, ...)."""
        if not self.packed:
            return {"input_ids": input_ids, "labels": labels}
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def build_split(model: nn.Module, *, micro_batch: int, seq_len: int, device, dtype, example_inputs=None,
                loss_fn=None, packed: bool = False, seq_tile: int | None = None) -> Split:
    """Export (two layers when the layers are identical, three when their programs differ: ``same_code``; a few
    of each kind where there are several kinds: ``kinds_kept``; the whole model where a reduced export's code
    cannot stand for every layer), split, expand to the full depth, and tile the layers' position-wise tails
    when ``seq_tile`` is given; ``packed``: with ``position_ids`` and the per-example mask (``packing.py``)."""
    sequential = isinstance(model, nn.Sequential)
    buffers = real_buffers(model, device)

    def exported(keep):
        clone = meta_clone(model, dtype, keep=keep)
        ep, root = export(clone, micro_batch, seq_len, example_inputs, loss_fn, packed=packed)
        return split_graph(ep, root, device=device, buffers=buffers, sequential=sequential)

    sp = _reduced(model, exported) or exported(None)
    names = {n for b in sp.blocks for n in b.param_names}
    missing = [n for n, _ in model.named_parameters() if n not in names]
    sp.meta["unused_params"] = missing
    sp.meta["packed"] = packed
    if seq_tile:
        tiled = tile_split(sp, seq_tile, micro_batch, seq_len, dict(model.named_parameters()))
        if tiled:
            sp.meta["seq_tile"] = {"tokens": seq_tile, "blocks": tiled}
    return sp


def _reduced(model: nn.Module, exported) -> Split | None:
    """The split of a reduced export expanded to every layer, or None where there is none to make or its code
    cannot stand for every layer (``expand`` says why; the caller exports the whole model)."""
    kinds = layer_kinds(model)
    if kinds is None:
        return None
    n = len(kinds)
    if reducible(model, kinds):
        try:
            sp = exported(2)
            if same_code(sp):
                return expand(sp, n)
            return expand(exported(3), n)         # layer 0's program differs: layer 1's serves the middle
        except TraceError:
            return None
    kept = kinds_kept(kinds)
    if kept is None:
        return None
    try:
        sp = exported(kept)
        pos = {i: r for r, i in enumerate(kept)}
        first: dict = {}
        for i in kept[1:-1]:
            if kinds[i] in first and not same_code(sp, pos[first[kinds[i]]], pos[i]):
                return None                       # two layers of a kind run different code
            first.setdefault(kinds[i], i)
        templates = [0] + [pos[first[kinds[j]]] for j in range(1, n - 1)] + [len(kept) - 1]
        return expand(sp, n, templates)
    except Exception:  # noqa: BLE001 - a clone of some layers that fails to export: the whole model's export decides
        return None


def real_buffers(model: nn.Module, device) -> dict[str, torch.Tensor]:
    """The model's buffers; those left on ``meta`` (a model built on meta, e.g. rotary ``inv_freq``) are
    recomputed by constructing their module again on the CPU from the model's config, when possible."""
    buffers = dict(model.named_buffers())
    if torch.device(device).type == "meta" or all(b.device.type != "meta" for b in buffers.values()):
        return buffers
    cfg = getattr(model, "config", None)
    for mod_name, mod in model.named_modules():
        own = [n for n, b in mod.named_buffers(recurse=False) if b.device.type == "meta"]
        if not own or cfg is None:
            continue
        try:
            with torch.device("cpu"):
                fresh = type(mod)(cfg)
        except Exception:  # noqa: BLE001 - left on meta; split() names the buffer in its error
            continue
        for n in own:
            b = getattr(fresh, n, None)
            if isinstance(b, torch.Tensor) and b.shape == buffers[f"{mod_name}.{n}".lstrip(".")].shape:
                buffers[f"{mod_name}.{n}".lstrip(".")] = b
    return buffers


def same_code(sp: Split, a: int = 0, b: int = 1) -> bool:
    """Is exported layer ``b``'s program layer ``a``'s, up to the names of its parameters and inputs?  In a
    two-layer export (0 and 1), layer 1's code then serves every layer after the first: it computes what layer 0
    computes, reads layer 0's outputs where layer 0 reads the embedding's, and outputs what the next layer (or
    the head) reads, since layer 0's outputs are what layer 1 reads; no node between two layers (which would
    join layer 0's block and not the last layer's) can hide."""
    la, lb = sp.blocks[1 + a], sp.blocks[1 + b]
    pre = sp.layers_prefix
    if [n.replace(f"{pre}.{a}.", f"{pre}.{b}.", 1) for n in la.param_names] != lb.param_names or \
            [sp.values[n] for n in la.input_names] != [sp.values[n] for n in lb.input_names]:
        return False
    return _op_sequence(la.gm) == _op_sequence(lb.gm)


def _op_sequence(gm) -> list[tuple]:
    """A graph's nodes as (op, target, arguments), every node argument replaced by its position."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}

    def ref(n):
        return ("node", pos[n])
    return [(n.op, n.target if n.op != "placeholder" else None, fx.node.map_arg(n.args, ref),
             fx.node.map_arg(n.kwargs, ref)) for n in gm.graph.nodes]


def expand(sp: Split, n_layers: int, templates: list[int] | None = None) -> Split:
    """Blocks of a reduced export -> blocks of the n-layer model: layer ``j`` runs exported layer ``templates[j]``'s
    code with its names renamed (its parameters and outputs to layer ``j``'s, what it reads of the layer before
    to layer ``j - 1``'s).  Default: of a 3-layer export, layer 1's code serves layers 1..n-2 and layer 2's the
    last; of a 2-layer export whose layers are the same code (``same_code``), layer 1's serves layers 1..n-1.
    ``TraceError`` where a layer reads more than the layer before it gives, or the head more than the last."""
    pre = sp.layers_prefix
    emb, *kept, head = sp.blocks
    last = len(kept) - 1               # the exported last layer
    if templates is None:
        templates = [0] + [1] * (n_layers - 2) + [last]
    outside = set(sp.user_inputs) | set(emb.output_names)
    for r in sorted(set(templates[1:])):
        if not set(kept[r].input_names) <= outside | set(kept[r - 1].output_names) or \
                kept[r].gm.graph.find_nodes(op="get_attr"):
            raise TraceError(f"{pre}.{r} reads values other than the previous layer's; cannot replicate layers")
    if not set(head.input_names) <= outside | set(kept[last].output_names):
        raise TraceError("the head reads values from layers before the last; cannot replicate layers")

    def rename(name: str, r: int, j: int) -> str:
        for rr, jj in ((r, j), (r - 1, j - 1)):
            if rr >= 0 and name.startswith(f"{pre}.{rr}."):
                return f"{pre}.{jj}." + name[len(f"{pre}.{rr}."):]
        return name

    for j in range(1, n_layers):       # what layer j reads of layer j - 1 is what layer j - 1's code gives
        r, before = templates[j], templates[j - 1]
        for n in kept[r].input_names:
            if n.startswith(f"{pre}.{r - 1}."):
                given = rename(n, r - 1, before)
                if given not in kept[before].output_names or sp.values[given] != sp.values[n]:
                    raise TraceError(f"layer {j} reads {n} of the layer before, which layer {j - 1}'s code "
                                     "does not give; cannot replicate layers")

    def relabel(bc: BlockCode, r: int, j: int, name: str | None = None) -> BlockCode:
        return BlockCode(name=name or rename(bc.name + ".", r, j)[:-1], kind=bc.kind, gm=bc.gm,
                         param_names=[rename(n, r, j) for n in bc.param_names],
                         input_names=[rename(n, r, j) for n in bc.input_names],
                         output_names=[rename(n, r, j) for n in bc.output_names], loss=bc.loss,
                         user_loss=bc.user_loss)

    layers = [kept[0]] + [relabel(kept[templates[j]], templates[j], j) for j in range(1, n_layers)]
    head2 = relabel(head, last + 1, n_layers, name=head.name)
    values = {k: v for k, v in sp.values.items() if not k.startswith(f"{pre}.")}
    values.update({k: sp.values[k] for k in kept[0].output_names})
    for j in range(1, n_layers):
        for k in kept[templates[j]].output_names:
            values[rename(k, templates[j], j)] = sp.values[k]
    return Split(blocks=[emb, *layers, head2], values=values, user_inputs=sp.user_inputs, layers_prefix=pre,
                 meta={**sp.meta, "replicated_from": len(kept)})
