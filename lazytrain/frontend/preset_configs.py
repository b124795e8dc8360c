"""The built-in model shapes (``PRESETS``), as plain data: copied from the published configs (Hugging Face
``config.json`` of each base model).  Apart from ``presets.py``, which builds them, so that naming them (the
command line's help) imports no torch."""

from __future__ import annotations


# the 7B and larger pad their vocabulary to 152,064 rows (their config.json), the smaller ones to 151,936
def _qwen25(h, i, n, a, kv, tied, max_pos, eps, vocab=151936):
    return {"model_type": "qwen2", "hidden_size": h, "intermediate_size": i, "num_hidden_layers": n,
            "num_attention_heads": a, "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied,
            "rope_theta": 1000000.0, "rms_norm_eps": eps, "max_position_embeddings": max_pos,
            "hidden_act": "silu", "use_sliding_window": False}


def _llama3(h, i, n, a, kv):
    return {"model_type": "llama", "hidden_size": h, "intermediate_size": i, "num_hidden_layers": n,
            "num_attention_heads": a, "num_key_value_heads": kv, "vocab_size": 128256, "tie_word_embeddings": False,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "hidden_act": "silu"}


def _qwen3(h, i, n, a, kv):
    return {"model_type": "qwen3", "hidden_size": h, "intermediate_size": i, "num_hidden_layers": n,
            "num_attention_heads": a, "num_key_value_heads": kv, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960, "hidden_act": "silu", "use_sliding_window": False}


PRESETS: dict[str, dict] = {
    # our plain GPT (lazytrain.models.gpt); "tiny" is ~3.5M parameters and fast on a CPU
    "tiny": {"model_type": "lazytrain-gpt", "vocab": 1024, "d_model": 256, "n_layer": 4, "n_head": 4,
             "d_ff": 1024, "max_seq": 512, "tie_weights": True},
    "gpt2": {"model_type": "lazytrain-gpt", "vocab": 50257, "d_model": 768, "n_layer": 12, "n_head": 12,
             "d_ff": 3072, "max_seq": 1024, "tie_weights": True},
    # Qwen2.5 base models (Qwen2Config)
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, True, 32768, 1e-6),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, True, 131072, 1e-6),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, True, 32768, 1e-6),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, False, 131072, 1e-6, 152064),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, False, 131072, 1e-5, 152064),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, False, 131072, 1e-5, 152064),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, False, 131072, 1e-5, 152064),
    # Llama 3 (LlamaConfig)
    "llama3-8b": _llama3(4096, 14336, 32, 32, 8),
    "llama3-70b": _llama3(8192, 28672, 80, 64, 8),
    # Qwen3 (Qwen3Config, head_dim 128)
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8),
}
