"""Built-in traces of the presets: a preset's graph at any sequence length, predicted without torch.

Without them a preset's first compile waits seconds for its trace, nearly all of it importing torch,
``torch.export`` and transformers, before the search can start [ledger: seed-traces].  Every number of a
traced graph is a polynomial of degree two or less in the sequence length (shapes and bytes grow linearly,
attention FLOPs quadratically; ``CHECK_SEQS`` checks it), so three traces of each preset, made once and
shipped (``seeds/NAME.json.gz``), give its graph at any length by Lagrange interpolation over the integers.

The prediction is never trusted: the compile searches on it while the real trace runs in a child process
on another core (``compiler/background_trace.py``), and returns its plan only if the two graphs are equal;
otherwise it compiles again on the traced graph.  A stale seed (another torch or transformers, a changed
tracer) costs a first compile its head start, never its plan.

Regenerate after a change to the tracer or to a preset (the test ``test_seed_traces.py`` finds a stale
seed): ``python -m lazytrain.frontend.seed_traces``.  Each preset is traced at three lengths
(``FIT_SEQS``, the largest three its positions allow) and checked at every length of ``CHECK_SEQS`` it
allows; the seed is used in the range of lengths where every check held (``valid``).
"""

from __future__ import annotations

import gzip
import json
import sys
from fractions import Fraction
from pathlib import Path

from ..ir import ModelGraph
from .preset_configs import PRESETS

SEED_FORMAT = "lazytrain.seed_trace/1"
#: one file per preset (a compile reads only its own): ``seeds/NAME.json.gz``
SEED_DIR = Path(__file__).with_name("seeds")
#: the dtype the seeds are traced in (the compile's default; a float32 compile traces as before)
SEED_DTYPE = "bfloat16"
#: lengths a seed is fitted at: the largest three of these a preset's positions allow
FIT_SEQS = (2048, 1024, 512, 256, 128)
#: lengths the fit is checked at, where the preset's positions allow them
CHECK_SEQS = (64, 100, 384, 768, 1000, 1536, 3000, 4096, 8192, 16384, 32768, 131072)
#: graph fields that are measurements, not structure: never predicted, never compared
UNCOMPARED_META = ("trace_seconds",)


def seed_path(name: str) -> Path:
    return SEED_DIR / f"{name}.json.gz"


def load_seed(name: str) -> dict | None:
    """Preset ``name``'s shipped seed (``{"format", "made_with", "config", "seqs", "valid", "graphs"}``), or None
    when it has none (or the file is not ours)."""
    if name not in PRESETS:
        return None
    try:
        d = json.loads(gzip.decompress(seed_path(name).read_bytes()))
    except (OSError, ValueError, EOFError):
        return None
    return d if isinstance(d, dict) and d.get("format") == SEED_FORMAT else None


def predict(name: str, seq_len: int, dtype: str = SEED_DTYPE) -> ModelGraph | None:
    """Preset ``name``'s graph at ``seq_len`` as its seed predicts it, or None: no seed for it (another dtype, a
    preset changed since the seed was made), a length outside the checked range, or a seed that does not
    interpolate to whole numbers there."""
    if dtype != SEED_DTYPE:
        return None
    seed = load_seed(name)
    try:        # a damaged file is no seed, never a failed compile
        if seed is None or PRESETS.get(name) != seed["config"] or not seed["valid"][0] <= seq_len <= seed["valid"][1]:
            return None
        d = interpolate(seed["graphs"], seed["seqs"], seq_len)
        return None if d is None else ModelGraph.from_json(d)
    except (TypeError, ValueError, KeyError, IndexError):
        return None


def interpolate(graphs: list[dict], seqs: list[int], seq: int):
    """The JSON value whose numbers are the polynomials through ``graphs`` (one per length of ``seqs``) at
    ``seq``; None where the values differ in anything but numbers (a structure that changes with the length),
    or a whole number would come out fractional."""
    first = graphs[0]
    if isinstance(first, dict):
        if any(not isinstance(g, dict) or g.keys() != first.keys() for g in graphs):
            return None
        out = {}
        for k in first:
            if k in UNCOMPARED_META:
                continue
            v = interpolate([g[k] for g in graphs], seqs, seq)
            if v is None and first[k] is not None:
                return None
            out[k] = v
        return out
    if isinstance(first, list):
        if any(not isinstance(g, list) or len(g) != len(first) for g in graphs):
            return None
        out = [interpolate(list(vs), seqs, seq) for vs in zip(*graphs)]
        return None if any(v is None and x is not None for v, x in zip(out, first)) else out
    if all(g == first and type(g) is type(first) for g in graphs):
        return first
    if not all(isinstance(g, int) and not isinstance(g, bool) for g in graphs):
        return None        # a float or string that changes with the length: not predicted
    value = _lagrange(seqs, graphs, seq)
    return int(value) if value.denominator == 1 else None


def _lagrange(xs: list[int], ys: list[int], x: int) -> Fraction:
    """The polynomial through the points (``xs``, ``ys``) at ``x``, exactly."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = Fraction(yi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return total


def comparable(graph: ModelGraph) -> dict:
    """``graph`` as JSON without its measurements (``UNCOMPARED_META``): two traces of one model compare equal."""
    d = json.loads(json.dumps(graph.to_json()))        # as it reads back from a file: lists, not tuples
    d["meta"] = {k: v for k, v in d["meta"].items() if k not in UNCOMPARED_META}
    return d


def same_graph(a: ModelGraph, b: ModelGraph) -> bool:
    """Are ``a`` and ``b`` one graph (every structure and number equal)?"""
    return comparable(a) == comparable(b)


# -- making the seeds (imports torch and transformers) ---------------------------------------------
def _positions(cfg: dict) -> int:
    return cfg.get("max_position_embeddings") or cfg.get("max_seq") or max(FIT_SEQS)


def make_seed(name: str, log=print) -> dict:
    """Trace preset ``name`` at its fit lengths, check the fit at the others; its entry in the seed file."""
    from .presets import build_model
    from .trace import trace
    model = build_model(name)
    positions = _positions(PRESETS[name])
    fit = sorted(s for s in FIT_SEQS if s <= positions)[-3:]
    graphs = [comparable(trace(model, seq_len=s, dtype=SEED_DTYPE)) for s in fit]
    lo, hi = fit[0], fit[-1]
    below = sorted((s for s in CHECK_SEQS if s < lo), reverse=True)
    above = sorted(s for s in CHECK_SEQS if hi < s <= positions)
    for side in (below, above):
        for s in side:
            try:
                ok = interpolate(graphs, fit, s) == comparable(trace(model, seq_len=s, dtype=SEED_DTYPE))
            except Exception as e:  # noqa: BLE001 - a length the tracer refuses ends the range there
                log(f"  {name} at {s}: {type(e).__name__}: {e}")
                ok = False
            if not ok:
                log(f"  {name}: the fit does not hold at {s} tokens: the seed stops short of it")
                break
            lo, hi = min(lo, s), max(hi, s)
    inner = [s for s in CHECK_SEQS if fit[0] < s < fit[-1] and s not in fit]
    for s in inner:
        if interpolate(graphs, fit, s) != comparable(trace(model, seq_len=s, dtype=SEED_DTYPE)):
            raise RuntimeError(f"{name}: the fit through {fit} does not hold at {s} tokens")
    log(f"  {name}: fitted at {fit}, valid {lo}..{hi} tokens")
    return {"config": PRESETS[name], "seqs": fit, "valid": [lo, hi], "graphs": graphs}


def main(argv: list[str] | None = None) -> int:
    """Write ``seeds/NAME.json.gz`` for every preset (or those named)."""
    from .trace_cache import code_version
    names = (argv if argv is not None else sys.argv[1:]) or list(PRESETS)
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        print(f"unknown presets: {', '.join(unknown)}", file=sys.stderr)
        return 2
    made_with = {k: v for k, v in code_version().items() if k != "lazytrain"}
    SEED_DIR.mkdir(exist_ok=True)
    for n in names:
        text = json.dumps({"format": SEED_FORMAT, "made_with": made_with, **make_seed(n)}, sort_keys=True,
                          separators=(",", ":"))
        seed_path(n).write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
        print(f"wrote {seed_path(n).name}: {seed_path(n).stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
