"""What a command loads before it does its work: a compile whose trace is cached imports neither torch (~1.3 s of
CPU on 2 cores, half of such a compile's) nor transformers and torch's export machinery (~3 s more, what a cold
compile pays to trace), nor the modules only ``train`` and ``bench`` describe their options with; ``show`` loads
neither torch nor networkx."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lazytrain.compiler import pipeline
from lazytrain.compiler.request import CompileRequest
from lazytrain.ir import Plan

ROOT = Path(__file__).resolve().parent.parent
TINY_QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 5,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "tie_word_embeddings": True,
              "max_position_embeddings": 64}
#: modules a command that does not trace, train or benchmark never needs
TRACING = ("torch", "transformers", "torch._dynamo", "torch.export._trace")
OTHER_COMMANDS = ("lazytrain.app.train", "lazytrain.app.finetune", "lazytrain.measure.bench", "lazytrain.tasks")


def _run(args: list[str], modules: tuple[str, ...]) -> list[str]:
    """``lazytrain ARGS`` in a fresh process (this checkout's package); the ``modules`` it has loaded when done."""
    code = ("import json, sys\nfrom lazytrain.app.cli import main\nrc = main(sys.argv[2:])\n"
            "print(json.dumps([rc, [m for m in json.loads(sys.argv[1]) if m in sys.modules]]))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(modules), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    rc, loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert rc == 0, r.stderr[-2000:]
    return loaded


def test_a_compile_from_the_trace_cache_loads_neither_torch_nor_a_tracer(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN2))
    pipeline.resolve_graph(str(model), CompileRequest(seq_len=32, seq_tile=None), [])   # the session's trace cache
    # (conftest) now holds it
    out = tmp_path / "plan.json"
    loaded = _run(["compile", str(model), "--batch", "2", "--seq", "32", "--gpu-memory", "8GiB", "-o", str(out)],
                  TRACING + OTHER_COMMANDS)
    assert Plan.load(out).history[0].get("cached") is True and loaded == []


def test_show_loads_neither_torch_nor_networkx(small_plan, tmp_path):
    small_plan.save(tmp_path / "plan.json")
    assert _run(["show", str(tmp_path / "plan.json")], ("torch", "networkx", *OTHER_COMMANDS)) == []
