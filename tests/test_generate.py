"""Evaluation by generation: greedy decoding with the KV cache equals decoding without it, answers are
extracted as documented, and a model fine-tuned on chat data stops at the chat template's end-of-turn."""

from __future__ import annotations

import pytest
import torch

import lazytrain
from lazytrain.data import Batches, Encoder, parse_record
from lazytrain.hf.generate import extract, greedy_generate, same_answer

pytest.importorskip("transformers")
from ft_fixtures import chat, tiny_folder, tiny_tokenizer  # noqa: E402


def _no_cache_greedy(model, prompt, n, stops):
    ids = list(prompt)
    out = []
    for _ in range(n):
        nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if nxt in stops:
            return out, True
        out.append(nxt)
        ids.append(nxt)
    return out, False


@torch.no_grad()
def test_kv_cache_decoding_of_a_left_padded_batch_equals_decoding_each_prompt_alone(tmp_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_folder(tmp_path / "m", tokenizer=False)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (3, 9, 5, 1)]
    stops = {7, 11}
    got = greedy_generate(model, prompts, max_new_tokens=12, stop_ids=stops, pad_id=0, batch_size=3)
    for p, r in zip(prompts, got):
        assert (r.tokens, r.stopped) == _no_cache_greedy(model, p, 12, stops)


def test_answer_extraction():
    assert extract("2*6=12, 56+12=68") == "68" and extract("it is 1,234 now") == "1234"
    assert extract("no number") is None and extract("-3 and 4.5") == "4.5"
    assert same_answer("so 23 - 9 = 14", "23-9=14") and not same_answer("23 - 9 = 11", "23-9=14")
    assert same_answer("Answer: B", "B", r"Answer: (\w)") and same_answer(" yes ", "yes")
    assert not same_answer("the answer is C", "Answer: B", r"answer is (\w)")


def test_a_chat_fine_tune_stops_at_the_templates_end_of_turn(tmp_path):
    """The reply's target ends with the template's <|im_end|>, not the tokenizer's eos: after training,
    generation stops there, with exactly the reply (the pitfall of training on reply + eos)."""
    from transformers import AutoModelForCausalLM
    folder = tiny_folder(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = tiny_tokenizer()
    enc = Encoder(tok)
    pairs = [("2+3", "5"), ("4+4", "8"), ("1+6", "7"), ("9-2", "7")]
    exs = [enc.encode(parse_record(chat(q, a), "t")) for q, a in pairs]
    seq = max(len(e) for e in exs)
    batches = Batches(exs, 4, seq, tok.pad_token_id)
    plan = lazytrain.compile(model, batch_size=4, seq_len=seq, hardware="cpu", gpu_memory="2GiB",
                             param_dtype="float32", optimizer="adamw", policy="keep-all")
    with lazytrain.Trainer(model, plan, optimizer=lazytrain.optim.TorchAdamW(lr=2e-2), device="cpu",
                           verbose=False) as tr:
        # 300 steps: at this learning rate the trajectory turns on fp32 rounding (the loss head's single pass and
        # its recompute differ by ulps and reach 1e-3 at different steps); both have memorised the four by 300
        for step in range(300):
            tr.step(batches.batch(step))
        tr.sync_to_model()
    eot = enc.end_of_turn_id()
    assert eot != tok.eos_token_id
    replies = greedy_generate(model.eval(), [list(e.prompt_ids) for e in exs], max_new_tokens=8, stop_ids=[eot],
                              pad_id=tok.pad_token_id, vocab=len(tok))
    assert [tok.decode(r.tokens) for r in replies] == [a for _, a in pairs]
    assert all(r.stopped for r in replies)
