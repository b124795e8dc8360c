"""``lazytrain train CONFIG.yaml [KEY=VALUE ...]`` (``app/config_file.py``): the keys are the settings of
``config.py`` under Hugging Face's names, values go through the flags' parsers, flags and arguments override the
file, and ``--print-config`` writes a file that reads back to the same run."""

import json

import pytest
import yaml

from lazytrain.app.cli import main
from lazytrain.app.config import FinetuneConfig, setting_of
from lazytrain.app.config_file import canonical_keys, settings_by_key

TINY = ["--eval-size", "8", "--policy", "keep-all", "--no-progress", "--device", "cpu", "--threads", "1"]


def _write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _printed(capsys, *argv) -> dict:
    assert main(["train", *argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_every_setting_with_a_flag_has_one_config_key():
    keys = canonical_keys()
    assert len(set(keys.values())) == len(keys)
    by_key = settings_by_key()
    for name, key in keys.items():
        assert by_key[key] == name and by_key[name] == name
    hf = {"model": "model_name_or_path", "output": "output_dir", "lr": "learning_rate", "steps": "max_steps",
          "epochs": "num_train_epochs", "warmup": "warmup_steps", "seq": "max_seq_length", "pack": "packing",
          "eval_every": "eval_steps", "evaluate": "do_eval"}
    for name, key in hf.items():
        assert keys[name] == key
    assert {"warmup_ratio", "lr_scheduler_type", "weight_decay", "max_grad_norm", "seed"} <= set(keys.values())


def test_a_yaml_config_with_overrides_trains(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = _write(tmp_path, f"""
# a run as a TRL user writes it
learning_rate: 1e-2          # YAML reads this as a string: the flag's parser takes it
max_steps: 9
output_dir: {out}
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
lr_scheduler_type: linear
warmup_ratio: 0.25
seed: 5
time_limit_min: null
""")
    assert main(["train", cfg, "max_steps=3", "seed=7", *TINY, "--lr", "0.02"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    s = m["settings"]
    assert (s["steps"], s["seed"], s["lr"], s["batch"]) == (3, 7, 0.02, 4)   # arguments and flags over the file
    assert (s["lr_scheduler_type"], s["warmup_ratio"], s["time_limit_min"]) == ("linear", 0.25, None)
    assert m["steps_done"] == 3 and m["peak_lr"] == pytest.approx(0.02)
    assert "difficulty" in s and "loss_on_prompt" in s      # a task run records its task


def test_print_config_reads_back_to_the_same_config(tmp_path, capsys):
    first = _printed(capsys, _write(tmp_path, "learning_rate: 3e-4\ngpu_memory: 24GiB\nresident: [0, 1]\n"),
                     "--data", "x.jsonl", "--pack")
    assert first["learning_rate"] == 3e-4 and first["gpu_memory"] == 24 << 30 and first["resident"] == [0, 1]
    assert first["packing"] is True and first["train_file"] == "x.jsonl"
    assert set(first) == set(canonical_keys().values())
    again = _printed(capsys, _write(tmp_path, yaml.safe_dump(first), "printed.yaml"))
    assert again == first


@pytest.mark.parametrize("text,argv,said", [
    ("learnin_rate: 1e-3\n", [], "run.yaml:1: unknown key 'learnin_rate'; did you mean 'learning_rate'?"),
    ("max_steps: 3\nlearning_rate: -1\n", [], "run.yaml:2: learning_rate: must be positive"),
    ("gpu_memory: lots\n", [], "run.yaml:1: gpu_memory:"),
    ("policy: fast\n", [], "policy is one of milp, megatrain"),
    ("packing: 3\n", [], "packing is true or false"),
    ("lr: 1e-3\nlearning_rate: 2e-3\n", [], "sets the same setting as"),
    ("- a\n- b\n", [], "a config file is a mapping"),
    ("max_steps: [1\n", [], "run.yaml:2: not valid YAML"),
    ("max_steps: 3\n", ["--steps", "4", "max_steps=5"], "max_steps is also given as a flag"),
    ("gradient_accumulation_steps: 4\n", [], "gradient_accumulation_steps needs per_device_train_batch_size"),
    ("per_device_train_batch_size: 4\nglobal_batch_size: 8\n", [], "give one"),
    ("max_steps: 3\n", ["oops"], "expected KEY=VALUE"),
])
def test_a_bad_config_is_one_line(tmp_path, capsys, text, argv, said):
    path = _write(tmp_path, text)
    assert main(["train", path, *argv, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_no_file_but_key_values_and_missing_file(tmp_path, capsys):
    assert _printed(capsys, "max_steps=12", "learning_rate=0.5")["max_steps"] == 12
    assert main(["train", str(tmp_path / "nope.yaml"), "--print-config"]) == 2
    assert "no such config file" in capsys.readouterr().err


def test_per_device_batch_counts_the_processes(tmp_path, capsys):
    path = _write(tmp_path, "per_device_train_batch_size: 3\ngradient_accumulation_steps: 2\nnproc: 2\n")
    printed = _printed(capsys, path)
    assert printed["global_batch_size"] == 12 and printed["nproc"] == 2
    assert _printed(capsys, path, "--batch", "4")["global_batch_size"] == 4       # the flag over the file


def test_the_config_keys_are_in_the_readme():
    """The README's config-file section names every key (it is written from ``canonical_keys``)."""
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [k for k in canonical_keys().values() if f"`{k}`" not in readme]
    assert not missing, missing
    for f in ("gpus", "per_device_train_batch_size", "gradient_accumulation_steps"):
        assert f"`{f}`" in readme
    assert all(setting_of(FinetuneConfig.__dataclass_fields__[n]).help for n in canonical_keys())
