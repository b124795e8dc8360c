"""Built-in model shapes and ``build_model``: preset name | HF ``config.json`` | ``pkg.module:factory``.

Shapes are copied from the published configs (Hugging Face ``config.json`` of each base model);
``transformers`` is optional and imported only when a Hugging Face architecture is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import json
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ..ir.limits import MAX_SEQ_LEN
from .preset_configs import PRESETS

if TYPE_CHECKING:
    from torch import nn

HF_ARCHS = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: Hugging Face model types whose training through a plan is tested against eager PyTorch
#: (tests/test_runtime.py, tests/test_hf_coverage.py); other decoder-only causal LMs are accepted
TESTED_HF = ("qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo2",
             "granite", "cohere", "gpt2", "gpt_neox", "gpt_neo", "opt", "bloom", "mixtral", "qwen3_moe", "deepseek_v3",
             "qwen3_next", "jamba", "doge")
HF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def require_transformers():
    """The ``transformers`` module, imported on first need; an ``ImportError`` naming the extra to install."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("this model needs Hugging Face transformers: pip install transformers (lazytrain's 'hf' "
                          "extra)") from e
    return transformers


def _unknown_preset(spec: str) -> ValueError:
    close = difflib.get_close_matches(spec.lower(), PRESETS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown model {spec!r}: not a preset, a config.json path, or 'package.module:factory'."
                      f"{hint} Known presets: {', '.join(PRESETS)}")


def _model_dtype(dtype):
    """The dtype a built model is in: ``dtype``, bf16 when None."""
    import torch
    return torch.bfloat16 if dtype is None else dtype


def build_from_config(cfg: dict, *, device="meta", dtype=None, source: str = "config") -> nn.Module:
    """Build a model from a config dict (a preset's or a Hugging Face ``config.json``'s), in ``dtype`` (bf16 by
    default)."""
    import torch  # here, not at the top: a compile whose trace is cached builds nothing (``torch_free``)
    dtype = _model_dtype(dtype)
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: a model config must be a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"{source}: model_type must be a string (e.g. \"qwen2\"), got {model_type!r}")
    if model_type == "lazytrain-gpt":
        from ..models.gpt import GPT, GPTConfig
        try:
            gcfg = GPTConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        except TypeError as e:
            raise ValueError(f"{source}: bad lazytrain-gpt config: {e}") from None
        _check_dataclass_fields(gcfg, source)
        with torch.device(device):
            return GPT(gcfg).to(dtype)
    if model_type not in HF_ARCHS and not _hf_decoder_transformer(model_type):
        archs = cfg.get("architectures") or []
        raise ValueError(f"{source}: unsupported architecture (model_type={model_type!r}, architectures={archs}); "
                         f"supported: Hugging Face decoder-only transformer causal LMs (tested: "
                         f"{', '.join(TESTED_HF)}) and lazytrain-gpt")
    tf = require_transformers()
    _refuse_encoders(tf, model_type, cfg, source)
    # the shape must be written in the file (a config class's defaults are some other model's), under
    # its own name or the one the class maps it to (GPT-2's n_embd, n_layer, n_head)
    cls = tf.CONFIG_MAPPING[model_type]
    alias = getattr(cls, "attribute_map", {}) or {}
    shape = {k: cfg.get(k, cfg.get(alias.get(k, k))) for k in (*HF_REQUIRED, "num_key_value_heads", "head_dim")}
    # a feed-forward width only where the architecture's default has one (GPT-2, GPT-Neo and BLOOM derive it from
    # the hidden size where the file gives none)
    required = [k for k in HF_REQUIRED if k != "intermediate_size" or getattr(cls(), k, None) is not None]
    missing = [k for k in required if shape[k] is None]
    if missing:
        raise ValueError(f"{source}: {model_type} config is missing {', '.join(missing)}")
    _check_ints(shape, [k for k, v in shape.items() if v is not None], source)
    _check_ints(cfg, [k for k in ("max_position_embeddings", "n_positions") if cfg.get(k) is not None], source)
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"] or shape["num_attention_heads"]
    if heads % kv:
        raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if shape["head_dim"] is None and shape["hidden_size"] % heads:
        raise ValueError(f"{source}: hidden_size {shape['hidden_size']} is not a multiple of num_attention_heads "
                         f"{heads} (and no head_dim is given)")
    # auto_map names remote code: a config is data here, only transformers' own classes are built
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype",
                                                         "auto_map", "trust_remote_code")}
    # encoder families (BERT, RoBERTa, ...) are causal LMs only as decoders; decoder-only models ignore it
    fields.setdefault("is_decoder", True)
    _check_hf_fields(cfg, cls(), source)
    try:
        hf_cfg = tf.AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # noqa: BLE001 - transformers validates fields with several exception types
        raise ValueError(f"{source}: bad {model_type} config: {type(e).__name__}: {' '.join(str(e).split())}") \
            from None
    _check_rope(hf_cfg, source)
    with torch.device(device):
        try:
            try:
                model = tf.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype,
                                                            trust_remote_code=False)
            except ValueError as e:        # an architecture without SDPA support (e.g. softcapped attention)
                if "attention implementation" not in str(e) and "sdpa" not in str(e).lower():
                    raise
                model = tf.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=dtype,
                                                            trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - a field transformers accepts but cannot build (hidden_act)
            first = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(f"{source}: cannot build the {model_type} model: {type(e).__name__}: {first}") from None
    return model.to(dtype)


def _hf_decoder_transformer(model_type) -> bool:
    """Is ``model_type`` a Hugging Face causal LM built of attention layers (what the tracer splits)?
    Its config class must define attention heads itself (Mamba's, say, does not)."""
    if not isinstance(model_type, str):
        return False
    tf = require_transformers()
    try:
        default = tf.AutoConfig.for_model(model_type)     # the architecture's default config
    except (ValueError, KeyError):
        return False
    return type(default) in tf.MODEL_FOR_CAUSAL_LM_MAPPING and hasattr(default, "num_attention_heads")


def _refuse_encoders(tf, model_type: str, cfg: dict, source: str) -> None:
    """An encoder family (BERT, RoBERTa: bidirectional attention, pretrained as a masked LM) has a causal-LM class
    in transformers that is causal only with ``is_decoder``: it is built so (``build_from_config``), and says so
    in one warning; a config that sets ``is_decoder: false`` is refused (its next-token loss would be learnt by
    attending to the very token it predicts).  An encoder-decoder's (BART's) causal-LM class is its decoder
    alone: refused."""
    default = tf.CONFIG_MAPPING[model_type]()
    if cfg.get("is_encoder_decoder") or getattr(default, "is_encoder_decoder", False):
        raise ValueError(f"{source}: unsupported architecture (model_type={model_type!r} is an encoder-decoder); "
                         f"supported: decoder-only transformer causal LMs")
    if type(default) not in tf.MODEL_FOR_MASKED_LM_MAPPING:
        return
    if cfg.get("is_decoder") is False:
        raise ValueError(f"{source}: unsupported architecture (model_type={model_type!r} with is_decoder false: "
                         f"bidirectional attention, under which a next-token loss sees the token it predicts); "
                         f"supported: decoder-only transformer causal LMs (leave is_decoder out, or set it true)")
    if "is_decoder" not in cfg:
        warnings.warn(f"{source}: {model_type} is an encoder family (pretrained with bidirectional attention): "
                      f"built as a causal decoder (is_decoder), as the next-token loss needs", stacklevel=4)


#: the largest shape a config may declare, per field: 16x or more the largest preset's (Qwen2.5-72B: 80
#: layers, 64 heads, hidden 8192, intermediate 29568, vocabulary 151936), so no real model is refused and
#: no config builds (or traces) for minutes on the meta device
SHAPE_LIMITS = {"num_hidden_layers": 2048, "n_layer": 2048, "num_attention_heads": 4096, "n_head": 4096,
                "num_key_value_heads": 4096, "hidden_size": 1 << 17, "d_model": 1 << 17, "head_dim": 1 << 14,
                "intermediate_size": 1 << 20, "d_ff": 1 << 20, "vocab_size": 1 << 22, "vocab": 1 << 22}


def _check_ints(cfg: dict, keys, source: str) -> None:
    for k in keys:
        v = cfg.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{source}: {k} must be a positive whole number, got {v!r}")
        if v > SHAPE_LIMITS.get(k, MAX_SEQ_LEN):
            raise ValueError(f"{source}: {k} {v:,} is larger than LazyTrain builds (at most "
                             f"{SHAPE_LIMITS.get(k, MAX_SEQ_LEN):,})")


def _must_be_positive(key: str) -> bool:
    """Fields that are a scale, a length or a rate: zero or negative is never meant (rope_theta -1 makes
    NaN rotary angles, an epsilon <= 0 divides by zero)."""
    return key in ("rope_theta", "max_position_embeddings", "n_positions") or key.endswith(("_eps", "epsilon"))


def _check_number(key: str, v, source: str) -> None:
    name = key.rpartition(".")[2]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{source}: {key} must be a finite number, got {v!r}")
    if _must_be_positive(name) and v <= 0:
        raise ValueError(f"{source}: {key} must be positive, got {v!r}")
    if name.endswith(("dropout", "_pdrop")) and not 0 <= v < 1:
        raise ValueError(f"{source}: {key} is a probability, in [0, 1), got {v!r}")


def _check_dataclass_fields(cfg, source: str) -> None:
    """Every field of a config dataclass has its declared type: whole numbers positive, flags true or
    false, numbers finite (and positive where ``_must_be_positive``)."""
    for f in dataclasses.fields(cfg):
        v, kind = getattr(cfg, f.name), f.type if isinstance(f.type, str) else f.type.__name__
        if kind == "int":
            _check_ints({f.name: v}, [f.name], source)
        elif kind == "bool" and not isinstance(v, bool):
            raise ValueError(f"{source}: {f.name} must be true or false, got {v!r}")
        elif kind == "float":
            _check_number(f.name, v, source)


def _check_hf_fields(given: dict, default, source: str) -> None:
    """A Hugging Face config's fields against the architecture's defaults: a flag must be true or false,
    a number a finite number (positive for scales and lengths, a probability for dropout), as the
    default's type says; transformers checks some types (one line of its own) and no ranges."""
    for key, v in given.items():
        ref = getattr(default, key, None)
        if isinstance(ref, bool):
            if not isinstance(v, bool):
                raise ValueError(f"{source}: {key} must be true or false, got {v!r}")
        elif isinstance(ref, (int, float)) and v is not None:
            _check_number(key, v, source)


def _check_rope(built, source: str) -> None:
    """Rotary parameters as the built config holds them (transformers 5 moves rope_theta there)."""
    rope = getattr(built, "rope_parameters", None)
    for key, v in (rope.items() if isinstance(rope, dict) else ()):
        if key == "rope_theta" or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            _check_number(f"rope_parameters.{key}", v, source)


def read_config(path: Path) -> dict:
    """A ``config.json`` as a dict, or a ValueError naming the file (unreadable, not UTF-8, not JSON, not
    an object, or an integer of thousands of digits)."""
    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (not UTF-8): a model config is JSON") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not a model config ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a model config must be a JSON object, got {type(cfg).__name__}")
    return cfg


def _check_callable_alone(fn, spec: str) -> None:
    """A factory is called with no arguments: one that is not callable, or needs arguments, is an error here (a
    ``TypeError`` its own body raises is its bug, and stays one)."""
    if not callable(fn):
        raise ValueError(f"factory {spec!r} is a {type(fn).__name__}, not a function to call")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):          # a builtin without a signature: called as it is
        return
    try:
        sig.bind()
    except TypeError:
        raise ValueError(f"factory {spec!r} needs arguments {sig}; a factory is called with none") from None


def build_model(spec: str, device="meta", dtype=None) -> nn.Module:
    """A model from a preset name, a HF ``config.json`` (or a folder holding one), or ``pkg.module:factory``.

    On ``device="meta"`` (the default) nothing is allocated, so any size builds on a laptop.  The
    ``pkg.module:factory`` form imports that module and calls the factory: it runs code, by design, so
    name only code you trust (``lazytrain train --resume`` never imports one unless told to).
    """
    if spec in PRESETS:
        return build_from_config(PRESETS[spec], device=device, dtype=dtype, source=f"preset {spec}")
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return build_from_config(read_config(path), device=device, dtype=dtype, source=str(path))
    if ":" in spec and not path.exists():
        mod_name, _, fn_name = spec.partition(":")
        import torch
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load factory {spec!r}: {e}") from e
        _check_callable_alone(fn, spec)
        with torch.device(device):
            model = fn()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"factory {spec!r} returned {type(model).__name__}, not an nn.Module")
        return model.to(_model_dtype(dtype))
    raise _unknown_preset(spec)
