"""What a plan file is (``PLAN_FORMAT``) and the error raised for one that cannot be used.

Its own module so that ``plan.py`` can check what it reads with ``schema.py`` and ``verify.py``, which
raise this error, without those importing ``plan.py`` back."""

from __future__ import annotations

PLAN_FORMAT = "lazytrain.plan/1"


class PlanError(ValueError):
    """A plan file or plan object that cannot be used: malformed, wrong version, wrong model, or
    failing verification.  The message says what and, where possible, what to do."""
