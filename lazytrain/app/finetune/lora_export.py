"""A LoRA run's export: the PEFT adapter folder and, with ``--merge``, the adapters merged into a full folder.

    OUTPUT/adapter/   adapter_config.json, adapter_model.safetensors (``hf.adapter_export.write_adapter``;
                      base_model_name_or_path: ``--model`` as given) and the run's tokenizer files beside them
    OUTPUT/model/     with --merge: the base with ``W + scaling * B @ A`` in each targeted weight
                      (``hf.adapter_export.merge_into_folder``), config, tokenizer, generation config

The same two folders come from the run (``lazytrain train --data ... --lora ... [--merge]``, from the trainer's
fp32 masters of the adapters) and from its checkpoint (``lazytrain export RUN -o DIR [--merge]``, which holds the
adapters and the base's identity, no base).

*Where the merge reads the base.*  A safetensors folder (``--model DIR``, or a named model's cached folder): from
its files, one weight at a time.  A GGUF file: transformers' GGUF reader dequantizes every tensor into one state
dict before it builds a model (there is no tensor-at-a-time reader), so a run merges the trainer's host copy of
the base instead (its load buffers, in the run's parameter dtype: a 16-bit base only; a quantized one there is
not the values the user gave), and ``lazytrain export --merge`` of such a run, which has no trainer, is refused.
A random base (a config or preset) is stored nowhere: the run merges the trainer's copy, the export refuses.
Either way no second copy of the base is held: the merge keeps one output shard.

*Is it the base the adapters trained on?*  The checkpoint records the SHA-256 of the frozen values as the trainer
held them (its load buffers: the plan's block layout, the parameter dtype, NF4 or int8 bytes with
``--base-bits``); recomputing that means reading and converting the whole base the way the runtime did, a
second pass over a 70B's 140 GB before the merge's own.  So ``lazytrain export --merge`` checks what is cheap and
says so: the frozen parameter count against the model the run's config builds, and the base's weight files by
name and size as the run recorded them (``base_record``).  A file rewritten in place at the same size is not
caught; the merge still checks every targeted weight's shape.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...hf.adapter_export import AdapterError, base_weights, merge_into_folder, write_adapter
from ...hf.export import ExportError, Weight, checkpoint_weights, hf_config, trainer_weights
from ...hf.named import NAMED
from .prepare import Source, resolve

ADAPTER_DIR = "adapter"
MODEL_DIR = "model"


# ---- the base's record ----------------------------------------------------------------------------------

def base_record(spec: str, src: Source) -> dict:
    """What a LoRA run's checkpoints record of its base (``Trainer.base_source``): ``--model`` as given, where
    it was read from (absolute), its kind, and its weight files' names and sizes."""
    rec: dict = {"model": spec, "kind": src.kind}
    if src.path is not None:
        rec["path"] = str(Path(src.path).absolute())
    files = weight_files(src.kind, src.path)
    if files:
        rec["files"] = files
    return rec


def weight_files(kind: str, path) -> dict[str, int]:
    """The base's weight files (name: bytes): a folder's safetensors files, a GGUF file; none for a random base."""
    if path is None:
        return {}
    path = Path(path)
    if kind == "gguf":
        return {path.name: path.stat().st_size} if path.is_file() else {}
    if kind in ("named", "pretrained"):
        return {p.name: p.stat().st_size for p in sorted(path.glob("*.safetensors"))}
    return {}


def _safetensors_folder(src: Source) -> Path | None:
    """The folder the merge reads the base from, where the source is one (else None)."""
    if src.kind in ("named", "pretrained") and src.path is not None and any(Path(src.path).glob("*.safetensors")):
        return Path(src.path)
    return None


# ---- in the run -----------------------------------------------------------------------------------------

def check_merge(merge: bool, lora, src: Source, base_bits: int) -> None:
    """Before training: a ``--merge`` the export could not do is a one-line error now, not after the run."""
    if not merge:
        return
    if not lora:
        raise ValueError("--merge merges LoRA adapters into their base: give --lora too (a full fine-tune's "
                         "OUTPUT/model/ is the whole model already)")
    if _safetensors_folder(src) is None and base_bits != 16:
        raise ValueError(f"--merge with --base-bits {base_bits}: the base {src.spec} is not a safetensors folder to "
                         f"read the weights from, and the trainer holds it quantized; merge with --base-bits 16, "
                         f"or export the adapter alone")


def adapter_tensors(trainer) -> dict[str, torch.Tensor]:
    """The trained parameters (the adapters) from the trainer's host store, fp32 masters, by the traced
    PeftModel's names; copies (the store reuses its block buffers)."""
    trained = {p.name for b in trainer.plan.graph.blocks for p in b.params if p.trainable}
    return {w.name: w.read().detach().clone() for w in trainer_weights(trainer) if w.name in trained}


def export_run(out: Path, *, spec: str, src: Source, trainer, model, tokenizer, generation_config,
               dtype: torch.dtype, merge: bool) -> dict[str, str | None]:
    """A LoRA run's folders (module docstring) under ``out``: {"adapter": path, "model": path or None}."""
    tensors = adapter_tensors(trainer)
    adapter = write_adapter(out / ADAPTER_DIR, model, tensors, base_model_name_or_path=spec, tokenizer=tokenizer)
    merged = None
    if merge:
        folder = _safetensors_folder(src)
        source = folder if folder is not None else base_weights(model, _base_in_store(trainer))
        base = model.get_base_model()
        merged = merge_into_folder(out / MODEL_DIR, source, tensors, model.peft_config["default"], dtype,
                                   config=hf_config(base.config, type(base).__name__), tokenizer=tokenizer,
                                   generation_config=generation_config)
    return {"adapter": str(adapter), "model": None if merged is None else str(merged)}


def _base_in_store(trainer) -> list[Weight]:
    """The trainer's copy of the base (its load buffers), where it holds it unquantized."""
    bits = (trainer.plan.options or {}).get("base_bits", 16)
    if bits != 16:
        raise AdapterError(f"the trainer holds the base in {bits} bits: merge from a safetensors folder of the base")
    return trainer_weights(trainer)


# ---- from a checkpoint (lazytrain export) ---------------------------------------------------------------

def export_checkpoint(ckpt: Path, meta: dict, output, *, settings: dict, config: dict, tokenizer,
                      generation_config, dtype: torch.dtype, merge: bool) -> list[Path]:
    """``lazytrain export`` of a LoRA checkpoint: ``output/adapter/`` and, with ``merge``, ``output/model/``
    (the base read from where the run recorded it, checked as the module docstring says)."""
    from ...frontend.lora import parse_lora, wrap
    from ...frontend.presets import build_from_config
    spec = parse_lora(settings.get("lora"))
    if spec is None:
        raise ExportError(f"{ckpt}: a checkpoint of adapters whose run records no LoRA setting (its metrics.json)")
    model = wrap(build_from_config(config, device="meta", dtype=torch.float32), spec)
    record = meta["base"].get("source") or {}
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if frozen != meta["base"].get("frozen_params"):
        raise ExportError(f"{ckpt}: its base has {meta['base'].get('frozen_params')} frozen parameters, the run's "
                          f"config with --lora {spec} builds {frozen}: the config is not the one it trained with")
    tensors = {w.name: w.read() for w in checkpoint_weights(ckpt, adapters=True)}
    name = str(record.get("model") or record.get("path") or "")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_adapter(out / ADAPTER_DIR, model, tensors, base_model_name_or_path=name, tokenizer=tokenizer)]
    if merge:
        base = _recorded_base(record, ckpt)
        written.append(merge_into_folder(out / MODEL_DIR, base, tensors, model.peft_config["default"], dtype,
                                         config=hf_config(config), tokenizer=tokenizer,
                                         generation_config=generation_config))
    return written


def _recorded_base(record: dict, ckpt: Path) -> Path:
    """The safetensors folder of the base the checkpoint's run trained on, as it recorded it, if it is still
    there with the same files; else a one-line error."""
    spec, path, kind = record.get("model"), record.get("path"), record.get("kind")
    if not spec and not path:
        raise ExportError(f"{ckpt} records no base source to merge into (an older LoRA checkpoint): load the adapter "
                          f"folder onto its base with PEFT")
    if kind == "gguf":
        raise ExportError(f"the base {spec} is a GGUF file, which transformers reads whole: merge in the run "
                          f"(lazytrain train --merge), or load the adapter folder onto it with PEFT")
    if kind in ("config", "preset"):
        raise ExportError(f"the base {spec} was randomly initialised and is stored nowhere: merge in the run "
                          f"(lazytrain train --merge)")
    if spec in NAMED and (path is None or not Path(path).is_dir()):
        src = resolve(spec)             # a named model's cache that was cleared: fetched again
    elif path is not None and Path(path).is_dir():
        src = Source(spec or path, kind or "pretrained", Path(path))
    else:
        raise ExportError(f"the base {spec or path} the adapters were trained on is not at {path or spec} any more: "
                          f"put it back to merge, or load the adapter folder onto it with PEFT")
    now = weight_files(src.kind, src.path)
    if "files" in record and now != record["files"]:
        changed = sorted(set(now) ^ set(record["files"]) | {f for f in now if record["files"].get(f) != now[f]})
        raise ExportError(f"the base at {src.path} changed since the adapters were trained on it ({changed[0]} "
                          f"differs in name or size): merge into the base they were trained on")
    folder = _safetensors_folder(src)
    if folder is None:
        raise ExportError(f"the base at {src.path} has no safetensors weights to merge into")
    return folder
