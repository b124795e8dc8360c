"""Imports flow one way (``docs/architecture.md``, "The pipeline"): ``ir`` <- ``frontend`` <- ``compiler``
and ``runtime``, which never import each other; and no two modules import each other at module level.

Read from the source with ``ast`` (nothing is imported), every import counted, function-local ones too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import lazytrain

ROOT = Path(lazytrain.__file__).parent
#: what each layer may import besides itself (and top-level modules that import nothing of LazyTrain)
ALLOWED = {"ir": set(), "frontend": {"ir"}, "compiler": {"ir", "frontend"}, "runtime": {"ir", "frontend"}}
#: imports upward, each with its reason (none: ``calibrate=True`` is supplied to the compiler from above,
#: ``compiler.pipeline.calibrating``)
UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ("lazytrain", *p.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _targets(mod: str, is_pkg: bool, node, mods) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "lazytrain"]
    if node.level == 0:
        if (node.module or "").split(".")[0] != "lazytrain":
            return []
        base = node.module
    else:
        pkg = mod.split(".")[:len(mod.split(".")) - node.level + is_pkg]
        base = ".".join(pkg + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def _graph() -> tuple[nx.DiGraph, nx.DiGraph]:
    """(every import, module-level imports only), TYPE_CHECKING blocks left out of the second."""
    mods = _modules()
    every, top = nx.DiGraph(), nx.DiGraph()
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        every.add_node(mod)
        top.add_node(mod)
        module_level = {id(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, path.name == "__init__.py", node, mods):
                    if t != mod:
                        every.add_edge(mod, t)
                        if id(node) in module_level:
                            top.add_edge(mod, t)
    return every, top


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ALLOWED else mod


def test_layers_import_only_below_themselves():
    every, _ = _graph()
    leaves = {m for m in every if _layer(m) == m and m != "lazytrain" and not set(every.successors(m)) - {"lazytrain"}}
    assert {"lazytrain.util.units", "lazytrain.models.gpt"} <= leaves
    wrong = []
    for a, b in every.edges:
        la, lb = _layer(a), _layer(b)
        if la in ALLOWED and lb != la and lb not in ALLOWED[la] and b not in leaves and (a, b) not in UPWARD:
            wrong.append(f"{a} -> {b}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))
    assert all(every.has_edge(*e) for e in UPWARD), "an allowed upward import is gone: drop it from UPWARD"


def test_no_module_level_import_cycle():
    _, top = _graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(top) if len(c) > 1]
    assert not cycles, f"modules importing each other at module level: {cycles}"
    assert top.has_edge("lazytrain.ir.plan", "lazytrain.ir.verify")     # the graph is read at all
