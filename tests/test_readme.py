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
