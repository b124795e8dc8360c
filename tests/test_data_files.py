"""Data from any common file (issue #43): parquet, CSV, TSV, Arrow and a ``datasets`` ``save_to_disk`` folder read
through pyarrow a record batch at a time into the token store, giving the examples, split and counts the JSONL of
the same rows gives; ``--columns``, ``--system-prompt``, ``--chat-template``; every bad file one error."""

from __future__ import annotations

import hashlib
import json

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("transformers")
import pyarrow.csv as pacsv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from ft_fixtures import CHATML, chat, tiny_folder, tiny_tokenizer, write_jsonl  # noqa: E402

from lazytrain.app.finetune.prepare import prepare_data, set_chat_template  # noqa: E402
from lazytrain.data import Batches, DataError, Encoder, fit, read_records  # noqa: E402
from lazytrain.data.batches import held_out  # noqa: E402
from lazytrain.data.formats import iter_records  # noqa: E402

QA = [{"prompt": f"{'so ' * (i % 5)}{i}+{i % 7}=", "completion": str(i + i % 7)} for i in range(60)]
QA += [QA[3], QA[3]]        # copies land on the same side of the split


def save_to_disk(folder, rows: list[dict], split: str | None = None):
    """A folder laid out as ``datasets.Dataset.save_to_disk`` lays it out (checked against datasets 5.2: the same
    bytes for string columns): the table as an Arrow *stream* with its features in the ``huggingface`` schema
    metadata, ``state.json`` listing the data files, ``dataset_info.json``; with ``split``, a ``DatasetDict``
    folder holding it and a small ``test`` split."""
    if split is not None:
        folder.mkdir(parents=True)
        (folder / "dataset_dict.json").write_text(json.dumps({"splits": [split, "test"]}))
        save_to_disk(folder / split, rows)
        save_to_disk(folder / "test", rows[:2])
        return folder
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    feats = {k: {"dtype": "string", "_type": "Value"} for k in rows[0]}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": feats}})})
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(folder / name), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}], "_fingerprint": "0",
                                                   "_format_columns": None, "_format_kwargs": {},
                                                   "_format_type": None, "_output_all_columns": False,
                                                   "_split": None}, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps({"features": feats}, indent=2))
    return folder


def _files(tmp_path, rows: list[dict]) -> dict:
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)       # several row groups
    pacsv.write_csv(table, tmp_path / "d.csv")
    pacsv.write_csv(table, tmp_path / "d.tsv", pacsv.WriteOptions(delimiter="\t"))
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=5)
    return {"jsonl": write_jsonl(tmp_path / "d.jsonl", rows), "parquet": tmp_path / "d.parquet",
            "csv": tmp_path / "d.csv", "tsv": tmp_path / "d.tsv", "arrow": tmp_path / "d.arrow",
            "datasets": save_to_disk(tmp_path / "ds", rows), "dict": save_to_disk(tmp_path / "dd", rows, "train")}


def _examples(data):
    return [(tuple(int(v) for v in t.ids), tuple(int(v) for v in t.labels)) for t in data.train]


def test_every_format_gives_the_examples_split_and_counts_of_the_jsonl(tmp_path):
    enc = Encoder(tiny_tokenizer())
    files = _files(tmp_path, QA)
    got = {k: prepare_data(enc, str(p), None, seq=12, max_positions=512, truncate="drop", eval_size=3)
           for k, p in files.items()}
    ref = got["jsonl"]
    # the split is held_out's (by content) over the records read whole, as before the stream
    records = read_records(files["jsonl"])
    train, evals = held_out(records, [r.key() for r in records], 3)
    assert len(evals) == 3 and ref.counts["eval"] == 3
    assert [e.reference for e in ref.eval] == [r.completion for r in evals if fit(enc.encode(r), 12, "truncate")]
    assert ref.counts["train_read"] == len(train) and ref.counts["dropped"] == ref.counts["too_long"] > 0
    fits = [e for e in (enc.encode(r) for r in train) if len(e) <= 12]
    assert _examples(ref) == [(e.ids, e.labels) for e in fits]
    # the fingerprint is of the bytes read (a resumed run compares it), as it was
    assert ref.fingerprint == hashlib.sha256(files["jsonl"].read_bytes() + b"-").hexdigest()[:16]
    for kind, data in got.items():
        assert _examples(data) == _examples(ref), kind
        assert [e.ids for e in data.eval] == [e.ids for e in ref.eval], kind
        assert data.counts == ref.counts and data.seq_len == ref.seq_len, kind
    assert got["parquet"].fingerprint != got["csv"].fingerprint       # each its file's bytes
    # the order of the rows changes neither the split nor the examples (as sets)
    shuffled = prepare_data(enc, str(write_jsonl(tmp_path / "r.jsonl", QA[::-1])), None, seq=12, max_positions=512,
                            truncate="drop", eval_size=3)
    assert sorted(e.reference for e in shuffled.eval) == sorted(e.reference for e in ref.eval)
    assert sorted(_examples(shuffled)) == sorted(_examples(ref))


def test_batches_from_the_store_are_those_of_the_examples(tmp_path):
    enc = Encoder(tiny_tokenizer())
    data = prepare_data(enc, str(_files(tmp_path, QA)["parquet"]), None, seq=16, max_positions=512,
                        truncate="truncate", eval_size=3)
    in_memory = [(t.ids.tolist(), t.labels.tolist()) for t in data.train]
    from lazytrain.data import Example
    listed = [Example(tuple(i), tuple(lab), (), "", "") for i, lab in in_memory]
    for pack in (False, True):
        a = Batches(data.train, 4, data.seq_len, 0, pack=pack, seed=3)
        b = Batches(listed, 4, data.seq_len, 0, pack=pack, seed=3)
        assert a.steps_per_epoch == b.steps_per_epoch and a.padding() == b.padding()
        for step in range(a.steps_per_epoch + 2):
            x, y = a.batch(step), b.batch(step)
            assert x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)


def test_nested_messages_column_and_a_dataset_dict_reads_its_train_split(tmp_path):
    rows = [chat(f"q{i}", f"a{i}") for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    recs = read_records(tmp_path / "m.parquet")
    assert [r.messages for r in recs] == [r.messages for r in read_records(write_jsonl(tmp_path / "m.jsonl", rows))]
    assert recs[2].where.endswith("m.parquet, row 3")
    folder = save_to_disk(tmp_path / "dd", [{"text": f"t{i}"} for i in range(5)], "train")
    assert [r.completion for r in read_records(folder)] == [f"t{i}" for i in range(5)]
    assert len(read_records(folder / "test")) == 2


def test_column_mapping(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1), "id": i} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qa.parquet")
    jsonl = write_jsonl(tmp_path / "qa.jsonl", rows)
    for path in (tmp_path / "qa.parquet", jsonl):
        with pytest.raises(DataError, match=r"keys: answer, id, question.*--columns question=prompt,answer=completion"):
            read_records(path)
        recs = read_records(path, columns={"question": "prompt", "answer": "completion"})
        assert [(r.prompt, r.completion) for r in recs] == [(f"{i}+1=", str(i + 1)) for i in range(6)]
    with pytest.raises(DataError, match=r"'quest'.*not a column of it \(its columns: question, answer, id\)"):
        read_records(tmp_path / "qa.parquet", columns={"quest": "prompt", "answer": "completion"})
    with pytest.raises(DataError, match="'quest', which no record has"):
        read_records(jsonl, columns={"quest": "prompt", "answer": "completion", "question": "text"})
    from lazytrain.data.formats import parse_columns
    assert parse_columns("question=prompt, answer=completion") == {"question": "prompt", "answer": "completion"}
    with pytest.raises(ValueError, match="'answer' is not a key we read"):
        parse_columns("question=prompt,x=answer")
    with pytest.raises(ValueError, match="COLUMN=KEY"):
        parse_columns("question")


SMOL_LIKE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
             "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
             "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SKIPS_EMPTY = ("{% if messages[0]['role'] != 'system' %}{{ 'DEFAULT PROMPT\n' }}{% endif %}"
               "{% for m in messages %}{% if m['content'] %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
               "'<|im_end|>\n' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_system_prompt(capsys):
    turns = (("user", "hi"), ("assistant", "yo"))

    def text(template, system):
        enc = Encoder(tiny_tokenizer(template), system_prompt=system)
        return enc.tok.decode(list(enc.prompt_for(turns[:1]))), enc
    said, enc = text(CHATML, "Be brief.")
    assert said.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
    from lazytrain.data.formats import Record
    ex = enc.encode(Record("x", "messages", messages=turns))
    assert enc.tok.decode(list(ex.ids)).startswith("<|im_start|>system\nBe brief.")
    assert text(CHATML, "")[0].startswith("<|im_start|>user")       # no default to leave out: nothing added
    assert text(SMOL_LIKE, None)[0].startswith("<|im_start|>system\nYou are a helpful")
    capsys.readouterr()
    said, _ = text(SMOL_LIKE, "")
    assert said.startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user") and "helpful" not in said
    assert "empty block" in capsys.readouterr().out
    said, _ = text(SKIPS_EMPTY, "")
    assert said.startswith("<|im_start|>user\nhi") and "DEFAULT" not in said
    assert "note" not in capsys.readouterr().out


def test_chat_template_file(tmp_path):
    tok = tiny_tokenizer()
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                                      "{% if add_generation_prompt %}[assistant] {% endif %}")
    set_chat_template(tok, str(tmp_path / "t.jinja"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"--chat-template .*bad.jinja: not a Jinja chat template"):
        set_chat_template(tok, str(tmp_path / "bad.jinja"))
    with pytest.raises(ValueError, match="cannot read it"):
        set_chat_template(tok, str(tmp_path / "none.jinja"))


def test_bad_files_are_one_error_naming_file_and_row(tmp_path):
    def error(path, **kw) -> str:
        with pytest.raises(DataError) as e:
            list(iter_records(path, **kw))
        assert "\n" not in str(e.value)
        return str(e.value)
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    assert "x.parquet: cannot read it as parquet" in error(tmp_path / "x.parquet")
    assert "accepted formats: JSONL (.jsonl)" in error(tmp_path / "x.parquet")
    (tmp_path / "r.csv").write_text("prompt,completion\n1+1=,2\n2+2=,4,extra\n")
    assert "r.csv, row 2: 3 fields where the header has 2" in error(tmp_path / "r.csv")
    folder = save_to_disk(tmp_path / "ds", QA)
    (folder / "data-00000-of-00001.arrow").unlink()
    assert "data files that are missing (data-00000-of-00001.arrow)" in error(folder)
    (tmp_path / "empty").mkdir()
    assert "not one `datasets` save_to_disk wrote" in error(tmp_path / "empty")
    pq.write_table(pa.table({"prompt": ["a", "c"], "completion": [1, 4]}), tmp_path / "t.parquet")
    assert "t.parquet, row 1: 'completion' must be a string, got int" in error(tmp_path / "t.parquet")
    pq.write_table(pa.table({"prompt": ["a", None], "completion": ["b", "d"]}), tmp_path / "n.parquet")
    assert "n.parquet, row 2: 'prompt' is null (an empty cell)" in error(tmp_path / "n.parquet")
    (tmp_path / "d.xlsx").write_bytes(b"x")
    assert "unknown extension '.xlsx'; accepted formats: JSONL" in error(tmp_path / "d.xlsx")
    (tmp_path / "c.arrow").write_bytes(b"ARROW1 broken")
    assert "c.arrow: cannot read it as an Arrow file" in error(tmp_path / "c.arrow")


def test_train_from_parquet_end_to_end(tmp_path):
    """``lazytrain train --data x.parquet --columns ... --system-prompt ... --chat-template FILE`` through main()."""
    from lazytrain.app.cli import main
    folder = tiny_folder(tmp_path / "hf")
    rows = [{"chat": chat(f"{i}+{i % 7}=?", f"{i + i % 7}")["messages"]} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "x.parquet")
    (tmp_path / "t.jinja").write_text(CHATML.replace("<|im_start|>", "<|im_start|> "))
    out = tmp_path / "run"
    assert main(["train", "--model", str(folder), "--data", str(tmp_path / "x.parquet"), "--columns",
                 "chat=messages", "--system-prompt", "Add.", "--chat-template",
                 str(tmp_path / "t.jinja"), "--steps", "2", "--batch", "4", "--eval-size", "2", "--policy",
                 "keep-all", "--no-progress", "--device", "cpu", "--threads", "1", "--time-limit-min", "0",
                 "--no-export", "--output", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps_done"] == 2 and m["data"]["train"] == 28 and m["data"]["eval"] == 2
    assert m["settings"]["columns"] == {"chat": "messages"}
    assert m["settings"]["system_prompt"] == "Add." and m["settings"]["chat_template"].endswith("t.jinja")
    saved = json.loads((out / "source" / "tokenizer_config.json").read_text()).get("chat_template") or \
        (out / "source" / "chat_template.jinja").read_text()
    assert "<|im_start|> " in saved and "system" in m["eval_curve"][0]["samples"][0]["prompt"]
    assert "<|im_start|> " in saved                   # the run's tokenizer keeps the template for resume / export
    assert not list(out.glob("lazytrain-tokens-*"))   # the token store is gone with the run


def test_the_folder_written_here_is_the_one_datasets_writes(tmp_path):
    """Where ``datasets`` is installed (not in CI): a real ``save_to_disk`` folder and a DatasetDict are read, and
    the test's own layout (``save_to_disk`` above) has the same files, the Arrow file byte for byte."""
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "real"))
    mine = save_to_disk(tmp_path / "mine", rows)
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == sorted(p.name for p in mine.iterdir())
    name = "data-00000-of-00001.arrow"
    assert (tmp_path / "real" / name).read_bytes() == (mine / name).read_bytes()
    cols = {"question": "prompt", "answer": "completion"}
    assert [r.prompt for r in read_records(tmp_path / "real", columns=cols)] == [f"q{i}" for i in range(5)]
    chats = datasets.Dataset.from_list([chat(f"q{i}", f"a{i}") for i in range(6)])
    datasets.DatasetDict({"test": chats.select(range(2)), "train": chats}).save_to_disk(str(tmp_path / "dict"))
    assert [r.messages[1][1] for r in read_records(tmp_path / "dict")] == [f"a{i}" for i in range(6)]


def test_text_field_and_a_config_files_columns_are_checked_mappings():
    """``dataset_text_field`` (``--text-field``) is ``--columns COLUMN=text``; a config file's ``columns`` mapping
    is checked as the flag's is, before anything loads."""
    from lazytrain.app.config import FinetuneConfig
    from lazytrain.app.finetune.run import _settled
    cfg, _ = _settled(FinetuneConfig(data="x.parquet", text_field="body", columns={"title": "prompt"}))
    assert cfg.columns == {"body": "text", "title": "prompt"}
    with pytest.raises(ValueError, match="'answer' is not a key we read"):
        _settled(FinetuneConfig(data="x.parquet", columns={"a": "answer"}))
    with pytest.raises(ValueError, match="columns must map column names to keys"):
        _settled(FinetuneConfig(data="x.parquet", columns=["question"]))
