"""Initiators known to the target: handle ranges, quotas, retention (spec "Session Establishment").

An initiator is known by its Initiator ID. Its range, quota, bindings and DIRECT_ALLOC
partition outlive its connection for the retention time (GOODBYE without RELEASE, or a
lost connection), so a reconnect with the same ID finds them intact; a HELLO whose ID
belongs to a session that is still active is refused. A retained session that holds
nothing (no binding, no ticket) keeps its slot only until a new initiator needs it: it is
dropped then, oldest first, so throw-away IDs cannot lock others out for the retention.
Under the same pressure, one that holds blocks gives way once it has been retained for
``min_retention_s``, oldest first, and loses its bindings as at the end of its retention
(the specification lets the target choose that time: docs/DECISIONS.md, "Retention under
pressure"), so IDs that each store a block and vanish hold others out for that long only.
An active session whose peer has sent nothing for ``idle_timeout_s`` gives way too: its
connection is ended, and it is dropped at once if it holds nothing, or retained as any
departed one is (a live but idle or frozen peer, whose RNIC still answers the liveness
probes, holds a slot for that long only while others wait). A source address outside
``trust`` holds at most ``max_sessions_per_source`` sessions, active or retained: beyond,
its own retained sessions give way, oldest first, and when all of them are active the HELLO
is refused, so one host cannot take every slot with throw-away IDs. Busy sessions, which
none of the rules above ends, hold their slots for ``min_tenure_s`` only while others wait:
when a newcomer still finds no room, and its source holds fewer sessions than the source
holding the most, that source's longest-held session is displaced (``displace``: its
connection is ended, and it gives way whatever it holds), so sessions rotate among the
sources that want them (docs/DECISIONS.md, "Busy sessions and the fair share"). A source
that lost a session so carries its tenure over: a session it opens or resumes while the loss
is remembered began when the lost one did, so reconnecting at once wins it no new
``min_tenure_s``.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config import TargetConfig
from .pool import Partition

if TYPE_CHECKING:
    from ..rnic.qp import QueuePair
    from .direct import TicketWatch


@dataclass(eq=False)
class InitiatorState:
    """What the target keeps of one initiator across its connections (not the reference
    initiator, ``kbtp_scapy.initiator.Initiator``, which is the other end)."""

    initiator_id: bytes
    index: int                     # which handle range
    handle_base: int
    handle_count: int
    quota: int
    partition: Partition | None = None
    bound: set[int] = field(default_factory=set)
    tickets: int = 0               # taken and not yet bound (target-executed or direct)
    active: bool = False
    features: int = 0
    direct_disabled: bool = False  # Partition STag invalidated after an abandoned ticket
    watch: TicketWatch | None = None   # of the partition's ring
    qp: QueuePair | None = None        # the connection of the active session
    expiry: asyncio.TimerHandle | None = None
    retained_at: float = 0.0       # loop time it was last retained
    admitted_at: float = 0.0       # loop time its current session began (its tenure)
    displaced: bool = False        # ended for a newcomer, whose room it is until it claims it
    heard_at: float = 0.0          # loop time of its last request (active sessions)
    # --execution chains: the connection's count of received requests, read by the idle
    # rule, since requests a chain runs reach no Python to set heard_at (docs/CHAINS.md)
    received: Callable[[], int] | None = None
    received_seen: int = 0
    source: str = ""               # the address of its first HELLO (its per-source count)

    def owns(self, handle: int) -> bool:
        return self.handle_base <= handle < self.handle_base + self.handle_count

    def heard(self, now: float) -> float:
        """``heard_at``, first brought up to date from ``received`` where the requests
        reach no Python: a request received since the last look counts as heard ``now``."""
        if self.received is not None and (count := self.received()) != self.received_seen:
            self.received_seen, self.heard_at = count, now
        return self.heard_at

    @property
    def usage(self) -> int:
        """Handles bound plus tickets taken and not bound (spec "Allocation Quotas")."""
        return len(self.bound) + self.tickets


class Refused(Exception):
    """A HELLO the target answers with a non-zero HELLO_ACK Status (docs/NOTES.md decision 6)."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status


#: sources remembered as having lost a session to a newcomer (``Sessions.displace``)
MAX_LOST = 4096


class Sessions:
    """Admission, retention and release of initiators."""

    def __init__(self, config: TargetConfig, partitions: list[Partition],
                 release: Callable[[InitiatorState], None]) -> None:
        self.config = config
        self.by_id: dict[bytes, InitiatorState] = {}
        self._free_ranges = list(range(config.max_initiators))
        self._partitions = partitions
        self._release = release
        self.retained = self.evicted = self.expired = 0   # counters, for the metrics
        self.ended_idle = self.displaced = 0
        self.refused_per_source = 0
        #: source -> (when a session of it was displaced, when that session began): for
        #: --min-tenure it counts the session it lost, so it cannot at once displace another
        #: in turn (a cascade that leaves every session younger than --min-tenure, and the
        #: next newcomer refused), and a session it opens meanwhile carries on that tenure
        self._lost: dict[str, tuple[float, float]] = {}

    def admit(self, initiator_id: bytes, want_partition: bool, source: str = "",
              claim: InitiatorState | None = None) -> tuple[InitiatorState, bool]:
        """The initiator's state and whether it was restored from retention; ``source``
        is the peer's address, for the per-source cap (none when empty); ``claim``, a
        session ``displace`` ended for this newcomer, which gives way now."""
        if claim is not None:
            claim.displaced = False
            if not claim.active:
                self.evicted += 1
                self.forget(claim)
        known = self.by_id.get(initiator_id)
        if known is not None:
            if known.active:
                raise Refused("ALREADY_BOUND", "this Initiator ID has an active session")
            if known.displaced:
                raise Refused("NO_SPACE", "this Initiator ID's session was ended for a newcomer")
            if known.expiry is not None:
                known.expiry.cancel()
                known.expiry = None
            known.active, known.displaced = True, False
            known.admitted_at = self._tenure(known.source)
            if want_partition and known.partition is None:   # given back while it was away
                known.partition = self._take_partition(initiator_id)
            return known, True
        self._room_for(source)
        while True:
            partition = None
            if want_partition:
                partition = self.free_partition()
            shared_sessions = sum(1 for i in self.by_id.values() if i.partition is None)
            shared_room = (shared_sessions + 1) * self.config.quota <= self.config.shared_blocks
            room = bool(self._free_ranges) and (partition is not None or shared_room)
            if room and (partition is not None or not want_partition):
                break
            # no room: any idle session makes some; room but no partition: only one with
            # a partition gives one
            idle = (self._idle(with_partition=room) or self._stale(with_partition=room)
                    or self._quiet(with_partition=room))
            if idle is None:
                if room:
                    break          # DIRECT_ALLOC without a partition: on the shared ring
                raise Refused("NO_SPACE", "no quota or handle range is left for another initiator")
            self.evicted += 1
            self.forget(idle)
        index = self._free_ranges.pop(0)
        c = self.config
        state = InitiatorState(initiator_id, index, c.base_handle + index * c.handles_per_initiator,
                               c.handles_per_initiator, c.quota, partition, active=True, source=source)
        state.admitted_at = self._tenure(source)
        if partition is not None:
            partition.owner = initiator_id
        self.by_id[initiator_id] = state
        return state, False

    def _tenure(self, source: str) -> float:
        """When a session that ``source`` opens now begins its tenure: now, or, while a
        session it lost to a newcomer is remembered, when that one began (rule 6), so a
        source that reconnects at once after each displacement wins no new tenure."""
        now = asyncio.get_running_loop().time()
        self._forget_lost(now)
        lost = self._lost.get(source)
        return now if lost is None else min(now, lost[1])

    def _forget_lost(self, now: float) -> None:
        """Sources whose loss is older than ``min_tenure_s`` are forgotten (in time order)."""
        cutoff = now - self.config.min_tenure_s
        while self._lost and next(iter(self._lost.values()))[0] <= cutoff:
            del self._lost[next(iter(self._lost))]

    def free_partition(self) -> Partition | None:
        return next((p for p in self._partitions if p.owner is None), None)

    def _take_partition(self, initiator_id: bytes) -> Partition | None:
        partition = self.free_partition()
        if partition is not None:
            partition.owner = initiator_id
        return partition

    def holders(self) -> tuple[int, int]:
        """Partitions held by active sessions, and by retained ones (which keep theirs
        while they hold bindings or tickets from it)."""
        held = [s for s in self.by_id.values() if s.partition is not None]
        return sum(s.active for s in held), sum(not s.active for s in held)

    def _room_for(self, source: str) -> None:
        """Enforce ``max_sessions_per_source`` for an untrusted ``source``: its retained
        sessions give way, oldest first; Refused when all it holds are active."""
        cap = self.config.max_sessions_per_source
        if not source or self.config.trusts(source):
            return
        mine = [s for s in self.by_id.values() if s.source == source]
        while len(mine) >= cap:
            retained = [s for s in mine if not s.active and not s.displaced]
            if not retained:
                self.refused_per_source += 1
                raise Refused("NO_SPACE", f"{source} already has {cap} active sessions "
                                          "(--max-sessions-per-source)")
            oldest = min(retained, key=lambda s: s.retained_at)
            self.evicted += 1
            self.forget(oldest)
            mine.remove(oldest)

    def _idle(self, with_partition: bool) -> InitiatorState | None:
        """The retained session that holds nothing and was retained first (one with a
        partition when ``with_partition``), if any."""
        idle = [s for s in self.by_id.values() if not s.active and s.usage == 0
                and not s.displaced and (s.partition is not None or not with_partition)]
        return min(idle, key=lambda s: s.retained_at, default=None)

    def _stale(self, with_partition: bool) -> InitiatorState | None:
        """The retained session, holding blocks, retained first and for at least
        ``min_retention_s`` (one with a partition when ``with_partition``), if any."""
        cutoff = asyncio.get_running_loop().time() - self.config.min_retention_s
        stale = [s for s in self.by_id.values() if not s.active and s.retained_at <= cutoff
                 and not s.displaced and (s.partition is not None or not with_partition)]
        return min(stale, key=lambda s: s.retained_at, default=None)

    def _quiet(self, with_partition: bool) -> InitiatorState | None:
        """An active session silent for ``idle_timeout_s``, silent longest, with its
        connection ended; returned only if it holds nothing (else it is retained when its
        connection's task ends, and gives way after ``min_retention_s``)."""
        now = asyncio.get_running_loop().time()
        cutoff = now - self.config.idle_timeout_s
        quiet = [s for s in self.by_id.values() if s.active and s.qp is not None
                 and not s.displaced and s.heard(now) <= cutoff and (s.partition is not None or not with_partition)]
        state = min(quiet, key=lambda s: s.heard_at, default=None)
        if state is None:
            return None
        self.ended_idle += 1
        assert state.qp is not None     # chosen among those that have one
        state.qp.abort(f"no request for {self.config.idle_timeout_s:g} s while another "
                       "initiator waits for room")
        return state if state.usage == 0 else None

    def displace(self, source: str, want_partition: bool) -> InitiatorState | None:
        """Fair share for a newcomer from ``source`` that ``admit`` refused NO_SPACE: the
        active session held longest, at least ``min_tenure_s``, of the source holding the
        most sessions, when that is more than ``source`` holds (and, when the newcomer
        needs room on the shared ring, one without a partition). Its connection is ended
        (an RDMAP Terminate, or the RoCEv2 error state and DREQ). Once its connection's
        task has retained it, it gives way to the newcomer's ``admit(claim=...)``,
        whatever it holds, and to no one else (not even its own reconnect), so the room
        goes to the newcomer it was made for; ``unclaim`` if the newcomer does not take it.
        None when no session may be displaced, or ``source`` is at its own cap."""
        c = self.config
        now = asyncio.get_running_loop().time()
        self._forget_lost(now)
        counts = Counter(s.source for s in self.by_id.values())
        mine = counts[source]
        if source and not c.trusts(source) and mine >= c.max_sessions_per_source:
            return None
        mine += source in self._lost
        shared = sum(1 for s in self.by_id.values() if s.partition is None)
        need_shared = (bool(self._free_ranges) and (shared + 1) * c.quota > c.shared_blocks
                       and not (want_partition and self.free_partition() is not None))
        cutoff = now - c.min_tenure_s
        held = [s for s in self.by_id.values() if s.active and s.qp is not None
                and not s.displaced and s.admitted_at <= cutoff and counts[s.source] > mine
                and (s.partition is None or not need_shared)]
        state = min(held, key=lambda s: (-counts[s.source], s.admitted_at), default=None)
        if state is None:
            return None
        assert state.qp is not None       # chosen among those that have one
        self.displaced += 1
        state.displaced = True
        self._lost.pop(state.source, None)      # in time order, for ``_forget_lost``
        self._lost[state.source] = (now, state.admitted_at)
        if len(self._lost) > MAX_LOST:
            del self._lost[next(iter(self._lost))]
        state.qp.abort(f"displaced for a newcomer after {c.min_tenure_s:g} s: "
                       f"{state.source or 'its source'} holds {counts[state.source]} "
                       f"sessions, {source or 'the newcomer'} {mine}")
        return state

    def unclaim(self, state: InitiatorState) -> None:
        """The newcomer ``state`` was displaced for will not take its room: it is an
        ordinary retained session again."""
        state.displaced = False

    def detach(self, state: InitiatorState, release: bool) -> None:
        """The session ended: release now (GOODBYE RELEASE), else keep for the retention time."""
        state.active, state.qp = False, None
        if self.by_id.get(state.initiator_id) is not state:
            return                      # given way already (``_quiet``)
        if release:
            self.forget(state)
            return
        if state.partition is not None and state.usage == 0:
            # Nothing of it is bound or ticketed: the partition goes back at once (its STag
            # died with the connection), the session keeps its range for a reconnect,
            # which takes a free partition again. One with bindings keeps its partition:
            # the bound blocks are in it, and the text keeps bindings for the retention.
            state.partition.release()
            state.partition, state.watch = None, None
        loop = asyncio.get_running_loop()
        self.retained += 1
        state.retained_at = loop.time()
        state.expiry = loop.call_later(self.config.retention_s, self._expire, state)

    def _expire(self, state: InitiatorState) -> None:
        if self.by_id.get(state.initiator_id) is state:
            self.expired += 1
        self.forget(state)

    def forget(self, state: InitiatorState) -> None:
        """Free every binding of the initiator and give back its range and partition."""
        if self.by_id.get(state.initiator_id) is not state:
            return
        if state.expiry is not None:
            state.expiry.cancel()
        self._release(state)
        del self.by_id[state.initiator_id]
        self._free_ranges.append(state.index)
        self._free_ranges.sort()
        if state.partition is not None:
            state.partition.release()
