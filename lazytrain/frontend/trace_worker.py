"""A trace in a process of its own: ``python -m lazytrain.frontend.trace_worker`` reads one request
(``{"model": spec, "seq_len": ..., "dtype": ..., "packed": ..., "seq_tile": ...}``) as JSON on stdin,
builds and traces the model exactly as ``compile_model`` would, stores the graph in the trace cache and
writes ``{"graph": ModelGraph.to_json()}`` on stdout; on any error, ``{"error": "..."}`` and exit status 1.

``compiler/background_trace.py`` runs it beside a compile that searches on a preset's seed
(``seed_traces.py``): the imports that make a trace slow then run on another core.
"""

from __future__ import annotations

import json
import os
import sys
import time

_T0 = time.perf_counter()


def trace_request(request: dict) -> dict:
    """The traced graph of ``request`` as JSON, stored in the trace cache on the way."""
    from .trace_cache import TraceCache, trace_and_store
    args = {"seq_len": request["seq_len"], "dtype": request["dtype"], "packed": bool(request.get("packed")),
            "seq_tile": request.get("seq_tile")}
    return trace_and_store(request["model"], TraceCache.of(request["model"], **args), **args).to_json()


def main() -> int:
    try:
        out = {"graph": trace_request(json.loads(sys.stdin.read())), "seconds": round(time.perf_counter() - _T0, 4)}
        code = 0
    except Exception as e:  # noqa: BLE001 - whatever failed, the compile traces in its own process and says why
        out, code = {"error": f"{type(e).__name__}: {e}"}, 1
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    # at once: tearing down an interpreter that imported torch and transformers takes ~0.5 s, which the compile
    # would wait for (the cache file is written and closed by now)
    os._exit(main())
