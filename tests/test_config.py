"""``lazytrain train``'s settings are written once (``app/config.py``): the flags, the settings a resume keeps and
``metrics.json``'s settings come from the same fields."""

from __future__ import annotations

from dataclasses import fields

import pytest

from lazytrain.app.cli import build_parser, config_from_args
from lazytrain.app.config import FinetuneConfig, TrainConfig, carried, recorded, resumed, setting_of
from lazytrain.compiler.options import Policy


def _config(*flags: str):
    return config_from_args(build_parser("train").parse_args(["train", *flags]))


def test_no_flags_are_the_configs_defaults():
    assert _config() == TrainConfig()
    assert _config("--data", "d.jsonl") == FinetuneConfig(data="d.jsonl")     # its own defaults: lr, warm-up, ...
    with pytest.warns(UserWarning, match="--pack, --tokenizer: flags of a run on a data file"):
        assert _config("--pack", "--tokenizer", "t") == TrainConfig()   # no use without --data: said, not silent


@pytest.mark.parametrize("flags, field, value", [
    (["--batch", "6"], "batch", 6), (["--gpu-memory", "1KiB"], "gpu_memory", 1024),
    (["--policy", "keep-all"], "policy", Policy.KEEP_ALL), (["--answer-only-loss"], "loss_on_prompt", False),
    (["--no-progress"], "progress", False), (["--profile"], "profile", 5), (["--profile", "3"], "profile", 3),
    (["--time-limit-min", "0"], "time_limit_min", None), (["--resident", "0,2"], "resident", [0, 2]),
    (["--difficulty", "tiny-rev-pad"], "difficulty", "tiny-pad-rev"), (["--no-eval"], "evaluate", False),
])
def test_each_flag_sets_its_field(flags, field, value):
    assert getattr(_config(*flags), field) == value


def test_policy_choices_are_the_enums():
    policy = TrainConfig.__dataclass_fields__["policy"]
    assert setting_of(policy).choices() == Policy.names()
    with pytest.raises(SystemExit):
        build_parser("train").parse_args(["train", "--policy", "fastest"])


def test_one_list_of_settings_a_resume_keeps():
    """The task's run keeps what defines its model, data and plan; a data run also its files, tokenizer and held-out
    size (which picks its training examples), not the task's difficulty."""
    task, data = set(resumed(TrainConfig())), set(resumed(FinetuneConfig()))
    shared = {"model", "batch", "seq", "seed", "warmup", "warmup_ratio", "lr_scheduler_type", "min_lr_ratio",
              "weight_decay", "max_grad_norm", "policy", "gpu_memory", "host_memory", "nvme_memory", "resident",
              "optimizer", "lora", "base_bits"}
    assert task == shared | {"difficulty", "loss_on_prompt"}
    assert data == shared | {"tokenizer", "data", "eval_data", "loss_on", "truncate", "pack", "eval_size",
                             "answer_regex", "epochs", "columns", "text_field", "system_prompt",
                             "chat_template"}


def test_metrics_settings_are_every_field_but_the_progress_bar_and_overwrite():
    """(``--overwrite`` is how a run took its folder, not what the run is; a data run records none of the built-in
    task's settings.)"""
    assert set(recorded(TrainConfig())) == {f.name for f in fields(TrainConfig)} - {"progress", "overwrite", "given"}
    assert set(recorded(FinetuneConfig())) == {f.name for f in fields(FinetuneConfig)} - {
        "progress", "extra", "overwrite", "given", "difficulty", "loss_on_prompt"}


def test_every_setting_a_task_resume_reads_has_a_shape_to_check():
    from lazytrain.app.config import resumed_shapes
    shapes = resumed_shapes(TrainConfig())
    assert set(shapes) == set(resumed(TrainConfig()) + carried(TrainConfig())) and None not in shapes.values()


def test_every_recorded_setting_is_kept_carried_or_this_commands():
    """A resume keeps or carries every setting the run recorded, but for those about this command alone (where
    it runs and writes): a new setting has to be put in one of the three."""
    mine = {"output", "resume", "resume_from_checkpoint", "resumed_checkpoint", "device", "hardware", "threads",
            "profile", "allow_factory", "nvme_dir"}
    for cfg, also in ((TrainConfig(), {"extra"}), (FinetuneConfig(), set())):
        own = set(recorded(cfg)) - set(resumed(cfg)) - set(carried(cfg))
        assert own == mine | also, own
        assert not set(resumed(cfg)) & set(carried(cfg))


@pytest.mark.parametrize("flags, given", [
    ([], set()), (["--lr", "0.003"], {"lr"}), (["--batch", "32", "--no-eval"], {"batch", "evaluate"}),
    (["--data", "d.jsonl", "--pack"], {"data", "pack"}),
])
def test_the_config_knows_which_flags_were_given_even_at_their_default(flags, given):
    assert _config(*flags).given == given


@pytest.mark.parametrize("flag", ["--data", "--eval-data", "--output", "--resume", "--model", "--tokenizer"])
def test_an_empty_file_name_is_an_error(flag, capsys):
    with pytest.raises(SystemExit):
        build_parser("train").parse_args(["train", "--data", "d.jsonl", flag, ""])
    assert "needs a file or folder name" in capsys.readouterr().err
