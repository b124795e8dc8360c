"""Checking untrusted JSON (a checkpoint manifest, a run's metrics) against a declared shape.

A file a user can edit is input: without a check, a field of the wrong type surfaces as a KeyError or
TypeError deep inside the code that reads it.  ``check(value, shape, file)`` walks the value once and
raises one error naming the file, the field and what it must be.  The shape grammar::

    shape ::= int | float | str | bool | None      -- a whole number in [0, 2**62) (never a bool), a
                                                    -- finite number >= 0, a string, true/false, null
            | Int(lo, hi) | Num(lo, hi, finite, nan)  -- bounded numbers (hi exclusive)
            | OneOf(v, ...)                        -- one of these literal values
            | Either(shape, ...)                   -- the first that fits
            | {"key": shape, "k2": Opt(shape)}     -- an object with these keys (Opt: may be absent;
                                                    -- other keys are allowed and not checked)
            | MapOf(shape) | ListOf(shape, n)      -- any keys / a list (of exactly n items when given)
            | Any                                  -- anything
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LIMIT = 1 << 62


@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int = LIMIT             # exclusive


@dataclass(frozen=True)
class Num:
    lo: float = 0.0
    hi: float = math.inf        # exclusive
    finite: bool = True         # refuse +-inf
    nan: bool = False           # accept NaN (a loss that diverged is a fact to keep, not a malformed file)


class OneOf:
    def __init__(self, *values):
        self.values = values


class Either:
    def __init__(self, *shapes):
        self.shapes = shapes


@dataclass(frozen=True)
class Opt:
    shape: object


@dataclass(frozen=True)
class MapOf:
    shape: object


@dataclass(frozen=True)
class ListOf:
    shape: object
    n: int | None = None


Any = object()


class ShapeError(ValueError):
    """A JSON value that does not have its declared shape; ``field`` is the dotted path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _got(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"a {type(v).__name__} ({text[:30]}...)"


def _fail(path: str, must: str, v) -> ShapeError:
    return ShapeError(path, f"field {path or '(top level)'} must be {must}, got {_got(v)}")


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_shape(v, shape, path: str = "") -> None:
    """Raise ShapeError unless ``v`` has ``shape`` (see the module docstring)."""
    if shape is Any:
        return
    if shape is int:
        shape = Int()
    elif shape is float:
        shape = Num()
    if isinstance(shape, Int):
        if not isinstance(v, int) or isinstance(v, bool):
            raise _fail(path, "a whole number", v)
        if not shape.lo <= v < shape.hi:
            raise _fail(path, f"a whole number in [{shape.lo}, {shape.hi})", v)
    elif isinstance(shape, Num):
        if not _is_num(v):
            raise _fail(path, "a number", v)
        if math.isnan(v):
            if not shape.nan:
                raise _fail(path, "a number (not NaN)", v)
        elif (math.isinf(v) and shape.finite) or not (math.isinf(v) or shape.lo <= v < shape.hi):
            rng = f"in [{shape.lo:g}, {shape.hi:g})" if shape.finite else f"at least {shape.lo:g}"
            raise _fail(path, f"a {'finite ' if shape.finite else ''}number {rng}", v)
    elif shape is str or shape is bool:
        if not isinstance(v, shape):
            raise _fail(path, "a string" if shape is str else "true or false", v)
    elif shape is None:
        if v is not None:
            raise _fail(path, "null", v)
    elif isinstance(shape, OneOf):
        if not any(v == x and type(v) is type(x) for x in shape.values):
            raise _fail(path, "one of " + ", ".join(map(repr, shape.values)), v)
    elif isinstance(shape, Either):
        for s in shape.shapes:
            try:
                check_shape(v, s, path)
                return
            except ShapeError:
                pass
        raise _fail(path, " or ".join(_describe(s) for s in shape.shapes), v)
    elif isinstance(shape, dict):
        if not isinstance(v, dict):
            raise _fail(path, "an object", v)
        for key, s in shape.items():
            sub = f"{path}.{key}" if path else key
            if key not in v:
                if isinstance(s, Opt):
                    continue
                raise ShapeError(sub, f"field {sub} is missing")
            check_shape(v[key], s.shape if isinstance(s, Opt) else s, sub)
    elif isinstance(shape, MapOf):
        if not isinstance(v, dict):
            raise _fail(path, "an object", v)
        for key, x in v.items():
            check_shape(x, shape.shape, f"{path}.{key}" if path else str(key))
    elif isinstance(shape, ListOf):
        if not isinstance(v, list):
            raise _fail(path, "a list", v)
        if shape.n is not None and len(v) != shape.n:
            raise _fail(path, f"a list of {shape.n} items", f"{len(v)} items")
        for i, x in enumerate(v):
            check_shape(x, shape.shape, f"{path}[{i}]")
    else:   # pragma: no cover - a shape this module does not know is a bug in the caller
        raise TypeError(f"unknown shape {shape!r}")


def _describe(shape) -> str:
    if shape is None:
        return "null"
    if shape in (int, str, bool, float) or isinstance(shape, (Int, Num)):
        return {int: "a whole number", str: "a string", bool: "true or false", float: "a number"}.get(
            shape, "a whole number" if isinstance(shape, Int) else "a number")
    if isinstance(shape, (dict, MapOf)):
        return "an object"
    if isinstance(shape, ListOf):
        return "a list"
    if isinstance(shape, OneOf):
        return "one of " + ", ".join(map(repr, shape.values))
    return "of another shape"


def dumps(value, **kw) -> str:
    """``value`` as strict JSON: a NaN or an infinity (a loss that diverged) is written as ``null``, never as the
    bare ``NaN`` that most JSON readers refuse."""
    import json

    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v
    return json.dumps(finite(value), allow_nan=False, **kw)
