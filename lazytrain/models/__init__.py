"""Reference models written in plain PyTorch (used by presets, tests and examples)."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
