"""``--rerun-failed REPORT``: the cases an earlier run's JSON report leaves to run again.

Every case of that run's selection that it did not judge for good: FAIL, WARN, ERROR, a
SKIP because the run could not reach the case (the target went away before it), and a case
the report does not hold (the run was interrupted before it, or never reached the target).
A PASS stands, and so does a SKIP for a reason of the target's own or of the selection (a
feature it did not grant, the other binding, ``--quick``): run again, it would say the same.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from .registry import PASS, SKIP


class ReportError(ValueError):
    """REPORT cannot say what to run again; the message says why and what to do."""


class Again(NamedTuple):
    cases: set[str]          # the ids of the cases to run again
    target: str | None       # the URL that run checked, as it was given


def again(path: Path) -> Again:
    """What the report at ``path`` leaves to run again."""
    try:
        doc = json.loads(path.read_text())
        target = doc.get("target")
        done = {c["id"] for c in doc["cases"]
                if c["verdict"] == PASS or c["verdict"] == SKIP and not c.get("not_run")}
        role = doc.get("role", "target")
        selected = doc.get("selected")
        left = set(selected) - done if isinstance(selected, list) else None
    except OSError as exc:
        raise ReportError(f"{path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ReportError(f"{path} is not the JSON report of a kbtp conform run (--json-file)") from None
    if role != "target":
        raise ReportError(f"{path} is the report of a --role {role} run; give one of --role target")
    if left is None:
        raise ReportError(f"{path} does not list the cases its run was to judge (an older kbtp conform "
                          "wrote it); run them once without --rerun-failed")
    return Again(left, target if isinstance(target, str) else None)
