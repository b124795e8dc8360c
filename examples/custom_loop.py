"""The Python API in a training loop of your own: compile, Trainer, your lr schedule, eval, checkpoint.

    python examples/custom_loop.py             # the task GPT on "tiny" arithmetic, 300 steps
    python examples/custom_loop.py --steps 3   # what tests/test_examples.py runs
"""

from __future__ import annotations

import argparse
import math
import tempfile

import torch

import lazytrain
from lazytrain.frontend.presets import build_from_config
from lazytrain.runtime.optim import Hybrid8bitAdamW
from lazytrain.tasks import PRESETS, CharTokenizer, eval_examples, exact_match, train_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()

    tok, seq = CharTokenizer(), PRESETS["tiny"].seq_len
    torch.manual_seed(0)
    model = build_from_config({"model_type": "lazytrain-gpt", "vocab": tok.vocab_size, "d_model": 128,
                               "n_layer": 4, "n_head": 4, "d_ff": 512, "max_seq": seq, "rope": True}, device="cpu",
                              dtype=torch.float32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = lazytrain.compile(model, batch_size=a.batch, seq_len=seq, hardware="cpu" if device == "cpu" else "h200",
                             param_dtype="float32" if device == "cpu" else "bfloat16", policy="keep-all")
    print(plan.summary())
    opt = Hybrid8bitAdamW(lr=a.lr, max_grad_norm=1.0)
    trainer = lazytrain.Trainer(model, plan, optimizer=opt, device=device)

    batches = train_batches(a.batch, difficulty="tiny", seq_len=seq)
    for step in range(a.steps):
        opt.lr = a.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        b = next(batches)
        stats = trainer.step({"input_ids": b.input_ids, "labels": b.labels})
        if step % 50 == 0 or step == a.steps - 1:
            print(f"step {step}: loss {stats.loss:.3f}, grad norm {stats.grad_norm:.2f}, "
                  f"{stats.tokens_per_s:,.0f} tokens/s, {stats.step_s * 1e3:.0f} ms")

    trainer.sync_to_model()            # master weights -> the model's parameters, for plain eager use
    model.eval()
    em = exact_match(model, eval_examples(100, "tiny"))   # greedy decoding on the CPU
    print(f"exact match {em:.1%}")
    with tempfile.TemporaryDirectory() as tmp:
        trainer.save_checkpoint(f"{tmp}/ckpt")
        resumed = lazytrain.Trainer.load_checkpoint(f"{tmp}/ckpt", model, device=device)
        print(f"checkpoint resumed at step {resumed.steps}")
        resumed.close()
    trainer.close()


if __name__ == "__main__":
    main()
