"""A cache of traces: the ``ModelGraph`` of a model at one sequence length, as versioned JSON on disk.

Tracing a Hugging Face model costs seconds that no compile after the first needs: importing
transformers to build it and ``torch.export`` of its two-layer clone (~3.5 s of the 5 s a small
model's compile may take on 2 cores), yet the result is a pure function of the model's structure, the
trace's arguments and the code that traces.  The key is a hash of all of them:

- the model: a preset or ``config.json`` by the config's content (so a hit builds nothing); an
  ``nn.Module`` by its class, its config, its attention implementation and its structure (every
  parameter's and buffer's name, shape and dtype, every submodule's class) -- only for classes of
  LazyTrain or transformers, whose code the key's versions pin; any other module (a user's class, a
  factory, an ``nn.Sequential`` with its loss function) is traced every time;
- the trace's arguments: sequence length, dtype, packed, sequence tile;
- the code: Python's, torch's and transformers' versions and a hash of LazyTrain's own sources.

A file is ``{"format": "lazytrain.trace/1", "key": ..., "graph": ModelGraph.to_json()}``, written
atomically, read with ``json`` only (never pickle); an unreadable, foreign or stale file is a miss and is
overwritten.  The folder is ``$LAZYTRAIN_TRACE_CACHE`` if set (empty: no cache), else
``$XDG_CACHE_HOME/lazytrain/traces`` (``~/.cache``); nothing is ever evicted (a 72B model's trace is
~0.2 MB).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path

from ..ir import ModelGraph
from ..util.torch_free import is_module, torch_version
from .preset_configs import PRESETS
from .presets import read_config

CACHE_FORMAT = "lazytrain.trace/1"
#: packages whose model classes the key may name: their code is pinned by the versions in the key (peft's, a LoRA
#: model's, in its own key: ``describe``)
VERSIONED_PACKAGES = ("lazytrain", "transformers", "peft")


def cache_dir() -> Path | None:
    """The cache folder, or None when the cache is off (``LAZYTRAIN_TRACE_CACHE`` set empty)."""
    v = os.environ.get("LAZYTRAIN_TRACE_CACHE")
    if v is not None:
        return Path(v) if v else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lazytrain" / "traces"


@functools.cache
def code_version() -> dict:
    """Versions of the code a trace depends on; LazyTrain's as a hash of its sources, so a change to
    the tracer between releases cannot serve an old trace."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    try:
        tf = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        tf = None
    return {"python": list(sys.version_info[:2]), "torch": torch_version(), "transformers": tf,
            "lazytrain": h.hexdigest()[:16]}


def _config_dict(cfg) -> dict | None:
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return None


def describe(model) -> dict | None:
    """What identifies ``model``'s trace, or None where it cannot be known without tracing."""
    if isinstance(model, str):
        if model in PRESETS:
            return {"config": PRESETS[model]}
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if path.suffix != ".json" or not path.is_file():
            return None                 # a factory: its code is not pinned by any version
        try:
            return {"config": read_config(path)}
        except ValueError:
            return None                 # build_model says what is wrong with it
    if not is_module(model) or is_module(model, "Sequential"):
        return None
    cls = type(model)
    if cls.__module__.partition(".")[0] not in VERSIONED_PACKAGES:
        return None
    cfg = getattr(model, "config", None)
    config = _config_dict(cfg)
    if config is None:
        return None
    pinned = {}
    if cls.__module__.startswith("peft."):      # a PeftModel: its adapters' code is peft's
        pinned["peft"] = importlib.metadata.version("peft")
    return {**pinned, "class": f"{cls.__module__}.{cls.__qualname__}", "config": config,
            "attn": getattr(cfg, "_attn_implementation", None),
            "params": [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
            "buffers": [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
            "modules": [(n, f"{type(m).__module__}.{type(m).__qualname__}") for n, m in model.named_modules()]}


@dataclasses.dataclass(frozen=True)
class TraceCache:
    """One trace's place in the cache: ``load`` it, or ``store`` it once traced."""

    path: Path
    key: str

    @classmethod
    def of(cls, model, *, seq_len: int, dtype: str, packed: bool, seq_tile: int | None) -> TraceCache | None:
        """The entry for tracing ``model`` so, or None when it is not cacheable or the cache is off."""
        folder = cache_dir()
        desc = None if folder is None else describe(model)
        if desc is None:
            return None
        text = json.dumps({"model": desc, "seq_len": seq_len, "dtype": str(dtype), "packed": bool(packed),
                           "seq_tile": seq_tile, "code": code_version()}, sort_keys=True, default=str)
        key = hashlib.sha256(text.encode()).hexdigest()[:32]
        return cls(path=folder / f"{key}.json", key=key)

    def load(self) -> ModelGraph | None:
        """The cached graph, or None (absent, unreadable, another format or key, not a graph)."""
        try:
            d = json.loads(self.path.read_text(encoding="utf-8"))
            if d.get("format") != CACHE_FORMAT or d.get("key") != self.key:
                return None
            return ModelGraph.from_json(d["graph"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def store(self, graph: ModelGraph) -> None:
        """Write the graph atomically (a concurrent reader sees the old file or the new one); a folder
        that cannot be written only costs the next compile its trace."""
        text = json.dumps({"format": CACHE_FORMAT, "key": self.key, "graph": graph.to_json()})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            pass


def trace_and_store(model, cache: TraceCache | None, **trace_args) -> ModelGraph:
    """``model`` (a module, or a spec ``build_model`` builds) traced with ``trace_args`` and stored in ``cache``
    (None: not cached).  Imports torch, transformers and the tracer: only here, where a trace is needed."""
    from .presets import build_model
    from .trace import trace
    graph = trace(build_model(model) if isinstance(model, str) else model, **trace_args)
    if cache is not None:
        cache.store(graph)
    return graph
