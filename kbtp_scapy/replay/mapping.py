"""Captured names to the names of the replay: handles, Block Offsets, tickets and slots.

Handles follow the handle ranges: handle h of a captured range with Handle Base B maps to
B' + (h - B), B' being the Handle Base the replayed session of that range was granted.
Block Offsets, tickets and slot offsets are learnt as the replay sees them (from
COMPLETIONs, table entries, ring slots and FetchAdd results) next to the captured ones.
STags are never mapped by value: every buffer a request names is registered afresh, at
the captured Tagged Offset, so Tagged Offsets carry over unchanged.
"""
from __future__ import annotations

from .sessions import Capture, Session


class Mapping:
    """The correspondence between a capture and one run of its replay."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.bases: dict[int, int] = {}            # session index -> replayed Handle Base
        self.blocks: dict[int, int] = {}           # captured Block Offset -> replayed
        self.tickets: dict[tuple[int, int], int] = {}   # (session, captured ticket) -> replayed
        self.slots: dict[tuple[int, int], int] = {}     # (session, captured slot offset) -> replayed
        self.kept: set[int] = set()                # handles no captured range explains

    def granted(self, ses: Session, handle_base: int) -> None:
        self.bases[ses.index] = handle_base

    def owner(self, ses: Session, handle: int) -> Session | None:
        """The session whose range holds ``handle``: ``ses`` itself first, then the latest
        other captured session with that range that has been replayed."""
        if handle in ses.handle_range:
            return ses
        owners = [s for s in self.capture.sessions if handle in s.handle_range and s.index in self.bases]
        return owners[-1] if owners else None

    def handle(self, ses: Session, handle: int) -> int:
        owner = self.owner(ses, handle)
        if owner is None or owner.index not in self.bases:
            self.kept.add(handle)
            return handle
        return self.bases[owner.index] + handle - owner.handle_range.start

    def learn_block(self, captured: int | None, replayed: int | None) -> None:
        if captured is None or replayed is None or (1 << 64) - 1 in (captured, replayed):
            return
        self.blocks[captured] = replayed

    def block(self, captured: int) -> int | None:
        return self.blocks.get(captured)
