"""One benchmark run against any KBTP target, in perftest's manner: one session (or
``connections`` at once, perftest's -q), N requests in flight in each (one worker per
request, each on a handle of its own), for a duration or an iteration count, every request
timed from posting to completion; each size once or ``trials`` times. Bidirectional: loads
and stores at once in each session, half the workers each (perftest's -b, for KBTP the two
directions of block data).

The data path is the reference initiator's, on the codec: no Scapy object per request.

A DIRECT_ALLOC whose ticket outlived the Ticket Timeout (a bench slower than the target
expects, on a busy host) is abandoned by the target, which revokes the session's Partition:
the bench counts it as expired, not as an error, and goes on in a new session.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..initiator import Initiator, KbtpError, Limits, PeerLimit, Result, TargetInfo
from ..rnic.qp import ConnectionLost, FrameListener, RemoteError
from ..vocab import Feature
from .stats import Samples

#: operation -> the requests of one iteration, in order (the first is the one measured for
#: throughput; ALLOC_STORE and DIRECT_ALLOC free their block again, so the quota holds)
OPERATIONS = {"load": ("LOAD",), "store": ("STORE",), "alloc_store": ("ALLOC_STORE", "FREE"),
              "direct_load": ("DIRECT_LOAD",), "direct_alloc": ("DIRECT_ALLOC", "FREE")}
NEEDS = {"direct_load": Feature.DIRECT_LOAD, "direct_alloc": Feature.DIRECT_ALLOC}


#: what ends a run early from the connection's side: the target died, hung or refused
LOST = (ConnectionLost, RemoteError, OSError, TimeoutError)


class BenchError(Exception):
    """The benchmark cannot run as asked (a feature not granted, more in flight than the quota)."""


class NotStarted(Exception):
    """No session could begin (no target there, no HELLO_ACK, the connection lost before
    it): the run never started. ``cause`` is the connection's error, which says why."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class SessionRefused(Exception):
    """The target refused the HELLO of one of -q's sessions (one past those it admits):
    ``number`` of ``total``, ``error`` its refusal."""

    def __init__(self, number: int, total: int, error: KbtpError) -> None:
        super().__init__(f"session {number} of {total}: {error.detail or 'refused'} {error.name}")
        self.number, self.total, self.error = number, total, error


class Interrupted(Exception):
    """The run was asked to stop (Ctrl-C) before its plan ended."""


@dataclass
class Plan:
    """What to measure."""

    url: str
    op: str = "load"
    sizes: list[int] = field(default_factory=list)     # [] : the target's Block Size
    in_flight: int = 1
    duration: float | None = 5.0                       # seconds, when no iteration count
    iterations: int | None = None
    inline: bool | None = None                         # stores: None as the initiator decides
    options: dict[str, Any] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)     # the HELLO_ACK's figures, each answer's wait
    frame_listeners: list[FrameListener] = field(default_factory=list)
    interrupted: bool = False                          # set by Ctrl-C: stop, keep what was measured
    all_sizes: bool = False                            # powers of two from 8 to the Block Size
    connections: int = 1                               # sessions at once, each with in_flight
    bidirectional: bool = False                        # loads and stores at once
    trials: int = 1                                    # runs of each size


@dataclass
class Measured:
    """One size's run: each request kind's samples, the wall and CPU time they took."""

    size: int
    samples: dict[str, Samples]
    seconds: float
    cpu_seconds: float
    cut: BaseException | None = None     # what ended it before its plan: Interrupted or LOST
    trial: int | None = None             # its number (from 1) when the plan repeats each size

    def rows(self) -> list[dict[str, Any]]:
        total = sum(len(s.latencies) for s in self.samples.values())
        out = []
        for s in self.samples.values():
            row = s.summary(self.seconds, self.cpu_seconds, total)
            if self.trial is not None:
                row["trial"] = self.trial
            row["cpu_percent"] = round(100 * self.cpu_seconds / self.seconds, 1) if self.seconds else None
            if self.cut is not None:
                row["partial"] = True
            out.append(row)
        return out


@dataclass
class Lane:
    """One session's share of a run: ``op`` on ``workers`` handles from the ``first``."""

    session: Session
    op: str
    workers: int
    first: int = 0

    def handles(self) -> list[int]:
        base = _info(self.session.ini).handle_base + self.first
        return [base + w for w in range(self.workers)]


def sweep(block_size: int) -> list[int]:
    """perftest's -a: powers of two from 8 (the smallest it sweeps) to the Block Size, that
    too when it is no power of two."""
    sizes = [1 << k for k in range(3, block_size.bit_length()) if 1 << k <= block_size]
    return sizes + [block_size] if not sizes or sizes[-1] != block_size else sizes


def _lanes(plan: Plan, sessions: list[Session]) -> list[Lane]:
    if not plan.bidirectional:
        return [Lane(s, plan.op, plan.in_flight) for s in sessions]
    loads = math.ceil(plan.in_flight / 2)
    return [lane for s in sessions
            for lane in (Lane(s, "load", loads), Lane(s, "store", plan.in_flight - loads, loads))]


async def run(plan: Plan, progress: Callable[[str], None] = lambda _: None) -> list[Measured]:
    """Connect ``connections`` sessions, run every size (``trials`` times), say GOODBYE with
    RELEASE. A size cut short (Ctrl-C, a connection lost) ends the run: the sizes so far are
    returned, the last one ``cut``."""
    sessions: list[Session] = []
    out: list[Measured] = []
    try:
        for number in range(1, plan.connections + 1):  # each with an Initiator ID of its own
            try:
                sessions.append(Session(plan, await _connect(plan)))
            except LOST as exc:
                raise NotStarted(exc) from exc
            except KbtpError as exc:
                if plan.connections == 1 or isinstance(exc, PeerLimit):
                    raise
                raise SessionRefused(number, plan.connections, exc) from exc
            _check(sessions[-1].ini, plan)
        lanes = _lanes(plan, sessions)
        block_size = _info(sessions[0].ini).block_size
        what = "load and store" if plan.bidirectional else plan.op
        for size in plan.sizes or (sweep(block_size) if plan.all_sizes else [block_size]):
            for trial in range(1, plan.trials + 1):
                if plan.interrupted:
                    return out
                progress(f"{what} of {size} octets, {plan.in_flight} in flight"
                         + (f" in each of {plan.connections} sessions" if plan.connections > 1 else "")
                         + (f", trial {trial} of {plan.trials}" if plan.trials > 1 else ""))
                out.append(await _one_size(lanes, plan, size))
                if plan.trials > 1:
                    out[-1].trial = trial
                if out[-1].cut is not None:
                    return out
        return out
    finally:
        if not (out and isinstance(out[-1].cut, LOST)):
            for session in sessions:
                await session.ini.end(release=True)


async def _connect(plan: Plan, initiator_id: bytes | None = None) -> Initiator:
    return await Initiator.connect(plan.url, initiator_id=initiator_id or os.urandom(16),
                                   frame_listeners=plan.frame_listeners, limits=plan.limits,
                                   **plan.options)


class Session:
    """The bench's session, renewed when a ticket expired and the target revoked its Partition."""

    def __init__(self, plan: Plan, ini: Initiator) -> None:
        self.plan, self.ini = plan, ini
        self._renewing = asyncio.Lock()

    async def renew(self, failed: Initiator) -> None:
        """A new session in place of ``failed`` (once, however many workers saw it fail).
        DIRECT_ALLOC stays revoked for the rest of a session, so the old one is ended
        with GOODBYE RELEASE (from a new connection under its Initiator ID when the target
        ended its connection, tried again after a pause while the target still
        sees the old one: ALREADY_BOUND), lest the target keep it, and a fresh one begins."""
        async with self._renewing:
            if self.ini is not failed:
                return
            old = failed
            for attempt in range(1, RECONNECTS + 1):
                try:
                    if old.qp.closed:
                        old = await _connect(self.plan, failed.initiator_id)
                    await old.end(release=True)
                    break
                except (ConnectionLost, RemoteError):
                    continue                           # ended meanwhile: once more
                except KbtpError as refused:
                    if refused.name != "ALREADY_BOUND" or attempt == RECONNECTS:
                        raise
                    await asyncio.sleep(min(PAUSE_MAX, _info(failed).ticket_timeout_ms / 1000 * 2 ** attempt))
            self.ini = await _connect(self.plan)
            _check(self.ini, self.plan)


RECONNECTS = 10       # HELLOs a renewal tries while the target still sees the old connection,
PAUSE_MAX = 1.0       # pausing a Ticket Timeout, doubled each time, at most this many seconds


def _expired(exc: BaseException, took_ns: int, ini: Initiator) -> bool:
    """Whether a direct allocation failed because its ticket was abandoned: BIND refused
    so, or refused at all after the Ticket Timeout (a target that reclaimed the ticket
    no longer knows it), or the Write to the Partition refused (the target revoked it),
    ending the connection."""
    if isinstance(exc, KbtpError):
        return exc.name == "TICKET_ABANDONED" or took_ns >= _info(ini).ticket_timeout_ms * 1_000_000
    return isinstance(exc, (RemoteError, ConnectionLost))


def _info(ini: Initiator) -> TargetInfo:
    return ini.target                      # connect() returns after the HELLO_ACK only


def _check(ini: Initiator, plan: Plan) -> None:
    t = _info(ini)
    need = NEEDS.get(plan.op)
    if need is not None and not t.feature(need):
        raise BenchError(f"{plan.url} did not grant {need.name}, which --op {plan.op} needs")
    if plan.bidirectional and plan.in_flight < 2:
        raise BenchError("--bidirectional needs --in-flight 2 or more: half load, half store")
    if plan.in_flight > min(t.quota, t.handle_count):
        raise BenchError(f"--in-flight {plan.in_flight} needs a block each; the target's quota "
                         f"is {t.quota} blocks")
    too_big = [s for s in plan.sizes if s > t.block_size or s < 1]
    if too_big:
        raise BenchError(f"--size {too_big[0]}: the target's Block Size is {t.block_size} "
                         "(sizes are 1 to it)")


def _steps(ini: Initiator, plan: Plan, op: str, handle: int,
           data: bytes) -> Sequence[Callable[[], Awaitable[Result]]]:
    """The requests of one iteration on ``handle``, as OPERATIONS names them."""
    size = len(data)
    return {
        "load": [lambda: ini.load(handle, length=size)],
        "store": [lambda: ini.store(handle, data, inline=plan.inline)],
        "alloc_store": [lambda: ini.alloc_store(handle, data, inline=plan.inline),
                        lambda: ini.free(handle)],
        "direct_load": [lambda: ini.direct_load(handle)],
        "direct_alloc": [lambda: ini.direct_alloc(handle, data), lambda: ini.free(handle)],
    }[op]


async def _prepare(lane: Lane, data: bytes) -> None:
    """Blocks for the operations that need one bound: sealed to load, open to store."""
    if lane.op in ("load", "direct_load", "store"):
        ini = lane.session.ini
        await asyncio.gather(*(ini.alloc_store(h, data, seal=lane.op != "store") for h in lane.handles()))


async def _clean(lane: Lane) -> None:
    if lane.op in ("load", "direct_load", "store"):
        ini = lane.session.ini
        await asyncio.gather(*(ini.free(h) for h in lane.handles()))


async def _one_size(lanes: list[Lane], plan: Plan, size: int) -> Measured:
    """Every lane at once on ``size`` octets; the samples of one request kind are summed
    over the lanes (perftest -q reports the sum of its connections)."""
    data = os.urandom(size)
    await asyncio.gather(*(_prepare(lane, data) for lane in lanes))
    samples: dict[str, Samples] = {}
    for lane in lanes:
        for n in OPERATIONS[lane.op]:
            samples.setdefault(n, Samples(n, 0 if n == "FREE" else size))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (plan.duration or 0)
    start = time.perf_counter_ns()
    cut: list[BaseException] = []                      # the first connection error, if any

    async def lane_run(lane: Lane) -> None:
        session, names = lane.session, OPERATIONS[lane.op]
        budget = [plan.iterations or 0]                # this lane's iterations still to start
        direct = lane.op in NEEDS

        def more() -> bool:
            if plan.interrupted or cut:
                return False
            if plan.iterations:
                budget[0] -= 1
                return budget[0] >= 0
            return loop.time() < deadline

        async def worker(w: int) -> None:
            while more():
                ini = session.ini                      # a new one after an expired ticket
                handle = _info(ini).handle_base + lane.first + w
                for name, call in zip(names, _steps(ini, plan, lane.op, handle, data)):
                    began = time.perf_counter_ns()
                    try:
                        result = await call()
                    except (KbtpError, RemoteError, ConnectionLost) as exc:
                        if direct and _expired(exc, time.perf_counter_ns() - began, ini):
                            if name == names[0]:
                                samples[name].expired += 1
                                if plan.iterations and samples[name].expired <= plan.iterations:
                                    budget[0] += 1     # taken again, at most once an iteration
                            elif session.ini is ini:   # the session ended under a later step
                                samples[name].errors += 1
                            await session.renew(ini)
                            break
                        if not isinstance(exc, KbtpError):
                            raise
                        samples[name].errors += 1
                        continue
                    ended = time.perf_counter_ns()
                    wire = (result.answered_ns - result.sent_ns
                            if result.sent_ns and not (direct and name == names[0]) else ended - began)
                    samples[name].add(wire, ended - began, ended - start)

        async def guarded(w: int) -> None:
            """One worker; a lost connection stops them all, keeping what completed."""
            try:
                await worker(w)
            except LOST as exc:
                cut.append(exc)

        await asyncio.gather(*(guarded(w) for w in range(lane.workers)))

    cpu = time.process_time()
    await asyncio.gather(*(lane_run(lane) for lane in lanes))
    cpu = time.process_time() - cpu
    seconds = (time.perf_counter_ns() - start) / 1e9
    last = max((x.done_at[-1] for x in samples.values() if x.done_at), default=0)
    if cut and last:
        seconds = last / 1e9          # not the wait for the RNIC to give the connection up
    ended = cut[0] if cut else Interrupted() if plan.interrupted else None
    if not cut:
        await asyncio.gather(*(_clean(lane) for lane in lanes))
    for first in (samples[OPERATIONS[lane.op][0]] for lane in lanes):
        if not first.latencies and ended is None:
            raise BenchError(f"no {first.op} completed ({first.errors} failed"
                             + (f", {first.expired} tickets expired: each took longer than the Ticket "
                                f"Timeout of {_info(lanes[0].session.ini).ticket_timeout_ms} ms"
                                if first.expired else "")
                             + ")")
    return Measured(size, samples, seconds, cpu, ended)
