"""A caller's mistakes are one clear error (or warning) naming the argument, never a traceback from deep inside."""

import pytest
import torch

from lazytrain import compile
from lazytrain.app.cli import main
from lazytrain.compiler.budgets import BudgetError
from lazytrain.frontend.presets import build_model

KW = dict(batch_size=4, seq_len=64, hardware="cpu", gpu_memory="2GiB")


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", device="meta")


@pytest.mark.parametrize("over, message", [
    (dict(param_dtype="int8"), r"^param_dtype must be one of bfloat16, float16, float32"),
    (dict(hardware=None), r"^hardware must be a profile's name"),
    (dict(time_limit="5"), r"^time_limit must be a positive number"),
    (dict(time_limit=-1), r"^time_limit must be a positive number"),
    (dict(gpu_memory=-5), r"^gpu_memory: a size must be positive"),
    (dict(host_memory=2.5), r"^host_memory: needs a size like 24GiB"),
    (dict(seq_len=1), r"^seq_len must be at least 2 for a language model"),
])
def test_bad_arguments_are_named(tiny, over, message):
    with pytest.raises(ValueError, match=message):
        compile(tiny, **{**KW, **over})


def test_a_torch_dtype_is_taken_by_its_name(tiny):
    assert compile(tiny, **KW, param_dtype=torch.float32).param_dtype == "float32"


@pytest.mark.parametrize("model, message", [
    (None, r"^model must be a torch.nn.Module, .* got NoneType None"),
    (5, r"^model must be a torch.nn.Module"),
    (torch.nn.Linear, r"^model is the class Linear, not a model: pass an instance"),
])
def test_what_is_not_a_model_is_named(model, message):
    with pytest.raises(ValueError, match=message):
        compile(model, **KW)


def test_a_config_object_is_not_a_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000)
    with pytest.raises(ValueError, match=r"^model is a Qwen2Config, a configuration: build the model from it"):
        compile(cfg, **KW)


def test_sizes_too_small_for_gib_are_stated_in_their_own_unit(tiny):
    with pytest.raises(BudgetError, match=r"GPU memory 24 B is below the reserve of 1\.5 GiB \('24' has no unit, "
                                          r"so it is bytes: write e\.g\. 24GiB\)"):
        compile(tiny, **{**KW, "gpu_memory": "24"})
    with pytest.raises(BudgetError, match=r"needs at least [\d.]+ GiB of host memory .* the budget is 1\.0 KiB"):
        compile(tiny, **{**KW, "host_memory": "1KiB"})


def test_a_gpu_budget_beyond_the_profiles_gpu_is_one_warning_line(tmp_path, capsys):
    assert main(["compile", "tiny", "--batch", "4", "--seq", "64", "--gpu-memory", "1TiB", "--policy", "megatrain",
                 "-o", str(tmp_path / "p.json")]) == 0
    err = capsys.readouterr().err
    assert ("lazytrain compile: warning: GPU memory 1.0 TiB is more than the 139.0 GiB of the h200 profile's NVIDIA "
            "H200") in err
    assert ".py:" not in err            # not Python's form: no source file and line


@pytest.mark.parametrize("model_type, extra, message", [("bert", {"is_decoder": False}, "with is_decoder false"),
                                                        ("bart", {}, "is an encoder-decoder")])
def test_encoders_are_refused_not_trained_as_leaky_decoders(tmp_path, model_type, extra, message):
    """BERT's causal-LM class is causal only with ``is_decoder``: it is built so, with one warning, and refused
    where the config turns it off (its next-token loss would see the token it predicts).  BART's causal-LM
    class is its decoder alone: refused."""
    pytest.importorskip("transformers")
    import json
    cfg = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512, "d_model": 64,
           "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(ValueError, match=message):
        compile(str(tmp_path), **{**KW, "policy": "megatrain"})
    if model_type == "bert":
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.warns(UserWarning, match="built as a causal decoder"):
            assert compile(str(tmp_path), **{**KW, "policy": "megatrain"}).graph.n_blocks >= 3
