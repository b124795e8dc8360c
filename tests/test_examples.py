"""Every program in examples/ runs, in its small configuration (each one's docstring says which)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "finetune_hf_local.py": (["--steps", "3", "--small"], "exact match"),
    "plan_70b.py": (["--model", "tiny", "--batch", "8", "--seq", "256", "--gpu-memory", "4GiB", "--fast"],
                    "simulated step"),
    "custom_loop.py": (["--steps", "3", "--batch", "8"], "checkpoint resumed at step 3"),
    "finetune_data_loop.py": (["--small", "--steps", "3", "--output", "out"], "exact match"),
}


def test_every_example_is_tested():
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == set(SMALL)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_example_runs(name, tmp_path):
    args, expect = SMALL[name]
    if name in ("finetune_hf_local.py", "finetune_data_loop.py"):
        pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert expect in r.stdout
