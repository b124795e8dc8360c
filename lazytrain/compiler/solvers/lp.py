"""A mixed-integer linear program as plain data: variables, rows and an objective that a solver
process can rebuild from JSON.

Why not build the model with python-mip directly: every ``mip.Model`` call goes into the solver's
native library, in the caller's process, and a native crash there (CBC's SIGSEGV in
``CbcNode::chooseDynamicBranch``) kills that process -- the user's script with it.  The MILP policy
therefore writes its model here, in pure Python, and ``solvers/isolated.py`` hands it to a child
process that owns the native library.  The same data lets the caller check a returned solution
against every row before trusting it.

Grammar (what ``to_json`` writes)::

    model  := {"vars": [var...], "rows": [row...], "objective": expr, "start": [[index, value]...]}
    var    := [name, lower, upper, integer]
    row    := [name, indices, coefficients, sense, rhs]        sense in "<=", ">=", "=="
    expr   := [indices, coefficients, constant]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INF = math.inf


class Var:
    """A column of a ``LinearModel`` (compares by identity; arithmetic makes an ``Expr``)."""

    __slots__ = ("index", "name")

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name

    def expr(self) -> Expr:
        return Expr({self.index: 1.0})

    def __add__(self, o):
        return self.expr() + o

    __radd__ = __add__

    def __sub__(self, o):
        return self.expr() - o

    def __rsub__(self, o):
        return -self.expr() + o

    def __neg__(self):
        return -self.expr()

    def __mul__(self, c):
        return self.expr() * c

    __rmul__ = __mul__

    def __le__(self, o):
        return self.expr() <= o

    def __ge__(self, o):
        return self.expr() >= o

    def __repr__(self) -> str:
        return self.name


class Expr:
    """A linear expression ``sum coef * var + constant``."""

    __slots__ = ("terms", "constant")
    __hash__ = None          # == builds a row

    def __init__(self, terms: dict[int, float] | None = None, constant: float = 0.0):
        self.terms = dict(terms or {})
        self.constant = float(constant)

    @staticmethod
    def of(x) -> Expr:
        if isinstance(x, Expr):
            return x
        if isinstance(x, Var):
            return x.expr()
        return Expr(constant=float(x))

    def __add__(self, o):
        o = Expr.of(o)
        out = Expr(self.terms, self.constant + o.constant)
        for i, c in o.terms.items():
            out.terms[i] = out.terms.get(i, 0.0) + c
        return out

    __radd__ = __add__

    def __neg__(self):
        return Expr({i: -c for i, c in self.terms.items()}, -self.constant)

    def __sub__(self, o):
        return self + (-Expr.of(o))

    def __rsub__(self, o):
        return -self + o

    def __mul__(self, c):
        if isinstance(c, (Var, Expr)):
            raise TypeError("a linear model multiplies expressions by numbers only")
        c = float(c)
        return Expr({i: v * c for i, v in self.terms.items()}, self.constant * c)

    __rmul__ = __mul__

    def __le__(self, o):
        return Row(self - o, "<=")

    def __ge__(self, o):
        return Row(self - o, ">=")

    def __eq__(self, o):  # type: ignore[override]
        return Row(self - o, "==")

    def value(self, x) -> float:
        return self.constant + sum(c * x[i] for i, c in self.terms.items())


def xsum(items) -> Expr:
    """Sum of variables, expressions and numbers (one dict, not a chain of temporaries)."""
    out = Expr()
    for it in items:
        if isinstance(it, Var):
            out.terms[it.index] = out.terms.get(it.index, 0.0) + 1.0
        elif isinstance(it, Expr):
            out.constant += it.constant
            for i, c in it.terms.items():
                out.terms[i] = out.terms.get(i, 0.0) + c
        else:
            out.constant += float(it)
    return out


@dataclass
class Row:
    """``expr sense 0``, the constant moved to the right-hand side when written."""

    expr: Expr
    sense: str
    name: str = ""

    def violation(self, x) -> float:
        v = self.expr.value(x)
        return max(0.0, v) if self.sense == "<=" else max(0.0, -v) if self.sense == ">=" else abs(v)


@dataclass
class LinearModel:
    """Columns, rows, objective (minimised) and an optional start, named by meaning."""

    vars: list[tuple[str, float, float, bool]] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    objective: Expr = field(default_factory=Expr)
    start: list[tuple[int, float]] = field(default_factory=list)

    def add_var(self, name: str, *, lb: float = 0.0, ub: float = INF, integer: bool = False) -> Var:
        self.vars.append((name, float(lb), float(ub), bool(integer)))
        return Var(len(self.vars) - 1, name)

    def binary(self, name: str, *, ub: float = 1.0) -> Var:
        return self.add_var(name, lb=0.0, ub=ub, integer=True)

    def add(self, row: Row, name: str) -> None:
        if not isinstance(row, Row):
            raise TypeError(f"row {name}: expected a comparison of linear expressions, got {type(row).__name__}")
        row.name = name
        self.rows.append(row)

    def __iadd__(self, named: tuple[Row, str]) -> LinearModel:
        self.add(*named)
        return self

    @property
    def n_vars(self) -> int:
        return len(self.vars)

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def to_json(self) -> dict:
        def expr(e: Expr) -> list:
            idx = [i for i, c in e.terms.items() if c != 0.0]
            return [idx, [e.terms[i] for i in idx], e.constant]

        rows = []
        for r in self.rows:
            idx, coef, const = expr(r.expr)
            rows.append([r.name, idx, coef, r.sense, -const])
        return {"vars": [list(v) for v in self.vars], "rows": rows, "objective": expr(self.objective),
                "start": [list(s) for s in self.start]}

    def check(self, x: list[float], tol: float = 1e-5) -> str | None:
        """Why ``x`` is not a solution of this model (bounds, integrality, rows; ``tol`` relative to
        each row's scale), or None.  A solver's answer is checked before it is trusted."""
        if len(x) != len(self.vars):
            return f"{len(x)} values for {len(self.vars)} variables"
        for (name, lb, ub, integer), v in zip(self.vars, x):
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                return f"{name} = {v!r}"
            if v < lb - tol or v > ub + tol:
                return f"{name} = {v:g} outside [{lb:g}, {ub:g}]"
            if integer and abs(v - round(v)) > tol:
                return f"{name} = {v:g} is not integral"
        for r in self.rows:
            scale = 1.0 + abs(r.expr.constant) + sum(abs(c * x[i]) for i, c in r.expr.terms.items())
            if r.violation(x) > tol * scale:
                return f"row {r.name} violated by {r.violation(x):.3g}"
        return None
