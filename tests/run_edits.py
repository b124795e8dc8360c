"""Editing a run folder the way a user (or a corruption) might, for the tests of what a resume refuses."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def write_committed_metrics(run: Path, text: str, *, digest: bool = True) -> None:
    """Replace the metrics committed with ``run``'s checkpoint by ``text``; ``digest``: and their SHA-256 in
    the manifest, as a deliberate edit would (the shape checks behind the checksum then answer)."""
    path = run / "checkpoint" / "metrics.json"
    path.write_text(text)
    if digest:
        meta_path = run / "checkpoint" / "checkpoint.json"
        meta = json.loads(meta_path.read_text())
        meta["extra_sha256"]["metrics.json"] = [hashlib.sha256(text.encode()).hexdigest()]
        meta_path.write_text(json.dumps(meta))
