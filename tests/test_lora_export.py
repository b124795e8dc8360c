"""A LoRA run's export (issue #44, point 3): ``OUTPUT/adapter/`` (PEFT's folder, loaded by
``PeftModel.from_pretrained``) and with ``--merge`` ``OUTPUT/model/`` (the adapters merged into the base), from the
run and from ``lazytrain export`` of its checkpoint; fp32 on the CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("peft")

LORA = "r=4,alpha=8,targets=q_proj,k_proj,v_proj,o_proj"
ARGS = ["--batch", "4", "--eval-size", "2", "--policy", "keep-all", "--no-progress", "--device", "cpu",
        "--threads", "1", "--time-limit-min", "2", "--no-eval", "--steps", "2"]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def _folder_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(_tensors(f))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from ft_fixtures import chat, tiny_folder, write_jsonl

    from lazytrain.app.cli import main
    tmp = tmp_path_factory.mktemp("lora_export")
    base = tiny_folder(tmp / "hf")
    data = write_jsonl(tmp / "train.jsonl", [chat(f"{i}+{i % 7}=?", f"{i + i % 7}") for i in range(24)])
    out = tmp / "run"
    assert main(["train", *ARGS, "--model", str(base), "--data", str(data), "--output", str(out), "--lora", LORA,
                 "--merge"]) == 0
    return tmp, base, data, out


def _trained(base, out):
    """The reference: the base loaded by transformers, wrapped by PEFT with the run's LoRA config, and the
    checkpoint's adapter tensors (the trainer's state after the last step) put in by the PeftModel's own names."""
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                      lora_dropout=0.0))
    saved = {}
    meta = json.loads((out / "checkpoint" / "checkpoint.json").read_text())
    for name in meta["files"]:
        with safe_open(str(out / "checkpoint" / name), "pt") as f:
            saved.update({k.removeprefix("param."): f.get_tensor(k) for k in f.keys() if k.startswith("param.")})
    params = dict(model.named_parameters())
    assert saved and set(saved) == {n for n, p in params.items() if p.requires_grad}
    with torch.no_grad():
        for n, t in saved.items():
            params[n].copy_(t)
    return model


def test_a_lora_run_writes_the_adapter_and_the_merged_model_that_give_the_trained_logits(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    _tmp, base, _data, out = run
    m = json.loads((out / "metrics.json").read_text())
    assert m["adapter"] == str(out / "adapter") and m["export"] == str(out / "model")
    assert m["settings"]["merge"] is True
    adapter = out / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base) and cfg["r"] == 4
    assert (adapter / "tokenizer.json").is_file()               # the tokenizer beside the adapter
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    want = _logits(_trained(base, out), ids)
    plain = _logits(AutoModelForCausalLM.from_pretrained(base), ids)
    assert (want - plain).abs().max() > 1e-4                    # the adapters moved the logits: the check can fail
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    torch.testing.assert_close(_logits(peft_model, ids), want, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(out / "model")
    torch.testing.assert_close(_logits(merged, ids), want, atol=1e-5, rtol=0)
    assert (out / "model" / "tokenizer.json").is_file() and (out / "model" / "generation_config.json").is_file()


def test_lazytrain_export_of_a_lora_run_gives_the_same_folders(run):
    from lazytrain.app.cli import main
    tmp, _base, _data, out = run
    dest = tmp / "exported"
    assert main(["export", str(out), "-o", str(dest), "--merge"]) == 0
    a, b = _tensors(out / "adapter" / "adapter_model.safetensors"), _tensors(dest / "adapter" /
                                                                              "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (json.loads((dest / "adapter" / "adapter_config.json").read_text())
            == json.loads((out / "adapter" / "adapter_config.json").read_text()))
    a, b = _folder_tensors(out / "model"), _folder_tensors(dest / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    only = tmp / "adapter_only"                         # without --merge: the adapter folder alone, no base read
    assert main(["export", str(out), "-o", str(only)]) == 0
    assert (only / "adapter" / "adapter_model.safetensors").is_file() and not (only / "model").exists()


def test_export_merge_refuses_a_base_moved_or_changed_in_one_line(run, capsys):
    from lazytrain.app.cli import main
    tmp, base, _data, out = run
    moved = tmp / "hf_moved"
    shutil.copytree(base, moved)
    shutil.rmtree(base)
    try:
        assert main(["export", str(out), "-o", str(tmp / "x1"), "--merge"]) == 2
        err = capsys.readouterr().err.strip()
        assert "is not at" in err and len(err.splitlines()) == 1
        shutil.copytree(moved, base)
        weights = next(base.glob("*.safetensors"))
        with open(weights, "ab") as f:              # the same name, another size
            f.write(b"\0" * 8)
        assert main(["export", str(out), "-o", str(tmp / "x2"), "--merge"]) == 2
        err = capsys.readouterr().err.strip()
        assert "changed since the adapters were trained" in err and len(err.splitlines()) == 1
        assert not (tmp / "x2" / "model").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.copytree(moved, base)


def test_merge_without_lora_is_refused_before_training(run, capsys):
    from lazytrain.app.cli import main
    tmp, base, data, _out = run
    assert main(["train", *ARGS, "--model", str(base), "--data", str(data), "--output", str(tmp / "full"),
                 "--merge"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--merge merges LoRA adapters into their base: give --lora too" in err and len(err.splitlines()) == 1


def test_a_gguf_base_merges_from_the_trainers_copy_and_its_export_merge_is_refused(run, capsys):
    """A GGUF base (read whole by transformers): the run merges the trainer's 16-bit copy of the base, which gives
    the logits of the adapter on the base the GGUF holds; ``lazytrain export --merge`` of that run refuses."""
    pytest.importorskip("gguf")
    from ft_fixtures import write_gguf
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lazytrain.app.cli import main
    tmp, base, data, _out = run
    gguf = write_gguf(AutoModelForCausalLM.from_pretrained(base), tmp / "tiny.gguf")
    out = tmp / "gguf_run"
    assert main(["train", *ARGS, "--model", str(gguf), "--tokenizer", str(base), "--data", str(data), "--output",
                 str(out), "--lora", LORA, "--merge"]) == 0
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    want = _logits(_trained(base, out), ids)        # (the GGUF holds the folder's weights exactly: test_gguf.py)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "adapter")
    torch.testing.assert_close(_logits(adapted, ids), want, atol=1e-5, rtol=0)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(gguf)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out / "model"), ids), want, atol=1e-5,
                               rtol=0)
    capsys.readouterr()
    assert main(["export", str(out), "-o", str(tmp / "gguf_export"), "--merge"]) == 2
    err = capsys.readouterr().err.strip()
    assert "which transformers reads whole" in err and len(err.splitlines()) == 1
