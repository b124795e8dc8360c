"""Checkpoints: a trainer's whole state in a folder of safetensors and one JSON file, never pickle.

Layout of a checkpoint folder (format ``"lazytrain.checkpoint/2"``)::

    checkpoint.json          the manifest (``manifest.py``): step, RNG states, optimizer class /
                             hyper-parameters / per-block steps, grad-norm tracker counters, the plan
                             (plan.to_json()) and its model fingerprint, every tensor file's size,
                             SHA-256 and per-tensor dtype and shape, and the names and SHA-256 of the
                             extra files
    block_0000.safetensors   one file per block that owns trainable parameters:
                               param.<name>  fp32 master weight of each owned trainable parameter, shaped
                               state.<key>   the rest of HostOptimizer.state_tensors(block)
    metrics.json ...         extra files a caller commits with the state (``lazytrain train``'s metrics)

A model with a frozen base (LoRA: ``ParamSpec.trainable`` False) saves its trained parameters and their state
only, and the base's identity under ``base`` in the manifest (``base_identity``): how many frozen parameters,
the SHA-256 of their values as the trainer holds them, and what the caller says the base came from
(``Trainer.base_source``: a model name, its files' sizes).  Loading rebuilds nothing: the caller builds the model
from its source again, and the load refuses a base whose values differ from the ones the checkpoint trained on.
A full fine-tune's checkpoint is as it was (no ``base``).

A checkpoint is a consistent state: ``save`` flushes the pending lagged updates first, so a trainer
loaded from it and stepped on equals the one that saved it, step for step, bit for bit.

Atomic replacement: everything (tensors, extras, manifest) is written into ``<dir>.tmp-XXXX`` next to
the target, every file and the folder are fsynced, then ``<dir>`` (if any) is renamed to ``<dir>.old``,
the new folder to ``<dir>``, and ``<dir>.old`` is removed (``util.atomic.commit_folder``).  A crash at any
point leaves a complete checkpoint at ``<dir>`` or, between the two renames, at ``<dir>.old``, which ``load``
then uses.  An extra file may be replaced later by ``write_extra`` (temporary file, fsync, rename): one atomic
step, its SHA-256 in the manifest moved around it so that every state a crash leaves matches.
One writer per target at a time.  A disk with no room for the new checkpoint is a ``DiskFullError`` naming the
folder and the space it needs (the previous checkpoint's size, else what the files written so far take per element),
and the previous checkpoint stays.

Loading reads JSON and safetensors only (no code runs), checks the manifest's shape, the format
version (a checkpoint of an older version, without checksums, is refused with a message that says
so), the plan's and the model's fingerprint, every file's size and SHA-256 and every tensor's dtype and
shape against what this model and optimizer hold, and raises :class:`CheckpointError` naming what
does not match; ``read_extra`` checks an extra file's SHA-256, and ``hf.export`` every file's before it
maps one (``manifest.check_files``).  It restores the global RNGs (torch CPU and CUDA, Python ``random``, numpy).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..ir import Plan, PlanError
from ..util.atomic import DISK_FULL, DiskFullError, fsync_file, replace_file, staged_folder, write_synced
from . import checkpoint_world
from .manifest import (
    FORMAT,
    META,
    CheckpointError,
    check_extra,
    check_manifest,
    describe,
    extra_digests,
    hash_async,
    hashing_pool,
    read_verified,
)
from .optim.hybrid8bit import Hybrid8bitAdamW
from .optim.torch_adamw import TorchAdamW

__all__ = ["FORMAT", "META", "CheckpointError", "load", "read_extra", "read_meta", "resolve", "save", "write_extra"]
#: constructor arguments saved to rebuild an optimizer; of those, the ones that fix the layout of its
#: state tensors must match to load them (all of them for a class not listed)
_CONFIG_ATTRS = ("moment_bits", "chunk_numel", "block_size", "min_8bit_numel")      # (in the order they are checked)
_LAYOUT_ATTRS = {"TorchAdamW": ("chunk_numel",), "Hybrid8bitAdamW": ("moment_bits", "block_size", "min_8bit_numel")}


# ---- saving -------------------------------------------------------------------------------------------
def save(trainer, directory, extras: dict[str, bytes] | None = None) -> Path:
    """Write ``trainer``'s state, and ``extras`` (file name -> contents, e.g. ``{"metrics.json": ...}``),
    to ``directory`` in one atomic commit (see the module docstring)."""
    if trainer._broken is not None:
        raise RuntimeError("cannot checkpoint a trainer whose last step failed (its state is inconsistent)")
    target = Path(directory).absolute()
    # (a symbolic link there is replaced by the new folder, never followed: ``commit_folder``)
    if not target.is_symlink() and target.exists() and not (target / META).is_file() and any(target.iterdir()):
        raise CheckpointError(f"{target} exists and is not a LazyTrain checkpoint (no {META}): refusing to "
                              f"replace it")
    if trainer.world is not None:       # every rank writes its shards, rank 0 commits (checkpoint_world)
        return checkpoint_world.save(trainer, target, extras, _write)
    trainer.flush()
    with staged_folder(target) as tmp:
        tensors_done = False
        try:
            meta = _write(trainer, tmp)
            tensors_done = True
            for name, data in sorted((extras or {}).items()):
                write_synced(tmp / name, data)
            meta["extras"], meta["extra_sha256"] = sorted(extras or {}), extra_digests(extras or {})
            write_synced(tmp / META, json.dumps(meta, allow_nan=False).encode())
        except OSError as e:
            if e.errno not in DISK_FULL or isinstance(e, DiskFullError):
                raise
            kept = "the previous checkpoint is kept" if target.exists() else ""
            raise DiskFullError(target.parent, f"a checkpoint ({target.name}/)",
                                _space_needed(trainer, target, tmp, extras, tensors_done), kept) from None
    return target


def _space_needed(trainer, target: Path, tmp: Path, extras: dict[str, bytes] | None, tensors_done: bool) -> int:
    """The bytes a checkpoint of ``trainer`` takes: the previous one's (the same state); else the tensor files
    written to ``tmp`` (the last one partial unless ``tensors_done``) scaled to every block's elements, at least
    the fp32 masters, with the extras."""
    if target.is_dir():
        return sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    owned = {f"block_{j:04d}.safetensors": lay.trainable_numel for j, lay in enumerate(trainer.store.layouts)
             if lay.trainable_numel}
    written = sorted(f.name for f in tmp.iterdir() if f.name in owned)
    complete = written if tensors_done else written[:-1]
    numel, nbytes = sum(owned[n] for n in complete), sum((tmp / n).stat().st_size for n in complete)
    total = sum(owned.values())
    per_element = nbytes / numel if numel else 4
    return math.ceil(total * per_element) + sum(len(d) for d in (extras or {}).values())


def _write(trainer, tmp: Path, suffix: str = "") -> dict:
    """Tensor files into ``tmp``, each hashed on a worker thread while the next one is written.
    ``suffix``: a rank's file names (``.rank0001``); its ``param.*`` are its flat pieces of the tensors."""
    opt = trainer.optimizer
    files, digests, block_steps = {}, {}, {}
    with hashing_pool() as pool:
        for j, lay in enumerate(trainer.store.layouts):
            if not lay.trainable_numel:     # (a frozen parameter is the base's: ``base_identity``)
                continue
            with trainer._installed(j):     # (state kept on NVMe: read in for the copy)
                state = dict(opt.state_tensors(j))
            master = state.pop("master").reshape(-1)
            tensors = {f"param.{s.name}": master[s.offset:s.offset + s.numel].reshape(s.shape if not suffix
                                                                                       else (s.numel,)).clone()
                       for s in lay.segments if s.offset < lay.trainable_numel}
            tensors.update({f"state.{k}": v.contiguous() for k, v in state.items()})
            if "step" in state:
                block_steps[str(j)] = int(state["step"].max().item()) if state["step"].numel() else 0
            name = f"block_{j:04d}{suffix}.safetensors"
            # one metadata entry: safetensors writes several in a random order, and the same state should
            # be the same bytes (the same SHA-256) whenever it is saved
            try:
                save_file(tensors, str(tmp / name), metadata={"format": FORMAT})
            except SafetensorError as e:        # its writer's I/O error (a full disk), as the OSError it is
                code = re.search(r"\(os error (\d+)\)", str(e))
                if code is None:
                    raise
                raise OSError(int(code[1]), os.strerror(int(code[1])), str(tmp / name)) from None
            fsync_file(tmp / name)
            digests[name] = hash_async(pool, tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": None, "tensors": describe(tensors)}
        for name, entry in files.items():
            entry["sha256"] = digests[name].result()
    tr = trainer.ctx.tracker
    base = {"base": base_identity(trainer)} if trainer.plan.graph.frozen_params else {}
    return {
        **base,
        "format": FORMAT,
        "step": trainer.steps,
        "model": {"name": trainer.plan.graph.name, "fingerprint": trainer.plan.fingerprint},
        "files": files,
        "optimizer": {"class": type(opt).__name__, "hyperparameters": opt.hyperparameters(),
                      "config": {a: getattr(opt, a) for a in _CONFIG_ATTRS if hasattr(opt, a)},
                      "block_steps": block_steps},
        "grad_norm": {"consecutive_nonfinite": tr.consecutive_nonfinite, "total_nonfinite": tr.total_nonfinite,
                      "last_norm": None if tr.last_norm is None else repr(tr.last_norm)},
        "rng": rng_state(),
        "plan": trainer.plan.to_json(),
    }


def write_extra(directory, name: str, data: bytes) -> None:
    """Replace the extra file ``name`` of the checkpoint at ``directory`` atomically, and its SHA-256 in the
    manifest: the manifest first accepts the old digest and the new, then the file is replaced, then the
    manifest keeps the new one (each step a temporary file, fsync, rename): a crash leaves the old contents
    or the new, never a mix, and always one the manifest accepts."""
    folder, meta = read_meta(directory)
    if folder.is_symlink():         # (its files are replaced in place: never in a folder elsewhere)
        raise CheckpointError(f"{folder} is a symbolic link; a checkpoint's files are read only from its own folder, "
                              f"and written only there")
    if name not in meta["extras"]:
        raise CheckpointError(f"{folder / META} lists no extra file {name!r} (it has {meta['extras']})")
    new = extra_digests({name: data})[name]
    digests = meta.setdefault("extra_sha256", {})
    digests[name] = digests.get(name, [])[-1:] + new
    replace_file(folder / META, json.dumps(meta, allow_nan=False).encode())
    replace_file(folder / name, data)
    digests[name] = new
    replace_file(folder / META, json.dumps(meta, allow_nan=False).encode())


def read_extra(folder: Path, meta: dict, name: str) -> bytes:
    """The extra file ``name`` of the checkpoint ``read_meta`` returned as ``(folder, meta)``."""
    if name not in meta["extras"]:
        raise CheckpointError(f"{folder / META} lists no extra file {name!r}: the checkpoint was not written "
                              f"by `lazytrain train`")
    if (folder / name).exists() and not (folder / name).is_file():     # a FIFO would block the read forever
        raise CheckpointError(f"{folder / name}: not a regular file: the checkpoint is damaged")
    try:
        data = (folder / name).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{folder / name}: cannot read it ({e.strerror or e}): the checkpoint is damaged") \
            from None
    return check_extra(folder / name, data, meta)


# ---- RNG states as JSON -------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """The global RNG states as JSON values: torch CPU (and CUDA when initialized), random, numpy."""
    version, internal, gauss = random.getstate()
    out = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    st = np.random.get_state(legacy=False)
    out["numpy"] = {"bit_generator": st["bit_generator"], "key": [int(k) for k in st["state"]["key"]],
                    "pos": int(st["state"]["pos"]), "has_gauss": int(st["has_gauss"]), "gauss": float(st["gauss"])}
    return out


def set_rng_state(d: dict) -> None:
    """Restore what ``rng_state`` returned; a malformed state (the manifest's ``rng``) is a ValueError
    before any generator is changed."""
    try:
        cpu = _unb64(d["torch"])
        version, internal, gauss = d["python"]
        py = (int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss))
        cuda = [_unb64(s) for s in d.get("cuda") or ()]
        if cpu.numel() != torch.get_rng_state().numel():
            raise ValueError(f"the torch state has {cpu.numel()} bytes, not {torch.get_rng_state().numel()}")
        saved = random.getstate()
        random.setstate(py)         # checks the version, the length and the range of the state
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise ValueError(f"malformed RNG state: {e}") from None
    try:
        torch.set_rng_state(cpu)
        if cuda and torch.cuda.is_available():
            for i, s in enumerate(cuda[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
        if d.get("numpy") is not None:
            n = d["numpy"]
            np.random.set_state({"bit_generator": n["bit_generator"],
                                 "state": {"key": np.array(n["key"], dtype=np.uint32), "pos": int(n["pos"])},
                                 "has_gauss": int(n["has_gauss"]), "gauss": float(n["gauss"])})
    except (RuntimeError, TypeError, ValueError) as e:
        random.setstate(saved)
        raise ValueError(f"malformed RNG state: {e}") from None


# ---- loading ------------------------------------------------------------------------------------------
def resolve(directory) -> Path:
    """The folder to load: ``directory``, or ``directory.old`` when a save died between its renames."""
    target = Path(directory).absolute()
    if (target / META).is_file():
        return _unlinked(target)
    old = target.with_name(target.name + ".old")
    if not target.exists() and (old / META).is_file():
        return _unlinked(old)
    if target.exists():
        raise CheckpointError(f"{target} is not a LazyTrain checkpoint (no {META})")
    raise CheckpointError(f"no checkpoint at {target}")


def _unlinked(folder: Path) -> Path:
    """``folder``, refused when a file in it is a symbolic link: a checkpoint is read from its own files only (a
    save never writes a link, and a run folder may come from anyone)."""
    links = sorted(p.name for p in folder.iterdir() if p.is_symlink())
    if links:
        raise CheckpointError(f"{folder}: {links[0]} is a symbolic link; a checkpoint's files are read only from its "
                              f"own folder (replace the link by the file)")
    return folder


def read_meta(directory) -> tuple[Path, dict]:
    """``(folder, metadata)`` of the checkpoint at ``directory``, format checked."""
    folder = resolve(directory)
    path = folder / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): "
                              f"the checkpoint is truncated or corrupted") from None
    except (ValueError, RecursionError) as e:    # an integer of thousands of digits, nesting too deep
        raise CheckpointError(f"{path} is not a checkpoint manifest ({type(e).__name__}: {e})") from None
    return folder, check_manifest(meta, path)


def _check_model(plan: Plan, model: torch.nn.Module, where: Path) -> None:
    """Parameter names and shapes of ``model`` against the checkpoint's plan, before any export."""
    have = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    bad = []
    for b in plan.graph.blocks:
        for p in b.params:
            if have.get(p.name) != tuple(p.shape):
                bad.append(f"{p.name}: checkpoint {list(p.shape)}, model "
                           f"{'missing' if p.name not in have else list(have[p.name])}")
    if bad:
        raise CheckpointError(f"checkpoint {where} is of another model ({plan.graph.name}, fingerprint "
                              f"{plan.fingerprint}): {len(bad)} parameter(s) differ, e.g. {'; '.join(bad[:3])}")


def _optimizer(opt, saved: dict, where: Path):
    known = {"TorchAdamW": TorchAdamW, "Hybrid8bitAdamW": Hybrid8bitAdamW}
    cls_name, hp, config = saved["class"], saved["hyperparameters"], saved.get("config", {})
    if opt is None:
        if cls_name not in known:
            raise CheckpointError(f"checkpoint {where} was saved with optimizer {cls_name}: pass an instance "
                                  f"as optimizer=")
        opt = known[cls_name](lr=hp["lr"], **config)
    elif type(opt).__name__ != cls_name:
        raise CheckpointError(f"checkpoint {where} holds {cls_name} state, the optimizer given is "
                              f"{type(opt).__name__}")
    for a, v in config.items():
        if a in _LAYOUT_ATTRS.get(cls_name, config) and getattr(opt, a, v) != v:
            raise CheckpointError(f"checkpoint {where}: the optimizer's {a} is {getattr(opt, a)}, the state was "
                                  f"saved with {a}={v}")
    opt.load_hyperparameters(hp)
    return opt


def load(cls, directory, model, *, optimizer=None, device=None, plan=None, verbose: bool = True, weights=None,
         nvme_dir=None):
    """A ``cls`` (Trainer) for ``model`` in the state saved at ``directory``.  ``weights``: the trainer's initial
    parameters before the checkpoint's overwrite them (``weights.CheckpointFilled`` for a meta-device model)."""
    folder, meta = read_meta(directory)
    try:
        saved_plan = Plan.from_json(meta["plan"])
    except PlanError as e:
        raise CheckpointError(f"{folder / META}: {e}") from None
    fp = meta["model"].get("fingerprint")
    if fp != saved_plan.fingerprint:
        raise CheckpointError(f"{folder / META}: model fingerprint {fp} does not match its plan's "
                              f"({saved_plan.fingerprint}): the file was edited or corrupted")
    if plan is None:
        plan = saved_plan
    elif plan.fingerprint != fp:
        raise CheckpointError(f"the plan given was compiled for another model: {plan.graph.name} (fingerprint "
                              f"{plan.fingerprint}); checkpoint {folder} is of {meta['model'].get('name')} "
                              f"(fingerprint {fp})")
    _check_model(plan, model, folder)
    optimizer = _optimizer(optimizer, meta["optimizer"], folder)
    try:
        trainer = cls(model, plan, optimizer=optimizer, device=device, verbose=verbose, weights=weights,
                      nvme_dir=nvme_dir)
    except PlanError as e:
        raise CheckpointError(f"checkpoint {folder} does not fit this model: {e}") from None
    _check_steps(meta, folder / META)
    _check_base(trainer, meta, folder)

    def load_block(opt, j: int, *args, **kw) -> None:      # into the files of state kept on NVMe, if any
        with trainer._installed(j, write_back=True):
            _load_block(opt, j, *args, **kw)
    if trainer.world is not None or "world" in meta:      # shards, or another world size's checkpoint
        checkpoint_world.load_blocks(trainer, folder, meta, load_block)
    else:
        _load_dense(trainer, folder, meta, load_block)
    trainer.steps = meta["step"]
    tr, g = trainer.ctx.tracker, meta["grad_norm"]
    tr.consecutive_nonfinite, tr.total_nonfinite = g["consecutive_nonfinite"], g["total_nonfinite"]
    try:
        tr.last_norm = None if g["last_norm"] is None else float(g["last_norm"])
        set_rng_state(meta["rng"])
    except ValueError as e:
        raise CheckpointError(f"{folder / META}: {e}") from None
    return trainer


def base_identity(trainer) -> dict:
    """What a checkpoint records of the frozen base it trained on: the count of frozen parameters, the SHA-256 of
    their values in the trainer's load buffers (per block, on a pool of threads: hashlib drops the GIL; a base held
    quantized: of the values it was quantized from, so the identity is the source's whatever ``base_bits``), and the
    caller's ``Trainer.base_source`` (the model's name and files, for the message when it differs)."""
    if trainer._base_sha256 is None:
        def block_digest(j: int) -> str:
            if j in trainer._frozen_digests:        # a quantized base: its values before quantizing
                return trainer._frozen_digests[j]
            lay, flat = trainer.store.layouts[j], trainer._buffers[j]
            frozen = flat[lay.trainable_numel:lay.owned_numel]
            return hashlib.sha256(frozen.detach().to("cpu").contiguous().view(torch.uint8).numpy()).hexdigest()
        blocks = [j for j, lay in enumerate(trainer.store.layouts) if lay.owned_numel > lay.trainable_numel]
        with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
            digests = list(pool.map(block_digest, blocks))
        h = hashlib.sha256()
        for j, d in zip(blocks, digests):
            h.update(f"{j}:{d};".encode())
        trainer._base_sha256 = h.hexdigest()
    return {"frozen_params": trainer.plan.graph.frozen_params, "param_dtype": trainer.plan.param_dtype,
            "weights_sha256": trainer._base_sha256, "source": trainer.base_source}


def _check_base(trainer, meta: dict, folder: Path) -> None:
    """A checkpoint with a frozen base resumes only on the same base (the values it trained its adapters on)."""
    saved = meta.get("base")
    if saved is None:
        return
    have = base_identity(trainer)
    if have["weights_sha256"] != saved.get("weights_sha256") or have["frozen_params"] != saved.get("frozen_params"):
        src = saved.get("source") or {}
        raise CheckpointError(f"checkpoint {folder} trained its adapters on another base model{_named(src)}: this "
                              f"model's frozen weights differ from those; resume with the base it was trained on")


def _named(src: dict) -> str:
    return f" ({src['model']})" if isinstance(src, dict) and src.get("model") else ""


def _load_dense(trainer, folder: Path, meta: dict, load_block) -> None:
    """Every block's file of a one-process checkpoint into a one-process trainer."""
    blocks = [j for j, lay in enumerate(trainer.store.layouts) if lay.trainable_numel]
    names = {j: f"block_{j:04d}.safetensors" for j in blocks}
    if set(meta["files"]) != set(names.values()):
        raise CheckpointError(f"{folder / META} lists files {sorted(meta['files'])}, this model needs "
                              f"{sorted(names.values())}")
    with hashing_pool() as pool:        # the next file is read and hashed while this one is loaded
        pending = {blocks[0]: hash_async(pool, folder / names[blocks[0]])} if blocks else {}
        for i, j in enumerate(blocks):
            if i + 1 < len(blocks):
                pending[blocks[i + 1]] = hash_async(pool, folder / names[blocks[i + 1]])
            load_block(trainer.optimizer, j, trainer.store.layouts[j], folder / names[j], meta["files"][names[j]],
                       pending.pop(j))


def _check_steps(meta: dict, where: Path) -> None:
    """The step counters agree: every block's optimizer has taken one update per step that was not
    skipped (a non-finite gradient norm skips a step), so no block is ahead of the trainer and none
    behind by more than the skipped steps."""
    step, skipped = meta["step"], meta["grad_norm"]["total_nonfinite"]
    for j, n in meta["optimizer"]["block_steps"].items():
        if not step - skipped <= n <= step:
            raise CheckpointError(f"{where}: step {step} ({skipped} skipped) does not match block {j}'s optimizer "
                                  f"step {n}: the manifest was edited or corrupted")


def _load_block(opt, j: int, lay, path: Path, entry: dict, pending, pieces: bool = False) -> None:
    """Block ``j``'s file, saved with this very layout (``pieces``: a rank's, flat pieces and padding)."""
    state = opt.state_tensors(j)        # what this optimizer holds for the block: the expected layout
    master = state.pop("master")
    owned = [s for s in lay.segments if s.offset < lay.trainable_numel]
    expected = {f"param.{s.name}": (master.dtype, (s.numel,) if pieces else tuple(s.shape)) for s in owned}
    expected.update({f"state.{k}": (v.dtype, tuple(v.shape)) for k, v in state.items()})
    del state
    tensors = read_verified(path, entry, expected, pending)
    if pieces:                          # padding stays zero
        master.zero_()
        for s in owned:
            master[s.offset:s.offset + s.numel].copy_(tensors.pop(f"param.{s.name}").reshape(-1))
    else:
        master = torch.cat([tensors.pop(f"param.{s.name}").reshape(-1) for s in owned])
    state = {k.removeprefix("state."): v for k, v in tensors.items()}
    state["master"] = master
    try:
        opt.load_state_tensors(j, state)
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path}: optimizer state does not fit block {j}: {type(e).__name__}: {e}") from None
