"""Random weights, fast (benchmarks, and fine-tuning from a config or a preset), whole or a piece at a time.

``random_model`` is ``build_model(spec)`` with random weights: built on meta, then each distinct parameter
(tied ones once) materialised on the CPU from one pool of 16 M N(0, 0.02) draws (seeded by torch's global
generator), each tensor from its own offset; 1-d parameters are norm weights (1) or biases (0).  Modules with
buffers (Hugging Face rotary embeddings) are rebuilt on the CPU from the model's config.  Hugging Face's
per-module init of a 3B model took 164 s on the GPU machine's host and a fresh ``normal_`` per tensor 90 s; the
pool makes it memory copies.  Step times do not depend on the values, and the loss is a random model's.

Why the pool also serves shards: every element of every tensor is a function of the pool, the tensor's index and
its position (``RandomWeights.piece``), so one of several ranks reads its shard of the same weights without
building the model (``random_init``: the model stays on the meta device; the rank holds the 64 MB pool and its
shard), and N ranks start from the weights one process starts from, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from .presets import build_model

POOL_NUMEL = 1 << 24
#: the stride between tensors' starting offsets in the pool (a prime: consecutive tensors start far apart)
POOL_STRIDE = 7_919_993


def _fill_random(flat: torch.Tensor, pool: torch.Tensor, offset: int) -> None:
    """``flat`` from the random ``pool``, starting at ``offset`` and wrapping around: a memcpy."""
    pos, n = 0, flat.numel()
    while pos < n:
        k = min(n - pos, pool.numel() - offset)
        flat[pos:pos + k].copy_(pool[offset:offset + k])
        pos, offset = pos + k, 0


class RandomWeights:
    """The random weights of ``random_model`` for a model built on the meta device, a piece at a time (the
    ``runtime.weights`` interface: ``piece(name, a, b)``, elements ``[a, b)`` of the flat tensor, fp32)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        #: per distinct tensor, in ``named_modules`` order: the (module, attribute) places that hold it, and its
        #: 1-d fill (norm weights 1, biases 0; None: drawn from the pool)
        self.places: list[list[tuple[nn.Module, str]]] = []
        self.fill: list[float | None] = []
        #: every parameter name (a tied tensor under each of its names) -> its tensor's index
        self.where: dict[str, int] = {}
        index: dict[int, int] = {}
        for mod_name, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) not in index:
                    index[id(p)] = len(self.places)
                    self.places.append([])
                    self.fill.append((1.0 if "norm" in f"{mod_name}.{pname}" else 0.0) if p.dim() == 1 else None)
                self.places[index[id(p)]].append((mod, pname))
                self.where[f"{mod_name}.{pname}" if mod_name else pname] = index[id(p)]
        self.pool = torch.empty(POOL_NUMEL, dtype=dtype).normal_(0, 0.02)

    def values(self, i: int, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[a, b)`` of tensor ``i`` (flat), in ``dtype``."""
        out = torch.empty(b - a, dtype=dtype)
        if self.fill[i] is not None:
            return out.fill_(self.fill[i])
        _fill_random(out, self.pool, (i * POOL_STRIDE + a) % POOL_NUMEL)
        return out

    def piece(self, name: str, a: int, b: int) -> torch.Tensor:
        return self.values(self.where[name], a, b, self.pool.dtype).to(torch.float32)


def random_init(spec: str, dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, RandomWeights]:
    """``build_model(spec)`` on the meta device and its random weights (``RandomWeights``), drawn from torch's
    global generator as ``random_model`` draws them."""
    model = build_model(spec, device="meta", dtype=dtype)
    return model, RandomWeights(model, dtype)


def random_model(spec: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``build_model(spec)`` with random weights (the module docstring), on the CPU."""
    model, weights = random_init(spec, dtype)
    with torch.no_grad():
        for i, places in enumerate(weights.places):
            old = getattr(*places[0])
            new = weights.values(i, 0, old.numel(), old.dtype).view(old.shape)
            param = torch.nn.Parameter(new, requires_grad=old.requires_grad)
            for m, n in places:
                setattr(m, n, param)
    _rebuild_buffer_modules(model)
    return model


def _rebuild_buffer_modules(model: nn.Module) -> None:
    for name, mod in list(model.named_modules()):
        if not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        try:
            fresh = type(mod)(config=model.config)
        except (AttributeError, TypeError) as e:
            raise ValueError(f"random_model: cannot rebuild {name} ({type(mod).__name__}), whose buffers are on "
                             f"meta: {e}") from None
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, fresh)
