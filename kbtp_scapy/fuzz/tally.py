"""How much of each answer the model judged, and what it could not predict, and why.

Every field of every COMPLETION, completion record and HELLO_ACK the fuzzer reads, and
every buffer of the initiator's the target may write, is either held to a prediction
(``judged``) or counted under the reason it cannot be (``unpredicted``), so that what
the oracle leaves alone shows in the report instead of passing silently.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

# the reasons the model cannot predict a field, named once for the report
UNKNOWN_ENTRY = "the entry is unknown to the model (after a lost connection or an unanswered request)"
NEVER_SHOWN = "no answer has shown this entry's Generation yet (a handle of the range never named)"
FOREIGN = "a handle outside the fuzzer's ranges: another initiator's entry, never shown"
NOT_FIXED_OK = "the text does not fix it for this operation's OK"
NOT_FIXED_REFUSAL = "the text does not fix it in a refusal"
NO_ENTRY_LOOKED = "MALFORMED or INVALID_HANDLE: the target may not have read an entry"
NO_FLAGS = "the text defines no COMPLETION flag"
UNPARSED = "the request could not be parsed: nothing to echo"
CHOSEN = "the target chooses it (a free block of the pool)"
UNKNOWN_DATA = "the block's content is unknown to the model"
NOT_OURS = "the request names an STag that is not a writable buffer of the fuzzer's"
NO_HELLO_FLAGS = "the text defines no HELLO_ACK flag"
REFUSED_HELLO = "a refused HELLO_ACK: the text fixes no body"
NO_TICKETS = "no DIRECT_ALLOC: no ticket to time out"


class Tally:
    """Counts per ``answer.field``: judged, and not predicted by reason.

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
