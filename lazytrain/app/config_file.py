"""``lazytrain train CONFIG.yaml [KEY=VALUE ...]``: a run's settings from a YAML file, as the peers' users write
them (``llamafactory-cli train x.yaml key=value``, ``axolotl train cfg.yaml``, TRL's ``SFTConfig``).

The keys are not a second list: each is a setting of ``config.py`` (``TrainConfig``, ``FinetuneConfig``) under its
``Setting.key``, the name Hugging Face's ``TrainingArguments`` / TRL's ``SFTConfig`` give it where they have one
(``learning_rate``, ``max_steps``, ``output_dir``, ``packing``), else the field's name (``gpu_memory``); the field's
name is accepted too (``lr``).  A value goes through the flag's own parser (its type and choices: ``24GiB``, ``none``),
so a file and a flag accept the same values and give the same errors, with the file and line in front.  Besides the
settings, the launch's ``gpus`` / ``nproc``, and Hugging Face's per-device batch:
``per_device_train_batch_size`` x ``gradient_accumulation_steps`` x the GPUs is the global batch
(``global_batch_size``, ours: the rows an optimizer step sees; the plan splits it into micro-batches itself, so
the accumulation is no setting of the run, only a way to say the global batch).

Precedence: the defaults, then the file, then ``KEY=VALUE`` and flags (one setting given both ways is an error:
which would win is not obvious).  What the file gives counts as given for a resume, as a flag does.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from .config import FinetuneConfig, setting_of

#: keys that are not settings of a run: the launch's, and the per-device batch the global one is made of
LAUNCH_KEYS = ("gpus", "nproc")
PER_DEVICE = "per_device_train_batch_size"
ACCUMULATION = "gradient_accumulation_steps"
#: the largest config file read: a run's settings are a few kilobytes
MAX_CONFIG_BYTES = 1 << 20


class ConfigError(ValueError):
    """A config file or ``KEY=VALUE`` that cannot be taken; the message names the file and line, or the argument."""


def settings_by_key() -> dict[str, str]:
    """Every config key (and every field name) -> the ``FinetuneConfig`` field it sets: the settings that have a
    flag."""
    out: dict[str, str] = {}
    for f in fields(FinetuneConfig):
        s = setting_of(f)
        if s.help is not None:
            out[s.key_name(f.name)] = f.name
            out.setdefault(f.name, f.name)
    return out


def canonical_keys() -> dict[str, str]:
    """field name -> its config key, in the configuration's order."""
    return {f.name: setting_of(f).key_name(f.name) for f in fields(FinetuneConfig) if setting_of(f).help is not None}


def read_file(path: str) -> dict[str, tuple[Any, str]]:
    """The top-level keys of a YAML (or JSON) config file: key -> (value, ``FILE:LINE`` where it stands)."""
    import yaml
    p = Path(path)
    try:
        if not p.is_file():
            raise ConfigError(f"{path}: no such config file" if not p.exists() else f"{path}: not a file")
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {p.stat().st_size:,} bytes; a config file is at most {MAX_CONFIG_BYTES:,}")
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a YAML config is UTF-8 text)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        loader = yaml.SafeLoader(text)      # parsed once: the node gives each key's line, the data is built from it
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or node is None or not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}: a config file is a mapping of keys to values (learning_rate: 2.0e-4), "
                          f"not a {type(data).__name__}")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    out = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{path}: key {key!r} is not a name")
        out[key] = (value, f"{path}:{lines.get(key, '?')}")
    return out


def read_overrides(items: list[str]) -> dict[str, tuple[Any, str]]:
    """``KEY=VALUE`` arguments: key -> (value as YAML reads it: ``3``, ``2.0e-4``, ``[a, b]``, ``true``; the
    argument)."""
    import yaml
    out: dict[str, tuple[Any, str]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or key.startswith("-"):
            raise ConfigError(f"{item!r}: expected KEY=VALUE after the config file (learning_rate=2e-4)")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text            # a value YAML cannot read is the string as typed (a regex, a path)
        if key in out:
            raise ConfigError(f"{item!r}: {key} is given twice")
        out[key] = (value, f"argument {item!r}")
    return out


def apply(a: argparse.Namespace, path: str | None, items: list[str]) -> None:
    """Put the settings of the config file ``path`` and of the ``KEY=VALUE`` ``items`` into the parsed flags ``a``
    (those the flags gave stay; a key also given as a flag or twice is an error).  Each value is checked by the
    setting's own flag parser."""
    given = dict(read_file(path)) if path else {}
    overrides = read_overrides(items)
    for key, (value, where) in overrides.items():
        given[key] = (value, where)          # an argument overrides the file's key
    by_key = settings_by_key()
    flagged = set(vars(a))
    batch_parts: dict[str, tuple[Any, str]] = {}
    seen: dict[str, str] = {}
    for key, (value, where) in given.items():
        if key in (PER_DEVICE, ACCUMULATION):
            batch_parts[key] = (value, where)
            continue
        if key in LAUNCH_KEYS:
            name = key
        elif key in by_key:
            name = by_key[key]
        else:
            known = [*by_key, *LAUNCH_KEYS, PER_DEVICE, ACCUMULATION]
            raise ConfigError(f"{where}: unknown key {key!r}{_closest(key, known)} (`lazytrain train --print-config` "
                              f"lists every key)")
        if name in seen:
            raise ConfigError(f"{where}: {key} sets the same setting as {seen[name]}")
        seen[name] = f"{key} ({where})"
        if name in flagged and getattr(a, name) is not None:    # (``--gpus`` / ``--nproc`` are None when not given)
            if key in overrides:
                raise ConfigError(f"{where}: {key} is also given as a flag; give it once")
            continue            # the flag overrides the file
        converted = _value(name, key, value, where)
        if converted is not _UNSET:
            setattr(a, name, converted)
    if batch_parts:
        _per_device_batch(a, batch_parts, seen, flagged)
    if getattr(a, "gpus", None) and getattr(a, "nproc", None):
        raise ConfigError("gpus and nproc: give one (GPUs, or processes on the CPU)")


_UNSET = object()


def _value(name: str, key: str, value: Any, where: str) -> Any:
    """``value`` (as YAML read it) for the setting ``name``, through its flag's parser."""
    if name in LAUNCH_KEYS:
        from .cli_types import positive
        return _parsed(positive, value, key, where) if value is not None else _UNSET
    f = FinetuneConfig.__dataclass_fields__[name]
    s = setting_of(f)
    if s.const is not None and s.nargs is None:        # a flag without a value: a boolean in the file
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} is true or false, got {value!r}")
        # the flag sets the field to ``const``; the key names the field's own value (do_eval: false, packing: true)
        return value
    if value is None:       # null: None where the setting takes it (time_limit_min: null, no limit), else the default
        if "None" in str(f.type):
            return None
        return f.default if f.default is not MISSING else _UNSET
    if s.nargs == "?" and value is True:         # ``profile: true``: the flag given without a step
        return s.const
    text = _as_flag_text(value, key, where)
    if s.type is not None:
        return _parsed(s.type, text, key, where)
    choices = s.choices() if callable(s.choices) else s.choices
    if choices is not None and text not in choices:
        raise ConfigError(f"{where}: {key} is one of {', '.join(choices)}; got {text!r}"
                          f"{_closest(text, list(choices))}")
    return text


def _as_flag_text(value: Any, key: str, where: str) -> str:
    """A YAML value as the flag's text: scalars as written, a list joined by commas, a mapping as ``a=b,c=d``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict) and all(isinstance(v, (int, float, str)) or isinstance(v, list) and all(
            isinstance(x, (int, float, str)) for x in v) for v in value.values()):      # (lora's targets: a list)
        return ",".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in value.items())
    raise ConfigError(f"{where}: {key}: a value of this setting is a number, a string or a list of them; got "
                      f"{type(value).__name__} {value!r}")


def _parsed(parse, value: Any, key: str, where: str) -> Any:
    try:
        return parse(value if isinstance(value, str) else _as_flag_text(value, key, where))
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise ConfigError(f"{where}: {key}: {e}") from None


def _per_device_batch(a: argparse.Namespace, parts: dict, seen: dict, flagged: set) -> None:
    """Hugging Face's per-device batch and accumulation as our global batch (see the module docstring)."""
    from .cli_types import positive
    if PER_DEVICE not in parts:
        raise ConfigError(f"{parts[ACCUMULATION][1]}: {ACCUMULATION} needs {PER_DEVICE} (or give the global batch: "
                          f"global_batch_size, the rows one optimizer step sees over all GPUs)")
    if "batch" in seen or ("batch" in flagged and parts[PER_DEVICE][1].startswith("argument")):
        raise ConfigError(f"{parts[PER_DEVICE][1]}: {PER_DEVICE} and {seen.get('batch', '--batch')}: give one "
                          f"(global_batch_size is {PER_DEVICE} x {ACCUMULATION} x the GPUs)")
    if "batch" in flagged:
        return          # ``--batch`` overrides the file's batch
    per_device = _parsed(positive, parts[PER_DEVICE][0], PER_DEVICE, parts[PER_DEVICE][1])
    steps = (_parsed(positive, parts[ACCUMULATION][0], ACCUMULATION, parts[ACCUMULATION][1])
             if ACCUMULATION in parts else 1)
    a.batch = per_device * steps * (getattr(a, "gpus", None) or getattr(a, "nproc", None) or 1)


def _closest(word: str, candidates: list[str]) -> str:
    near = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""


def effective(cfg, launch: dict | None = None) -> dict[str, Any]:
    """The run's configuration ``cfg`` as a config file: every setting with a flag, under its key, its value as
    the file takes it back (sizes in bytes, choices by name); the launch's ``gpus`` / ``nproc`` where given."""
    import enum
    keys = canonical_keys()
    out: dict[str, Any] = {}
    for f in fields(cfg):
        if f.name not in keys:
            continue
        v = getattr(cfg, f.name)
        out[keys[f.name]] = v.value if isinstance(v, enum.Enum) else v
    for k, v in (launch or {}).items():
        if v:
            out[k] = v
    return out


def dump(cfg, launch: dict | None = None) -> str:
    """``effective`` as YAML text, with a header saying what it is."""
    import yaml
    header = ("# lazytrain train: the effective configuration (every setting; defaults included).\n"
              "# Run it with `lazytrain train THIS.yaml [key=value ...]`; flags override it.\n")
    return header + yaml.safe_dump(effective(cfg, launch), sort_keys=False, allow_unicode=True, width=120)
