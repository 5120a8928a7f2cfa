"""Half-open connections: counted per listener and per source address, and capped.

A connection is half-open from the first packet of its set-up (a CM REQ on RoCEv2, the
TCP handshake on iWARP) until the program on top says it is open (the target: once its
HELLO is answered) or until it ends. Every transport of a listener takes a ``Ticket``
from the same ``HalfOpen`` for each new connection and refuses the connection when none
is left, so a peer that starts set-ups and never finishes them holds at most
``per_source`` of them, and all peers together at most ``limit``; the deadlines of each
phase (CM timeout, MPA, first HELLO) give the slots back.
"""
from __future__ import annotations

from collections import Counter


class HalfOpen:
    """The set-ups in progress on one listener. ``refused`` counts refusals by reason:
    the caps' own (``half_open``, ``half_open_per_source``) and what transports and the
    target add (a deadline missed, for example)."""

    def __init__(self, limit: int, per_source: int) -> None:
        self.limit, self.per_source = limit, per_source
        self.count = 0
        self.by_source: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    def enter(self, source: str) -> Ticket | None:
        """A slot for a new connection from ``source``, or None (counted) when full."""
        if self.count >= self.limit:
            self.refused["half_open"] += 1
            return None
        if self.by_source[source] >= self.per_source:
            self.refused["half_open_per_source"] += 1
            return None
        self.count += 1
        self.by_source[source] += 1
        return Ticket(self, source)


class Ticket:
    """One half-open connection's slot; ``leave`` gives it back (once)."""

    __slots__ = ("_owner", "source")

    def __init__(self, owner: HalfOpen, source: str) -> None:
        self._owner: HalfOpen | None = owner
        self.source = source

    def leave(self) -> None:
        owner, self._owner = self._owner, None
        if owner is None:
            return
        owner.count -= 1
        owner.by_source[self.source] -= 1
        if owner.by_source[self.source] <= 0:
            del owner.by_source[self.source]
