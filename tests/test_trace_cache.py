"""The trace cache (``frontend/trace_cache.py``): a hit is the graph an uncached trace gives, and a hit
never builds the model; anything that changes the trace changes the key."""

from __future__ import annotations

import json

import pytest
import torch

from lazytrain.compiler import pipeline
from lazytrain.compiler.request import CompileRequest
from lazytrain.frontend import trace_cache
from lazytrain.frontend.presets import build_from_config, build_model
from lazytrain.frontend.trace import trace
from lazytrain.frontend.trace_cache import TraceCache

TINY_QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "tie_word_embeddings": True,
              "max_position_embeddings": 64}


def _same(a, b) -> bool:
    """Equal as the compiler sees them: every field and the metadata but the trace's own timing."""
    ja, jb = a.to_json(), b.to_json()
    ja["meta"].pop("trace_seconds", None)
    jb["meta"].pop("trace_seconds", None)
    return a == b and ja == jb


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYTRAIN_TRACE_CACHE", str(tmp_path))
    return tmp_path


def _graph(model, history=None, **kw):
    req = CompileRequest(seq_len=kw.pop("seq_len", 32), param_dtype=kw.pop("dtype", "bfloat16"),
                         seq_tile=kw.pop("seq_tile", None), **kw)
    return pipeline.resolve_graph(model, req, [] if history is None else history)


def test_a_hit_is_the_uncached_trace_and_builds_nothing(cache, monkeypatch, tmp_path):
    (tmp_path / "m").mkdir()               # a Hugging Face config.json: keyed by its content
    (tmp_path / "m" / "config.json").write_text(json.dumps(TINY_QWEN2))
    spec = str(tmp_path / "m")
    first, again = [], []
    cold = _graph(spec, first)
    assert "cached" not in first[0] and len(list(cache.glob("*.json"))) == 1

    def no_build(*a, **k):
        raise AssertionError("a cache hit must not build the model")
    monkeypatch.setattr("lazytrain.frontend.presets.build_model", no_build)     # ``api`` imports it to trace
    hot = _graph(spec, again)
    assert again[0]["cached"] is True
    assert _same(hot, cold)


def test_the_key_follows_what_the_trace_depends_on(cache):
    base = TraceCache.of("tiny", seq_len=32, dtype="bfloat16", packed=False, seq_tile=None)
    assert base == TraceCache.of("tiny", seq_len=32, dtype="bfloat16", packed=False, seq_tile=None)
    others = [TraceCache.of("gpt2", seq_len=32, dtype="bfloat16", packed=False, seq_tile=None),
              TraceCache.of("tiny", seq_len=64, dtype="bfloat16", packed=False, seq_tile=None),
              TraceCache.of("tiny", seq_len=32, dtype="float32", packed=False, seq_tile=None),
              TraceCache.of("tiny", seq_len=32, dtype="bfloat16", packed=True, seq_tile=None),
              TraceCache.of("tiny", seq_len=32, dtype="bfloat16", packed=False, seq_tile=16)]
    assert len({base.key, *(o.key for o in others)}) == 6
    # a module: by class, config and structure; a module of another package or a factory is never cached
    model = build_from_config(TINY_QWEN2)
    key = TraceCache.of(model, seq_len=32, dtype="bfloat16", packed=False, seq_tile=None).key
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(64, 32, bias=True, device="meta")
    assert TraceCache.of(model, seq_len=32, dtype="bfloat16", packed=False, seq_tile=None).key != key

    class Mine(torch.nn.Module):
        config = model.config
    assert TraceCache.of(Mine(), seq_len=32, dtype="bfloat16", packed=False, seq_tile=None) is None
    assert TraceCache.of("lt_mod:factory", seq_len=32, dtype="bfloat16", packed=False, seq_tile=None) is None


def test_a_bad_file_is_a_miss_and_the_cache_can_be_off(cache, monkeypatch):
    entry = TraceCache.of("tiny", seq_len=32, dtype="bfloat16", packed=False, seq_tile=None)
    entry.path.write_text("{not json")
    assert entry.load() is None
    entry.path.write_text(json.dumps({"format": trace_cache.CACHE_FORMAT, "key": "another", "graph": {}}))
    assert entry.load() is None
    graph = _graph("tiny")                       # traced again and stored over the bad file
    assert _same(entry.load(), graph) and _same(graph, trace(build_model("tiny"), seq_len=32))
    monkeypatch.setenv("LAZYTRAIN_TRACE_CACHE", "")
    assert TraceCache.of("tiny", seq_len=32, dtype="bfloat16", packed=False, seq_tile=None) is None
