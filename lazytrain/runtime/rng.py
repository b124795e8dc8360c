"""Random-number replay, so that recomputing a block draws what its forward drew.

A block with dropout (or any op that draws from the generator) gives different outputs each time it
runs.  When its saved activations are dropped and recomputed for the backward, the recomputation must
see the forward's masks, or backward differentiates another function than the one that produced the
loss.  As ``torch.utils.checkpoint`` does, the forward records the generator state before it runs
and the recomputation runs from that state, then puts the generator back where it was, so blocks
after it draw the same numbers whether or not a recomputation ran in between.  The states are host
objects (a CPU generator state, or a CUDA generator's seed and offset): taking and setting them does
not synchronize the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator that ops on ``device`` draw from."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


@contextmanager
def replaying(device: torch.device, state: torch.Tensor) -> Iterator[None]:
    """Run the body from generator ``state``, then restore the generator as it was before."""
    now = rng_state(device)
    _set(device, state)
    try:
        yield
    finally:
        _set(device, now)
