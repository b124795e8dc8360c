"""The built-in arithmetic task: generation, split, tokenizer, batching and exact-match decoding."""

import random
import re

import pytest
import torch

from lazytrain.tasks import (
    IGNORE,
    PRESETS,
    CharTokenizer,
    Example,
    StepKind,
    collate,
    encode_example,
    eval_examples,
    exact_match,
    greedy_generate,
    predict,
    shifted_cross_entropy,
    train_batches,
)
from lazytrain.tasks.arith import drill_examples, final_answer, n_tokens, take_train

TOK = CharTokenizer()
OPS = {  # an evaluator of its own, so the test does not trust Step.apply
    StepKind.ADD: lambda c, a, b: c + a,
    StepKind.SUB: lambda c, a, b: c - a,
    StepKind.ADD_GROUPS: lambda c, a, b: c + a * b,
    StepKind.MUL: lambda c, a, b: c * a,
    StepKind.DIV: lambda c, a, b: c / a,
}


@pytest.mark.parametrize("name", PRESETS)
def test_same_seed_same_problems_other_seed_other_problems(name):
    assert [e.text for e in take_train(200, name, seed=3)] == [e.text for e in take_train(200, name, seed=3)]
    assert [e.text for e in take_train(200, name, seed=3)] != [e.text for e in take_train(200, name, seed=4)]
    assert [e.text for e in eval_examples(100, name, seed=1)] == [e.text for e in eval_examples(100, name, seed=1)]
    a, b = next(train_batches(8, difficulty=name, seed=5)), next(train_batches(8, difficulty=name, seed=5))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


@pytest.mark.parametrize("name", PRESETS)
def test_eval_arithmetic_never_in_train(name):
    evals = eval_examples(300, name)
    assert len({e.problem.key for e in evals}) == 300
    train = [e for seed in range(3) for e in take_train(3000, name, seed=seed)]
    assert not {e.problem.key for e in evals} & {e.problem.key for e in train}
    assert not {e.prompt for e in evals} & {e.prompt for e in train}
    assert all(e.problem.in_eval for e in evals) and not any(e.problem.in_eval for e in train)
    # the split is by arithmetic, so it holds across difficulties too
    other = [e for n in PRESETS for e in take_train(1000, n)]
    assert not {e.problem.key for e in evals} & {e.problem.key for e in other}


@pytest.mark.parametrize("name", PRESETS)
def test_answers_recomputed_and_numbers_match_the_english(name):
    d = PRESETS[name]
    for ex in take_train(500, name) + eval_examples(100, name):
        count, numbers = ex.problem.start, [ex.problem.start]
        for step in ex.problem.steps:
            count = OPS[step.kind](count, step.a, step.b)
            assert count == int(count) and 0 <= count <= d.max_answer, ex.text
            numbers += [step.a, step.b] if step.kind is StepKind.ADD_GROUPS else [step.a]
        assert ex.answer == str(int(count)) == final_answer(ex.solution)
        assert_solution_is_worked(ex)
        assert [int(x) for x in re.findall(r"\d+", ex.question.replace("1/", "/"))] == numbers, ex.text
        assert d.n_steps[0] <= len(ex.problem.steps) <= d.n_steps[1]
        assert n_tokens(ex) == len(encode_example(ex, TOK)[0]) <= d.seq_len


def assert_solution_is_worked(ex):
    """One true equation per operation (a product, then a sum, for "packs of"), the running count on
    the left of each, the last result the answer."""
    sign = {StepKind.ADD: "+", StepKind.SUB: "-", StepKind.MUL: "*", StepKind.DIV: "/"}
    equations, count = iter(ex.solution.split(", ")), ex.problem.start
    for step in ex.problem.steps:
        if step.kind is StepKind.ADD_GROUPS:
            assert next(equations) == f"{step.a}*{step.b}={step.a * step.b}", ex.solution
        after = int(OPS[step.kind](count, step.a, step.b))
        if step.kind is StepKind.ADD_GROUPS:
            want = f"{count}+{step.a * step.b}={after}"
        else:
            want = f"{count}{sign[step.kind]}{step.a}={after}"
        assert next(equations) == want, ex.solution
        count = after
    assert next(equations, None) is None and str(count) == ex.answer


def test_presets_scale_up():
    easy, hard = PRESETS["easy"], PRESETS["hard"]
    assert easy.seq_len <= 144 and max(len(e.answer) for e in take_train(2000, "easy")) <= 3
    assert hard.n_steps[0] > easy.n_steps[1] - 1 and hard.max_digits > easy.max_digits
    kinds = {s.kind for e in take_train(2000, "hard") for s in e.problem.steps}
    assert kinds == set(StepKind)


def test_tokenizer_round_trip():
    text = "".join(chr(c) for c in range(32, 127))
    ids = TOK.encode(text, bos=True, eos=True)
    assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id and len(ids) == len(text) + 2
    assert TOK.decode(ids) == text
    assert TOK.decode(ids, skip_special=False) == f"<bos>{text}<eos>"
    assert max(ids) == TOK.vocab_size - 1 == 97
    assert len({TOK.pad_id, TOK.bos_id, TOK.eos_id}) == 3
    for ex in take_train(50):
        assert TOK.decode(TOK.encode(ex.text)) == ex.text
    with pytest.raises(ValueError, match="alphabet"):
        TOK.encode("caf\u00e9")


@pytest.mark.parametrize("loss_on_prompt", [False, True])
def test_labels_mask(loss_on_prompt):
    examples = take_train(16)
    batch = collate(examples, 144, loss_on_prompt=loss_on_prompt)
    assert batch.input_ids.shape == batch.labels.shape == (16, 144)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
    for row, ex in enumerate(examples):
        ids, n_prompt = encode_example(ex, TOK)
        assert batch.input_ids[row, :len(ids)].tolist() == ids
        assert (batch.input_ids[row, len(ids):] == TOK.pad_id).all()
        labels = batch.labels[row].tolist()
        assert labels[len(ids):] == [IGNORE] * (144 - len(ids))
        if loss_on_prompt:
            assert labels[:len(ids)] == ids
        else:
            assert labels[:n_prompt] == [IGNORE] * n_prompt
            assert TOK.decode(labels[n_prompt:len(ids)], skip_special=False) == ex.solution + "<eos>"
    with pytest.raises(ValueError, match="does not fit"):
        collate(examples, 40)


def test_shifted_loss_is_zero_only_on_the_answer():
    batch = collate(take_train(4), 144)
    sure = torch.full((4, 144, TOK.vocab_size), -30.0)
    sure[:, :-1].scatter_(2, batch.input_ids[:, 1:, None], 30.0)  # predicts every next token perfectly
    assert shifted_cross_entropy(sure, batch.labels) < 1e-6
    wrong = sure.clone()
    answer_start = (batch.labels[0] != IGNORE).nonzero()[0, 0]
    wrong[0, answer_start - 1] = 0.0  # unsure of the answer's first digit only
    assert shifted_cross_entropy(wrong, batch.labels) > 0.05   # ln(98) over ~40 labelled tokens
    prompt_unsure = sure.clone()
    prompt_unsure[:, 5] = 0.0  # unsure inside the prompt: no loss there
    assert shifted_cross_entropy(prompt_unsure, batch.labels) < 1e-6


def oracle(examples, answer_of=lambda ex: ex.solution):
    """generate_fn that is sure of the next token of ``prompt + answer_of(ex) + eos`` and puts garbage on
    padding, so reading any row at a wrong position gives a wrong token."""
    targets = {ex.prompt: TOK.encode(ex.prompt + answer_of(ex), bos=True, eos=True) for ex in examples}

    def fn(input_ids):
        logits = torch.zeros(*input_ids.shape, TOK.vocab_size)
        logits[..., TOK.encode("#")[0]] = 1.0
        for row, ids in enumerate(input_ids.tolist()):
            n = len(ids) - ids[::-1].index(next(i for i in ids[::-1] if i != TOK.pad_id))
            text = TOK.decode(ids[:n])
            target = targets[text[:text.index(" A: ") + 4]]
            # sure at every position t < n where ids[:t + 1] is a prefix of the target and the target goes on:
            # the positions before the first difference (one indexed write, not one per position)
            k = 0
            while k < min(n, len(target) - 1) and ids[k] == target[k]:
                k += 1
            logits[row, torch.arange(k), torch.tensor(target[1:k + 1], dtype=torch.long)] = 5.0
        return logits
    return fn


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_exact_match_oracle_and_wrong(batch_size):
    examples = eval_examples(40, "medium")  # prompts of many lengths in one batch
    assert exact_match(oracle(examples), examples, batch_size) == 1.0
    assert predict(oracle(examples), examples, batch_size) == [ex.solution for ex in examples]
    off_by_one = oracle(examples, lambda ex: ex.solution.rsplit("=", 1)[0] + f"={int(ex.answer) + 1}")
    assert exact_match(off_by_one, examples, batch_size) == 0.0
    no_eos = oracle(examples, lambda ex: ex.solution + "0" * 30)  # right digits, never stops in time
    assert exact_match(no_eos, examples, batch_size) == 0.0
    bare = oracle(examples, lambda ex: ex.answer)                  # the answer alone still counts
    assert exact_match(bare, examples, batch_size) == 1.0
    half = oracle(examples, lambda ex: ex.solution if ex.problem.start % 2 else ex.solution + "1")
    assert exact_match(half, examples, batch_size) == sum(ex.problem.start % 2 for ex in examples) / 40


def test_greedy_generate_batched_equals_one_by_one():
    torch.manual_seed(0)
    emb, prev = torch.randn(TOK.vocab_size, TOK.vocab_size), torch.randn(TOK.vocab_size, TOK.vocab_size)

    def causal(input_ids):  # logits[t] depend on tokens t and t-1 only
        shifted = torch.cat([torch.zeros_like(input_ids[:, :1]), input_ids[:, :-1]], 1)
        return emb[input_ids] + prev[shifted]

    rng = random.Random(0)
    prompts = [[TOK.bos_id] + [rng.randrange(3, TOK.vocab_size) for _ in range(rng.randint(0, 12))] for _ in range(9)]
    batched = greedy_generate(causal, prompts, 6)
    assert batched == [greedy_generate(causal, [p], 6)[0] for p in prompts]
    assert all(1 <= len(b) <= 6 and (len(b) == 6 or b[-1] == TOK.eos_id) for b in batched)
    same_len = torch.tensor([p[:1] + [5] * 4 for p in prompts])
    assert greedy_generate(causal, same_len, 3) == greedy_generate(causal, same_len.tolist(), 3)


def test_example_sequence_format():
    ex = take_train(1)[0]
    assert isinstance(ex, Example)
    assert ex.prompt.startswith("Q: ") and ex.prompt.endswith("? A: ") and ex.text == ex.prompt + ex.solution
    ids, _ = encode_example(ex, TOK)
    assert TOK.decode(ids, skip_special=False) == f"<bos>Q: {ex.question} A: {ex.solution}<eos>"


def test_drills_fill_the_padding_with_whole_train_answers_in_stream_order():
    plain = next(train_batches(16, difficulty="tiny", seed=2, seq_len=88))
    drilled = next(train_batches(16, difficulty="tiny", seed=2, seq_len=88, drills=True))
    stream = drill_examples("tiny", seed=2)
    seen = 0
    for row in range(16):
        n = int((plain.input_ids[row] != TOK.pad_id).sum())
        # the word problem, its labels included, is the row it was without drills
        assert torch.equal(drilled.input_ids[row, :n], plain.input_ids[row, :n])
        assert torch.equal(drilled.labels[row, :n], plain.labels[row, :n])
        tail = TOK.decode(drilled.input_ids[row, n:], skip_special=False).replace("<pad>", "")
        drills = [d for d in tail.split("<eos>") if d]
        for d in drills:            # whole, in the drill stream's order, from train problems only
            ex = next(stream)
            assert d == "<bos>" + ex.solution and not ex.problem.in_eval
            a, op, b, c = re.fullmatch(r"<bos>(\d+)([+-])(\d+)=(\d+)", d).groups()
            assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        seen += len(drills)
        labels = drilled.labels[row, n:].tolist()
        ids = drilled.input_ids[row, n:].tolist()
        # labelled where a drill token follows a drill token; never a bos, never padding
        assert [x for x, t in zip(labels, ids) if x != IGNORE] == [t for t in ids if t not in (TOK.bos_id, TOK.pad_id)]
    assert seen >= 8                # ~0.8 a row: ~15% of a "tiny" row is padding
