"""Judge each replayed step against the capture: match, differ, error, skipped, unchecked."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..tables.enums import STATUS
from .player import Played

FIELDS = ("status", "generation", "data_length", "block_offset", "data", "ticket", "flags")
DEFAULT_IGNORE = frozenset({"block_offset"})
FAILING = ("differ", "error")
CYCLE = 0xFFFF        # Generations run 1 to 65535, then 1 again


@dataclass
class Difference:
    field: str
    captured: Any
    replayed: Any

    def describe(self) -> str:
        if self.field == "data":
            a, b = self.captured or b"", self.replayed or b""
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"data: {len(a)} octets captured, {len(b)} replayed, first difference at octet {at}"
        return f"{self.field}: captured {_show(self.field, self.captured)}, " \
               f"replayed {_show(self.field, self.replayed)}"

    def as_json(self) -> dict[str, Any]:
        value = (lambda v: v.hex() if isinstance(v, bytes) else v)
        return {"field": self.field, "captured": value(self.captured), "replayed": value(self.replayed)}


@dataclass
class Verdict:
    played: Played
    state: str                           # match, differ, error, skipped, unchecked
    differences: list[Difference] = field(default_factory=list)
    detail: str = ""


def _show(name: str, value: Any) -> str:
    if value is None:
        return "nothing"
    if name == "status":
        return STATUS.describe(value)
    if name in ("block_offset", "flags"):
        return f"0x{value:x}"
    return str(value)


class Generations:
    """Generations compared as they move, not as numbers: the first Generation a session
    sees for a handle sets that handle's offset between capture and replay, and every later
    one must keep it. A capture made on a target whose entry was used before then matches
    a target where it was not (and the other way round); a step that bumps the Generation
    once too often still differs. ``--strict`` compares them as captured.

    Every answer's Generation counts, 0 too: an answer's Generation is the entry's current
    one (a failed request's as well), and 0 is an entry never bound, which a used target
    shows as the Generation its entry reached. Offsets are taken modulo 65535, the cycle
    a Generation runs (65535 steps to 1, skipping 0, as 0 does)."""

    def __init__(self) -> None:
        self.offsets: dict[tuple[int, int], int] = {}    # (session, captured handle): offset

    def as_captured(self, played: Played, captured: int | None, replayed: int | None) -> int | None:
        """The replayed Generation in the capture's numbering."""
        handle = played.step.handle if played.step else None
        if handle is None or captured is None or replayed is None:
            return replayed          # nothing to relate
        offset = self.offsets.setdefault((played.session.index, handle), (replayed - captured) % CYCLE)
        moved = (replayed - offset) % CYCLE
        return captured if moved == captured % CYCLE else moved


def judge_run(results: list[Played], ignore: frozenset[str] = DEFAULT_IGNORE,
              relative: bool = True) -> list[Verdict]:
    """Every step of one replay, in order; Generations relative per handle unless not
    ``relative``."""
    generations = Generations() if relative else None
    return [judge(p, ignore, generations) for p in results]


def judge(played: Played, ignore: frozenset[str] = DEFAULT_IGNORE,
          generations: Generations | None = None) -> Verdict:
    """Compare what the capture shows with what the replay got, field by field."""
    if played.skipped:
        return Verdict(played, "skipped", detail=played.skipped)
    if played.error:
        return Verdict(played, "error", detail=played.error)
    if played.step and played.step.cut:
        return Verdict(played, "unchecked", detail=played.step.cut)
    captured, replayed = played.captured, played.replayed
    if captured is None:
        detail = played.step.problem if played.step and played.step.problem else "no answer in the capture"
        return Verdict(played, "unchecked", detail=detail)
    if replayed is None:
        return Verdict(played, "error", detail="no answer")
    old, new = captured.values(), replayed.values()
    if generations is not None and "generation" in new:
        new["generation"] = generations.as_captured(played, old.get("generation"), new["generation"])
    diffs = [Difference(name, old.get(name), new.get(name)) for name in FIELDS
             if name not in ignore and (name in old or name in new) and old.get(name) != new.get(name)]
    detail = ""
    if played.step and played.step.problem:
        detail = played.step.problem
    elif captured.form != replayed.form and {captured.form, replayed.form} == {"completion", "record"}:
        detail = f"completed by {replayed.form}, captured by {captured.form}"
    return Verdict(played, "differ" if diffs else "match", diffs, detail)
