"""LoRA adapters out of a run: a PEFT adapter folder, or the adapters merged into a full Hugging Face folder.

``write_adapter(DIR, model, tensors, base_model_name_or_path=...)`` writes what ``PeftModel.save_pretrained``
writes, so ``PeftModel.from_pretrained(base, DIR)`` loads it::

    adapter_config.json          the PeftModel's ``peft_config`` (inference mode, the base the user named)
    adapter_model.safetensors    the adapter's tensors under the keys PEFT saves (``...q_proj.lora_A.weight``)

The trained tensors come under the traced PeftModel's parameter names (``...q_proj.lora_A.default.weight``);
PEFT's own ``get_peft_model_state_dict(model, state_dict=...)`` maps them to the saved keys (it picks the
adapter's entries by visiting the model's tuner layers, not by their names), so the folder is the one PEFT
would write, whatever the PEFT version.

``merge_into_folder(DIR, base, adapter, lora_config, dtype)`` writes a full model folder (``export.write_folder``'s
layout) with ``W + scaling * B @ A`` in each targeted weight (``scaling = alpha / r``, ``alpha / sqrt(r)``
with rsLoRA; ``(B @ A)^T`` for fan_in_fan_out's Conv1D weights), from a Hugging Face folder (safetensors,
sharded or not) or from ``Weight`` records (the trainer's host store).  Each weight is read alone (its own
memory map, closed after), merged in fp32 and kept only until its output shard is written: the merge holds
one output shard, never a second copy of the base.  LoRA variants whose merge is not ``W + s B A`` (DoRA,
trained biases, a base moved at init by PiSSA/OLoRA/CorDA/LoftQ, ...) are refused by name.

Both write into a staged folder renamed into place (``util.atomic.staged_folder``): a crash leaves the old
folder or the new one.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..util.atomic import staged_folder
from .export import INDEX, MAX_SHARD_BYTES, ExportError, Weight, hf_config, share_folder, write_folder

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: LoraConfig fields whose adapters are not merged as ``W + scaling * B @ A`` (or not by a weight's delta alone)
UNMERGEABLE = {
    "use_dora": "DoRA rescales each merged weight by a trained magnitude",
    "lora_bias": "the adapter trains a bias of its own",
    "modules_to_save": "whole modules are trained beside the adapters",
    "trainable_token_indices": "embedding rows are trained beside the adapters",
    "target_parameters": "the adapters target parameters, not layers",
    "layer_replication": "layers are replicated",
    "use_qalora": "QALoRA pools its input",
    "use_bdlora": "BD-LoRA's blocks are not B @ A",
    "arrow_config": "Arrow routes between adapters",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens",
}
#: ``init_lora_weights`` values that change the base weights when the adapter is created
MOVES_BASE = ("pissa", "olora", "corda", "loftq")


class AdapterError(ExportError):
    """Adapters that cannot be exported or merged (tensors that do not fit the model or the base, a LoRA
    variant the merge does not handle, a base folder with missing files); the message says which."""


def _peft():
    try:
        import peft
    except ImportError:
        raise AdapterError("exporting LoRA adapters needs peft: pip install peft (lazytrain's 'lora' extra)") from None
    return peft


# ---- the adapter folder -------------------------------------------------------------------------------

def adapter_state(model, tensors: dict[str, torch.Tensor], adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """``tensors`` (the PeftModel ``model``'s trained parameters, by their names in it) under the keys PEFT
    saves, through ``peft.get_peft_model_state_dict``; every tensor of the adapter must be there with the
    model's shape, and nothing else.  ``model`` may live on the ``meta`` device."""
    _peft()
    from peft.utils import get_peft_model_state_dict
    want = get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
    got = get_peft_model_state_dict(model, state_dict=dict(tensors), adapter_name=adapter_name,
                                    save_embedding_layers=False)
    used = {id(t) for t in got.values()}
    extra = [k for k, t in tensors.items() if id(t) not in used]
    if extra:
        raise AdapterError(f"adapter tensor {extra[0]} is not a parameter of adapter {adapter_name!r} of the model"
                           + (f" ({len(extra) - 1} more)" if len(extra) > 1 else ""))
    missing = sorted(set(want) - set(got))
    if missing:
        raise AdapterError(f"the adapter tensors lack {missing[0]}"
                           + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    for k, t in got.items():
        if tuple(t.shape) != tuple(want[k].shape):
            raise AdapterError(f"adapter tensor {k} has shape {tuple(t.shape)}, the model {tuple(want[k].shape)}")
    return got


def write_adapter(folder, model, tensors: dict[str, torch.Tensor], *, base_model_name_or_path: str,
                  adapter_name: str = "default", dtype: torch.dtype | None = None, tokenizer=None) -> Path:
    """The PEFT adapter folder (see the module docstring) of ``model``'s adapter ``adapter_name`` with the
    trained ``tensors``, written atomically at ``folder``; ``dtype`` casts the floating tensors (None keeps
    theirs); ``tokenizer``'s files go beside them (what PEFT users load with the adapter).  Returns the folder's
    path."""
    target = Path(folder).absolute()
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / ADAPTER_CONFIG).exists())):
        raise AdapterError(f"{target} exists and is not an adapter folder (no {ADAPTER_CONFIG}): refusing to "
                           "replace it")
    state = adapter_state(model, tensors, adapter_name)
    state = {k: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().cpu().contiguous()
             for k, t in state.items()}
    config = copy.deepcopy(model.peft_config[adapter_name])
    config.base_model_name_or_path = base_model_name_or_path
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None:           # what PeftModel.save_pretrained records for AutoPeftModel
        base_class = type(model.get_base_model())
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    with staged_folder(target) as tmp:
        save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(str(tmp), auto_mapping_dict=auto_mapping)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        share_folder(tmp)
    return target


# ---- merging ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Delta:
    """One targeted weight's update: ``scaling * B @ A`` (transposed for fan_in_fan_out's Conv1D)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    transpose: bool

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the weight it updates."""
        out, inp = self.b.shape[0], self.a.shape[1]
        return (inp, out) if self.transpose else (out, inp)

    def merged(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` plus this update, in fp32 (one copy of ``w``: the product is added in place)."""
        out = w.to(torch.float32, copy=True)
        (out.t() if self.transpose else out).addmm_(self.b.float(), self.a.float(), alpha=self.scaling)
        return out


def check_mergeable(lora_config) -> None:
    """Refuse a config whose adapters are not merged as ``W + scaling * B @ A`` (one line naming the field)."""
    kind = str(getattr(lora_config, "peft_type", ""))
    if not kind.endswith("LORA") or kind.endswith("ADALORA"):
        raise AdapterError(f"merging handles LoRA adapters, not {kind or type(lora_config).__name__}")
    for field, why in UNMERGEABLE.items():
        if getattr(lora_config, field, None):
            raise AdapterError(f"cannot merge an adapter with {field} set: {why}; export the adapter folder instead")
    if getattr(lora_config, "bias", "none") != "none":
        raise AdapterError(f"cannot merge an adapter with bias={lora_config.bias!r}: the trained biases are not in "
                           "its LoRA matrices; export the adapter folder instead")
    init = getattr(lora_config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(MOVES_BASE):
        raise AdapterError(f"cannot merge an adapter initialised with init_lora_weights={init!r}: it changed the "
                           "base weights at init, so the saved base is not the one it was trained on")


def lora_deltas(adapter: dict[str, torch.Tensor], lora_config, adapter_name: str = "default") -> dict[str, Delta]:
    """Each targeted base weight's name (``model.layers.0.self_attn.q_proj.weight``) and its ``Delta``, from
    ``adapter``: tensors under the keys of PEFT's ``adapter_model.safetensors`` (``adapter_state``'s; the
    PeftModel's own names are taken too).  The keys are read as the file format PEFT writes them."""
    check_mergeable(lora_config)
    key = re.compile(rf"base_model\.model\.(.+)\.lora_([AB])(?:\.{re.escape(adapter_name)})?\.weight")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in adapter.items():
        m = key.fullmatch(name)
        if m is None:
            raise AdapterError(f"adapter tensor {name} is not a LoRA matrix (base_model.model.MODULE.lora_A.weight "
                               "or .lora_B.weight): only Linear and Conv1D targets are merged")
        pairs.setdefault(m[1], {})[m[2]] = t
    out = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter module {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterError(f"adapter module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are "
                               "not the rank-r matrices of a Linear layer")
        r = a.shape[0]
        want_r = _pattern(lora_config.rank_pattern, module, lora_config.r)
        if r != want_r:
            raise AdapterError(f"adapter module {module} has rank {r}, its config {want_r}")
        alpha = _pattern(lora_config.alpha_pattern, module, lora_config.lora_alpha)
        scaling = alpha / math.sqrt(r) if lora_config.use_rslora else alpha / r
        out[f"{module}.weight"] = Delta(a, b, scaling, bool(lora_config.fan_in_fan_out))
    return out


def _pattern(patterns: dict | None, module: str, default):
    """The value ``rank_pattern`` / ``alpha_pattern`` gives ``module``, matched by PEFT's own rule."""
    if not patterns:
        return default
    try:
        from peft.utils.other import get_pattern_key
    except ImportError:
        raise AdapterError("merging an adapter with rank_pattern or alpha_pattern needs a newer peft "
                           "(pip install -U peft)") from None
    return patterns.get(get_pattern_key(list(patterns), module), default)


def merge_into_folder(out, base_source, adapter: dict[str, torch.Tensor], lora_config, dtype: torch.dtype, *,
                      config: dict | None = None, tokenizer=None, generation_config=None, adapter_name: str = "default",
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """A full Hugging Face folder at ``out`` (``export.write_folder``'s layout, weights in ``dtype``) with the
    adapters merged into the base.  ``base_source``: a model folder (its config, generation config and
    tokenizer come along; a quantized base is refused), or ``Weight`` records under the base's Hugging Face
    names, e.g. ``trainer_weights`` of the frozen base (then ``config``, and the tokenizer and generation
    config if wanted, are given).  Every targeted weight must be in the base."""
    deltas = lora_deltas(adapter, lora_config, adapter_name)
    if isinstance(base_source, (str, Path)):
        folder = Path(base_source)
        weights, folder_config = folder_weights(folder)
        config = config if config is not None else hf_config(folder_config)
        tokenizer, generation_config = _folder_extras(folder, tokenizer, generation_config)
    else:
        weights = list(base_source)
        if config is None:
            raise AdapterError("merging into weights from the trainer needs the model's config")
    names = {w.name for w in weights}
    unmatched = sorted(set(deltas) - names)
    if unmatched:
        tied = " (tied to the input embeddings: merge would change both)" if (
            unmatched[0] == "lm_head.weight" and config.get("tie_word_embeddings")) else ""
        raise AdapterError(f"adapter targets {unmatched[0]}, which matches no base weight{tied}"
                           + (f" ({len(unmatched) - 1} more)" if len(unmatched) > 1 else "")
                           + ": is this the base the adapter was trained on?")
    for w in weights:
        d = deltas.get(w.name)
        if d is not None and tuple(w.shape) != d.shape:
            raise AdapterError(f"adapter's update of {w.name} is {d.shape}, the base weight {tuple(w.shape)}"
                               + (" (fan_in_fan_out: the base's Conv1D weights are [in, out])" if d.transpose else ""))
    merged = [Weight(w.name, w.shape, (lambda w=w, d=deltas[w.name]: d.merged(w.read())) if w.name in deltas
                     else w.read) for w in weights]
    return write_folder(out, merged, config=config, dtype=dtype, tokenizer=tokenizer,
                        generation_config=generation_config, max_shard_bytes=max_shard_bytes)


# ---- a base model folder ------------------------------------------------------------------------------

def folder_weights(folder: Path) -> tuple[list[Weight], dict]:
    """The weights of a Hugging Face model folder (``model.safetensors`` or the shards its index names), each
    read alone when asked, in file order; and its ``config.json``.  Missing files and quantized weights are
    one-line errors."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise AdapterError(f"{folder} is not a Hugging Face model folder (no config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{cfg_path} cannot be read: {e}") from None
    if cfg.get("quantization_config"):
        raise AdapterError(f"{folder} holds a quantized model: merge the adapter into its unquantized weights")
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise AdapterError(f"{folder / INDEX} cannot be read: {e}") from None
        files = list(dict.fromkeys(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise AdapterError(f"{folder} has no safetensors weights (model.safetensors or {INDEX})")
    out = []
    for fname in files:
        path = folder / fname
        if not path.is_file():
            raise AdapterError(f"{path} is missing: {INDEX} names it (copy the whole base folder)")
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise AdapterError(f"{path} cannot be read: {e}") from None
        keys = [k for k in shapes if weight_map is None or weight_map.get(k) == fname]
        out += [Weight(k, shapes[k], lambda p=path, k=k: _read(p, k)) for k in keys]
    if weight_map is not None:
        lost = sorted(set(weight_map) - {w.name for w in out})
        if lost:
            raise AdapterError(f"{folder / weight_map[lost[0]]} lacks {lost[0]}, which the index puts there")
    return out, cfg


def _read(path: Path, key: str) -> torch.Tensor:
    """One tensor of a safetensors file, its map closed after (so the merge's resident pages stay one tensor's)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{path} cannot be read: {e}") from None


def _folder_extras(folder: Path, tokenizer, generation_config):
    """The base folder's tokenizer and generation config (where it has them and none were given)."""
    if generation_config is None and (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig
        generation_config = GenerationConfig.from_pretrained(folder)
    if tokenizer is None and (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, generation_config


# ---- a PeftModel's base weights -------------------------------------------------------------------------

def base_weights(model, weights: Iterable[Weight]) -> list[Weight]:
    """``weights`` of the PeftModel ``model`` (by its parameter names, as ``trainer_weights`` gives them)
    as the base model's: the adapters' left out, each tuner layer's ``base_layer`` infix dropped.  Which
    names are which comes from the model's modules (PEFT's ``BaseTunerLayer``), not from the names."""
    _peft()
    from peft.tuners.tuners_utils import BaseTunerLayer
    rename, adapters = {}, set()
    for path, mod in model.named_modules():
        if isinstance(mod, BaseTunerLayer):
            base = mod.get_base_layer()
            inner = {id(p) for p in base.parameters()}
            for n, p in mod.named_parameters(prefix=path):
                if id(p) not in inner:
                    adapters.add(n)
            for n, _ in base.named_parameters():
                rename[f"{path}.base_layer.{n}"] = f"{path}.{n}"
    prefix = "base_model.model."
    out = []
    for w in weights:
        if w.name in adapters:
            continue
        name = rename.get(w.name, w.name)
        out.append(Weight(name.removeprefix(prefix), w.shape, w.read))
    return out
