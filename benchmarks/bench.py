"""Side-by-side benchmark: lazytrain (MILP, megatrain policy), FSDP2 + CPU offload, plain PyTorch.

    python benchmarks/bench.py [--model qwen2.5-3b --batch 8 --seq 1024 --gpu-memory 24GiB] [--find-max-batch]

The same as ``lazytrain bench``; the driver is ``lazytrain/measure/bench.py`` (see its docstring), the
systems are ``benchmarks/systems/*.py`` and the tables and chart ``benchmarks/report.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lazytrain.measure.bench import main  # noqa: E402 - after the path set-up

if __name__ == "__main__":
    main(prog="python benchmarks/bench.py")
