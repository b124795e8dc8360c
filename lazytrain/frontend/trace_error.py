"""The front end's error: a model that could not be turned into blocks.  Raised by the export
(``trace_export``), the split (``split``), the packing (``packing``) and the trace alike, so it sits below them
all."""

from __future__ import annotations


class TraceError(ValueError):
    """The model could not be turned into blocks; the message says what failed and where."""
