"""Half-open connections: counted per listener and per source address, and capped.

A connection is half-open from the first packet of its set-up (a CM REQ on RoCEv2, the
TCP handshake on iWARP) until the program on top says it is open (the target: once its
HELLO is answered) or until it ends. Every transport of a listener takes a ``Ticket``
from the same ``HalfOpen`` for each new connection and refuses the connection when none
is left, so a peer that starts set-ups and never finishes them holds at most
``per_source`` of them, and all peers together at most ``limit``; the deadlines of each
phase (CM timeout, MPA, first HELLO) give the slots back.

When all ``limit`` slots are taken, a set-up from a source that holds fewer of them than
the source holding most ends that source's oldest set-up and takes its slot (counted as
``half_open_evicted``):
a few addresses that keep ``per_source`` set-ups each open, or dribble each one just
inside its deadlines, cannot lock out an address they do not use.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable


class HalfOpen:
    """The set-ups in progress on one listener. ``refused`` counts refusals by reason:
    the caps' own (``half_open``, ``half_open_per_source``) and what transports and the
    target add (a deadline missed, for example)."""

    def __init__(self, limit: int, per_source: int) -> None:
        self.limit, self.per_source = limit, per_source
        self.count = 0
        self.by_source: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self._held: dict[str, deque[Ticket]] = {}

    def enter(self, source: str) -> Ticket | None:
        """A slot for a new connection from ``source``, or None (counted) when full."""
        if self.by_source[source] >= self.per_source:
            self.refused["half_open_per_source"] += 1
            return None
        if self.count >= self.limit and not self._make_room(source):
            self.refused["half_open"] += 1
            return None
        self.count += 1
        self.by_source[source] += 1
        ticket = Ticket(self, source)
        self._held.setdefault(source, deque()).append(ticket)
        return ticket

    def _make_room(self, source: str) -> bool:
        """End the oldest set-up of the source holding most slots, if it holds more than
        ``source`` would with this one; True when a slot was freed."""
        heaviest, held = self.by_source.most_common(1)[0]
        if held <= self.by_source[source] + 1:
            return False
        held_by = ((t, t.evict) for t in self._held[heaviest])
        victim, evict = next(((t, e) for t, e in held_by if e is not None), (None, None))
        if victim is None or evict is None:
            return False
        victim.leave()
        self.refused["half_open_evicted"] += 1
        evict(f"set-up ended to make room for a connection from {source} "
              f"({heaviest} held {held} of the {self.limit} half-open slots)")
        return True


class Ticket:
    """One half-open connection's slot; ``leave`` gives it back (once)."""

    __slots__ = ("_owner", "source", "evict")

    def __init__(self, owner: HalfOpen, source: str) -> None:
        self._owner: HalfOpen | None = owner
        self.source = source
        #: how its holder ends the set-up when the slot is taken for another (None: never)
        self.evict: Callable[[str], None] | None = None

    def leave(self) -> None:
        owner, self._owner = self._owner, None
        if owner is None:
            return
        owner.count -= 1
        owner.by_source[self.source] -= 1
        held = owner._held[self.source]
        held.remove(self)
        if owner.by_source[self.source] <= 0:
            del owner.by_source[self.source]
            del owner._held[self.source]
