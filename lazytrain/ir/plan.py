"""The plan: the compiled artifact.  Versioned JSON (``"format": "lazytrain.plan/1"``), never pickle."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

from .decisions import Decisions
from .format import PLAN_FORMAT, PlanError
from .graph import ModelGraph
from .ops import GiB, Op, OpKind
from .schema import check_plan
from .summary import summary_rows
from .verify import check_plan_json, verify

__all__ = ["PLAN_FORMAT", "Plan", "PlanError", "SolverStats"]


def _no_constant(name: str):
    raise PlanError(f"plan file holds {name}, which is not valid JSON (a NaN or infinite figure): "
                    "the file was not written by LazyTrain or is corrupted")


@dataclass(frozen=True, kw_only=True)
class SolverStats:
    status: str
    objective: float | None = None
    gap: float | None = None
    n_vars: int = 0
    n_constraints: int = 0
    seconds: float = 0.0
    #: the solver that answered ("highs", "cbc"), and what happened to those tried before it or,
    #: when none answered, to every one ("cbc crashed (SIGSEGV)"): the plan then comes from a heuristic
    solver: str = ""
    failures: tuple[str, ...] = ()
    #: the compile's search deadline (``compiler/search.py``) ran out before the search was done: no further
    #: solve or re-solve was started, and the plan is the best one found by then
    out_of_time: bool = False
    #: the clock that ran out: "cpu" (the deadline, counted in the CPU time the compile got) or "wall" (the
    #: wall-clock backstop, on a machine too busy to give it that CPU time); "" when none did
    deadline_clock: str = ""


@dataclass(kw_only=True)
class Plan:
    graph: ModelGraph
    hardware: dict
    budgets: dict                 # gpu_bytes, host_bytes, nvme_bytes, nvme_dir
    batch_size: int
    seq_len: int
    param_dtype: str
    decisions: Decisions
    ops: list[Op]
    predicted: dict = field(default_factory=dict)
    solver: SolverStats | None = None
    history: list[dict] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    #: data-parallel ranks the op list is written for (``ir.sharding``): every rank runs this list on
    #: its slice of a global batch of ``batch_size * world_size`` rows; a runtime of another size refuses it
    world_size: int = 1

    # ---- views -------------------------------------------------------------------------
    @property
    def micro_batch(self) -> int:
        return self.decisions.micro_batch

    @property
    def n_micro(self) -> int:
        return self.decisions.n_micro

    @property
    def fingerprint(self) -> str:
        return self.graph.fingerprint()

    def __str__(self) -> str:
        head = (f"plan {self.graph.name}: batch {self.batch_size} = {self.n_micro} x {self.micro_batch}, "
                f"seq {self.seq_len}, policy {self.decisions.policy}, {len(self.ops)} ops")
        if self.world_size > 1:
            head += f", per rank of {self.world_size}"
        return "\n".join([head, *map(str, self.ops)])

    def table(self, limit: int | None = None) -> str:
        """The op list as a table (tabulate)."""
        rows = []
        for op in self.ops[:limit]:
            rows.append([op.id, op.kind.value, op.block, "" if op.mb is None else op.mb,
                         "" if op.tensor is None else str(op.tensor),
                         f"{op.src.value}->{op.dst.value}" if op.src and op.dst else (op.src.value if op.src else ""),
                         f"{op.nbytes / GiB:.3f}" if op.nbytes else "", op.resource.value,
                         f"{op.seconds * 1e3:.3f}" if op.seconds else "",
                         ",".join(map(str, op.deps[:4])) + ("…" if len(op.deps) > 4 else "")])
        out = tabulate(rows, headers=["#", "kind", "blk", "mb", "tensor", "move", "GiB", "res", "ms", "deps"])
        if limit is not None and len(self.ops) > limit:
            out += f"\n... {len(self.ops) - limit} more ops"
        return out

    def summary(self) -> str:
        """Totals: decisions, predicted time and memory, solver statistics (tabulate)."""
        return tabulate(summary_rows(self), tablefmt="plain")

    # ---- JSON --------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": PLAN_FORMAT,
                "model": {"name": self.graph.name, "fingerprint": self.fingerprint,
                          "n_blocks": self.graph.n_blocks, "total_params": self.graph.total_params,
                          # a frozen base's plan (LoRA) says how many train; a full fine-tune's is as it was
                          **({"trainable_params": self.graph.trainable_params} if self.graph.frozen_params else {})},
                "graph": self.graph.to_json(), "hardware": self.hardware, "budgets": self.budgets,
                "batch_size": self.batch_size, "micro_batch": self.micro_batch, "n_micro": self.n_micro,
                "seq_len": self.seq_len, "param_dtype": self.param_dtype,
                "decisions": self.decisions.to_json(), "ops": [op.to_json() for op in self.ops],
                "predicted": self.predicted,
                "solver": None if self.solver is None else {k: (None if isinstance(v, float) and not math.isfinite(v)
                                                                else v) for k, v in self.solver.__dict__.items()},
                "history": self.history, "options": self.options, "world_size": self.world_size}

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (``atomic.write_atomic``: temporary file + rename) so a crash never leaves half a plan;
        ``ValueError`` for a path that is a folder or a special file."""
        from ..util.atomic import write_atomic
        write_atomic(path, json.dumps(self.to_json(), indent=1), what="plan")

    @staticmethod
    def from_json(d: dict) -> Plan:
        check_plan_json(d)
        try:
            graph = ModelGraph.from_json(d["graph"])
            plan = Plan(graph=graph, hardware=dict(d["hardware"]), budgets=dict(d["budgets"]),
                        batch_size=int(d["batch_size"]), seq_len=int(d["seq_len"]),
                        param_dtype=str(d["param_dtype"]), decisions=Decisions.from_json(d["decisions"]),
                        ops=[Op.from_json(o) for o in d["ops"]], predicted=dict(d.get("predicted") or {}),
                        solver=None if not d.get("solver") else SolverStats(
                            **{**d["solver"], "failures": tuple(d["solver"].get("failures") or ())}),
                        history=list(d.get("history") or []), options=dict(d.get("options") or {}),
                        world_size=d.get("world_size", 1))
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError) as e:
            raise PlanError(f"malformed plan: {type(e).__name__}: {e}") from None
        check_plan(plan)
        if d["model"].get("fingerprint") != plan.fingerprint:
            raise PlanError("plan's model fingerprint does not match its own graph: the file was edited "
                            "or corrupted; compile it again")
        return plan

    @staticmethod
    def load(path: str | os.PathLike, *, check: bool = True) -> Plan:
        """Read a plan file.  Everything in it is checked before it is returned: JSON only (no code
        runs, ``NaN`` / ``Infinity`` refused), the shape of the JSON, every field's type and range,
        every cross-reference, the model fingerprint, and (unless ``check=False``) ``verify``.  Any
        problem is a ``PlanError`` naming it."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise PlanError(f"cannot read plan {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise PlanError(f"{path} is not a text file (not UTF-8): not a LazyTrain plan") from None
        try:
            d = json.loads(text, parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise PlanError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); "
                            "was it truncated? compile the plan again") from None
        except RecursionError:
            raise PlanError(f"{path} is not a LazyTrain plan: JSON nested too deeply") from None
        except ValueError as e:     # an integer of thousands of digits (Python refuses to convert it)
            raise PlanError(f"{path} is not a LazyTrain plan: {e}") from None
        plan = Plan.from_json(d)
        if check:
            verify(plan)
        return plan

    def check_model(self, graph: ModelGraph) -> None:
        """Refuse a model whose structure differs from the one this plan was compiled for."""
        if graph.fingerprint() != self.fingerprint:
            raise PlanError(f"this plan was compiled for a different model ({self.graph.name}, fingerprint "
                            f"{self.fingerprint}); the model given has fingerprint {graph.fingerprint()} "
                            f"({graph.name}): compile a plan for it")
        if graph.seq_len != self.seq_len:
            raise PlanError(f"plan was compiled for seq {self.seq_len}, the model was traced at {graph.seq_len}")

    def check_world_size(self, world_size: int) -> None:
        """Refuse to run in a world of another size than the plan's (its shards and collectives)."""
        if world_size != self.world_size:
            raise PlanError(f"this plan was compiled for world size {self.world_size} but the runtime has "
                            f"{world_size} process(es): compile it again with --world-size {world_size}")

    def count(self, kind: OpKind) -> int:
        return sum(op.kind is kind for op in self.ops)
