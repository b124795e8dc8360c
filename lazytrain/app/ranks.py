"""The processes of one ``lazytrain train`` run: what the train loop does differently on N ranks.

``torchrun --nproc-per-node N -m lazytrain train ...`` (or ``lazytrain train --gpus N``, ``launch.py``)
starts N copies of the same command; ``Ranks.join`` reads what the launcher announces (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and starts the process group (NCCL on CUDA, each
rank on its ``LOCAL_RANK``'s GPU; gloo on the CPU).  Without a launcher it is a world of one and every
method below is what one process does anyway, so the loop has one code path.

Choices, written down so the next person sees them:

- *One plan, compiled by rank 0.*  Rank 0 compiles the plan for ``world_size=N`` and every other rank
  takes its JSON from the process group's store (``share``).  Compiling on every rank and comparing
  would not do: the MILP runs under a time limit, so two ranks on a loaded host can stop at different
  incumbents and hold different (both valid) plans, and N solvers on one host compete for the cores
  the compile's time budget assumes.  The plan crosses as JSON (``Plan.to_json``), never pickled; an
  error of rank 0's compile crosses too, so the others stop at once with its message instead of
  waiting for a plan that will not come.
- *The same global batch.*  ``--batch`` is the global batch, as one process would take it; every rank
  generates it (same seed, same stream) and the ``Trainer`` keeps its rows ``[r * B/N, (r+1) * B/N)``.
  ``--batch`` must be a multiple of N.
- *Decisions are rank 0's.*  The learning rate of a step (its schedule follows the clock under
  ``--time-limit-min``) and the time limit are rank 0's, Ctrl-C on any rank stops every rank; they
  cross in one small all-reduce before each step (``agree``), so every rank runs the same steps with
  the same rate and no rank waits in a collective another rank will never enter.
- *Rank 0 speaks and writes.*  Progress, metrics, plots, the exported model are rank 0's; the other
  ranks' standard output is dropped (their standard error, where errors go, is kept).  Checkpoints
  are every rank's (``runtime/checkpoint_world.py``); an evaluation by generation runs on rank 0
  after every rank gathered the weights (``sync_to_model`` is a collective; only rank 0 keeps them), and
  its result reaches the others through the store, which they wait on as at a barrier with a timeout
  (``_wait``: a rank 0 that died is named within seconds, one that never answers after the collective
  timeout).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..runtime.distributed import RankFailure, collective_timeout, env_world_size

_KEY = "lazytrain/shared/"
#: a rank waiting for rank 0 (``Ranks.share``) checks rank 0's heartbeat this often: a rank 0 that died is
#: named within about this plus the heartbeat's staleness (``distributed.STALE_BEATS`` x ``HEARTBEAT_S``, 2 s)
WAIT_SLICE_S = 1.0


class RankZeroError(RuntimeError):
    """Rank 0 failed where the others wait for it; they stop with its message, which rank 0 has printed
    already (``quiet``: the command line prints it once, from rank 0)."""

    quiet = True


@dataclass(eq=False)
class Ranks:
    """This process's place among the run's processes (a world of one without a launcher)."""

    rank: int = 0
    size: int = 1
    local_size: int = 1
    #: the trainer's ``World`` once it exists (its collectives name a rank that failed)
    world: object = None
    _store: object = field(default=None, repr=False)
    _shared: int = 0
    _stdout: object = field(default=None, repr=False)
    #: this run started the process group (and ends it in ``close``), rather than its caller
    _owns: bool = False

    @staticmethod
    def join(device_type: str) -> Ranks:
        """Start the process group the launcher describes (see the module docstring)."""
        size = env_world_size()
        if size == 1:
            return Ranks()
        import torch.distributed as dist
        owns = not dist.is_initialized()
        if owns:
            if device_type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                    timeout=timedelta(seconds=collective_timeout()))
        rank, size = dist.get_rank(), dist.get_world_size()
        out = Ranks(rank=rank, size=size, local_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(size))),
                    _store=dist.distributed_c10d._get_default_store(), _owns=owns)
        if rank:
            out._stdout, sys.stdout = sys.stdout, open(os.devnull, "w")    # noqa: SIM115 - closed in close()
        return out

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.size // max(1, self.local_size))

    def cpu_threads(self, alone) -> int:
        """Threads of this process on the CPU: ``alone()`` for one process; an equal share of the host's
        cores for each of several (they run at once)."""
        if self.size == 1:
            return alone()
        from ..util.host import cpu_cores
        return max(1, cpu_cores() // self.local_size)

    def per_rank_batch(self, batch: int) -> int:
        """The plan's batch: this rank's share of the global ``--batch``."""
        if batch % self.size:
            raise ValueError(f"--batch {batch} is not a multiple of the {self.size} "
                             "processes: every rank takes the same share of the global batch "
                             f"(give a multiple of {self.size})")
        return batch // self.size

    def share(self, what: str, fn):
        """``fn()`` computed on rank 0 (a JSON value), returned on every rank.  An exception of rank 0's is
        raised on every rank (rank 0's own; the others' names rank 0 and carries its message)."""
        if self.size == 1:
            return fn()
        key = f"{_KEY}{self._shared}"
        self._shared += 1
        if self.main:
            try:
                value = fn()
            except BaseException as e:
                self._store.set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
                raise
            self._store.set(key, json.dumps({"value": value}))
            return value
        got = json.loads(self._wait(key, what))
        if "error" in got:
            raise RankZeroError(f"rank 0 stopped while computing the {what}: {got['error']}")
        return got["value"]

    def _wait(self, key: str, what: str) -> bytes:
        """Rank 0's answer under ``key``: a barrier with a timeout.  Waited for in slices of ``WAIT_SLICE_S``;
        between two, rank 0's liveness is read from its heartbeat (once the trainer's ``World`` exists), so
        a rank 0 that died fails the others within seconds, one that lives but never answers within the
        collective timeout (``LAZYTRAIN_COLLECTIVE_TIMEOUT``)."""
        limit = collective_timeout()
        deadline = time.monotonic() + limit

        def failed(why: str) -> RankFailure:
            return RankFailure(f"waiting for rank 0's {what} failed on rank {self.rank} of {self.size}: {why}; the "
                               "others stop too: resume from the last checkpoint")
        while True:
            left = deadline - time.monotonic()
            try:
                self._store.wait([key], timedelta(seconds=max(0.01, min(WAIT_SLICE_S, left))))
                return self._store.get(key)
            except Exception as e:  # noqa: BLE001 - the slice's timeout, or the store's host is gone
                err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            try:
                gone = self.world.gone(0) if self.world is not None else ""
            except Exception:  # noqa: BLE001 - the store does not answer: its host (rank 0, the launcher) is gone
                raise failed(f"rank 0 did not answer ({err})") from None
            if gone:
                raise failed(gone)
            if time.monotonic() >= deadline:
                raise failed(f"rank 0 is alive but did not answer within {limit:g} s (LAZYTRAIN_COLLECTIVE_TIMEOUT)")

    def agree(self, lr: float, over: bool, stop: bool) -> tuple[float, bool, bool]:
        """Rank 0's learning rate and time limit, and whether any rank was asked to stop (Ctrl-C)."""
        if self.size == 1:
            return lr, over, stop
        mine = [lr, float(over), float(stop)] if self.main else [0.0, 0.0, float(stop)]
        lr, over, stop = self.world.sum_floats(mine, "agreeing on the next step")
        return lr, over > 0, stop > 0

    def close(self) -> None:
        """Leave the process group (after a last barrier: no rank leaves while another still needs it)."""
        if self.size == 1:
            return
        import torch.distributed as dist
        if dist.is_initialized():
            if self.world is not None:
                self.world.barrier("the end of the run")
            if self._owns:
                dist.destroy_process_group()
        if self._stdout is not None:
            with contextlib.suppress(OSError):
                sys.stdout.close()
            sys.stdout, self._stdout = self._stdout, None
