"""What kind of dataset file a name is, told by its extension, and the error every unreadable file gives.  Apart
from ``formats.py`` so that its readers (``tables.py``) share them without importing it."""

from __future__ import annotations

from pathlib import Path


class DataError(ValueError):
    """A dataset file that cannot be read as examples; the message names the file and the line."""


#: the dataset files read, told by the extension (a folder: a datasets save_to_disk folder)
FILE_FORMATS = ("JSONL (.jsonl)", "JSON (.json)", "parquet (.parquet)", "CSV (.csv)", "TSV (.tsv)",
                "Arrow (.arrow)", "a datasets save_to_disk folder")
_KINDS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet",
          ".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}


def kind_of(path: str | Path) -> str:
    """json | parquet | csv | tsv | arrow | datasets, told by the extension (a folder: datasets).  A name without
    a known extension that is not a regular file (a FIFO, ``<(zcat ...)``) or has no extension is JSON / JSONL."""
    path = Path(path)
    if path.is_dir():
        return "datasets"
    kind = _KINDS.get(path.suffix.lower())
    if kind is None and path.suffix and path.is_file():
        raise DataError(f"{path}: unknown extension {path.suffix!r}; accepted formats: {', '.join(FILE_FORMATS)}")
    return kind or "json"
