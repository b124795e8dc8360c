"""Small things the fine-tuning tests share: a character tokenizer with a ChatML template whose eos
(``<|endoftext|>``) is not its end-of-turn (``<|im_end|>``), a tiny Llama folder with it, JSONL files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(template: str | None = CHATML):
    """Characters (printable ASCII and newline) one id each, after four special tokens; no bos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<pad>")
    if template:
        tok.chat_template = template
    return tok


def tiny_folder(folder: Path, *, model_type: str = "llama", tied: bool = True, tokenizer: bool = True,
                template: str | None = CHATML, dtype: torch.dtype = torch.float32, layers: int = 2) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    extra = {"num_key_value_heads": 2} if model_type in ("llama", "qwen2") else {}
    cfg = AutoConfig.for_model(model_type, vocab_size=112, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=512,
                               tie_word_embeddings=tied, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(folder)
    if tokenizer:
        tiny_tokenizer(template).save_pretrained(folder)
    return folder


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
