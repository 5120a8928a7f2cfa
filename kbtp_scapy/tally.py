"""Counts of what a checker's oracle judged and what it could not predict, and why.

Both fuzzers (``fuzz/``, the target's; ``conform/initiator/``, the initiator's) hold every
field they read either to a prediction (``judged``) or under the reason it cannot be
(``unpredicted``), so that what an oracle leaves alone shows in the report instead of
passing silently; this is their one tally and its report table.
"""
from __future__ import annotations

from collections import Counter
from typing import Any


class Tally:
    """Counts per field (``answer.field``, ``REQUEST.field``, ``read.table``): judged, and
    not predicted by reason.

    Marks go to a plain list first and are counted in bulk (``Counter`` of a list runs
    in C), so that counting every field of every answer costs the run next to nothing."""

    FOLD = 1 << 16

    def __init__(self) -> None:
        self._judged: Counter[str] = Counter()
        self._unpredicted: Counter[tuple[str, str]] = Counter()
        self._marks: list[str] = []
        self._reasons: list[tuple[str, str]] = []

    def judge(self, *fields: str) -> None:
        self._marks.extend(fields)
        if len(self._marks) > self.FOLD:
            self._fold()

    def cannot(self, why: str, *fields: str) -> None:
        self._reasons.extend((f, why) for f in fields)
        if len(self._reasons) > self.FOLD:
            self._fold()

    def _fold(self) -> None:
        self._judged.update(self._marks)
        self._unpredicted.update(self._reasons)
        self._marks, self._reasons = [], []

    @property
    def judged(self) -> Counter[str]:
        self._fold()
        return self._judged

    @property
    def unpredicted(self) -> Counter[tuple[str, str]]:
        self._fold()
        return self._unpredicted

    def add(self, other: Tally) -> None:
        """Count ``other``'s marks here too (one case's tally into the run's)."""
        self.judged.update(other.judged)
        self.unpredicted.update(other.unpredicted)

    def as_dict(self) -> dict[str, Any]:
        """Per field: how often judged, and how often not predicted, by reason."""
        fields = sorted(set(self.judged) | {f for f, _ in self.unpredicted})
        return {f: {"judged": self.judged[f],
                    "not_predicted": {why: n for (g, why), n in sorted(self.unpredicted.items()) if g == f}}
                for f in fields}

    def lines(self) -> list[str]:
        """The report's table: one line per field, the reasons under it."""
        total_j, total_u = sum(self.judged.values()), sum(self.unpredicted.values())
        out = [f"oracle: {total_j} fields judged, {total_u} not predicted",
               f"{'field':34} {'judged':>8} {'not pred.':>9}", f"{'-' * 34} {'-' * 8} {'-' * 9}"]
        for f, d in self.as_dict().items():
            out.append(f"{f:34} {d['judged']:>8} {sum(d['not_predicted'].values()):>9}")
            out += [f"    {n:>8}  {why}" for why, n in d["not_predicted"].items()]
        return out
