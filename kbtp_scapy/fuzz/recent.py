"""The frames of a run's last few cases, kept in memory: the capture of a target that went
away, which no replay can show again (a crash's input, as AFL keeps it)."""
from __future__ import annotations

from collections import deque
from pathlib import Path

from ..rnic.pcap import PcapSink

KEPT = 3      # cases whose frames are kept: the one where the target went, and those before


class Recent:
    """A frame listener; ``begin`` starts the next case's frames, dropping the oldest."""

    def __init__(self, kept: int = KEPT) -> None:
        self._cases: deque[tuple[str, list[tuple[str, bytes, int]]]] = deque([("set-up", [])], maxlen=kept)

    def begin(self, name: str) -> None:
        self._cases.append((name, []))

    def __call__(self, direction: str, frame: bytes, ns: int) -> None:
        self._cases[-1][1].append((direction, bytes(frame), ns))

    @property
    def names(self) -> list[str]:
        """The cases whose frames are kept, oldest first."""
        return [name for name, _ in self._cases]

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        sink = PcapSink(path)
        for _, frames in self._cases:
            for frame in frames:
                sink(*frame)
        sink.close()
