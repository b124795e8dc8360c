"""LoRA export (hf/adapter_export.py): the adapter folder loads in PEFT with the trained logits, and the merged
folder loads in transformers with the logits of PEFT's merge_and_unload; sharded and tied bases, rsLoRA,
fan_in_fan_out (GPT-2's Conv1D), a base from Weight records; bad inputs are one-line errors."""

import json

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from lazytrain.hf.adapter_export import (  # noqa: E402
    AdapterError,
    adapter_state,
    base_weights,
    check_mergeable,
    merge_into_folder,
    write_adapter,
)
from lazytrain.hf.export import hf_config, module_weights  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 127], [3, 3, 4, 8, 2, 90, 11, 0]])


def _llama(tie: bool):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Tiny Llama folders: untied in one file, untied in small shards, tied."""
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for name, tie, shard in (("plain", False, "5GB"), ("sharded", False, "60KB"), ("tied", True, "5GB")):
        _llama(tie).save_pretrained(root / name, max_shard_size=shard)
        out[name] = root / name
    assert len(list(out["sharded"].glob("model-*.safetensors"))) > 3
    assert not (root / "plain" / "model.safetensors.index.json").exists()
    return out


def _load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _lora(base_folder, **kw):
    """A PeftModel over the base folder with random nonzero adapters, and its trained tensors by name."""
    pm = get_peft_model(_load(base_folder), LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                                          "target_modules": "all-linear", **kw}))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:                    # lora_B is zero at init: make every adapter count
                p.copy_(torch.randn_like(p) * 0.05)
    pm.eval()
    return pm, {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_adapter_folder_loads_in_peft_with_the_trained_logits(bases, tmp_path):
    pm, tensors = _lora(bases["plain"])
    folder = write_adapter(tmp_path / "adapter", pm, tensors, base_model_name_or_path="my/base")
    loaded = PeftModel.from_pretrained(_load(bases["plain"]), folder).eval()
    torch.testing.assert_close(_logits(loaded), _logits(pm), atol=1e-6, rtol=0)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "my/base" and cfg["inference_mode"] is True and cfg["r"] == 4
    pm.save_pretrained(tmp_path / "peft")            # the keys PEFT itself writes
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(folder / "adapter_model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
    # bf16 on request, and the folder is replaced in place
    write_adapter(folder, pm, tensors, base_model_name_or_path="my/base", dtype=torch.bfloat16)
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


@pytest.mark.parametrize("base,kw", [("plain", {}), ("sharded", {"use_rslora": True}), ("tied", {})])
def test_merged_folder_gives_the_logits_of_merge_and_unload(bases, tmp_path, base, kw):
    pm, tensors = _lora(bases[base], **kw)
    out = merge_into_folder(tmp_path / "merged", bases[base], adapter_state(pm, tensors), pm.peft_config["default"],
                            torch.float32, max_shard_bytes=100_000)
    want = _logits(pm.merge_and_unload())
    torch.testing.assert_close(_logits(_load(out)), want, atol=1e-5, rtol=0)
    assert len(list(out.glob("model-*.safetensors"))) > 3           # written in several shards
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in index) is (base != "tied")           # a tied weight stays once
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is (base == "tied")
    assert not any("lora" in k or "base_layer" in k for k in index)


def test_merge_from_the_trainers_weights(bases, tmp_path):
    """A base that exists only as Weight records under the PeftModel's names (the trainer's host store)."""
    pm, tensors = _lora(bases["tied"])
    weights = base_weights(pm, module_weights(pm))
    assert {w.name for w in weights} == set(_load(bases["tied"]).state_dict()) - {"lm_head.weight"}
    out = merge_into_folder(tmp_path / "merged", weights, tensors, pm.peft_config["default"], torch.float32,
                            config=hf_config(pm.get_base_model().config))
    want = _logits(pm.merge_and_unload())
    torch.testing.assert_close(_logits(_load(out)), want, atol=1e-5, rtol=0)


def test_fan_in_fan_out_conv1d_is_merged_transposed(tmp_path):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=16)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    pm, tensors = _lora(tmp_path / "gpt2", target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    out = merge_into_folder(tmp_path / "merged", tmp_path / "gpt2", adapter_state(pm, tensors),
                            pm.peft_config["default"], torch.float32)
    want = _logits(pm.merge_and_unload())
    torch.testing.assert_close(_logits(_load(out)), want, atol=1e-5, rtol=0)


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_bad_inputs_are_one_line_errors(bases, tmp_path):
    pm, tensors = _lora(bases["sharded"])
    state = adapter_state(pm, tensors)
    config = pm.peft_config["default"]
    # adapter names that match no base weight (another model's layers)
    other = {k.replace("layers.1.", "layers.7."): v for k, v in state.items()}
    with pytest.raises(AdapterError) as e:
        merge_into_folder(tmp_path / "m", bases["sharded"], other, config, torch.float32)
    _one_line(e, "model.layers.7.", "matches no base weight")
    with pytest.raises(AdapterError) as e:
        merge_into_folder(tmp_path / "m", bases["sharded"], {"base_model.model.x.weight": torch.ones(2, 2)}, config,
                          torch.float32)
    _one_line(e, "is not a LoRA matrix")
    # a base folder missing a shard
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bases["sharded"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    sorted(broken.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(AdapterError) as e:
        merge_into_folder(tmp_path / "m", broken, state, config, torch.float32)
    _one_line(e, "is missing", "model.safetensors.index.json names it")
    assert not (tmp_path / "m").exists() and list(tmp_path.iterdir()) == [broken]
    # tensors that are not the model's adapter, or not all of it
    with pytest.raises(AdapterError) as e:
        write_adapter(tmp_path / "a", pm, {**tensors, "base_model.model.lm_head.weight": torch.ones(128, 64)},
                      base_model_name_or_path="b")
    _one_line(e, "lm_head.weight is not a parameter of adapter 'default'")
    with pytest.raises(AdapterError) as e:
        write_adapter(tmp_path / "a", pm, dict(list(tensors.items())[1:]), base_model_name_or_path="b")
    _one_line(e, "the adapter tensors lack")
    # a folder that is not an adapter folder is not replaced
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    with pytest.raises(AdapterError) as e:
        write_adapter(tmp_path / "keep", pm, tensors, base_model_name_or_path="b")
    _one_line(e, "is not an adapter folder")


def test_lm_head_tied_to_the_embeddings_is_refused(bases, tmp_path):
    pm, tensors = _lora(bases["tied"], target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterError) as e:
        merge_into_folder(tmp_path / "m", bases["tied"], adapter_state(pm, tensors), pm.peft_config["default"],
                          torch.float32)
    _one_line(e, "lm_head.weight", "tied to the input embeddings")


@pytest.mark.parametrize("kw,words", [({"use_dora": True}, "use_dora"), ({"bias": "lora_only"}, "bias='lora_only'"),
                                      ({"init_lora_weights": "pissa"}, "changed the base weights"),
                                      ({"modules_to_save": ["lm_head"]}, "modules_to_save")])
def test_lora_variants_with_another_merge_are_refused(kw, words):
    with pytest.raises(AdapterError) as e:
        check_mergeable(LoraConfig(r=4, target_modules=["q_proj"], **kw))
    _one_line(e, "cannot merge", words)
