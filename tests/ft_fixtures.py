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


def write_gguf(model, path: Path) -> Path:
    """A Llama's weights as an F32 GGUF file the way llama.cpp lays them out (its tensor names, q and k
    rows permuted), without tokenizer metadata."""
    import gguf
    import numpy as np
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    names.update({f"model.layers.{i}.{a}.weight": f"blk.{i}.{b}.weight" for i in range(c.num_hidden_layers)
                  for a, b in parts.items()})

    def permute(t, heads):
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
    for n, p in model.named_parameters():
        t = p.detach().float().numpy()
        if names[n].endswith("attn_q.weight"):
            t = permute(t, c.num_attention_heads)
        elif names[n].endswith("attn_k.weight"):
            t = permute(t, c.num_key_value_heads)
        w.add_tensor(names[n], np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
