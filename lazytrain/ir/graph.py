"""The model as streaming blocks: what the compiler knows about a model, as plain data.

Every figure here is *per sample* (micro-batch of 1) at the traced sequence length; activation
bytes, saved bytes and FLOPs all scale linearly with the micro-batch size, so the compiler can
search micro-batch sizes without tracing again.  Parameter figures are element counts; their
byte size depends on the dtype the plan streams them in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # networkx loads where a graph is built (``dataflow``, the cost graph), not with the IR
    import networkx as nx

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1, "float64": 8,
               "int8": 1, "uint8": 1}

#: fewest vocabulary columns a loss-head chunk takes, so its matmul stays a large GEMM [ledger: loss-head-single-pass]
LOSS_MIN_COLUMNS = 256


#: a chunk's columns (its logits' row stride) are a multiple of this where at least as many [ledger: loss-column-align]
LOSS_COLUMN_ALIGN = 128


#: a row of a chunk's logits (and of their gradient) starts every this many elements: in a half-precision model the
#: matrix is allocated ``rows x padded_row(columns)`` and used through its first ``columns``, so a vocabulary that
#: is no multiple of 8 (gpt2's 50,257, a Llama with one added token) still gives the GEMMs 16-byte aligned rows (a
#: single-pass chunk's rows are counted at the padded width whatever the dtype) [ledger: logit-row-align]
LOGIT_ROW_ALIGN = 8
#: tokens a tiled tail's chunk (``frontend/tiling.py``; here for the compiler, which decides where to tile without
#: importing torch): a 7B MLP chunk's intermediates (4096 x 18,944, four of them, bf16) are 0.6 GB, and each
#: chunk's matmuls (4096 x 3584 x 18,944) are still large enough to run at full GEMM efficiency
TILE_TOKENS = 4096
#: a layer doing fewer FLOPs per token than this share of 2 per parameter uses only some of its parameters per
#: token (``ModelGraph.active_params``); a dense layer does about 1 (its norms' weights do no matmul)
SPARSE_SHARE = 0.75


def padded_row(columns: int) -> int:
    """The row stride, in elements, of a chunk of logits ``columns`` wide (``LOGIT_ROW_ALIGN``)."""
    return -(-columns // LOGIT_ROW_ALIGN) * LOGIT_ROW_ALIGN


def loss_chunk_columns(chunk_logits: int, rows: int, vocab: int) -> int:
    """Vocabulary columns per chunk of the fused loss head for ``rows`` tokens: ``chunk_logits`` logits (never
    more: the chunk's price), rounded down to a multiple of ``LOSS_COLUMN_ALIGN``, at least ``LOSS_MIN_COLUMNS``,
    at most the vocabulary (data here: the runtime and the summary share it)."""
    cols = chunk_logits // max(rows, 1)
    if cols >= LOSS_COLUMN_ALIGN:
        cols -= cols % LOSS_COLUMN_ALIGN
    return max(1, min(vocab, max(LOSS_MIN_COLUMNS, cols)))


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """A value crossing a block boundary (per sample): name, shape without the batch dim, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = False   # depends on parameters: backward sends a gradient for it

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """One parameter of a block.  ``owner`` is the block that updates it: a tied parameter
    (e.g. lm_head sharing the embedding) is listed in every block that reads it, with the
    owner's index, and its gradient is accumulated into the owner's before the owner's update."""

    name: str
    shape: tuple[int, ...]
    owner: int
    #: False for a parameter with ``requires_grad=False`` at trace time (a LoRA base weight): it streams in, but has
    #: no gradient, no optimizer state and no update (its host copy is its load buffer alone)
    trainable: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True, kw_only=True)
class Cut:
    """One way a compiled block splits its work between forward and backward (``frontend/cuts.py``): the
    partitioner's activation memory ``budget`` that gives it (1.0: the min-cut, what ``Block.saved_bytes``
    counts), the bytes its forward saves, and the FLOPs its backward recomputes beyond the min-cut backward's
    (``recompute_attn_flops`` of them fused attention).  Per sample, as every figure of a block."""

    budget: float
    saved_bytes: int
    recompute_flops: int = 0
    recompute_attn_flops: int = 0


@dataclass(frozen=True, kw_only=True)      # no slots: the element counts below are cached per block
class Block:
    """The unit that streams through the GPU: embedding, one decoder layer, or head + loss."""

    index: int
    name: str                     # module path, e.g. "model.layers.3"
    kind: str                     # "embed" | "layer" | "head" | "other"
    params: tuple[ParamSpec, ...]
    inputs: tuple[TensorSpec, ...]   # values entering from earlier blocks (per sample)
    outputs: tuple[TensorSpec, ...]  # values this block produces for later blocks (per sample)
    saved_bytes: int              # bytes autograd saves for backward (per sample)
    workspace_bytes: int          # transient peak above inputs/outputs/saved (per sample)
    fwd_flops: int                # per sample
    bwd_flops: int                # per sample
    workspace_fixed_bytes: int = 0   # transient that does not grow with the micro-batch (a loss chunk)
    backward_workspace_bytes: int = 0  # its backward's transient (per sample) where above workspace_bytes
    fwd_ops: int = 0              # ops of the forward program: each is issued from Python (dispatch floor)
    # the fused attention's share of fwd_flops / bwd_flops (per sample, as the kernel computes them: causal
    # is half the square, backward 2.5x forward), and the head dimension and key length its rate depends on
    attn_fwd_flops: int = 0
    attn_bwd_flops: int = 0
    attn_head_dim: int = 0
    attn_kv_len: int = 0
    #: the cuts the compiler may choose from (``Decisions.cut`` indexes them), the min-cut first; empty for a
    #: block that runs eager or has one cut: it saves ``saved_bytes``
    cuts: tuple[Cut, ...] = ()

    @cached_property
    def param_numel(self) -> int:
        """Elements this block loads (tied links included); computed once (a block is immutable, and the
        lowering, verify and the cost model ask for it per op)."""
        return sum(p.numel for p in self.params)

    @cached_property
    def owned_numel(self) -> int:
        """Elements this block updates; computed once."""
        return sum(p.numel for p in self.params if p.owner == self.index)

    @cached_property
    def trainable_numel(self) -> int:
        """Owned elements that train: what the optimizer's state, master copy and update cover."""
        return sum(p.numel for p in self.params if p.owner == self.index and p.trainable)

    @cached_property
    def frozen_numel(self) -> int:
        """Owned elements that do not train: only in the load buffer (parameter dtype, or the base's bits)."""
        return self.owned_numel - self.trainable_numel

    @cached_property
    def grad_numel(self) -> int:
        """Elements of the block's gradient: every trainable parameter it reads (owned or a tied link); 0 for a
        frozen block, which then has no gradient offload."""
        return sum(p.numel for p in self.params if p.trainable)


@dataclass(frozen=True, kw_only=True)      # no slots: ``all_readers`` is cached per graph
class ModelGraph:
    """A model as a chain of blocks plus the per-sample bytes live at each boundary.

    ``boundary_bytes[i]`` is what is live between block i-1 and block i (i = 0: the model's
    inputs; i = L: the loss).  A boundary is every value produced before the cut and read after
    it, so skip connections and glue values (rotary tables, masks) are counted where they live.
    """

    name: str
    seq_len: int
    dtype: str                    # compute dtype the activation figures were traced in
    blocks: tuple[Block, ...]
    boundary_bytes: tuple[int, ...]
    boundary_values: tuple[tuple[str, ...], ...] = ()  # names of the values live at each boundary
    edges: tuple[tuple[int, int], ...] = ()   # dataflow block -> block (beyond the chain)
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.boundary_bytes) != len(self.blocks) + 1:
            raise ValueError("boundary_bytes needs one entry per block boundary (L + 1)")

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def total_params(self) -> int:
        """Distinct parameters (tied ones counted once)."""
        return sum(b.owned_numel for b in self.blocks)

    @property
    def trainable_params(self) -> int:
        """Distinct parameters that train (all of them but a frozen base's)."""
        return sum(b.trainable_numel for b in self.blocks)

    @property
    def frozen_params(self) -> int:
        return self.total_params - self.trainable_params

    @property
    def active_params(self) -> int:
        """The parameters a token's forward uses, what the model FLOPs (``6 * active_params * tokens``) count:
        ``total_params`` for a dense model.  A layer whose forward, attention apart, does fewer than
        ``SPARSE_SHARE`` x 2 FLOPs per token per parameter uses some of them per token (a mixture of experts, each
        token routed to a few): it counts the parameters those FLOPs use (2 a token each), so a MoE's model FLOPs
        are those of the experts that run, not of all of them (Qwen3-Next-80B, 3B active: 718 "model TFLOPS"
        on one H200 otherwise)."""
        total = 0
        for b in self.blocks:
            used = (b.fwd_flops - b.attn_fwd_flops) / max(self.seq_len, 1) / 2
            sparse = b.kind == "layer" and b.param_numel and used < SPARSE_SHARE * b.param_numel
            total += round(b.owned_numel * used / b.param_numel) if sparse else b.owned_numel
        return total

    def readers(self, owner: int) -> tuple[int, ...]:
        """The blocks that read block ``owner``'s parameters, in block order: ``owner`` itself and every
        block a tied parameter links to it.  Their gradients are what ``owner``'s update consumes, and
        their loads copy what that update writes."""
        return self.all_readers()[owner]

    def all_readers(self) -> tuple[tuple[int, ...], ...]:
        """``readers`` of every block, in one pass over the parameters, once per graph (the GPU-update rule's
        candidates ask for every block's tie group in each of its ~100 builds)."""
        return self._readers_table

    @cached_property
    def _readers_table(self) -> tuple[tuple[int, ...], ...]:
        out: list[set[int]] = [{j} for j in range(len(self.blocks))]
        for b in self.blocks:
            for p in b.params:
                out[p.owner].add(b.index)
        return tuple(tuple(sorted(r)) for r in out)

    def owners(self, block: int) -> tuple[int, ...]:
        """The blocks whose parameters ``block`` reads (itself included), in block order: the inverse of
        ``readers``, what its ``load`` copies from."""
        return tuple(sorted({p.owner for p in self.blocks[block].params} | {block}))

    @property
    def attention_model_flops(self) -> int:
        """Per-sample attention FLOPs of one training step as the model defines them (not as a kernel
        runs them): each block's attention forward and a backward of twice it, causal as half the square,
        no recomputation.  Added to ``6 * total_params * seq`` for the model FLOPs with attention."""
        return 3 * sum(b.attn_fwd_flops for b in self.blocks)

    @property
    def dataflow(self) -> nx.DiGraph:
        """Blocks as nodes, an edge for each producer -> consumer pair (the chain plus skips)."""
        import networkx as nx
        g = nx.DiGraph()
        g.add_nodes_from(range(self.n_blocks))
        g.add_edges_from((i, i + 1) for i in range(self.n_blocks - 1))
        g.add_edges_from(self.edges)
        for b in self.blocks:
            for p in b.params:
                if p.owner != b.index:
                    g.add_edge(p.owner, b.index, tied=True)
        return g

    def fingerprint(self) -> str:
        """Structure hash: block kinds, names, parameter names and shapes, seq and dtype.
        A plan carries it and refuses a model whose structure differs."""
        desc = [(b.kind, b.name, [(p.name, list(p.shape), p.owner, *(() if p.trainable else (False,)))
                                  for p in b.params]) for b in self.blocks]
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]

    def block_signature(self, j: int) -> str:
        """What a block's measured time depends on, without its name: kind, parameter shapes, the shapes
        and dtypes it reads and writes, its per-sample FLOPs, bytes and op count, the sequence length
        and dtype.  Structurally identical blocks (the middle layers, a model traced with fewer layers)
        share it, so one measurement serves them all (``compiler.block_timing.BlockTiming``)."""
        b = self.blocks[j]

        def specs(ts):
            return [(list(t.shape), t.dtype, t.requires_grad) for t in ts]
        shapes = [list(p.shape) if p.trainable else [*p.shape, "frozen"] for p in b.params]
        desc = [b.kind, shapes, specs(b.inputs), specs(b.outputs), b.saved_bytes,
                b.workspace_bytes, b.fwd_flops, b.bwd_flops, b.fwd_ops, self.seq_len, self.dtype]
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        d = asdict(self)
        d["meta"] = dict(self.meta)
        for b in d["blocks"]:
            if not b["cuts"]:         # an eager block's JSON is what it was before cuts existed
                del b["cuts"]
            for p in b["params"]:     # ... and a trainable parameter's what it was before frozen ones were
                if p["trainable"]:
                    del p["trainable"]
        return d

    @staticmethod
    def from_json(d: dict) -> ModelGraph:
        blocks = tuple(
            Block(**{**b,
                     "params": tuple(ParamSpec(name=p["name"], shape=tuple(p["shape"]), owner=p["owner"],
                                               trainable=bool(p.get("trainable", True)))
                                     for p in b["params"]),
                     "inputs": tuple(TensorSpec(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"],
                                                requires_grad=bool(t.get("requires_grad", False)))
                                     for t in b["inputs"]),
                     "outputs": tuple(TensorSpec(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"],
                                                 requires_grad=bool(t.get("requires_grad", False)))
                                      for t in b["outputs"]),
                     "cuts": tuple(Cut(**c) for c in b.get("cuts", ()))})
            for b in d["blocks"])
        return ModelGraph(name=d["name"], seq_len=d["seq_len"], dtype=d["dtype"], blocks=blocks,
                          boundary_bytes=tuple(d["boundary_bytes"]),
                          boundary_values=tuple(tuple(v) for v in d.get("boundary_values", ())),
                          edges=tuple(tuple(e) for e in d.get("edges", ())), meta=dict(d.get("meta", {})))
