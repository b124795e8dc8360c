"""``lazytrain train --gpus N`` (``--nproc N`` on the CPU): the same command on N processes of this host,
started by ``torch.distributed.run`` (torchrun's own launcher, as ``--standalone``: a rendezvous on a
free local port).  No transport of ours: the ranks meet and talk through torch.distributed (``ranks.py``).

- ``--gpus N``: N processes, one CUDA GPU each (NCCL); refused unless N GPUs are visible.
- ``--nproc N``: N processes on the CPU (gloo, ``--device cpu``): a run of several ranks on a machine
  without GPUs (the tests use it).

Each process runs ``python -m lazytrain ARGS`` with this command's own arguments, ``--gpus N`` included:
a process that finds itself one of N ranks (``WORLD_SIZE`` = N) trains, so ``torchrun
--nproc-per-node N -m lazytrain train --gpus N ...`` does the same as the launcher.  Each process gets
an equal share of the host's cores for its threads (``OMP_NUM_THREADS``, unless set: torchrun's own
default is 1, which would leave the host update one thread).

Failure: when a rank exits with an error or is killed, torchrun stops the others (SIGTERM, then SIGKILL
after its shutdown timeout) and reports each failure; ``launch`` turns that into one line naming the
first rank that failed and why (the one-line error the rank left in torchrun's error file,
``leave_error``, or the signal that killed it).  A killed rank is named before the ranks that failed
because of it.  Nothing of the last checkpoint is lost: the ranks commit a checkpoint together, whole
or not at all (``runtime/checkpoint_world.py``).  Ctrl-C reaches the launcher only (torchrun starts each
rank in a session of its own), which stops every rank at once: the run keeps its last checkpoint
(one process, instead, stops after the step in flight and saves).

Several hosts: run ``torchrun --nnodes H --nproc-per-node N --rdzv-endpoint HOST:PORT -m lazytrain train ...``
on each (``ranks.py`` reads what it announces).
"""

from __future__ import annotations

import json
import logging
import os
import time

from ..runtime.distributed import env_world_size

#: seconds torchrun waits after its SIGTERM before it kills a rank (a live one ends at once) [ledger: launch-shutdown]
SHUTDOWN_S = 5


class LaunchError(RuntimeError):
    """A rank of a launched run failed; the message names it."""


def launch(argv: list[str], n: int, *, gpus: bool) -> int:
    """Run ``lazytrain ARGV`` on ``n`` processes (see the module docstring); 0 when every rank ended well."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    if gpus:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < n:
            raise ValueError(f"--gpus {n}: {have} CUDA GPU(s) are visible here; --nproc {n} starts {n} processes "
                             "on the CPU instead")
    from ..util.host import cpu_cores
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpu_cores() // n)))
    for name in list(logging.root.manager.loggerDict):      # the failure is our one line, not torchrun's report
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(["--standalone", "--nproc-per-node", str(n), "--shutdown-timeout", str(SHUTDOWN_S),
                        "--module", "--", "lazytrain", *argv]))
    except ChildFailedError as e:
        raise LaunchError(_first_failure(e.failures, n)) from None
    except SignalException:
        raise KeyboardInterrupt from None
    return 0


def _first_failure(failures: dict, n: int) -> str:
    """One line on the rank whose failure came first (torchrun's times are whole seconds); within a second,
    a rank killed from outside (a signal other than the launcher's SIGTERM, no error of its own) before a
    rank's own error (a survivor's report of it), before the rest; then rank 0 first (the others' copy of
    rank 0's error comes as early).  A rank killed by the launcher after its shutdown timeout comes
    later than the error that made it stop the others."""
    def order(r: int):
        f = failures[r]
        said = _said(f)
        killed = f.exitcode < 0 and not said and f.signal_name() not in ("SIGTERM", "SIGINT")
        return (f.timestamp, 0 if killed else 1 if said else 2, r)
    rank = min(failures, key=order)
    f = failures[rank]
    said = _said(f)
    why = (f"failed: {said}" if said else f"was killed by {f.signal_name()}" if f.exitcode < 0
           else f"exited with status {f.exitcode}")
    others = "the other rank was" if n == 2 else "the other ranks were"
    return (f"rank {rank} of {n} (pid {f.pid}) {why}; {others} stopped (a checkpoint of several ranks is "
            "committed whole or not at all: resume from the last one)")


def _said(failure) -> str:
    """The one-line error the rank left (``leave_error``), or ''."""
    if not os.path.isfile(str(failure.error_file)):     # (torchrun's placeholder message then)
        return ""
    msg = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    return msg if isinstance(msg, str) else ""


def check_launch(n: int) -> bool:
    """Should this process launch ``n`` ranks (True), or is it one of them already (False)?"""
    have = env_world_size()
    if have == 1:
        return True
    if have != n:
        raise ValueError(f"--gpus/--nproc {n}, but the launcher started {have} processes: give the same number "
                         "(or leave the flag out under torchrun)")
    return False


def leave_error(message: str) -> None:
    """Under torchrun, this rank's one-line error into its error file (``TORCHELASTIC_ERROR_FILE``), where
    the launcher reads why the rank failed."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except OSError:
        pass
