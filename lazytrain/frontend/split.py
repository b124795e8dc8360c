"""The exported program cut into blocks: ``split`` assigns every node of a ``torch.export`` graph to a
block by its ``nn_module_stack`` and builds one fx ``GraphModule`` per block, whose inputs are the values
crossing the cut and the block's lifted parameters (``trace_export.py`` says which node goes where and why).

Nodes are rewritten for the device the blocks run on: fused attention and ``histc`` by functions that pick
their kernel by device (``sdpa``, ``histc``), device constants retargeted, export-only asserts dropped.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from .hf_export import labels_shifted, logits_path, node_arg
from .trace_export import BlockCode, LossHead, Split, TraceError, find_layers, histc, sdpa

aten = torch.ops.aten


def _stack_paths(n: fx.Node) -> list[str]:
    st = n.meta.get("nn_module_stack") or {}
    return [v[0] for v in st.values()]


def _retarget(x, device):
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device(device)
    return x


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
