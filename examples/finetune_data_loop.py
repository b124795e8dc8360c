"""Fine-tune on a JSONL file with the Python API, in your own loop: the data pipeline of ``lazytrain train
--data`` (formats, chat template, completion-only labels, packing), a packed plan, evaluation by
generation, and export to a Hugging Face folder.

    python examples/finetune_data_loop.py --data train.jsonl --steps 100     # SmolLM2-135M-Instruct
    python examples/finetune_data_loop.py --small --steps 3                  # a tiny random Llama (tests)

``--small`` builds a 2-layer Llama and a character tokenizer with a ChatML template here, so it runs
without a download; the default fetches ``smollm2-135m-instruct`` once (``lazytrain/hf/named.py``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import lazytrain
from lazytrain.data import Batches, Encoder, read_records
from lazytrain.hf.export import hf_config, trainer_weights, write_folder
from lazytrain.hf.generate import greedy_generate, same_answer
from lazytrain.hf.model_loading import from_pretrained, load_tokenizer


def small_folder(folder: Path) -> Path:
    """A tiny random Llama with a character tokenizer and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
    specials = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer, core.decoder = pre_tokenizers.Split("", behavior="isolated"), decoders.Fuse()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                         "{{ '<|im_end|>\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    cfg = AutoConfig.for_model("llama", vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def small_data(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"{i}+{i % 5}?"},
                          {"role": "assistant", "content": str(i + i % 5)}]} for i in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="a JSONL/JSON file (default with --small: generated)")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--output", default="runs/finetune_loop")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    if a.small:
        folder = small_folder(tmp / "model")
        data = a.data or small_data(tmp / "train.jsonl")
    else:
        from lazytrain.hf.named import model_folder
        folder, data = model_folder("smollm2-135m-instruct"), a.data
    model, tok = from_pretrained(folder), load_tokenizer(folder)

    enc = Encoder(tok)                                    # chat template, labels on the replies only
    examples = [enc.encode(r) for r in read_records(data)]
    train, held = examples[:-8], examples[-8:]
    batches = Batches(train, a.batch, a.seq, tok.pad_token_id, pack=True)
    print(f"{len(train)} examples, {batches.steps_per_epoch} packed batches an epoch, padding {batches.padding()}")

    plan = lazytrain.compile(model, batch_size=a.batch, seq_len=a.seq, hardware="cpu", gpu_memory="2GiB",
                             param_dtype="float32", optimizer="hybrid8bit", policy="megatrain", packed=True)
    opt = lazytrain.optim.Hybrid8bitAdamW(lr=a.lr, max_grad_norm=1.0)
    with lazytrain.Trainer(model, plan, optimizer=opt, device="cpu", verbose=False) as trainer:
        for step in range(a.steps):
            stats = trainer.step(batches.batch(step))         # input_ids, labels, position_ids
            print(f"step {step + 1}: loss {stats.loss:.4f}")
        trainer.sync_to_model()
        replies = greedy_generate(model.eval(), [list(e.prompt_ids) for e in held], max_new_tokens=16,
                                  stop_ids=enc.stop_ids(), pad_id=tok.pad_token_id, vocab=len(tok))
        texts = [tok.decode(r.tokens, skip_special_tokens=True) for r in replies]
        em = sum(same_answer(t, e.reference) for t, e in zip(texts, held)) / len(held)
        print(f"exact match {em:.1%} on {len(held)} held-out examples; first reply {texts[0]!r}")
        out = write_folder(Path(a.output) / "model", trainer_weights(trainer),
                           config=hf_config(model.config, type(model).__name__), dtype=torch.float32, tokenizer=tok)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
