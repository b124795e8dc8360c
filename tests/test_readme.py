"""The README's code runs, and .ci/run installs and tests exactly as the README says."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_python_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile("import torch\n" + code, "README.md", "exec"), {})
    assert (tmp_path / "plan.json").exists()


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert len(commands) == 2
    main_cmd, test_cmd = commands
    assert "lazytrain " in main_cmd and "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    install, run = test_cmd.split(" && ")
    assert install in ci and run in ci


def _train_flags(group: str) -> dict[str, str]:
    """flag -> help template of every ``lazytrain train`` setting in ``group`` (``app/config.py``)."""
    from dataclasses import fields

    from lazytrain.app.config import FinetuneConfig, setting_of
    out = {}
    for f in fields(FinetuneConfig):
        s = setting_of(f)
        if s.help is not None and s.group == group:
            out[s.flag_name(f.name)] = s.help
    return out


def test_readme_train_flags_are_the_configs():
    """The "Flags:" paragraph under "## Train" names every setting of a run on the built-in task that has a flag, and
    no flag that is not one (or the launch's --gpus / --nproc)."""
    train = README[README.index("\n## Train\n"):README.index("\n## Fine-tune your model\n")]
    start = train.index("\nFlags")
    paragraph = train[start:train.index("\n\n", start)]
    named = set(re.findall(r"`(--[a-z][a-z-]*)", paragraph))
    flags = set(_train_flags("train"))
    assert flags - named == set(), "README's train flags lack these"
    assert named - flags - {"--gpus", "--nproc"} == set(), "README names train flags that do not exist"


def test_train_help_shows_every_setting_with_its_help(monkeypatch):
    from lazytrain.app.cli import build_parser
    monkeypatch.setenv("COLUMNS", "10000")         # argparse wraps at the terminal's width: one line a flag
    sub = build_parser("train")._subparsers._group_actions[0].choices["train"]
    text = " ".join(sub.format_help().split())
    for flag, help in {**_train_flags("train"), **_train_flags("data")}.items():
        assert f" {flag}" in text, flag
        first = help.split("(")[0].split("{")[0].replace("%%", "%").strip()     # the help's words before any default
        assert " ".join(first.split()) in text, (flag, first)
