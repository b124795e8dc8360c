"""The presets' seeds (``frontend/seed_traces.py``) and a first compile searched on them while the trace runs in
another process (``compiler/background_trace.py``): the plan is always the traced graph's."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lazytrain.compiler import background_trace
from lazytrain.compiler.api import compile_model
from lazytrain.compiler.budgets import BudgetError
from lazytrain.frontend import seed_traces
from lazytrain.frontend.presets import build_model
from lazytrain.frontend.trace import trace
from lazytrain.frontend.trace_cache import TraceCache
from lazytrain.ir import Plan
from lazytrain.util.torch_free import torch_version

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(batch_size=4, gpu_memory="8GiB", host_memory="64GiB")


def _made_with(name: str = "qwen2.5-0.5b") -> dict:
    return seed_traces.load_seed(name)["made_with"]


def test_every_preset_has_a_seed_for_its_usual_lengths():
    for name in seed_traces.PRESETS:
        assert seed_traces.predict(name, 512) is not None, name
    assert seed_traces.predict("llama3-8b", 8192) is not None
    assert seed_traces.predict("llama3-8b", 8193) is None              # past the lengths checked
    assert seed_traces.predict("llama3-8b", 1024, "float32") is None    # the seeds are bf16


@pytest.mark.parametrize("name,seq", [("tiny", 384), ("gpt2", 700)])
def test_a_seed_predicts_the_trace_at_a_length_it_was_not_fitted_at(name, seq):
    """Our GPT's seeds depend on torch (pinned) and the tracer: a change to the tracer that changes a graph fails
    here until ``python -m lazytrain.frontend.seed_traces`` is run again."""
    release = _made_with(name)["torch"].split("+")[0]       # a CPU or CUDA build of one release traces alike
    assert release == torch_version().split("+")[0], "the seeds were made with another torch: make them again"
    predicted = seed_traces.predict(name, seq)
    assert predicted is not None and seed_traces.same_graph(predicted, trace(build_model(name), seq_len=seq))


def test_a_hugging_face_seed_predicts_the_trace_where_made_with_this_transformers():
    if _made_with()["transformers"] != importlib.metadata.version("transformers"):
        pytest.skip("the seeds were made with another transformers (a first compile then searches twice)")
    predicted = seed_traces.predict("qwen2.5-0.5b", 1536)
    assert seed_traces.same_graph(predicted, trace(build_model("qwen2.5-0.5b"), seq_len=1536))


def test_a_damaged_seed_is_no_seed(monkeypatch):
    monkeypatch.setattr(seed_traces, "load_seed", lambda name: {"format": seed_traces.SEED_FORMAT,
                                                                "config": seed_traces.PRESETS[name]})
    assert seed_traces.predict("tiny", 384) is None


def test_interpolation_is_exact_or_refused():
    graphs = [{"a": [s, s * s // 2, "x"], "b": 7, "c": None} for s in (2, 4, 8)]
    assert seed_traces.interpolate(graphs, [2, 4, 8], 6) == {"a": [6, 18, "x"], "b": 7, "c": None}
    assert seed_traces.interpolate(graphs, [2, 4, 8], 5) is None         # 12.5: not a whole number
    changing = [{"a": [s], "kind": f"k{s}"} for s in (2, 4, 8)]
    assert seed_traces.interpolate(changing, [2, 4, 8], 6) is None       # a structure that changes with the length
    assert seed_traces.interpolate([[1, 2], [1, 2], [1, 2, 3]], [2, 4, 8], 6) is None


@pytest.fixture
def seeded(monkeypatch, tmp_path):
    """A first compile here takes the seed's path (this process has torch, which it would not take), with an
    empty trace cache."""
    monkeypatch.setenv("LAZYTRAIN_TRACE_CACHE", str(tmp_path / "traces"))
    monkeypatch.setattr(background_trace, "imports_pending", lambda: True)
    monkeypatch.setattr(background_trace, "cpu_cores", lambda: 2)


def _traced_plan(name: str, seq: int, **kw) -> Plan:
    return compile_model(trace(build_model(name), seq_len=seq), seq_len=seq, seq_tile=None, **kw)


def _same_plan(a: Plan, b: Plan) -> bool:
    """The same schedule from the same graph (the decisions' notes aside: they carry the passes' timings)."""
    def decided(p: Plan):
        return dataclasses.replace(p.decisions, notes={})
    return (a.ops == b.ops and decided(a) == decided(b) and a.predicted["step_time_s"] == b.predicted["step_time_s"]
            and seed_traces.same_graph(a.graph, b.graph))


def test_a_first_compile_on_the_seed_returns_the_traced_graphs_plan_and_caches_the_trace(seeded):
    plan = compile_model("tiny", seq_len=384, **TINY)
    assert plan.history[0] == {"pass": "trace", "background": True, "seed": "matched",
                               "seconds": plan.history[0]["seconds"]}
    assert plan.graph.meta["trace_seconds"] > 0            # the real trace's measurement, not the seed's
    assert _same_plan(plan, _traced_plan("tiny", 384, **TINY))
    cache = TraceCache.of("tiny", seq_len=384, dtype="bfloat16", packed=False, seq_tile=None)
    assert cache.load() is not None                        # stored by the child: the next compile reads it
    assert compile_model("tiny", seq_len=384, **TINY).history[0].get("cached") is True


def test_a_seed_that_differs_from_the_trace_is_searched_again_on_the_trace(seeded, monkeypatch):
    real = seed_traces.predict("tiny", 384)
    blocks = list(real.blocks)
    blocks[1] = dataclasses.replace(blocks[1], saved_bytes=blocks[1].saved_bytes * 50)
    monkeypatch.setattr(seed_traces, "predict", lambda *a: dataclasses.replace(real, blocks=tuple(blocks)))
    plan = compile_model("tiny", seq_len=384, **TINY)
    assert plan.history[0]["seed"] == "differed"
    assert _same_plan(plan, _traced_plan("tiny", 384, **TINY))


def test_a_failed_background_trace_is_traced_here(seeded, monkeypatch):
    monkeypatch.setattr(background_trace, "worker_command", lambda: [sys.executable, "-c", "import os; os.abort()"])
    plan = compile_model("tiny", seq_len=384, **TINY)
    assert plan.history[0]["seed"] == "trace failed" and plan.history[0]["why"].startswith("exit status -6")
    assert plan.history[1]["pass"] == "trace" and not plan.history[1].get("background")    # traced here
    assert _same_plan(plan, _traced_plan("tiny", 384, **TINY))


def test_a_hung_background_trace_is_killed_and_traced_here(seeded, monkeypatch):
    monkeypatch.setattr(background_trace, "worker_command", lambda: [sys.executable, "-c", "import time; "
                                                                     "time.sleep(120)"])
    monkeypatch.setattr(background_trace, "TRACE_TIMEOUT_S", 1.0)
    plan = compile_model("tiny", seq_len=384, **TINY)
    assert plan.history[0]["seed"] == "trace failed" and plan.history[0]["why"] == "no answer in 1 s (killed)"
    assert _same_plan(plan, _traced_plan("tiny", 384, **TINY))


#: fields the published Qwen2.5-0.5B config.json has beyond the preset's
PUBLISHED_EXTRAS = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
                    "eos_token_id": 151643, "initializer_range": 0.02, "max_window_layers": 24, "sliding_window": 32768,
                    "use_cache": True, "use_mrope": False, "rope_scaling": None}


def test_a_config_json_of_a_presets_model_takes_the_presets_seed(tmp_path):
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**seed_traces.PRESETS["qwen2.5-0.5b"], **PUBLISHED_EXTRAS}))
    assert background_trace.seed_of("qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert background_trace.seed_of(str(folder)) == background_trace.seed_of(str(folder / "config.json")) \
        == "qwen2.5-0.5b"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**seed_traces.PRESETS["qwen2.5-0.5b"], "num_hidden_layers": 12}))
    assert background_trace.seed_of(str(other)) is None                        # another shape: no seed
    assert background_trace.seed_of(str(tmp_path / "missing.json")) is None
    assert background_trace.seed_of("pkg.module:factory") is None


def test_a_first_compile_of_a_presets_config_json_searches_on_the_seed(seeded, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**seed_traces.PRESETS["qwen2.5-0.5b"], **PUBLISHED_EXTRAS}))
    kw = dict(batch_size=8, gpu_memory="8GiB", host_memory="64GiB")
    plan = compile_model(str(path), seq_len=512, **kw)
    same_versions = _made_with()["transformers"] == importlib.metadata.version("transformers")
    assert plan.history[0]["seed"] == "matched" if same_versions else plan.history[0]["seed"] in ("matched",
                                                                                                  "differed")
    traced = compile_model(trace(build_model(str(path)), seq_len=512), seq_len=512, seq_tile=None, **kw)
    assert _same_plan(plan, traced)


def test_a_mistaken_profile_or_size_is_said_before_any_background_trace(seeded, monkeypatch):
    def no_child(*a, **k):
        raise AssertionError("a background trace was started")
    monkeypatch.setattr(background_trace, "BackgroundTrace", no_child)
    with pytest.raises(ValueError, match="unknown hardware 'a100'"):
        compile_model("tiny", seq_len=384, **{**TINY, "hardware": "a100"})
    with pytest.raises(ValueError, match="gpu_memory"):
        compile_model("tiny", seq_len=384, **{**TINY, "gpu_memory": "lots"})


def test_no_plan_on_the_seed_is_said_only_once_the_trace_confirms_it(seeded):
    with pytest.raises(BudgetError):
        compile_model("tiny", seq_len=384, batch_size=4, gpu_memory="1GiB", reserve="1020MiB")
    assert TraceCache.of("tiny", seq_len=384, dtype="bfloat16", packed=False, seq_tile=None).load() is not None


def test_a_process_with_torch_or_one_cpu_or_no_child_traces_itself(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYTRAIN_TRACE_CACHE", str(tmp_path / "traces"))
    args = dict(seq_len=384, dtype="bfloat16", packed=False, seq_tile=None, compile_blocks=False)
    assert background_trace.start("tiny", **args) is None                     # this process has torch
    monkeypatch.setattr(background_trace, "imports_pending", lambda: True)
    monkeypatch.setattr(background_trace, "cpu_cores", lambda: 1)
    assert background_trace.start("tiny", **args) is None
    monkeypatch.setattr(background_trace, "cpu_cores", lambda: 2)
    assert background_trace.start("tiny", **{**args, "seq_tile": 128}) is None
    bg = background_trace.start("tiny", **args)
    assert bg is not None
    bg.close()
    monkeypatch.setattr(background_trace, "worker_command", lambda: ["/nonexistent/python"])
    assert background_trace.start("tiny", **args) is None                     # no child to be had


@pytest.mark.skipif(background_trace.cpu_cores() < 2, reason="the seed's path needs two CPUs")
def test_the_command_line_compiles_a_preset_first_on_its_seed(tmp_path):
    out = tmp_path / "plan.json"
    env = {**os.environ, "LAZYTRAIN_TRACE_CACHE": str(tmp_path / "traces")}
    r = subprocess.run([sys.executable, "-m", "lazytrain", "compile", "tiny", "--batch", "4", "--seq", "384",
                        "--gpu-memory", "8GiB", "--host-memory", "64GiB", "-o", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Plan.load(out).history[0]["seed"] == "matched"


def test_the_seeds_are_package_data():
    """An install from a wheel has them (not only a checkout): the package data's patterns match every seed."""
    import fnmatch
    tomllib = pytest.importorskip("tomllib")           # Python 3.11 on
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["lazytrain"]
    seeds = sorted(seed_traces.SEED_DIR.glob("*.json.gz"))
    assert len(seeds) == len(seed_traces.PRESETS)
    for path in seeds:
        rel = path.relative_to(ROOT / "lazytrain").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel
