"""A damaged Hugging Face model folder is one line, with ``--data`` and without: a weight file truncated,
empty, of random bytes, with a header length of 2**62 or tensor offsets past its end; an index naming weight
files of which none or only some are there (a folder with a config alone is a random init by design, one
with an index is not)."""

from __future__ import annotations

import json
import os
import struct

import pytest

from lazytrain.app.cli import main

pytest.importorskip("transformers")
from ft_fixtures import chat, tiny_folder, write_jsonl  # noqa: E402

ARGS = ["--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
        "--threads", "1", "--time-limit-min", "0", "--no-eval", "--steps", "1", "--no-export"]


def _damage(folder, how: str) -> str:
    """Damage ``folder``'s weights as ``how`` says; the words the error must hold."""
    st = folder / "model.safetensors"
    data = st.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    if how == "truncated":
        st.write_bytes(data[:len(data) // 2])
    elif how == "empty":
        st.write_bytes(b"")
    elif how == "random":
        st.write_bytes(os.urandom(4096))
    elif how == "header 2**62":
        st.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    elif how == "offsets past the end":
        header = json.loads(data[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 1 << 20
        hb = json.dumps(header).encode()
        st.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n:])
    elif how == "empty index":
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
        st.unlink()
        return "maps no weights"
    else:                   # an index over two shards: "no shard" of them there, or "one shard" of two
        header = json.loads(data[8:8 + n])
        names = sorted(k for k in header if k != "__metadata__")
        files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        wmap = {k: files[i % 2] for i, k in enumerate(names)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        if how == "one shard":
            st.rename(folder / files[0])
        else:
            st.unlink()
        return "model-00002-of-00002.safetensors"
    return "model.safetensors"


DAMAGES = ["truncated", "empty", "random", "header 2**62", "offsets past the end", "no shard", "one shard",
           "empty index"]


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("data", [True, False], ids=["data", "task"])
def test_a_damaged_model_folder_is_one_line(tmp_path, capsys, how, data):
    folder = tiny_folder(tmp_path / "hf")
    words = _damage(folder, how)
    extra = ["--data", str(write_jsonl(tmp_path / "d.jsonl", [chat(f"{i}+1", f"{i + 1}") for i in range(8)]))] \
        if data else []
    capsys.readouterr()
    assert main(["train", *ARGS, "--model", str(folder), "--output", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]           # after transformers' progress bars, if any
    assert "Traceback" not in err and last.startswith("lazytrain train: error: ") and words in last, err
    assert not (tmp_path / "o" / "checkpoint").exists()


def test_an_index_may_not_name_files_outside_its_folder(tmp_path, capsys):
    folder = tiny_folder(tmp_path / "hf")
    (tmp_path / "elsewhere.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "../elsewhere.safetensors"}}))
    data = write_jsonl(tmp_path / "d.jsonl", [chat(f"{i}+1", f"{i + 1}") for i in range(8)])
    assert main(["train", *ARGS, "--model", str(folder), "--output", str(tmp_path / "o"), "--data", str(data)]) == 2
    assert "names files outside its folder" in capsys.readouterr().err
