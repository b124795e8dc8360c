"""Issue #42, "silently wrong settings on resume and input": a resumed ``--data`` run keeps or refuses its settings
(never an ``AttributeError``); a data file is read once (a FIFO works); oversized, deeply nested or absurd records,
an empty ``--data``, an eval set that is the training set, a bad ``--answer-regex`` and a factory that needs
arguments are one-line errors naming what is wrong."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import pytest

from lazytrain.app.cli import main
from lazytrain.data import DataError, read_records
from lazytrain.data.formats import MAX_RECORD_BYTES

pytest.importorskip("transformers")
from ft_fixtures import chat, tiny_folder, tiny_tokenizer, write_jsonl  # noqa: E402

ARGS = ["--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
        "--threads", "1", "--time-limit-min", "0", "--no-export"]
RECORDS = [chat(f"{i}+{i % 7}=?", f"{i + i % 7}") for i in range(24)]


def _error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ---- a resumed --data run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ft_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ft")
    folder, data, out = tiny_folder(tmp / "hf"), write_jsonl(tmp / "train.jsonl", RECORDS), tmp / "run"
    assert main(["train", *ARGS, "--model", str(folder), "--data", str(data), "--steps", "1", "--lr", "0.01",
                 "--no-eval", "--output", str(out)]) == 0
    return tmp, data, out


@pytest.mark.parametrize("flags, words", [
    (["--data", "other.jsonl"], "--data other.jsonl differs from the run's data"),
    (["--eval-data", "other.jsonl"], "--eval-data other.jsonl differs from the run's eval_data"),
    (["--pack"], "--pack differs from the run's pack (False)"),
    (["--loss-on", "all"], "--loss-on all differs from the run's loss_on (completion)"),
    (["--batch", "32"], "--batch 32 differs from the run's batch (4)"),        # 32: the task's default
])
def test_a_data_runs_resume_refuses_what_it_keeps(ft_run, flags, words, capsys, monkeypatch):
    tmp, _, out = ft_run
    (tmp / "other.jsonl").write_text(json.dumps(chat("a", "b")) + "\n")
    monkeypatch.chdir(tmp)
    last = _error(capsys, "train", *ARGS, "--resume", str(out), "--output", str(tmp / "o"), "--steps", "2", *flags)
    assert words in last, last


def test_a_data_runs_resume_keeps_its_lr_and_says_what_a_flag_changes(ft_run, capsys):
    tmp, data, out = ft_run
    assert main(["train", *ARGS, "--resume", str(out), "--output", str(tmp / "r1"), "--steps", "2",
                 "--data", str(data)]) == 0        # --data naming the run's own file: the same, not a change
    r = json.loads((tmp / "r1" / "metrics.json").read_text())
    assert r["settings"]["lr"] == 0.01 and r["settings"]["evaluate"] is False and r["steps_done"] == 2
    said = capsys.readouterr().out
    assert "steps 1 -> 2" in said and " lr " not in said.split("changed on this command line")[1].splitlines()[0]


# ---- reading the data ----------------------------------------------------------------------------------------
def test_a_fifo_is_read_once_and_fingerprinted_as_the_file(tmp_path):
    """``--data <(zcat ...)``: the examples and the fingerprint come from one read (a second would wait forever
    for a writer).  The test cannot hang: the reader runs in a thread given 60 s, then unblocked."""
    from lazytrain.app.finetune.prepare import prepare_data
    from lazytrain.data import Encoder
    payload = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
    fifo = tmp_path / "data.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(payload), daemon=True)
    writer.start()
    got: dict = {}
    enc = Encoder(tiny_tokenizer())

    def read():
        try:
            got["data"] = prepare_data(enc, str(fifo), None, seq=None, max_positions=512, truncate="truncate",
                                       eval_size=2)
        except Exception as e:  # noqa: BLE001 - reported below
            got["error"] = e
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():               # blocked on a second open: give it an end of file, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("the data FIFO was opened a second time")
    assert "error" not in got, got
    assert got["data"].counts["train"] + got["data"].counts["eval"] == len(RECORDS)
    assert got["data"].fingerprint == hashlib.sha256(payload + b"-").hexdigest()[:16]   # a file's, as before


def test_dev_zero_is_refused_after_one_records_bound():
    with pytest.raises(DataError, match=r"^/dev/zero:1: a line of more than 4 MiB"):
        read_records("/dev/zero")


def test_an_oversized_record_is_refused_before_tokenizing(tmp_path):
    big = "x" * (MAX_RECORD_BYTES + 1)
    lines = tmp_path / "big.jsonl"
    lines.write_text(json.dumps(chat("a", "b")) + "\n" + json.dumps({"text": big}) + "\n")
    with pytest.raises(DataError, match=r"big.jsonl:2: a line of more than 4 MiB"):
        read_records(lines)
    listed = tmp_path / "big.json"
    listed.write_text(json.dumps([chat("a", "b"), {"text": big}]))       # one line: a JSON list has no line bound
    with pytest.raises(DataError, match=r"big.json\[1\]: a record of 4,194,305 characters"):
        read_records(listed)
    fine = tmp_path / "fine.json"
    fine.write_text(json.dumps([{"text": "y" * 1000}] * 5000))            # 5 MB on one line, small records
    assert len(read_records(fine)) == 5000


def test_a_byte_order_mark_is_read_past(tmp_path):
    """A Windows editor's UTF-8 mark before a JSONL or JSON list file (json.loads refuses it)."""
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(chat("a", "b")).encode() + b"\n")
    (tmp_path / "a.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([chat("a", "b")]).encode())
    assert read_records(tmp_path / "a.jsonl")[0].messages == read_records(tmp_path / "a.json")[0].messages


@pytest.mark.parametrize("value, words", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deeply)"),
    ("1" * 100_000, "not valid JSON (Exceeds the limit"),
])
def test_absurd_json_names_the_file_and_line(tmp_path, value, words):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(chat("a", "b")) + "\n" + '{"text": "x", "extra": ' + value + "}\n")
    with pytest.raises(DataError) as e:
        read_records(path)
    assert str(e.value).startswith(f"{path}:2: {words}") and "set_int_max_str_digits" not in str(e.value)
    listed = tmp_path / "a.json"
    listed.write_text('[{"text": "x", "extra": ' + value + "}]")
    with pytest.raises(DataError, match=rf"^{listed}: {words[:12]}"):
        read_records(listed)


# ---- flags checked before any loading ------------------------------------------------------------------------
def test_empty_data_is_an_error_not_the_builtin_task(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--data", "", "--output", str(tmp_path / "o")])
    assert "--data: needs a file or folder name, got ''" in capsys.readouterr().err
    from lazytrain.app.config import FinetuneConfig
    from lazytrain.app.train import run
    with pytest.raises(ValueError, match="--data '': an empty name names no file"):
        run(FinetuneConfig(data="", output=str(tmp_path / "o")))


def test_a_bad_answer_regex_is_refused_before_the_model_is_looked_for(tmp_path, capsys):
    last = _error(capsys, "train", *ARGS, "--model", str(tmp_path / "none"), "--data", str(tmp_path / "none.jsonl"),
                  "--answer-regex", "(", "--output", str(tmp_path / "o"))
    assert "--answer-regex '(': not a regular expression (missing ), unterminated subpattern" in last, last


def test_eval_data_that_is_the_training_data_is_refused(tmp_path, capsys):
    from lazytrain.app.finetune.prepare import prepare_data
    from lazytrain.data import Encoder
    enc = Encoder(tiny_tokenizer())
    data = write_jsonl(tmp_path / "train.jsonl", RECORDS)
    copy = write_jsonl(tmp_path / "copy.jsonl", RECORDS[:5])      # a part of it, under another name
    for same in (data, copy):
        with pytest.raises(DataError, match="every eval example is also in --data"):
            prepare_data(enc, str(data), str(same), seq=None, max_positions=512, truncate="truncate", eval_size=4)
    some = write_jsonl(tmp_path / "some.jsonl", RECORDS[:1] + [chat("new", "one")])
    d = prepare_data(enc, str(data), str(some), seq=None, max_positions=512, truncate="truncate", eval_size=4)
    assert len(d.eval) == 2 and "1 of the 2 eval examples" in capsys.readouterr().out


@pytest.mark.parametrize("spec, words", [("os.path:join", "needs arguments (a, *p); a factory is called with none"),
                                         ("os:sep", "is a str, not a function to call")])
def test_a_factory_that_cannot_be_called_alone(spec, words, capsys, tmp_path):
    last = _error(capsys, "compile", spec, "--batch", "4", "--seq", "64", "-o", str(tmp_path / "p.json"))
    assert words in last, last
