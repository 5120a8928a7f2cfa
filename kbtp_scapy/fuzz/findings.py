"""A finding: one thing a target did that the specification forbids, as the wire showed it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Finding:
    """``kind`` groups findings for minimization (a smaller case must show the same kind)."""

    kind: str
    detail: str
    step: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "detail": self.detail, "step": self.step, "evidence": self.evidence}
