"""Loading a rank's shard of a safetensors folder (``runtime.weights``): pieces read by rows equal the
tensors' slices, a rank's initial shard equals the one cut from the whole model, and a trainer of a
meta-device model trains and evaluates like one of the loaded model."""

from __future__ import annotations

import pytest
import torch

import lazytrain
from lazytrain.frontend.presets import build_from_config
from lazytrain.hf.model_loading import from_pretrained, shard_loadable
from lazytrain.runtime.shards import gathered_layouts, init_shards, shard_layouts
from lazytrain.runtime.trainer import Trainer
from lazytrain.runtime.weights import ModelWeights, SafetensorsWeights

CFG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 160,
       "max_position_embeddings": 64, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    build_from_config(CFG, device="cpu", dtype=torch.float32).save_pretrained(out)
    return out


def test_pieces_read_by_rows_are_the_tensors_slices(folder):
    whole = from_pretrained(folder)
    model, weights = shard_loadable(folder)
    assert all(p.device.type == "meta" for p in model.parameters())
    mine = ModelWeights(whole)
    g = torch.Generator().manual_seed(2)
    for name, p in whole.named_parameters():
        n = p.numel()
        for _ in range(3):
            a = int(torch.randint(0, n, (1,), generator=g))
            b = int(torch.randint(a + 1, n + 1, (1,), generator=g))
            assert torch.equal(weights.piece(name, a, b), mine.piece(name, a, b)), (name, a, b)


def test_a_missing_or_misshapen_weight_is_one_line_naming_it(folder, tmp_path):
    wrong = build_from_config({**CFG, "intermediate_size": 128}, device="meta", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"do not match config.json: model.layers.0.mlp.gate_proj.weight "
                                         r"\(weights \(96, 64\), config \(128, 64\)\)"):
        SafetensorsWeights(folder, wrong)
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        SafetensorsWeights(tmp_path, wrong)


class _Setup:
    """Records what ``init_shards`` gives the optimizer."""

    def __init__(self):
        self.got = {}

    def setup(self, j, init, buf, segs):
        self.got[j] = init.clone()


def test_each_ranks_initial_shard_read_from_the_folder_equals_the_one_cut_from_the_model(folder):
    whole = from_pretrained(folder)
    model, weights = shard_loadable(folder)
    plan = lazytrain.compile(model, batch_size=1, seq_len=16, hardware="cpu", policy="megatrain",
                             param_dtype="float32", optimizer="adamw", world_size=2)
    gathered = gathered_layouts(plan.graph, 2)
    for r in range(2):
        lays = shard_layouts(gathered, 2, r)
        got = []
        for src in (weights, ModelWeights(whole)):
            rec = _Setup()
            bufs = {j: torch.empty(lay.owned_numel) for j, lay in enumerate(lays)}
            init_shards(src, gathered, lays, 2, r, rec, bufs)
            got.append(rec.got)
        assert got[0].keys() == got[1].keys() and all(torch.equal(got[0][j], got[1][j]) for j in got[0])


def test_a_meta_model_with_its_folders_weights_trains_and_evaluates_like_the_loaded_model(folder):
    whole = from_pretrained(folder)
    model, weights = shard_loadable(folder)
    plan = lazytrain.compile(whole, batch_size=2, seq_len=16, hardware="cpu", policy="megatrain",
                             param_dtype="float32", optimizer="adamw")
    ids = torch.randint(0, 160, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for m, w in ((whole, None), (model, weights)):
        tr = Trainer(m, plan, optimizer=lazytrain.optim.TorchAdamW(lr=1e-3), device="cpu", verbose=False, weights=w)
        losses.append([tr.step((ids, ids)).loss for _ in range(2)])
        tr.sync_to_model()
    assert losses[0] == losses[1]
    assert model.lm_head.weight is model.model.embed_tokens.weight       # the tie kept through to_empty
    with torch.no_grad():
        assert torch.equal(model(ids).logits, whole(ids).logits)
