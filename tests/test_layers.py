"""Imports go downward only (``docs/architecture.md``, "The pipeline"), at every level.

- Packages, bottom to top: ``util`` < ``ir`` < ``models`` < ``frontend`` < {``compiler``, ``runtime``} <
  {``data``, ``tasks``} < ``hf`` < ``measure`` < ``app`` < the top (``lazytrain/__init__.py``, ``__main__.py`` and at
  most two more modules of the public API).  A package imports only those below it; ``compiler`` and ``runtime``
  never import each other (so the runtime needs no MIP solver); ``data`` and ``tasks`` may, one way only.
- Modules (files): no cycle at all, inside a package or across packages, so every package's files stand in an order
  too.  Every import counts: function-local ones and those under ``if TYPE_CHECKING:`` alike (a reader sees the
  circle either way), except the few annotations of ``ANNOTATIONS``: a context object whose own type the functions
  it holds take (``runtime.context.Run``), and the ``Plan`` whose reading runs the checks that take it.  Breaking
  those would split a class for the sake of its annotations; each is checked to be an annotation only.
- No module imports a private name (``_name``) that another module defines.

Read from the source with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

import lazytrain

ROOT = Path(lazytrain.__file__).parent
TOP = "top"
#: each package's rank: a package imports only packages of a lower rank (and ``data``/``tasks`` each other)
RANK = {"util": 0, "ir": 1, "models": 2, "frontend": 3, "compiler": 4, "runtime": 4, "data": 5, "tasks": 5, "hf": 6,
        "measure": 7, "app": 8, TOP: 9}
#: packages of one rank that may import each other, one way only (the package graph stays acyclic)
SIDEWAYS = {frozenset({"data", "tasks"})}
#: modules right under ``lazytrain/`` besides ``__init__`` and ``__main__`` (the public API)
MAX_EXTRA_TOP = 2

#: imports under ``if TYPE_CHECKING:`` only, left out of the cycle check (the module docstring says why)
ANNOTATIONS = {
    ("lazytrain.ir.schema", "lazytrain.ir.plan"): "check_plan(plan: Plan): Plan.from_json runs it on what it built",
    ("lazytrain.ir.verify", "lazytrain.ir.plan"): "verify(plan: Plan): Plan.load runs it",
    ("lazytrain.runtime.context", "lazytrain.runtime.interpreter"): "Run.schedule: the dispatcher's Schedule",
    ("lazytrain.runtime.context", "lazytrain.runtime.updates"): "Run.updates: the update path, whose methods take "
                                                                "the Step",
}



@dataclass(frozen=True)
class Import:
    """One imported module or name: ``source`` imports ``target`` (a module), and ``name`` from it if any."""
    source: str
    target: str
    name: str | None
    line: int
    #: under ``if TYPE_CHECKING:`` (annotations only)
    typing_only: bool = False


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ("lazytrain", *p.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, mods) -> list[tuple[str, str | None]]:
    """(module, name or None) for each name the statement imports, LazyTrain's only."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name.split(".")[0] == "lazytrain"]
    if node.level == 0:
        if (node.module or "").split(".")[0] != "lazytrain":
            return []
        base = node.module
    else:
        parts = mod.split(".")
        base = ".".join(parts[:len(parts) - node.level + is_pkg] + ([node.module] if node.module else []))
    return [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in mods else (base, a.name) for a in node.names]


def _typing_only(tree: ast.Module) -> set[int]:
    """The ids of the import statements under ``if TYPE_CHECKING:``."""
    out = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


@functools.cache
def _imports() -> tuple[Import, ...]:
    mods = _modules()
    out = []
    for mod, path in sorted(mods.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = _typing_only(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out += [Import(mod, target, name, node.lineno, id(node) in typing_only)
                        for target, name in _resolve(mod, path.name == "__init__.py", node, mods) if target != mod]
    return tuple(out)


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(_modules())
    g.add_edges_from((i.source, i.target) for i in _imports())
    return g


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else TOP


def test_every_package_has_a_rank_and_the_top_stays_small():
    mods = _modules()
    assert {_package(m) for m in mods} == set(RANK)
    extra = {m for m in mods if _package(m) == TOP} - {"lazytrain", "lazytrain.__main__"}
    assert len(extra) <= MAX_EXTRA_TOP, f"too many top-level modules: {sorted(extra)}"


def test_packages_import_only_below_themselves():
    wrong, sideways = [], nx.DiGraph()
    for a, b in _graph().edges:
        pa, pb = _package(a), _package(b)
        if pa == pb:
            continue
        if frozenset({pa, pb}) in SIDEWAYS:
            sideways.add_edge(pa, pb)
        elif RANK[pb] >= RANK[pa]:
            wrong.append(f"{a} -> {b}")
    assert not wrong, "imports against the package order:\n" + "\n".join(sorted(wrong))
    assert nx.is_directed_acyclic_graph(sideways), f"packages of one rank import each other: {list(sideways.edges)}"


def test_no_import_cycle_between_modules():
    g = _graph()
    assert g.has_edge("lazytrain.ir.plan", "lazytrain.ir.verify")       # the graph is read at all
    g.remove_edges_from(ANNOTATIONS)
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)
    assert not cycles, "modules importing each other (directly or around a circle):\n" + "\n".join(map(str, cycles))


def test_no_private_name_of_another_module_is_imported():
    wrong = [f"{i.source}:{i.line} imports {i.name} from {i.target}" for i in _imports()
             if i.name and i.name.startswith("_") and not i.name.startswith("__")]
    assert not wrong, "private names imported from another module:\n" + "\n".join(sorted(wrong))


def test_the_imports_left_out_of_the_cycle_check_are_annotations_only():
    imports = _imports()
    assert any(i.typing_only for i in imports)      # ``if TYPE_CHECKING:`` is recognised at all
    for edge in ANNOTATIONS:
        found = [i for i in imports if (i.source, i.target) == edge]
        assert found, f"{edge} is no longer imported: delete it from ANNOTATIONS"
        assert all(i.typing_only for i in found), f"{edge} is imported outside ``if TYPE_CHECKING:``"


def test_no_private_name_of_another_module_is_read_through_the_module():
    """``from . import store`` then ``store._name``: the same private name, reached one dot later."""
    mods = _modules()
    wrong = []
    for mod, path in sorted(mods.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a, (target, name) in zip(node.names, _resolve(mod, path.name == "__init__.py", node, mods)):
                    if name is None:
                        aliases[a.asname or a.name] = target
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in mods})
        wrong += [f"{mod}:{n.lineno} reads {aliases[n.value.id]}.{n.attr}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
                  and n.attr.startswith("_") and not n.attr.startswith("__") and aliases[n.value.id] != mod]
    assert not wrong, "private names read from another module:\n" + "\n".join(wrong)

