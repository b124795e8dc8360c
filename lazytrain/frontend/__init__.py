"""Front end: a model as the user names it -> ``ir.ModelGraph`` and the per-block program the runtime runs
(``docs/architecture.md``, "The pipeline").

``presets.py`` and ``validate.py`` read what the model declares (a preset, a config.json, a module) and
check sizes before any work; ``trace.py`` measures each block of the program that ``program.py`` builds
from ``torch.export`` (``trace_export.py`` and ``split.py``, with ``hf_export.py`` for Hugging Face models, ``rope.py``,
``packing.py``, ``tiling.py``, ``attention.py``). The compiler and the runtime both import it; it imports
only ``lazytrain.ir`` (and torch), never the compiler or the runtime.
"""
