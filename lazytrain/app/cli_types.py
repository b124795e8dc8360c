"""Value types of the ``lazytrain`` command's arguments: each turns one argument's text into its value, or says in
one line what it needs (``argparse.ArgumentTypeError``), never a traceback."""

from __future__ import annotations

import argparse
import math

from ..util.units import parse_size


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

def whole_number(text: str, least: int, what: str, bound: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a {what}, got {text!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be {bound}, got {v}")
    return v

def positive(text: str) -> int:
    return whole_number(text, 1, "positive whole number", "positive")

def positive_or_max(text: str):
    """A positive whole number, or 'max' (the largest that fits, which the compile searches)."""
    return "max" if text == "max" else positive(text)

def lora(text: str) -> dict | None:
    """``r=16,alpha=32,targets=q_proj,k_proj,...[,dropout=0]`` (``frontend/lora.py``) as its mapping, or None for
    'none'."""
    from ..frontend.lora import parse_lora
    try:
        spec = parse_lora(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return None if spec is None else spec.to_json()


def seq_tile(text: str):
    return None if text == "none" else "auto" if text == "auto" else positive(text)   # auto, none or tokens

def resident(text: str):
    """'none', 'auto', a number of leading blocks, or block indices separated by commas."""
    if text in ("none", "auto"):
        return text
    try:
        if "," in text:
            return [int(x) for x in text.split(",") if x.strip()]
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs none, auto, a number of blocks or a list like 0,1,2; got {text!r}") \
            from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v

def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a positive number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    if v == math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return v

def fraction(text: str) -> float:
    """A number in [0, 1]: a share."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return v

def non_negative_float(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"needs a number >= 0, got {text!r}") from None

def seed(text: str) -> int:
    v = whole_number(text, 0, "whole number >= 0", ">= 0")
    if v >= 1 << 63:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {text}")
    return v

def non_negative(text: str) -> int:
    return whole_number(text, 0, "whole number >= 0", ">= 0")

def difficulty(text: str) -> str:
    """A task preset, or one in answer formats (``tiny-pad-rev``), as its canonical name."""
    from ..tasks import get_difficulty  # only when a train flag is parsed
    try:
        return get_difficulty(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid choice: {e}") from None

def minutes(text: str) -> float | None:
    """A positive number of minutes, or 0 / none for no time limit."""
    if text.strip().lower() in ("0", "none"):
        return None
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"needs minutes (a positive number), or 0 for no limit; got {text!r}") \
            from None

def path(text: str) -> str:
    """A file or folder name: not empty (an empty one would name nothing, or the current folder, silently)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"needs a file or folder name, got {text!r}")
    return text


def report_to(text: str) -> list[str]:
    """Trackers separated by commas (``tensorboard,wandb``), or ``none`` (``trackers.parse``)."""
    from .trackers import parse
    try:
        return list(parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def columns(text: str) -> dict[str, str]:
    """``question=prompt,answer=completion``: source columns renamed to the keys we read."""
    from ..data.formats import parse_columns  # (no pyarrow, no torch)
    try:
        return parse_columns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
