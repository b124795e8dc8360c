"""Sizes and counts as people type them on a command line: ``24GiB``, ``24GB``, ``24000MB``, ``8``.

Choices (so the next person does not have to guess):

- Units are case-insensitive: ``24gib``, ``24GiB`` and ``24GIB`` are the same (nobody means millibits).
- ``KB MB GB TB PB`` are powers of 1000 (SI, as disks and ``nvidia-smi``'s marketing figures use);
  ``KiB MiB GiB TiB PiB`` are powers of 1024.
- A bare letter (``100g``, ``512M``, ``2T``) is binary, i.e. ``100g == 100GiB``: this is what
  ``java -Xmx100g``, ``docker --memory 100g`` and Slurm's ``--mem=100G`` mean, so a user copying a
  flag from those gets what they expect.
- ``B`` or no unit is bytes; a byte count must then be whole (``1.5`` is an error, ``1.5KiB`` is 1536).
- Fractions are rounded to the nearest byte; zero and negative sizes are errors (every size here is
  a capacity or a budget). Underscores and spaces inside are allowed: ``24 GiB``, ``24_000MB``.
"""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size", "parse_count"]

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_SIZE_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)$")
_EXAMPLE = "a size like 24GiB, 24GB or 24000MB"


def _multiplier(unit: str) -> int | None:
    """Bytes per ``unit`` (lower-case), or None when it is not a size unit."""
    if unit in ("", "b"):
        return 1
    if len(unit) == 1:
        return _BINARY.get(unit)
    if len(unit) == 2 and unit[1] == "b":
        return _DECIMAL.get(unit[0])
    if len(unit) == 3 and unit[1:] == "ib":
        return _BINARY.get(unit[0])
    return None


def parse_size(text: str | int) -> int:
    """``"24GiB"`` -> 25769803776 bytes (see the module docstring for the units).

    An ``int`` is taken as a byte count already, so ``gpu_memory=24 * 2**30`` works too.
    Raises ``ValueError`` naming the input for anything else.
    """
    if isinstance(text, bool):
        raise ValueError(f"needs {_EXAMPLE}, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"a size must be positive, got {text} bytes")
        return text
    if not isinstance(text, str):
        raise ValueError(f"needs {_EXAMPLE}, got {text!r}")
    cleaned = text.strip().replace("_", "").lower()
    match = _SIZE_RE.match(cleaned)
    if match is None:
        raise ValueError(f"needs {_EXAMPLE}, got {text!r}")
    number, unit = match.groups()
    multiplier = _multiplier(unit)
    if multiplier is None:
        raise ValueError(
            f"unknown size unit in {text!r}: use KB, MB, GB, TB (powers of 1000), "
            f"KiB, MiB, GiB, TiB (powers of 1024) or B, e.g. 24GiB"
        )
    value = float(number) * multiplier
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    if multiplier == 1 and value != int(value):
        raise ValueError(f"a byte count must be whole, got {text!r}")
    nbytes = round(value)
    if nbytes <= 0:
        raise ValueError(f"a size must be at least one byte, got {text!r}")
    return nbytes


def format_size(nbytes: float) -> str:
    """Bytes as a short binary figure: ``25132175360`` -> ``"23.4 GiB"``, ``512`` -> ``"512 B"``."""
    sign = "-" if nbytes < 0 else ""
    value = abs(float(nbytes))
    if value < 1024:
        return f"{sign}{value:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")


def parse_count(text: str | int, name: str) -> int:
    """A positive whole number such as a batch size: ``"32"`` -> 32; ``name`` appears in the error."""
    if isinstance(text, bool):
        raise ValueError(f"{name} needs a positive whole number, got {text!r}")
    if isinstance(text, int):
        value = text
    elif isinstance(text, str) and re.fullmatch(r"[+-]?\d[\d_]*", text.strip()):
        value = int(text.strip().replace("_", ""))
    else:
        raise ValueError(f"{name} needs a positive whole number, got {text!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value
