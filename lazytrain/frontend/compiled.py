"""Compiled block programs: a block's forward and backward compiled by Inductor, with the tensors saved
for backward in the runtime's hands.

``compile(..., compile_blocks=True)`` asks for it (``plan.options["compile_blocks"]``); the ``Trainer``
compiles the plan's block programs when it starts (``compile_program``).  How one block is compiled:

1. the joint graph: ``aot_export_joint_simple`` traces the block's fx program and its backward together on
   fake tensors, decomposed as Inductor decomposes;
2. the partition: ``min_cut_rematerialization_partition`` (the cut ``torch.compile`` trains with) splits it
   into a forward returning ``(outputs..., saved...)`` and a backward taking ``(saved..., output
   gradients...)`` and returning one gradient per argument.  It saves what is expensive to recompute
   (matmul and attention outputs) and recomputes cheap pointwise and normalisation ops in the backward;
   or, at the cut the plan chose for the block (``Decisions.cut``, ``cuts.py``), saves less and recomputes
   more in the backward;
3. each half compiled by Inductor (``compile_fx_inner``: static shapes, no CUDA graphs, whose private
   memory pool would sit outside the plan's accounting).  A block the plan runs forward without saving
   (a recomputed block's first forward) also gets the forward without its saved outputs (``infer``).

There is no autograd graph and no ``saved_tensors_hooks`` in a compiled block: the runtime calls the two
halves itself and stores the saved list in ``saved[j]`` (``runtime/compiled_block.py``), so keep,
offload to host or NVMe, reload and recompute move exactly those tensors, as for an eager block.

What is compiled: every block but the head with the fused loss (its chunked autograd is hand-written,
``loss_head.py``), a block that draws random numbers (its recomputation replays the generator through
eager kernels, ``rng.py``) and a block with a tiled tail (``tiling.py`` recomputes it chunk by chunk);
those run eager.  Blocks whose programs are the same code (identical layers: the structure of the graph,
not its names, plus every argument's shape, stride, dtype and gradient flag; ``structure_key``) and cuts
share one compiled pair.  Across runs Inductor's FX graph cache serves a program compiled before (in
``~/.cache/lazytrain/inductor``, or ``TORCHINDUCTOR_CACHE_DIR`` when the process set one).  A block whose
Inductor compile fails runs its partition's forward and backward graphs uncompiled (``_uncompiled``): the same
saved tensors as the plan's cut, so only its time changes (eager autograd would save the whole forward's
activations, more than the cut); a block whose partition fails runs eager.  One warning names every such block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx

from .cuts import CUT_BUDGETS, graph_flops
from .cuts import budget as cut_budget
from .tiling import run_tail
from .trace_export import BlockCode


@dataclass(frozen=True)
class ArgSpec:
    """One argument of a block program as the compiled code expects it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    grad: bool                  # its gradient is computed (a trained parameter, an input that needs one)


def contiguous_spec(shape, dtype: torch.dtype, grad: bool) -> ArgSpec:
    shape = tuple(int(s) for s in shape)
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return ArgSpec(shape=shape, stride=tuple(reversed(stride)), dtype=dtype, grad=grad)


def why_eager(bc: BlockCode) -> str | None:
    """Why block ``bc`` is not compiled (None: it is)."""
    if bc.loss is not None or bc.user_loss:
        return "the loss head"
    if bc.random:
        return "draws random numbers"
    if any(n.target is run_tail for n in bc.gm.graph.nodes if n.op == "call_function"):
        return "tiled tail"
    return None


def structure_key(gm: fx.GraphModule, specs: list[ArgSpec], device: torch.device) -> str:
    """The block program's code without its names (identical layers share it) and its arguments.  A graph
    reading constants (``get_attr``) is keyed by its own identity: its constants are not compared."""
    index: dict[fx.Node, int] = {}

    def arg(a):
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(arg(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{arg(v)}" for k, v in sorted(a.items())) + "}"
        return repr(a)

    def target(t) -> str:
        return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', str(t))}"

    lines = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op == "get_attr":
            lines.append(f"own {id(gm)}")
        lines.append(f"{n.op} {'' if n.op == 'placeholder' else target(n.target)} {arg(n.args)} {arg(n.kwargs)}")
    lines += [f"{s.shape} {s.stride} {s.dtype} {s.grad}" for s in specs] + [str(device)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]


# ---- partition ----------------------------------------------------------------------------------------
@dataclass
class Partition:
    """A block program cut into forward and backward graphs (AOTAutograd's joint graph, partitioned)."""

    fw: fx.GraphModule          # (*args) -> (*outputs, *saved)
    bw: fx.GraphModule          # (*saved, *tangents) -> one gradient (or None) per argument
    n_outputs: int              # outputs the forward computes (passthrough outputs excluded)
    tangents: tuple[int, ...]   # indices into the program's outputs whose gradients the backward takes
    passthrough: dict[int, int] = field(default_factory=dict)  # output index -> argument it returns unchanged

    @property
    def n_saved(self) -> int:
        return len(self.fw.graph.output_node().args[0]) - self.n_outputs


def _fake_args(specs: list[ArgSpec], device: torch.device, mode) -> list[torch.Tensor]:
    with mode:
        return [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device).requires_grad_(s.grad)
                for s in specs]


@dataclass
class Joint:
    """A block program's joint forward + backward graph (AOTAutograd), before it is cut: ``cut`` partitions a
    copy, so one joint serves every cut of the program (``propose``)."""

    graph: fx.GraphModule
    args: list                  # the fake arguments it was traced at
    n_outputs: int              # outputs the forward computes (passthrough outputs excluded)
    grad_out: list[int]         # indices into the program's outputs whose gradients the backward takes
    passthrough: dict[int, int]


def joint(gm: fx.GraphModule, specs: list[ArgSpec], device) -> Joint:
    """The joint forward + backward of ``gm`` at ``specs``, decomposed as Inductor decomposes."""
    from torch._functorch.aot_autograd import aot_export_joint_simple
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device(device)
    outs = list(gm.graph.output_node().args[0])
    places = {n: i for i, n in enumerate(gm.graph.nodes) if n.op == "placeholder"}
    order = list(places)
    passthrough = {k: order.index(o) for k, o in enumerate(outs) if isinstance(o, fx.Node) and o in places}
    kept = [k for k in range(len(outs)) if k not in passthrough]

    def fn(*args):
        res = gm(*args)
        return tuple(res[k] for k in kept)

    mode = FakeTensorMode(allow_non_fake_inputs=True)      # constants (rotary tables) stay real
    args = _fake_args(specs, device, mode)
    with mode:
        probe = fn(*args)
    grad_out = [kept[k] for k, o in enumerate(probe) if isinstance(o, torch.Tensor) and o.requires_grad]
    graph = aot_export_joint_simple(fn, args, trace_joint=True, decompositions=select_decomp_table())
    return Joint(graph=graph, args=args, n_outputs=len(kept), grad_out=grad_out, passthrough=passthrough)


def cut(j: Joint, n_params: int, budget: float = 1.0) -> Partition:
    """A copy of the joint graph cut by the min-cut rematerialization partitioner (parameters have a static
    lifetime: saving one costs nothing, the runtime passes it again) at activation memory budget ``budget``
    (1.0: min-cut; less: ``cuts.py``).  The partitioner rewrites the graph it is given, hence the copy."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with cut_budget(budget):
        fw, bw = min_cut_rematerialization_partition(_copy(j.graph), j.args, num_fwd_outputs=j.n_outputs,
                                                     static_lifetime_input_indices=list(range(n_params)))
    n_tan = sum(1 for n in bw.graph.nodes if n.op == "placeholder" and str(n.target).startswith("tangents"))
    if n_tan != len(j.grad_out):
        raise RuntimeError(f"the backward takes {n_tan} output gradients, {len(j.grad_out)} outputs need one")
    return Partition(fw=fw, bw=bw, n_outputs=j.n_outputs, tangents=tuple(j.grad_out), passthrough=j.passthrough)


def propose(gm: fx.GraphModule, specs, device, n_params: int) -> list[tuple[float, int, int, int]]:
    """The distinct cuts of block program ``gm`` (its joint graph, ``cut`` at each of ``CUT_BUDGETS``):
    (budget, saved bytes, backward FLOPs beyond the min-cut backward's, of them attention), min-cut first, each
    later one saving fewer bytes than every one before it."""
    out: list[tuple[float, int, int, int]] = []
    base = None
    whole = joint(gm, specs, device)
    for b in CUT_BUDGETS:
        part = cut(whole, n_params, budget=b)
        nbytes = saved_bytes(part, n_params)
        flops, attn = graph_flops(part.bw)
        if base is None:
            base = (flops, attn)
        if out and nbytes >= out[-1][1]:
            continue
        out.append((b, nbytes, max(flops - base[0], 0), max(attn - base[1], 0)))
    return out


#: joint graphs by ``structure_key``, each with the program it was traced from (held, so that a key naming a
#: program by its identity is not reused while the entry lives): one joint serves every cut of a program, in one
#: compile and across the trainers a calibration starts, one per cut (``calibrate.cut_timings``).  Tracing the
#: joint is most of a compile without Inductor (~1 s of a tiny Qwen2 layer's ~1.3 s on the CPU); a model has a
#: few distinct programs, so a few entries suffice.
_JOINTS: dict[str, tuple[fx.GraphModule, Joint]] = {}
JOINT_CACHE_ENTRIES = 8


def _joint_of(key: str, gm: fx.GraphModule, specs: list[ArgSpec], device) -> Joint:
    """``joint(gm, specs, device)``, from ``_JOINTS`` when the program was traced before under ``key``."""
    if key not in _JOINTS:
        while len(_JOINTS) >= JOINT_CACHE_ENTRIES:
            del _JOINTS[next(iter(_JOINTS))]
        _JOINTS[key] = (gm, joint(gm, specs, device))
    return _JOINTS[key][1]


def saved_bytes(part: Partition, n_params: int) -> int:
    """Bytes the partition's forward saves for backward: storages of the saved values, each once, parameters
    excluded (the runtime passes the loaded ones again), the block's inputs included (as the eager count)."""
    places = [n for n in part.fw.graph.nodes if n.op == "placeholder"]
    params = {_storage(n.meta["val"]) for n in places[:n_params]}
    seen: dict = {}
    for n in part.fw.graph.output_node().args[0][part.n_outputs:]:
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        if isinstance(v, torch.Tensor):
            k = _storage(v)
            if k not in params:
                seen[k] = v.untyped_storage().nbytes()
    return sum(seen.values())


def _storage(t: torch.Tensor):
    return t.untyped_storage()._cdata


# ---- compile ------------------------------------------------------------------------------------------
def inductor(gm: fx.GraphModule, *, backward: bool = False, inference: bool = False):
    """``gm`` compiled by Inductor at the shapes its placeholders carry.  Inside a tracing context whose fake
    mode has a shape environment, as ``torch.compile`` calls it: Inductor's FX graph cache needs one."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)   # constants (rotary tables) stay real
    with mode:
        example = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                   for v in (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")]
    with V.set_fake_mode(mode), tracing(TracingContext(mode)):
        return compile_fx_inner(gm, example, is_backward=backward, is_inference=inference)


def _without_saved(part: Partition) -> fx.GraphModule:
    """The partition's forward returning only the outputs: what a forward that saves nothing runs."""
    g = fx.Graph()
    env: dict = {}
    for n in part.fw.graph.nodes:
        if n.op == "output":
            g.output(tuple(env[a] if isinstance(a, fx.Node) else a for a in n.args[0][:part.n_outputs]))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.eliminate_dead_code()
    return fx.GraphModule(part.fw, g)


@dataclass
class CompiledBlock:
    """One block program compiled: ``forward`` -> (outputs, saved), ``backward(saved, tangents)`` -> one
    gradient (or None) per argument, ``infer`` -> outputs (None unless the plan runs it)."""

    part: Partition
    specs: list[ArgSpec]
    fw: object
    bw: object
    infer: object | None = None
    key: str = ""

    def _args(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        return [_conform(a, s) for a, s in zip(args, self.specs, strict=True)]

    def _outputs(self, computed, args: list[torch.Tensor]) -> list[torch.Tensor]:
        it = iter(computed)
        n = self.part.n_outputs + len(self.part.passthrough)
        return [args[self.part.passthrough[k]] if k in self.part.passthrough else next(it) for k in range(n)]

    def forward(self, args: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        args = self._args(args)
        with torch.no_grad():
            res = list(self.fw(list(args)))
        return self._outputs(res[:self.part.n_outputs], args), res[self.part.n_outputs:]

    def forward_only(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        args = self._args(args)
        with torch.no_grad():
            return self._outputs(list(self.infer(list(args))), args)

    def backward(self, saved: list[torch.Tensor], tangents: list[torch.Tensor]) -> list[torch.Tensor | None]:
        with torch.no_grad():
            return list(self.bw([*saved, *(t.contiguous() for t in tangents)]))


def _conform(t: torch.Tensor, s: ArgSpec) -> torch.Tensor:
    """``t`` with the strides the compiled code was specialised to (a copy only where they differ)."""
    if tuple(t.shape) != s.shape or t.dtype != s.dtype:
        raise RuntimeError(f"a compiled block got {tuple(t.shape)} {t.dtype} where it was compiled for "
                           f"{s.shape} {s.dtype}")
    if tuple(t.stride()) == s.stride:
        return t
    return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=t.device).copy_(t)


@dataclass
class CompileReport:
    """What ``compile_program`` did: seconds, distinct programs compiled, Inductor cache hits, and the blocks
    left eager with the reason."""

    seconds: float = 0.0
    blocks: int = 0                 # blocks running compiled code
    programs: int = 0               # distinct compiled programs (identical layers share one)
    cache_hits: int = 0             # Inductor FX graph cache hits (a graph compiled in an earlier run)
    cache_misses: int = 0
    eager: dict[int, str] = field(default_factory=dict)
    #: blocks whose partition failed (they run eager) and whose Inductor compile failed (they run their partition's
    #: fx graphs uncompiled, ``_uncompiled``), with the error
    failed: dict[int, str] = field(default_factory=dict)
    uncompiled: dict[int, str] = field(default_factory=dict)
    #: the largest ratio over the compiled blocks of the bytes this device's partition saves to what the plan
    #: counted (the trace partitions on ``meta``; above 1 the plan's memory peak is optimistic); 0 before set
    saved_vs_plan: float = 0.0

    def line(self) -> str:
        text = (f"compiled {self.blocks} blocks ({self.programs} distinct programs) in {self.seconds:.1f} s, "
                f"Inductor cache {self.cache_hits} hits / {self.cache_misses} misses")
        if self.saved_vs_plan:
            text += f", saved bytes at most {self.saved_vs_plan:.2f}x the plan's"
        if self.eager or self.failed:
            text += f"; eager: {len(self.eager) + len(self.failed)} blocks"
        if self.uncompiled:
            text += f"; partitioned but not compiled (Inductor failed): {len(self.uncompiled)} blocks"
        return text

    def to_json(self) -> dict:
        return {"seconds": round(self.seconds, 3), "blocks": self.blocks, "programs": self.programs,
                "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
                "saved_vs_plan": round(self.saved_vs_plan, 4),
                "eager": {str(j): why for j, why in {**self.eager, **self.failed}.items()},
                "uncompiled": {str(j): why for j, why in self.uncompiled.items()}}


def _reason(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


def _uncompiled(part: Partition, specs: list[ArgSpec], key: str, with_infer: bool) -> CompiledBlock:
    """A block whose Inductor compile failed: its partition's fx graphs run as they are, with the compiled calling
    convention.  The same forward and backward graphs, so the same saved tensors (the plan's memory holds), only
    slower; ``part``'s graphs are copies taken before Inductor saw them (it may have rewritten those it failed on)."""
    def run(gm: fx.GraphModule):
        return lambda args: gm(*args)
    return CompiledBlock(part=part, specs=specs, fw=run(part.fw), bw=run(part.bw),
                         infer=run(_without_saved(part)) if with_infer else None, key=key)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph (nodes and their meta, shallow) in a module of its own."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, g)


def _failure_warning(rep: CompileReport, blocks: list[BlockCode]) -> str:
    """The one warning of a compile where blocks failed: which run their partition uncompiled (the plan's memory,
    slower) and which run eager (their partition failed: autograd saves more than the plan counted), and why."""
    parts = []
    for failed, what in ((rep.uncompiled, "Inductor failed: they run their partitioned forward and backward "
                                          "uncompiled, saving what the plan counted, slower"),
                         (rep.failed, "the partition failed: they run eager, and autograd saves more than the "
                                      "plan counted")):
        if failed:
            names = ", ".join(f"{j} ({blocks[j].name})" for j in sorted(failed))
            parts.append(f"blocks {names}: {what}; first error: {failed[min(failed)]}")
    n = len(rep.failed) + len(rep.uncompiled)
    return f"compile_blocks: {n} blocks could not be compiled: " + "; ".join(parts)


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lazytrain" / "inductor"


def use_cache_folder() -> None:
    """Inductor's caches in LazyTrain's folder (created private), unless this process chose a folder already:
    Inductor loads compiled code from it, so a folder another user can write is not used."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    folder = cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(folder)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def _counter(name: str) -> int:
    from torch._dynamo.utils import counters
    return int(counters["inductor"][name])


def compile_blocks(blocks: list[BlockCode], specs: list[list[ArgSpec]], device, *, infer: set[int] = frozenset(),
                   compile_fn=inductor, budgets: dict[int, float] | None = None
                   ) -> tuple[dict[int, CompiledBlock], CompileReport]:
    """Compile each block (``specs[j]``: its arguments, parameters first) once per distinct program and cut
    (``budgets[j]``: the activation memory budget of block j's cut, ``cuts.py``; 1.0, the min-cut, where
    absent); ``infer``: blocks that also need the forward without saved tensors.  A block that fails runs
    eager, and one warning names them all."""
    budgets = budgets or {}
    use_cache_folder()
    device = torch.device(device)
    rep = CompileReport()
    t0 = time.perf_counter()
    hits, misses = _counter("fxgraph_cache_hit"), _counter("fxgraph_cache_miss")
    groups: dict[str, list[int]] = {}
    for j, bc in enumerate(blocks):
        why = why_eager(bc)
        if why is not None:
            rep.eager[j] = why
        else:
            groups.setdefault((structure_key(bc.gm, specs[j], device), budgets.get(j, 1.0)), []).append(j)
    out: dict[int, CompiledBlock] = {}
    for (key, budget), members in groups.items():
        bc, sp = blocks[members[0]], specs[members[0]]
        n_params, with_infer = len(bc.param_names), bool(infer & set(members))
        try:
            part = cut(_joint_of(key, bc.gm, sp, device), n_params, budget=budget)
            # cut before compiling: Inductor rewrites the graph it compiles (not on a cache hit), and the forward-
            # only graph must be the same code every run for its own cache entry to hit; so must the fallback's
            only = _without_saved(part) if with_infer else None
            pristine = dataclasses.replace(part, fw=_copy(part.fw), bw=_copy(part.bw))
        except Exception as e:  # noqa: BLE001 - these blocks run eager; the warning names them and why
            rep.failed.update({j: _reason(e) for j in members})
            continue
        try:
            cb = CompiledBlock(part=part, specs=sp, fw=compile_fn(part.fw), bw=compile_fn(part.bw, backward=True),
                               key=key)
            if only is not None:
                cb.infer = compile_fn(only, inference=True)
        except Exception as e:  # noqa: BLE001 - these blocks run their partition uncompiled; the warning says why
            rep.uncompiled.update({j: _reason(e) for j in members})
            cb = _uncompiled(pristine, sp, key, with_infer)
        out.update({j: cb for j in members})
    rep.seconds = time.perf_counter() - t0
    rep.blocks = len(out) - len(rep.uncompiled)
    rep.programs = len({id(cb) for j, cb in out.items() if j not in rep.uncompiled})
    rep.cache_hits, rep.cache_misses = _counter("fxgraph_cache_hit") - hits, _counter("fxgraph_cache_miss") - misses
    if rep.failed or rep.uncompiled:
        warnings.warn(_failure_warning(rep, blocks), stacklevel=2)
    return out, rep
