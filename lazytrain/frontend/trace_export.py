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

Large models are exported with only three layers (first, one middle, last) when all layers are
structurally identical; the middle layer's code then serves every middle layer of the full model.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from .hf_export import TensorsFromData, export_hf, labels_shifted, logits_path, node_arg

aten = torch.ops.aten


class TraceError(ValueError):
    """The model could not be turned into blocks; the message says what failed and where."""


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
        return _draws_random(self.gm)


def _draws_random(gm: fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        if n.op == "call_function" and _node_draws(n):
            return True
        if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), fx.GraphModule) and \
                _draws_random(getattr(gm, n.target)):
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

def meta_clone(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A structural copy on ``meta`` with floating parameters in ``dtype``; no weight is copied.

    The copy is in training mode whatever mode ``model`` is in (``from_pretrained`` returns a model in
    eval mode): a plan is a training step, so dropout is on where the model's config asks for it, as
    ``model.train()`` would have it.  Set the config's dropout to 0 to train without."""
    memo: dict[int, object] = {}
    for p in model.parameters(recurse=True):
        if id(p) not in memo:
            dt = dtype if p.is_floating_point() else p.dtype
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dt, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(model, memo).train()


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The repeated layers: the ModuleList of same-typed children holding the most parameters."""
    best, best_n = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = (name, m), n
    return best


def is_hf(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "model_type") and hasattr(model, "get_input_embeddings")


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


def reducible(model: nn.Module) -> bool:
    """Are all layers structurally identical, so three of them stand for all?"""
    found = find_layers(model)
    if found is None or isinstance(model, nn.Sequential) or len(found[1]) <= 4:
        return False
    _, layers = found
    if len({_layer_signature(m) for m in layers}) != 1:
        return False
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return not types or len(set(types)) == 1


def reduce_layers(clone: nn.Module, keep: int = 3) -> nn.Module:
    """Keep layers 0, 1 and the last (renumbered 0, 1, 2) of a meta clone, in place."""
    prefix, layers = find_layers(clone)
    parent_name, _, attr = prefix.rpartition(".")
    parent = clone.get_submodule(parent_name) if parent_name else clone
    kept = [layers[0], layers[1], layers[len(layers) - 1]][:keep]
    setattr(parent, attr, nn.ModuleList(kept))
    cfg = getattr(clone, "config", None)
    if cfg is not None and hasattr(cfg, "num_hidden_layers"):
        cfg.num_hidden_layers = len(kept)
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types[: len(kept)])
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
            raise TraceError("an nn.Sequential needs example_inputs=(x, target) and loss_fn(output, target)")
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
            from .packing import packed_inputs  # packing.py builds on this module's export
            kwargs.update(packed_inputs(clone, ids))

    def run():
        with TensorsFromData():
            return torch.export.export(root, (), kwargs, strict=False)
    try:
        ep = export_hf(clone, seq_len, run) if is_hf(clone) and not packed else run()
    except Exception as e:  # noqa: BLE001 - re-raised with the failing module named
        raise TraceError(f"torch.export failed on {type(clone).__name__}: {_short(e)}") from None
    if packed:
        from .packing import check_document_mask  # (as above)
        check_document_mask(ep, type(clone).__name__)
    return ep, root


def _to_meta_batch(t: torch.Tensor, micro_batch: int) -> torch.Tensor:
    t = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return t[:1].expand(micro_batch, *t.shape[1:]).contiguous()


def _short(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


# ----------------------------------------------------------------------------------------- split

def _stack_paths(n: fx.Node) -> list[str]:
    st = n.meta.get("nn_module_stack") or {}
    return [v[0] for v in st.values()]


def _retarget(x, device):
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device(device)
    return x


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention``; on ``meta`` it runs the fused (flash-style) kernel's meta
    function so saved-for-backward bytes match a fused GPU kernel (O(s) per head, not O(s^2))."""
    if q.device.type == "meta" and dropout_p == 0.0:
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
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


#: aten ops replaced by functions that choose their kernel by the device they run on
_SUBSTITUTES = {aten.scaled_dot_product_attention.default: sdpa, aten.histc.default: histc}


_SKIP = {aten._assert_tensor_metadata.default}


def split(ep, root: nn.Module, *, device="meta", buffers: dict[str, torch.Tensor] | None = None,
          sequential: bool = False) -> Split:
    """Partition the exported graph into blocks and build one GraphModule per block: name the graph's
    inputs, assign each node to a block, find the loss head, cut (what each block needs and which values
    cross which cut), name the crossing values, then build each block's GraphModule."""
    g = ep.graph_module.graph
    sig = ep.graph_signature
    ph_param, ph_const, user_inputs = _graph_inputs(sig, root)
    roots, prefix = _block_roots(root, sequential)
    n_blocks = len(roots) + (0 if sequential else 2)
    tail = n_blocks - 1
    members = _assign_blocks(g, root, roots, n_blocks, 0 if sequential else 1)
    if sequential:
        head_roots, loss = [next(n for n in g.nodes if n.op == "output").args[0][0]], None
    else:
        head_roots, loss = _loss_head(g, root, members[tail], ph_param, user_inputs)
    plan = _cut(g, members, head_roots, loss, ph_param, ph_const)
    names = [_block_name(root, roots, b, tail, sequential) for b in range(n_blocks)]
    vname = {n: n.name for n in g.nodes if n.op == "placeholder" and n.name in user_inputs}
    for b in range(n_blocks):
        layer = not sequential and 0 < b < tail
        for k, n in enumerate(plan[b][1]):
            vname[n] = f"{names[b]}.out{k}" if layer else f"{names[b]}.{n.name}"
    values = _crossing_values(g, vname, ph_param)
    bufs = _constants(ep, sig, buffers)
    blocks = []
    for b in range(n_blocks):
        needed, outs, ext, hroots = plan[b]
        kind = "other" if sequential else ("embed" if b == 0 else "head" if b == tail else "layer")
        extra = [] if b != tail or loss is None else [loss.weight] + ([loss.bias] if loss.bias else [])
        gm, pnames = _build_gm(members[b], needed, outs + hroots, ext, ph_param, ph_const, vname, ep, bufs,
                               device, extra)
        blocks.append(BlockCode(name=names[b], kind=kind, gm=gm, param_names=pnames,
                                input_names=[vname[a] for a in ext], output_names=[vname[n] for n in outs],
                                loss=loss if b == tail else None, user_loss=sequential and b == tail))
    return Split(blocks=blocks, values=values, user_inputs=list(user_inputs), layers_prefix=prefix)


def _graph_inputs(sig, root: nn.Module) -> tuple[dict, dict, list]:
    """The exported graph's placeholders: parameter -> its canonical name (a tied parameter's first
    name), buffer or constant -> its target, and the user inputs."""
    canon = {}
    by_id = {}
    for name, p in root.named_parameters():
        by_id.setdefault(id(p), name)
    for fqn in sig.inputs_to_parameters.values():
        canon[fqn] = by_id[id(root.get_parameter(fqn))]
    ph_param = {k: canon[v] for k, v in sig.inputs_to_parameters.items()}
    ph_const = dict(sig.inputs_to_buffers)
    ph_const.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}))
    return ph_param, ph_const, [s for s in sig.user_inputs]


def _block_roots(root: nn.Module, sequential: bool) -> tuple[list[str], str | None]:
    """The module path of each streamed layer (each child of an ``nn.Sequential``), and the layers' prefix."""
    if sequential:
        return [name for name, _ in root.named_children() if name != "loss_fn"], None
    found = find_layers(root)
    if found is None:
        raise TraceError(f"{type(root).__name__}: found no nn.ModuleList of repeated layers to stream")
    prefix = found[0]
    return [f"{prefix}.{i}" for i in range(len(found[1]))], prefix


def _assign_blocks(g: fx.Graph, root: nn.Module, roots: list[str], n_blocks: int, offset: int) -> list[list]:
    """Each computing node's block, in graph order: a layer's nodes by their module path, the nodes
    between layers with the layer before them, everything after the last layer in the tail."""
    root_idx = {r: i for i, r in enumerate(roots)}
    tail = n_blocks - 1
    nodes = [n for n in g.nodes if n.op == "call_function" and n.target not in _SKIP]
    layer_of = {}
    for n in nodes:
        for path in _stack_paths(n):
            if path in root_idx:
                layer_of[n] = root_idx[path] + offset
                break
    if not layer_of:
        raise TraceError(f"{type(root).__name__}: no graph node was attributed to a layer ({roots[0]} ...)")
    last_layer_pos = max(i for i, n in enumerate(nodes) if n in layer_of)
    block_of, cur = {}, 0
    for i, n in enumerate(nodes):
        if n in layer_of:
            cur = layer_of[n]
        elif i > last_layer_pos:
            cur = tail
        block_of[n] = cur
    members = [[] for _ in range(n_blocks)]
    for n in nodes:
        members[block_of[n]].append(n)
    for n in nodes:
        for a in n.all_input_nodes:
            if a in block_of and block_of[a] > block_of[n]:
                raise TraceError(f"node {n.name} in {_where(n)} reads {a.name} computed in a later block")
    return members


def _loss_head(g: fx.Graph, root: nn.Module, tail_nodes: list, ph_param: dict, user_inputs: list):
    """The head stops at the input of the last linear reading a parameter, if one cross-entropy of a
    causal LM follows it: (the head's roots, the ``LossHead`` the chunked loss computes)."""
    lin = [n for n in tail_nodes if n.target is aten.linear.default and n.args[1].op == "placeholder"
           and n.args[1].name in ph_param]
    if not lin:
        raise TraceError(f"{type(root).__name__}: no LM head (linear over a parameter) after the last layer")
    lm = lin[-1]
    ce = [n for n in tail_nodes if n.target is aten.cross_entropy_loss.default]
    if len(ce) != 1:
        raise TraceError(f"{type(root).__name__}: the head does not end in one cross_entropy (found {len(ce)})")
    c = ce[0]
    if node_arg(c, 2, "weight") is not None or node_arg(c, 5, "label_smoothing", 0.0) != 0.0 or \
       node_arg(c, 4, "ignore_index", -100) != -100:
        raise TraceError("the model's cross_entropy uses class weights, label smoothing or an ignore_index "
                         "other than -100; the chunked loss does not reproduce that")
    bias = node_arg(lm, 2, "bias")
    softcap = getattr(getattr(root, "config", None), "final_logit_softcapping", None)
    scale, odd = logits_path(lm, c, softcap)
    if odd:
        raise TraceError(f"{type(root).__name__}: the head transforms the logits before the cross-entropy "
                         f"({', '.join(sorted(odd))}); the chunked loss does not reproduce that")
    if "labels" not in user_inputs:
        raise TraceError("the model takes no 'labels' input")
    lab = next(n for n in g.nodes if n.op == "placeholder" and n.name == "labels")
    if not labels_shifted(c, lab):
        raise TraceError(f"{type(root).__name__}: its loss compares each position's logits with the label at "
                         "the same position (no shift to the next token): not a causal LM loss, which the "
                         "chunked loss computes; LazyTrain trains decoder-only causal LMs")
    loss = LossHead(weight=ph_param[lm.args[1].name], bias=None if bias is None else ph_param[bias.name],
                    labels="labels", softcap=float(softcap) if softcap else None, scale=scale)
    return [lm.args[0]], loss


def _cut(g: fx.Graph, members: list[list], head_roots: list, loss, ph_param: dict, ph_const: dict) -> list:
    """A reverse pass over the blocks: per block (the nodes it needs, its outputs that later blocks
    read, the values it reads from earlier blocks or the user, the head's roots in the tail)."""
    tail = len(members) - 1
    required: set[fx.Node] = set()
    plan = [None] * len(members)
    for b in reversed(range(len(members))):
        mem = set(members[b])
        outs = [n for n in members[b] if n in required]
        # in-place writes have no users (``k = x.new_empty(...); k[..., :d].copy_(a)``): keep them all
        roots_b = outs + (head_roots if b == tail else []) + [n for n in members[b] if _mutates(n)]
        needed, stack = set(), list(roots_b)
        while stack:
            n = stack.pop()
            if n in needed or n not in mem:
                continue
            needed.add(n)
            stack.extend(n.all_input_nodes)
        ext = []
        for n in members[b]:
            if n in needed:
                for a in n.all_input_nodes:
                    if a not in mem and a not in ext and a.op != "get_attr" and not (a.op == "placeholder" and
                                                               (a.name in ph_param or a.name in ph_const)):
                        ext.append(a)
        if b == tail and loss is not None:
            lab = next(n for n in g.nodes if n.op == "placeholder" and n.name == "labels")
            if lab not in ext:
                ext.append(lab)
        required |= set(ext)
        plan[b] = (needed, outs, ext, head_roots if b == tail else [])
    return plan


def _block_name(root: nn.Module, roots: list[str], b: int, tail: int, sequential: bool) -> str:
    """Block ``b``'s name: the layer's module path, the embedding's, or ``head``."""
    if sequential:
        return roots[b]
    if b == 0:
        emb = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
        for name, m in root.named_modules():
            if (emb is not None and m is emb) or (emb is None and isinstance(m, nn.Embedding)):
                return name.rpartition(".")[0] if emb is None and "." in name else name
        return "embed"
    if b == tail:
        return "head"
    return roots[b - 1]


def _crossing_values(g: fx.Graph, vname: dict, ph_param: dict) -> dict:
    """Each value crossing a cut: (shape, dtype, whether it depends on a parameter: needs a gradient)."""
    param_dep = _param_dependence(g, ph_param)
    values = {}
    for n, name in vname.items():
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise TraceError(f"value {n.name} crossing a block boundary is not a tensor ({type(val).__name__})")
        values[name] = (tuple(val.shape), val.dtype, bool(param_dep[n] and val.is_floating_point()))
    return values


def _constants(ep, sig, buffers: dict | None) -> dict:
    """The buffers the blocks are built with: a lifted constant with its values (a tensor attribute, a
    table ``rope.fix_rope_length`` fixed) is what the graph was traced with, even where the model has a
    buffer of the same name."""
    bufs = dict(buffers or {})
    for target in getattr(sig, "inputs_to_lifted_tensor_constants", {}).values():
        t = ep.constants.get(target)
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            bufs[target] = t
    return bufs


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


def _mutates(n: fx.Node) -> bool:
    """Does the node write into one of its inputs (an in-place or ``out=`` op)?"""
    return isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable


def _where(n: fx.Node) -> str:
    paths = _stack_paths(n)
    return paths[-1] if paths else "<root>"


def _param_dependence(g: fx.Graph, ph_param: dict) -> dict:
    dep = {}
    for n in g.nodes:
        dep[n] = (n.op == "placeholder" and n.name in ph_param) or any(dep.get(a, False) for a in n.all_input_nodes)
    return dep


def _fix_graph(gm: fx.GraphModule, device) -> None:
    """In a nested graph: drop metadata asserts, use our attention, move meta devices to ``device``."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _SKIP and not n.users:
            gm.graph.erase_node(n)
            continue
        n.target = _SUBSTITUTES.get(n.target, n.target)
        n.args = tree_map(lambda x: _retarget(x, device), n.args)
        n.kwargs = tree_map(lambda x: _retarget(x, device), n.kwargs)
        if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), fx.GraphModule):
            _fix_graph(getattr(gm, n.target), device)
    gm.recompile()


def _build_gm(members, needed, outs, ext, ph_param, ph_const, vname, ep, bufs, device, extra=()):
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    pnames: list[str] = []
    used_params = []
    for n in members:
        if n in needed:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a.name in ph_param and ph_param[a.name] not in used_params:
                    used_params.append(ph_param[a.name])
    used_params += [p for p in extra if p not in used_params]   # read by the chunked loss, not the graph
    p_nodes = {}
    for pn in used_params:
        p_nodes[pn] = g.placeholder("p_" + pn.replace(".", "_"))
        pnames.append(pn)
    for a in ext:
        env[a] = g.placeholder("in_" + "".join(c if c.isalnum() else "_" for c in vname[a]))
    holder = nn.Module()
    consts = {}

    def lookup(a):
        if a in env:
            return env[a]
        if a.op == "get_attr":   # a higher-order op's body (e.g. an autocast region) or a constant
            if a.target not in consts:
                obj = ep.graph_module.get_submodule(a.target) if isinstance(
                    getattr(ep.graph_module, a.target, None), nn.Module) else getattr(ep.graph_module, a.target)
                attr = "s_" + "".join(c if c.isalnum() else "_" for c in a.target)
                if isinstance(obj, fx.GraphModule):
                    sub = copy.deepcopy(obj)
                    _fix_graph(sub, device)
                    holder.add_module(attr, sub)
                elif isinstance(obj, torch.Tensor):
                    holder.register_buffer(attr, obj.detach().to(device))
                else:
                    setattr(holder, attr, copy.deepcopy(obj))
                consts[a.target] = g.get_attr(attr)
            return consts[a.target]
        if a.op == "placeholder" and a.name in ph_param:
            return p_nodes[ph_param[a.name]]
        if a.op == "placeholder" and a.name in ph_const:
            target = ph_const[a.name]
            if target not in consts:
                t = bufs.get(target)
                if t is None:
                    t = ep.constants.get(target) if target in ep.constants else ep.state_dict.get(target)
                if t is None:
                    raise TraceError(f"constant {target} has no value")
                if t.device.type == "meta" and torch.device(device).type != "meta":
                    raise TraceError(f"buffer {target} is on the meta device; build the model on a real device "
                                     "(or materialise its buffers) before building a program for " + str(device))
                attr = "c_" + "".join(c if c.isalnum() else "_" for c in target)
                holder.register_buffer(attr, t.detach().to(device))
                consts[target] = g.get_attr(attr)
            return consts[target]
        raise TraceError(f"internal: {a.name} is not available in this block")

    for n in members:
        if n not in needed:
            continue
        new = g.node_copy(n, lookup)
        new.target = _SUBSTITUTES.get(new.target, new.target)
        new.args = tree_map(lambda x: _retarget(x, device), new.args)
        new.kwargs = tree_map(lambda x: _retarget(x, device), new.kwargs)
        env[n] = new
    g.output(tuple(env[n] for n in outs))
    return fx.GraphModule(holder, g), pnames
