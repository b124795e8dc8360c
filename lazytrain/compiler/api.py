"""``compile_model``: model -> verified, simulated Plan.  The arguments become one ``CompileRequest``
(``compiler/request.py``) and the request goes through the pipeline (``compiler/pipeline.py``): its outer searches,
then trace -> budgets -> search (cost, lower, verify, simulate per candidate) -> GPU-update rule -> loss head.
Each stage's wall time goes into ``plan.history``."""

from __future__ import annotations

from ..ir import Plan
from .auto_tile import compile_tiled
from .budgets import BudgetError, make_budgets  # noqa: F401 - what callers of compile_model import from here
from .builder import Compiler  # noqa: F401 - the builder, for callers that build plans themselves
from .request import CompileRequest


def compile_model(model, **kwargs) -> Plan:
    """Compile a training plan.  ``model``: an ``nn.Module`` (meta or real), a preset name, a path
    to a Hugging Face ``config.json``, ``package.module:factory``, or an already traced ModelGraph.

    ``gpu_memory`` / ``host_memory`` / ``nvme_memory`` accept bytes or sizes like ``"24GiB"``;
    they default to the hardware profile's.  ``hardware``: a built-in profile's name, a profile file (``lazytrain
    profile``) or a ``HardwareProfile``; without it the compile plans for the h200 profile and says so on its
    progress log.  ``batch_size="max"`` finds the largest batch with a
    feasible plan, up to ``max_batch_limit``; ``seq_len="max"`` the longest sequence for the batch
    (``seq_search``).  ``reserve`` is GPU memory kept back for the CUDA
    context, cuBLAS workspaces and allocator fragmentation (default: 1.5 GiB + 5% of the budget).

    ``resident`` keeps blocks on the GPU for the whole run (parameters, optimizer state, gradients;
    their update runs on the GPU, off the host): ``"none"``, ``"auto"`` (default: for the MILP policy
    on a GPU the solver chooses how many leading blocks to keep, tied groups whole, jointly with the
    rest of the plan; the fixed policies stream everything, as the systems they stand for do), a
    number of leading blocks, or a list of block indices.

    ``solver``: the MILP solver tried first (``"highs"`` or ``"cbc"``); every solve runs in a child
    process, so a solver that crashes or hangs costs that solve only: the other solver is tried,
    then the best heuristic plan is used, with one warning and the failures in ``plan.solver``.
    ``time_limit``: CPU seconds per solve (default ``LIMITS.solve_s``, ``compiler/time_limits.py``).  ``deadline``:
    CPU seconds (the compile's and its solver's; at most four times as many wall seconds) the search for the plan
    may take in all, heuristics, solves, the checks of their plans and the GPU-update rule after them included (default
    ``LIMITS.deadline_s``, none when ``time_limit`` is given; the search leaves the rule ``LIMITS.rule_reserve_s``
    of it); counted in CPU time, a busy machine does not change the plan.  When it runs out
    the best plan found so far is returned and ``plan.solver.out_of_time`` says so (``deadline_clock``: which
    clock ran out).

    ``calibrate=True`` times the model's own blocks on this machine at the plan's micro-batch and
    sequence length and compiles with those times (``lazytrain.measure.calibrate``; written into ``hardware``
    when it is a file): the runtime runs them, so ``lazytrain.compile`` answers it, not this function alone.

    ``packed``: batches carry ``position_ids`` and hold several examples a row, each attending only to
    itself (a Hugging Face causal LM; ``frontend/packing.py``).

    ``world_size``: data-parallel ranks (GPUs) the plan is for, over ``nodes`` hosts (``ir.sharding``):
    ``batch_size`` is then per rank, each rank holds 1/N of the host state (the host budget is per host,
    shared by its ranks), loads its shard and all-gathers the block, reduce-scatters the gradients, and
    the global clip norm is an all-reduce.  Resident blocks and tied parameters shard the same way (a resident
    block keeps its shard of its state on the GPU, gathered once a step); ``"auto"`` lets the MILP choose them.

    ``seq_tile``: run the layers' position-wise tails (output projection, norm, MLP) in chunks of that
    many tokens, recomputed in backward (``tiling.py``); ``"auto"`` (default) does so, in chunks of
    ``ir.graph.TILE_TOKENS``, only when no plan fits without; ``None``: never.

    ``gpu_update``: streamed blocks whose update runs on the GPU (``Decisions.gpu_update``: the gradient stays
    on the GPU into the next step, parameters and optimizer state cross PCIe for the update): ``"auto"``
    (default: for the MILP policy on a GPU in a world of one, the rule of ``compiler/gpu_update.py`` chooses
    how many, trading resident blocks for them, by the simulated step under the budgets), ``"none"``, a number
    of the first streamed blocks, or a list of block indices.

    ``compile_blocks``: the runtime runs each distinct block program compiled by Inductor, forward and backward,
    the tensors its backward needs still kept, moved and recomputed by the plan (``frontend/compiled.py``); the
    graph's saved bytes are then what the compiled forwards save.  Off by default until measured on a GPU.

    ``loss_head``: how the fused LM head + cross-entropy forms its gradients (``frontend/loss_head.py``):
    ``"auto"`` (default: on a GPU, the searched plan's decisions with a single-pass head where they still fit and
    the simulated step is shorter, ``compiler/loss_chunk.py``), ``"single_pass"`` (the forward forms them, no
    logits recomputed, a weight-gradient accumulator held; the search plans for it) or ``"recompute"`` (the
    backward recomputes the logits chunk by chunk).
    """
    return compile_request(model, CompileRequest.of(model, **kwargs))


def with_lora(model, spec):
    """The model a compile with ``lora=spec`` plans for: a named model (preset, config, factory) built on the meta
    device and wrapped with LoRA adapters (``frontend/lora.py``)."""
    if not isinstance(model, str):
        raise ValueError("lora= takes a model by name (a preset, a config.json, package.module:factory); wrap a "
                         "model object with peft.get_peft_model yourself and compile that")
    from ..frontend.lora import wrap
    from ..frontend.presets import build_model
    return wrap(build_model(model, device="meta"), spec)


def compile_request(model, req: CompileRequest) -> Plan:
    """The plan ``req`` asks for: the longest sequence searched where it asks for ``"max"`` (``seq_search.py``), else
    the request's one length (``auto_tile.compile_tiled``); ``compiler/pipeline.py``'s docstring has the levels.
    With ``lora`` the named model is built (on the meta device) and wrapped with PEFT's adapters first."""
    if req.lora is not None:
        model = with_lora(model, req.lora)
    if req.seq_len == "max":
        from .seq_search import compile_max_seq  # it builds and traces models: torch, where asked for only
        return compile_max_seq(model, req)
    return compile_tiled(model, req)
