"""Dataset files in every accepted format, the label masks the chat template and the loss setting give,
truncation, the held-out split and the batch stream."""

from __future__ import annotations

import json

import pytest

from lazytrain.data import Batches, DataError, Encoder, fit, held_out, pack_rows, parse_record, read_records
from lazytrain.data.encode import IGNORE

pytest.importorskip("transformers")
from ft_fixtures import chat, tiny_tokenizer, write_jsonl  # noqa: E402

RECORDS = [
    chat("hi", "12"),
    {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "a"},
                       {"from": "gpt", "value": "b"}, {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]},
    {"prompt": "2+2=", "completion": "4"},
    {"instruction": "Add", "input": "1 and 2", "output": "3"},
    {"instruction": "Say yes", "output": "yes"},
    {"text": "plain words"},
    {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "r"}]},
]


def _labelled(tok, ex) -> str:
    return "".join(tok.decode([i]) for i, lab in zip(ex.ids, ex.labels) if lab != IGNORE)


def test_every_format_is_read_from_jsonl_and_json(tmp_path):
    a = read_records(write_jsonl(tmp_path / "a.jsonl", RECORDS))
    (tmp_path / "b.json").write_text(json.dumps(RECORDS))
    b = read_records(tmp_path / "b.json")
    assert [r.format for r in a] == ["messages", "conversations", "completion", "alpaca", "alpaca", "text",
                                     "completion"]
    assert [r.messages for r in a] == [r.messages for r in b] and a[0].where.endswith("a.jsonl:1")
    assert a[1].messages[0] == ("system", "be brief") and a[1].messages[-1] == ("assistant", "d")
    assert a[3].messages == (("user", "Add\n\n1 and 2"), ("assistant", "3"))
    assert a[4].messages[0] == ("user", "Say yes") and a[5].completion == "plain words"
    assert a[6].messages == (("user", "q"), ("assistant", "r"))


@pytest.mark.parametrize("line, words", [
    ('{"question": "x", "answer": "y"}',
     ["a.jsonl:2", "no known format", "keys: answer, question", "prompt/completion"]),
    ('{"text": 3}', ["a.jsonl:2", "'text' must be a string"]),
    ('[1, 2]', ["a.jsonl:2", "must be a JSON object"]),
    ('{"messages": [{"role": "user", "content": "x"}]}', ["a.jsonl:2", "no assistant turn"]),
    ('{"messages": [{"role": "bot", "content": "x"}]}', ["a.jsonl:2", "role 'bot'"]),
    ('{"text": "x"', ["a.jsonl:2", "not valid JSON"]),
])
def test_a_bad_record_is_one_error_naming_the_line(tmp_path, line, words):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        read_records(path)
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_records(tmp_path / "none.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no examples"):
        read_records(tmp_path / "e.jsonl")


def test_chat_labels_are_the_assistant_turns_with_the_templates_end_of_turn():
    tok = tiny_tokenizer()
    enc = Encoder(tok)
    two = parse_record(RECORDS[1], "x")
    ex = enc.encode(two)
    # both replies, each closed by the template's end-of-turn (not the eos), nothing of the prompt
    assert _labelled(tok, ex) == "b<|im_end|>\nd<|im_end|>\n"
    assert tok.decode(list(ex.ids)) == enc.render(two.messages)
    assert tok.decode(list(ex.prompt_ids)).endswith("c<|im_end|>\n<|im_start|>assistant\n")
    assert list(ex.ids[:len(ex.prompt_ids)]) == list(ex.prompt_ids) and ex.reference == "d"
    assert enc.end_of_turn_id() == tok.convert_tokens_to_ids("<|im_end|>") != tok.eos_token_id
    assert enc.stop_ids() == [tok.eos_token_id, enc.end_of_turn_id()]
    every = Encoder(tok, loss_on="all").encode(two)
    assert every.ids == ex.ids and every.labels == every.ids


def test_completion_text_and_alpaca_labels():
    tok = tiny_tokenizer()
    enc = Encoder(tok)
    comp = enc.encode(parse_record(RECORDS[2], "x"))
    assert _labelled(tok, comp) == "4<|endoftext|>" and tok.decode(list(comp.prompt_ids)) == "2+2="
    text = enc.encode(parse_record(RECORDS[5], "x"))
    assert _labelled(tok, text) == "plain words<|endoftext|>" and text.prompt_ids == ()
    alpaca = enc.encode(parse_record(RECORDS[3], "x"))          # through the chat template
    assert _labelled(tok, alpaca) == "3<|im_end|>\n"
    plain = Encoder(tiny_tokenizer(template=None))               # no template: the Alpaca prompt
    ex = plain.encode(parse_record(RECORDS[3], "x"))
    assert "### Instruction:\nAdd\n\n1 and 2" in tok.decode(list(ex.ids)) and _labelled(tok, ex) == "3<|endoftext|>"
    with pytest.raises(DataError, match="has none"):
        plain.encode(parse_record(RECORDS[0], "f.jsonl:1"))


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # drops the last assistant turn's content from the prefix rendering: not prefix-consistent
    odd = ("{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}{{ '>' + m['content'] }}"
           "{% else %}{{ m['role'] + ':' + m['content'] + ';' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
    enc = Encoder(tiny_tokenizer(template=odd))
    with pytest.raises(DataError, match="prefix of the whole"):
        enc.encode(parse_record(RECORDS[1], "f.jsonl:2"))


def test_truncate_and_drop():
    tok = tiny_tokenizer()
    ex = Encoder(tok).encode(parse_record({"prompt": "abc", "completion": "defgh"}, "x"))
    cut = fit(ex, 5, "truncate")
    assert cut.ids == ex.ids[:5] and cut.labels == ex.labels[:5]
    assert fit(ex, 5, "drop") is None and fit(ex, 100, "drop") is ex
    assert fit(ex, 3, "truncate") is None          # nothing left to learn


def test_held_out_split_is_fixed_by_content():
    keys = [f"example {i % 40}" for i in range(100)]           # 40 distinct, repeated
    train, evals = held_out(list(range(100)), keys, 10)
    train2, evals2 = held_out(list(reversed(range(100))), list(reversed(keys)), 10)
    assert sorted(evals) == sorted(evals2) and len(evals) >= 10 and len(train) + len(evals) == 100
    assert not {keys[i] for i in evals} & {keys[i] for i in train}


def test_pack_rows_and_batches_are_deterministic():
    assert pack_rows([5, 7, 4, 9, 3], 16) == [[0, 1, 2], [3, 4]]     # best fit: each into the fullest row it fits
    rows = pack_rows([5, 7, 4, 9, 3, 16], 16)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum([5, 7, 4, 9, 3, 16][i] for i in r) <= 16 for r in rows) and len(rows) == 3
    tok = tiny_tokenizer()
    enc = Encoder(tok)
    exs = [enc.encode(parse_record({"prompt": "q" * (i % 5), "completion": "a" * (1 + i % 3)}, "x"))
           for i in range(30)]
    b1 = Batches(exs, 4, 24, tok.pad_token_id, pack=True, seed=3)
    b2 = Batches(exs, 4, 24, tok.pad_token_id, pack=True, seed=3)
    for step in (0, 1, b1.steps_per_epoch + 1):
        x, y = b1.batch(step), b2.batch(step)
        assert all((x[k] == y[k]).all() for k in x)
    pad = b1.padding()
    assert 0 <= pad["packed"] < pad["unpacked"] < 1
    seen = sum(int((b1.batch(s)["labels"] != IGNORE).sum()) for s in range(b1.steps_per_epoch))
    want = sum(sum(v != IGNORE for v in e.labels[1:]) for e in exs)
    assert seen == want           # every label of an epoch is trained on once (first tokens carry none)
