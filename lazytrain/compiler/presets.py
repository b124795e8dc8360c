"""Built-in model shapes and ``build_model``: preset name | HF ``config.json`` | ``pkg.module:factory``.

Shapes are copied from the published configs (Hugging Face ``config.json`` of each base model);
``transformers`` is optional and imported only when a Hugging Face architecture is built.
"""

from __future__ import annotations

import difflib
import importlib
import json
from pathlib import Path

import torch
from torch import nn

HF_ARCHS = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: Hugging Face model types whose training through a plan is tested against eager PyTorch
#: (tests/test_runtime.py, tests/test_hf_coverage.py); other decoder-only causal LMs are accepted
TESTED_HF = ("qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo2",
             "granite", "cohere", "gpt2", "gpt_neox", "opt", "bloom", "mixtral", "qwen3_moe", "deepseek_v3")
HF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _qwen25(h, i, n, a, kv, tied, max_pos, eps):
    return {"model_type": "qwen2", "hidden_size": h, "intermediate_size": i, "num_hidden_layers": n,
            "num_attention_heads": a, "num_key_value_heads": kv, "vocab_size": 151936, "tie_word_embeddings": tied,
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
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, False, 131072, 1e-6),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, False, 131072, 1e-5),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, False, 131072, 1e-5),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, False, 131072, 1e-5),
    # Llama 3 (LlamaConfig)
    "llama3-8b": _llama3(4096, 14336, 32, 32, 8),
    "llama3-70b": _llama3(8192, 28672, 80, 64, 8),
    # Qwen3 (Qwen3Config, head_dim 128)
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8),
}


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("this model needs Hugging Face transformers: pip install lazytrain[hf]") from e
    return transformers


def _unknown_preset(spec: str) -> ValueError:
    close = difflib.get_close_matches(spec.lower(), PRESETS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown model {spec!r}: not a preset, a config.json path, or 'package.module:factory'."
                      f"{hint} Known presets: {', '.join(PRESETS)}")


def build_from_config(cfg: dict, *, device="meta", dtype=torch.bfloat16, source: str = "config") -> nn.Module:
    """Build a model from a config dict (a preset's or a Hugging Face ``config.json``'s)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: a model config must be a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type == "lazytrain-gpt":
        from ..models.gpt import GPT, GPTConfig
        try:
            gcfg = GPTConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        except TypeError as e:
            raise ValueError(f"{source}: bad lazytrain-gpt config: {e}") from None
        _check_ints(gcfg.__dict__, [k for k, v in gcfg.__dict__.items() if type(v) is int or k in
                                    ("vocab", "d_model", "n_layer", "n_head", "d_ff", "max_seq")], source)
        with torch.device(device):
            return GPT(gcfg).to(dtype)
    if model_type not in HF_ARCHS and not _hf_decoder_transformer(model_type):
        archs = cfg.get("architectures") or []
        raise ValueError(f"{source}: unsupported architecture (model_type={model_type!r}, architectures={archs}); "
                         f"supported: Hugging Face decoder-only transformer causal LMs (tested: "
                         f"{', '.join(TESTED_HF)}) and lazytrain-gpt")
    tf = _transformers()
    # the shape must be written in the file (a config class's defaults are some other model's), under
    # its own name or the one the class maps it to (GPT-2's n_embd, n_layer, n_head)
    cls = tf.CONFIG_MAPPING[model_type]
    alias = getattr(cls, "attribute_map", {}) or {}
    shape = {k: cfg.get(k, cfg.get(alias.get(k, k))) for k in (*HF_REQUIRED, "num_key_value_heads", "head_dim")}
    # a feed-forward width only where the architecture has one (GPT-2 and BLOOM derive it from the hidden size)
    required = [k for k in HF_REQUIRED if k != "intermediate_size" or hasattr(cls(), "intermediate_size")]
    missing = [k for k in required if shape[k] is None]
    if missing:
        raise ValueError(f"{source}: {model_type} config is missing {', '.join(missing)}")
    _check_ints(shape, [k for k, v in shape.items() if v is not None], source)
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"] or shape["num_attention_heads"]
    if heads % kv:
        raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if shape["head_dim"] is None and shape["hidden_size"] % heads:
        raise ValueError(f"{source}: hidden_size {shape['hidden_size']} is not a multiple of num_attention_heads "
                         f"{heads} (and no head_dim is given)")
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    # encoder families (BERT, RoBERTa, ...) are causal LMs only as decoders; decoder-only models ignore it
    fields.setdefault("is_decoder", True)
    try:
        hf_cfg = tf.AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # noqa: BLE001 - transformers validates fields with several exception types
        raise ValueError(f"{source}: bad {model_type} config: {type(e).__name__}: {e}") from None
    with torch.device(device):
        try:
            model = tf.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
        except ValueError as e:        # an architecture without SDPA support (e.g. softcapped attention)
            if "attention implementation" not in str(e) and "sdpa" not in str(e).lower():
                raise
            model = tf.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=dtype)
    return model.to(dtype)


def _hf_decoder_transformer(model_type) -> bool:
    """Is ``model_type`` a Hugging Face causal LM built of attention layers (what the tracer splits)?
    Its config class must define attention heads itself (Mamba's, say, does not)."""
    if not isinstance(model_type, str):
        return False
    tf = _transformers()
    try:
        default = tf.AutoConfig.for_model(model_type)     # the architecture's default config
    except (ValueError, KeyError):
        return False
    return type(default) in tf.MODEL_FOR_CAUSAL_LM_MAPPING and hasattr(default, "num_attention_heads")


def _check_ints(cfg: dict, keys, source: str) -> None:
    for k in keys:
        v = cfg.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{source}: {k} must be a positive whole number, got {v!r}")


def build_model(spec: str, device="meta", dtype=torch.bfloat16) -> nn.Module:
    """A model from a preset name, a HF ``config.json`` (or a folder holding one), or ``pkg.module:factory``.

    On ``device="meta"`` (the default) nothing is allocated, so any size builds on a laptop.
    """
    if spec in PRESETS:
        return build_from_config(PRESETS[spec], device=device, dtype=dtype, source=f"preset {spec}")
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return build_from_config(cfg, device=device, dtype=dtype, source=str(path))
    if ":" in spec and not path.exists():
        mod_name, _, fn_name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load factory {spec!r}: {e}") from e
        with torch.device(device):
            model = fn()
        if not isinstance(model, nn.Module):
            raise ValueError(f"factory {spec!r} returned {type(model).__name__}, not an nn.Module")
        return model.to(dtype)
    raise _unknown_preset(spec)


# ---- random weights, fast (benchmarks) ------------------------------------------------------------

POOL_NUMEL = 1 << 24


def _fill_random(flat: torch.Tensor, pool: torch.Tensor, offset: int) -> None:
    """``flat`` from the random ``pool``, starting at ``offset`` and wrapping around: a memcpy."""
    pos, n = 0, flat.numel()
    while pos < n:
        k = min(n - pos, pool.numel() - offset)
        flat[pos:pos + k].copy_(pool[offset:offset + k])
        pos, offset = pos + k, 0


def random_model(spec: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``build_model(spec)`` with random weights, fast, for benchmarks: built on meta, then each
    distinct parameter (tied ones once) materialised on the CPU from one pool of 16 M N(0, 0.02)
    draws (seeded by torch's global generator), each tensor from its own offset; 1-d parameters are
    norm weights (1) or biases (0).  Modules with buffers (Hugging Face rotary embeddings) are
    rebuilt on the CPU from the model's config.  Hugging Face's per-module init of a 3B model took
    164 s on the GPU machine's host and a fresh ``normal_`` per tensor 90 s; the pool makes it
    memory copies.  Step times do not depend on the values, and the loss is a random model's."""
    model = build_model(spec, device="meta", dtype=dtype)
    owners: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod, pname, f"{mod_name}.{pname}"))
    pool = torch.empty(POOL_NUMEL, dtype=dtype).normal_(0, 0.02)
    with torch.no_grad():
        for i, places in enumerate(owners.values()):
            mod, pname, full = places[0]
            old = getattr(mod, pname)
            new = torch.empty(old.shape, dtype=old.dtype, device="cpu")
            if old.dim() == 1:
                new.fill_(1.0 if "norm" in full else 0.0)
            else:
                _fill_random(new.view(-1), pool, (i * 7_919_993) % POOL_NUMEL)
            param = torch.nn.Parameter(new, requires_grad=old.requires_grad)
            for m, n, _ in places:
                setattr(m, n, param)
    _rebuild_buffer_modules(model)
    return model


def _rebuild_buffer_modules(model: nn.Module) -> None:
    for name, mod in list(model.named_modules()):
        if not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        try:
            fresh = type(mod)(config=model.config)
        except (AttributeError, TypeError) as e:
            raise ValueError(f"random_model: cannot rebuild {name} ({type(mod).__name__}), whose buffers are on "
                             f"meta: {e}") from None
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, fresh)
