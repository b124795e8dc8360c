"""The data-parallel world a trainer runs in: torch.distributed, one process per GPU (``torchrun``).

``World`` is what the runtime needs of it: this rank, the number of ranks, the collectives of the plan
(``all_gather`` of parameter shards, ``reduce_scatter`` of gradients, ``all_reduce`` of the squared
gradient norms and of the step's loss), each a ``torch.distributed`` call: NCCL between GPUs, gloo
on the CPU (CPU mode, and the tests).  A world of one (no process group) has no ``World`` at all: the
runtime's one-GPU path does no extra work.

Failure: every collective waits at most the process group's timeout (``LAZYTRAIN_COLLECTIVE_TIMEOUT``
seconds, default ``COLLECTIVE_TIMEOUT_S``).  A rank that dies makes the others' next collective fail
(gloo: the connection closes; NCCL: the watchdog's timeout); the error then names the rank, found from
what each rank registered in the process group's store at the start (host, pid) and from its
heartbeat there, which a background thread renews every ``HEARTBEAT_S``.  A rank that hangs (alive, its
heartbeat still renewed, but its training stopped) is named by the step it last entered
(``mark_step``, one store write a step): the ranks behind this one's step.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..frontend.loss_head import IGNORE

#: seconds a collective waits for the other ranks before the step fails [ledger: collective-timeout]
COLLECTIVE_TIMEOUT_S = 600.0
#: heartbeat period; a rank whose heartbeat is older than ``STALE_BEATS`` periods is reported as gone
HEARTBEAT_S = 0.5
STALE_BEATS = 4
#: how long stopping a heartbeat waits for a store write in flight
HEARTBEAT_JOIN_S = 5.0
_KEY = "lazytrain/rank/"
#: the worlds whose heartbeat runs: every one is stopped at the interpreter's exit (``World.stop_heartbeat``),
#: also those of trainers that joined a group another trainer owns and were never closed
_HEARTBEATS: set = set()


@atexit.register
def _stop_heartbeats() -> None:
    for world in list(_HEARTBEATS):
        world.stop_heartbeat()


class RankFailure(RuntimeError):
    """Another rank died or hung: this rank's collective failed; the message names the rank."""


def env_world_size() -> int:
    """The world size the launcher (``torchrun``) announces, 1 without one."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def collective_timeout() -> float:
    v = os.environ.get("LAZYTRAIN_COLLECTIVE_TIMEOUT")
    try:
        return float(v) if v else COLLECTIVE_TIMEOUT_S
    except ValueError:
        raise ValueError(f"LAZYTRAIN_COLLECTIVE_TIMEOUT must be a number of seconds, got {v!r}") from None


@dataclass(eq=False)
class World:
    """This process's place in the data-parallel world (``size`` > 1; see the module docstring)."""

    rank: int
    size: int
    local_rank: int
    device: torch.device              # where the collectives' tensors live (CUDA for NCCL, else the CPU)
    _store: object = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _beats_thread: threading.Thread | None = field(default=None, repr=False)
    #: this trainer joined the process group (and leaves it on ``close``), rather than the caller
    owns_group: bool = False
    #: a collective failed: the group may not answer any more (the exit does not tear it down)
    broken: bool = False

    # ---- set up -----------------------------------------------------------------------------------
    @staticmethod
    def start(device_type: str) -> World | None:
        """The world of this process: joins the process group ``torchrun`` describes (NCCL for CUDA,
        gloo for the CPU) unless one exists; None in a world of one."""
        import torch.distributed as dist
        if not dist.is_available():
            return None
        owns = not dist.is_initialized()
        if owns:
            if env_world_size() == 1:
                return None
            backend = "nccl" if device_type == "cuda" else "gloo"
            if device_type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout()))
        if dist.get_world_size() == 1:
            return None
        rank = dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
        nccl = dist.get_backend() == "nccl"
        world = World(rank=rank, size=dist.get_world_size(), local_rank=local,
                      device=torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"),
                      owns_group=owns)
        world._register()
        if owns:
            # a trainer never closed must still leave the group before the interpreter tears its threads down:
            # rank 0, which hosts the store, aborted at exit under load otherwise (exit -6, "terminate called
            # without an active exception"), after training had finished
            atexit.register(world._close_at_exit)
        return world

    def _register(self) -> None:
        """Who this rank is (host, pid) and a heartbeat, in the process group's store."""
        import torch.distributed as dist
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store reachable: failures are reported without names
            return
        self._store.set(f"{_KEY}{self.rank}", f"{socket.gethostname()}:{os.getpid()}")
        self._beat()
        self._beats_thread = threading.Thread(target=self._beats, name="lazytrain-heartbeat", daemon=True)
        self._beats_thread.start()
        _HEARTBEATS.add(self)

    def _beat(self) -> None:
        self._store.set(f"{_KEY}{self.rank}/beat", repr(time.time()))

    def _beats(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store's host is gone: the collectives will say so
                return

    def mark_step(self, step: int) -> None:
        """This rank has entered step ``step`` (``culprits`` names a rank that stays behind)."""
        if self._store is not None:
            self._store.set(f"{_KEY}{self.rank}/step", str(step))

    def _close_at_exit(self) -> None:
        """``close`` at the interpreter's exit, unless a collective failed (a group with a rank gone may block its
        teardown: the exit must not wait on it; its heartbeat is stopped after, with every world's)."""
        if not self.broken:
            self.close()

    def stop_heartbeat(self) -> None:
        """End the heartbeat thread and wait for it (a bounded wait: a store write in flight times out).  A daemon
        thread still inside a store write when the interpreter finalizes is killed inside C++ code that may not
        unwind: the process aborts ("terminate called without an active exception", exit -6) after its work
        is done; a rank of four did so under a loaded suite, from a second trainer's heartbeat never stopped."""
        self._stop.set()
        t = self._beats_thread
        if t is not None and t is not threading.current_thread():
            t.join(HEARTBEAT_JOIN_S)
        _HEARTBEATS.discard(self)

    def close(self) -> None:
        import torch.distributed as dist
        self.stop_heartbeat()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False

    # ---- the plan's collectives -----------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, what: str) -> None:
        """``out`` = every rank's ``shard`` in rank order."""
        import torch.distributed as dist
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._call(lambda: fn(out, shard), what)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, what: str) -> None:
        """``out`` = this rank's slice of the sum over ranks of ``full``."""
        import torch.distributed as dist
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._call(lambda: fn(out, full), what)

    def sum_floats(self, values: list[float], what: str) -> list[float]:
        """The element-wise sum over ranks of ``values`` (float64, on the collectives' device)."""
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._call(lambda: dist.all_reduce(t), what)
        return t.tolist()

    def barrier(self, what: str) -> None:
        import torch.distributed as dist
        self._call(lambda: dist.barrier(), what)

    def shard(self, numel: int) -> slice:
        """This rank's slice of a gathered buffer of ``numel`` elements (``ir.sharding``)."""
        s = numel // self.size
        return slice(self.rank * s, (self.rank + 1) * s)

    def _call(self, fn, what: str) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - gloo / NCCL raise RuntimeError or DistBackendError
            self.broken = True
            raise RankFailure(f"{what} failed on rank {self.rank} of {self.size}: {self.culprits()} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the others stop too: "
                              "resume from the last checkpoint") from None

    def culprits(self) -> str:
        """Which ranks are gone: those on this host whose process no longer exists, and those whose
        heartbeat stopped (waited for up to ``STALE_BEATS`` periods); else those alive but behind this
        rank's step (hung)."""
        if self._store is None:
            return "another rank died or hung (no store to tell which)"
        deadline = time.time() + STALE_BEATS * HEARTBEAT_S
        while True:
            try:
                gone = [g for r in range(self.size) if r != self.rank and (g := self.gone(r))]
            except Exception:  # noqa: BLE001 - the store lives in rank 0's process (or the launcher)
                return "rank 0 or the launcher is gone (the process group's store does not answer)"
            if gone:
                return ", ".join(gone)
            if time.time() > deadline:
                return self._behind() or "another rank failed (every rank still answers)"
            time.sleep(HEARTBEAT_S / 2)

    def gone(self, r: int) -> str:
        """``"rank r (host:pid) exited"`` / ``"... stopped answering"`` when rank r's process on this host no
        longer exists or its heartbeat is older than ``STALE_BEATS`` periods; "" while it lives, or when there
        is no store to tell (the store's errors are the caller's)."""
        if self._store is None:
            return ""
        who = self._store.get(f"{_KEY}{r}").decode()
        h, _, pid = who.rpartition(":")
        beat = float(self._store.get(f"{_KEY}{r}/beat").decode())
        dead = h == socket.gethostname() and not _alive(int(pid))
        if dead or time.time() - beat > STALE_BEATS * HEARTBEAT_S:
            return f"rank {r} ({who}) {'exited' if dead else 'stopped answering'}"
        return ""

    def _behind(self) -> str:
        """Ranks alive whose last step (``mark_step``) is before this rank's: they hang."""
        def step(r: int) -> int:
            key = f"{_KEY}{r}/step"
            return int(self._store.get(key).decode()) if self._store.check([key]) else 0
        try:
            mine = step(self.rank)
            late = [(r, step(r)) for r in range(self.size) if r != self.rank]
            return ", ".join(f"rank {r} ({self._store.get(f'{_KEY}{r}').decode()}) is alive but still in step {s} "
                             f"while this rank is in step {mine}: it hangs" for r, s in late if s < mine)
        except Exception:  # noqa: BLE001 - the store went away meanwhile
            return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def global_tokens(program, labels: torch.Tensor, n_micro: int) -> int:
    """Tokens the loss of the whole global batch counts (what one process's head would sum): a causal
    LM's next-token targets that are not ignored, or one per micro-batch for a model's own loss.  Every
    rank holds the global batch, so this needs no collective."""
    head = program.blocks[-1]
    if head.loss is None:
        return n_micro
    return int((labels[:, 1:] != IGNORE).sum())
