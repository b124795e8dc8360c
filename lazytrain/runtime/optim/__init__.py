"""Host optimizers: the runtime's ``update`` op calls ``HostOptimizer.step`` per block on the CPU."""

from .base import HostOptimizer, Segment
from .clipping import GradNormTracker, NonFiniteGradError, clip_coefficient
from .hybrid8bit import Hybrid8bitAdamW
from .torch_adamw import TorchAdamW

__all__ = [
    "HostOptimizer",
    "Segment",
    "TorchAdamW",
    "Hybrid8bitAdamW",
    "clip_coefficient",
    "GradNormTracker",
    "NonFiniteGradError",
]
