"""One benchmark run against any KBTP target, in perftest's manner: one session, N requests
in flight (one worker per request, each on a handle of its own), for a duration or an
iteration count, every request timed from posting to completion.

The data path is the reference initiator's, on the codec: no Scapy object per request.

A DIRECT_ALLOC whose ticket outlived the Ticket Timeout (a bench slower than the target
expects, on a busy host) is abandoned by the target, which revokes the session's Partition:
the bench counts it as expired, not as an error, and goes on in a new session.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..initiator import Initiator, KbtpError, Limits, Result, TargetInfo
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


@dataclass
class Measured:
    """One size's run: each request kind's samples, the wall and CPU time they took."""

    size: int
    samples: dict[str, Samples]
    seconds: float
    cpu_seconds: float
    cut: BaseException | None = None     # what ended it before its plan: Interrupted or LOST

    def rows(self) -> list[dict[str, Any]]:
        total = sum(len(s.latencies) for s in self.samples.values())
        out = []
        for s in self.samples.values():
            row = s.summary(self.seconds, self.cpu_seconds, total)
            row["cpu_percent"] = round(100 * self.cpu_seconds / self.seconds, 1) if self.seconds else None
            if self.cut is not None:
                row["partial"] = True
            out.append(row)
        return out


async def run(plan: Plan, progress: Callable[[str], None] = lambda _: None) -> list[Measured]:
    """Connect, run every size, say GOODBYE with RELEASE. A size cut short (Ctrl-C, the
    connection lost) ends the run: the sizes so far are returned, the last one ``cut``."""
    session = Session(plan, await _connect(plan))
    out: list[Measured] = []
    try:
        _check(session.ini, plan)
        for size in plan.sizes or [_info(session.ini).block_size]:
            if plan.interrupted:
                break
            progress(f"{plan.op} of {size} octets, {plan.in_flight} in flight")
            out.append(await _one_size(session, plan, size))
            if out[-1].cut is not None:
                break
        return out
    finally:
        if not (out and isinstance(out[-1].cut, LOST)):
            await _end(session.ini)


async def _connect(plan: Plan, initiator_id: bytes | None = None) -> Initiator:
    return await Initiator.connect(plan.url, initiator_id=initiator_id or os.urandom(16),
                                   frame_listeners=plan.frame_listeners, limits=plan.limits,
                                   **plan.options)


async def _end(ini: Initiator) -> None:
    if not ini.qp.closed:
        await ini.goodbye(release=True)


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
                    await _end(old)
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
    if plan.in_flight > min(t.quota, t.handle_count):
        raise BenchError(f"--in-flight {plan.in_flight} needs a block each; the target's quota "
                         f"is {t.quota} blocks")
    too_big = [s for s in plan.sizes if s > t.block_size or s < 1]
    if too_big:
        raise BenchError(f"--size {too_big[0]}: the target's Block Size is {t.block_size} "
                         "(sizes are 1 to it)")


def _steps(ini: Initiator, plan: Plan, handle: int, data: bytes) -> Sequence[Callable[[], Awaitable[Result]]]:
    """The requests of one iteration on ``handle``, as OPERATIONS names them."""
    size = len(data)
    return {
        "load": [lambda: ini.load(handle, length=size)],
        "store": [lambda: ini.store(handle, data, inline=plan.inline)],
        "alloc_store": [lambda: ini.alloc_store(handle, data, inline=plan.inline),
                        lambda: ini.free(handle)],
        "direct_load": [lambda: ini.direct_load(handle)],
        "direct_alloc": [lambda: ini.direct_alloc(handle, data), lambda: ini.free(handle)],
    }[plan.op]


async def _prepare(ini: Initiator, plan: Plan, handles: list[int], data: bytes) -> None:
    """Blocks for the operations that need one bound: sealed to load, open to store."""
    if plan.op in ("load", "direct_load", "store"):
        await asyncio.gather(*(ini.alloc_store(h, data, seal=plan.op != "store") for h in handles))


async def _clean(ini: Initiator, plan: Plan, handles: list[int]) -> None:
    if plan.op in ("load", "direct_load", "store"):
        await asyncio.gather(*(ini.free(h) for h in handles))


async def _one_size(session: Session, plan: Plan, size: int) -> Measured:
    data = os.urandom(size)
    ini = session.ini
    handles = [_info(ini).handle_base + w for w in range(plan.in_flight)]
    await _prepare(ini, plan, handles, data)
    names = OPERATIONS[plan.op]
    samples = {n: Samples(n, 0 if n == "FREE" else size) for n in names}
    first = samples[names[0]]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (plan.duration or 0)
    budget = [plan.iterations or 0]                    # iterations still to start, all workers
    start = time.perf_counter_ns()

    cut: list[BaseException] = []                      # the first connection error, if any

    def more() -> bool:
        if plan.interrupted or cut:
            return False
        if plan.iterations:
            budget[0] -= 1
            return budget[0] >= 0
        return loop.time() < deadline

    direct = plan.op in NEEDS and names[0] != "FREE"

    async def worker(w: int) -> None:
        while more():
            ini = session.ini                          # a new one after an expired ticket
            handle = _info(ini).handle_base + w
            for name, call in zip(names, _steps(ini, plan, handle, data)):
                began = time.perf_counter_ns()
                try:
                    result = await call()
                except (KbtpError, RemoteError, ConnectionLost) as exc:
                    if direct and _expired(exc, time.perf_counter_ns() - began, ini):
                        if name == names[0]:
                            samples[name].expired += 1
                            if plan.iterations and samples[name].expired <= plan.iterations:
                                budget[0] += 1         # taken again, at most once an iteration
                        elif session.ini is ini:       # the session ended under a later step
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

    cpu = time.process_time()
    await asyncio.gather(*(guarded(w) for w in range(plan.in_flight)))
    cpu = time.process_time() - cpu
    seconds = (time.perf_counter_ns() - start) / 1e9
    last = max((x.done_at[-1] for x in samples.values() if x.done_at), default=0)
    if cut and last:
        seconds = last / 1e9          # not the wait for the RNIC to give the connection up
    ended = cut[0] if cut else Interrupted() if plan.interrupted else None
    if not cut:
        await _clean(session.ini, plan, handles)
    if not first.latencies and ended is None:
        raise BenchError(f"no {names[0]} completed ({first.errors} failed"
                         + (f", {first.expired} tickets expired: each took longer than the Ticket "
                            f"Timeout of {_info(session.ini).ticket_timeout_ms} ms" if first.expired else "")
                         + ")")
    return Measured(size, samples, seconds, cpu, ended)
