"""Fine-tune a Hugging Face model from a local folder with LazyTrain, on the built-in arithmetic task.

The folder here is made on the spot: a tiny, randomly initialised Qwen2 written with
``save_pretrained`` (config.json + model.safetensors), so the example needs no download.  Point
``--model`` at any local Qwen2 / Llama / Qwen3 folder to fine-tune real weights the same way.

    python examples/finetune_hf_local.py                    # tiny Qwen2, 200 steps
    python examples/finetune_hf_local.py --steps 3 --small  # what tests/test_examples.py runs
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def write_tiny_qwen2(folder: Path, *, small: bool) -> Path:
    """A random Qwen2 whose vocabulary covers the char tokenizer's ids, saved as a HF folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lazytrain.tasks import CharTokenizer
    width = 32 if small else 128
    cfg = Qwen2Config(vocab_size=CharTokenizer().vocab_size, hidden_size=width, intermediate_size=2 * width,
                      num_hidden_layers=2 if small else 4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local Hugging Face folder (default: write a tiny Qwen2)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--small", action="store_true", help="a smaller model and eval (for tests)")
    ap.add_argument("--output", default=None, help="run folder (default: a temporary one)")
    a = ap.parse_args()

    from lazytrain.app.config import TrainConfig
    from lazytrain.app.train import run
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.model) if a.model else write_tiny_qwen2(Path(tmp) / "tiny-qwen2", small=a.small)
        print(f"fine-tuning {folder}: {sorted(p.name for p in folder.iterdir())}")
        metrics = run(TrainConfig(model=str(folder), difficulty="tiny", batch=8 if a.small else 32, steps=a.steps,
                                  lr=1e-3, warmup=min(20, a.steps), policy="keep-all" if a.small else "milp",
                                  eval_size=16 if a.small else 200, output=a.output or str(Path(tmp) / "run"),
                                  progress=not a.small))
        print(f"loss {metrics['loss_curve'][0]['loss']:.3f} -> {metrics['final_loss']:.3f}, "
              f"exact match {metrics['exact_match']:.1%}")


if __name__ == "__main__":
    main()
