"""Where the CPU time of a cold compile goes (no trace cached): the libraries' imports, the trace, the search.

    python benchmarks/cold_compile.py [MODEL] [--batch 24] [--gpu-memory 32GiB]

Run in a fresh process, as ``lazytrain compile MODEL`` with an empty trace cache runs it, each stage timed in
CPU seconds (what the machine's load moves least): importing torch; LazyTrain's compiler; torch.export's tracer
(dynamo, sympy, ...), which the first export imports; transformers and the model's modeling module (its lazy
table of every model file, ``modeling_utils``); building the model on ``meta``; the trace (export of two layers,
split, measure); the search and the megatrain baseline in this process, and the solver worker's CPU (a child).
"""

from __future__ import annotations

import argparse
import importlib
import resource
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu-memory", default="32GiB")
    a = ap.parse_args()
    stages: list[tuple[str, float]] = []
    last = [time.process_time()]

    def done(name: str) -> None:
        now = time.process_time()
        stages.append((name, now - last[0]))
        last[0] = now

    import torch  # noqa: F401 - timed
    done("import torch")
    from lazytrain.compiler import api
    done("import lazytrain's compiler")
    import torch.export._trace  # noqa: F401 - what the first torch.export imports
    done("import torch.export's tracer (dynamo, sympy, ...)")
    from lazytrain.frontend.presets import PRESETS, build_model
    model_type = PRESETS.get(a.model, {}).get("model_type", "")
    if model_type != "lazytrain-gpt":
        import transformers  # noqa: F401 - timed
        done("import transformers (its table of model files)")
        if model_type:
            importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
            done(f"import modeling_{model_type} (modeling_utils, ...)")
    model = build_model(a.model)
    done("build the model on meta")
    from lazytrain.frontend.trace import trace
    graph = trace(model, seq_len=a.seq)
    done("trace (export, split, measure)")
    plan = api.compile_model(graph, batch_size=a.batch, seq_len=a.seq, gpu_memory=a.gpu_memory, seq_tile=None)
    done("search and megatrain baseline (this process)")
    from lazytrain.compiler.solvers.isolated import shutdown
    shutdown()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    stages.append(("solver worker (a child process)", ru.ru_utime + ru.ru_stime))
    for name, seconds in stages:
        print(f"| {name} | {seconds:.2f} |")
    print(f"| total | {sum(s for _, s in stages):.2f} |")
    print(f"predicted step {plan.predicted['step_time_s']:.4f} s, micro-batch {plan.micro_batch}, "
          f"search out of time: {bool(plan.solver and plan.solver.out_of_time)}")


if __name__ == "__main__":
    main()
