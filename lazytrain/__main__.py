"""``python -m lazytrain``: the ``lazytrain`` command, as ``torchrun --nproc-per-node N -m lazytrain train ...``
starts it on every rank (``ranks.py``)."""

import sys

from .app.cli import main

sys.exit(main())
