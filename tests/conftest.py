"""Fixtures shared by test files: one small GPT plan compiled once per session (tracing costs seconds),
and a trace cache of the session's own.

Under pytest-xdist (``pytest -n N``, the README's command) each worker takes its share of the cores for
torch's intra-op threads, and so do the processes its tests start (``OMP_NUM_THREADS``, unless set): two
workers with two threads each on the 2-core CI machine would oversubscribe it, and an OpenMP thread that
waits for a descheduled sibling makes a step 2-3x slower (``custom_loop.py`` beside a busy core: 21.5 s
with two threads, 15.3 s with one)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

import lazytrain
from lazytrain.frontend.presets import build_from_config

# traces are cached for this session only (``frontend/trace_cache.py``): never read from or written to the
# user's cache, and shared by the tests (and the CLI processes they start) that compile the same model
_TRACES = tempfile.mkdtemp(prefix="lazytrain-test-traces-")
os.environ["LAZYTRAIN_TRACE_CACHE"] = _TRACES
atexit.register(shutil.rmtree, _TRACES, ignore_errors=True)

SMALL_GPT = {"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 48,
             "max_seq": 32, "tie_weights": True}


def small_gpt(cfg: dict = SMALL_GPT) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config(cfg, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def small_plan():
    """Batch 4 x seq 16 in micro-batches of 2, fp32, on the CPU profile (megatrain: no solver)."""
    return lazytrain.compile(small_gpt(), batch_size=4, seq_len=16, micro_batch=2, hardware="cpu", gpu_memory="8GiB",
                             host_memory="16GiB", param_dtype="float32", optimizer="adamw", policy="megatrain")
