"""What a case works with: sessions with the target under test, and ways to judge them.

Cases do not depend on one another. Every session is opened with a fresh random
Initiator ID (and the run's frame listener, so the frames of a case can be kept for its
pcap), and every handle a case asks for is one no earlier case of the run was given. At
the end of a case the checker frees every handle it gave the case and ends each of its
sessions with GOODBYE RELEASE, so a target whose RELEASE is broken fails the case that
checks RELEASE and not the others. Should such a target, still keeping the old sessions,
refuse a fresh Initiator ID, the case reconnects with an ID of an earlier case (the
target then gives that range back, which the checker had cleaned up) and says so.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Awaitable, Coroutine, Iterable
from pathlib import Path
from typing import Any

from .. import codec
from ..initiator import Initiator, KbtpError, PeerLimit, Result, SessionEnded
from ..initiator.client import ALL_FEATURES, COMPLETION_BUFFER
from ..initiator.limits import Limits
from ..initiator.results import TargetInfo
from ..rnic import MemoryTable, QueuePair, connect as rdma_connect
from ..rnic.pcap import PcapSink
from ..rnic.qp import ConnectionLost, Received, RemoteError
from ..tables.enums import STATUS
from ..vocab import AnyMessage, Feature, Opcode
from .hold import ReadHold
from .pace import NoAnswer
from .registry import Broke, Fail, Rule, SetupFailed, Skip

#: what a FREE that makes room answers: the handle was bound (OK) or was not (NOT_VALID)
UNBOUND = ("OK", "NOT_VALID")


class FrameBuffer:
    """A frame listener that keeps the current case's frames in memory, for a pcap written
    only when the case's verdict asks for one."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes, int]] = []

    def __call__(self, direction: str, frame: bytes, ns: int) -> None:
        self.frames.append((direction, bytes(frame), ns))

    def write(self, path: Path) -> None:
        """The frames as a capture, each at its own time."""
        path.parent.mkdir(parents=True, exist_ok=True)
        sink = PcapSink(path)
        for frame in self.frames:
            sink(*frame)
        sink.close()


class RunState:
    """What the cases of one run share: the handles given out and the Initiator IDs whose
    sessions ended, so that no case inherits what another left behind."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits      # the checker's own bounds on a HELLO_ACK (--max-block-size)
        self.used: set[int] = set()
        self.retired: list[bytes] = []
        self.crowded = False      # a fresh Initiator ID was refused: try earlier ones first


def session_options(local: str | None, state: RunState | None) -> dict[str, Any]:
    """What every ``Initiator.connect`` of a run passes: ``--local`` and the run's limits."""
    options: dict[str, Any] = {"local": local} if local else {}
    if state is not None and state.limits is not None:
        options["limits"] = state.limits
    return options


def close_all(coros: Iterable[Coroutine]) -> None:
    """Close requests a case built but did not send (a Fail came first): no "never awaited"."""
    for coro in coros:
        coro.close()


def describe(exc: BaseException, timeout: float) -> str:
    """What an exception says happened, never empty (a timeout has no message)."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return str(exc).strip() or f"no answer within {timeout:g} s"     # the RNIC's says what
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there)"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Ctx:
    """One case's view of the target: ``url``, the probe's ``info``, ``timeout`` per wait."""

    def __init__(self, url: str, transport: str, info: TargetInfo, *, timeout: float,
                 local: str | None, frames: FrameBuffer, run: RunState | None = None) -> None:
        self.url, self.transport, self.info, self.timeout = url, transport, info, timeout
        self.frames = frames
        self.run = run or RunState()
        self._rnic: dict[str, Any] = {"local": local} if local else {}     # a bare RDMA connection's
        self._options = session_options(local, self.run)                  # a session's
        self.sessions: list[Initiator] = []
        self._qps: list[QueuePair] = []
        self._ids: dict[bytes, bool] = {}          # Initiator ID -> released
        self._given: dict[bytes, list[int]] = {}   # Initiator ID -> handles given to the case
        self._rids = itertools.count(0x7000_0000)  # raw Request IDs, apart from the initiator's
        self.notes: list[str] = []

    # -- sessions ------------------------------------------------------------------------

    async def connect(self, *, features: int = ALL_FEATURES, need: int = 0,
                      initiator_id: bytes | None = None, credits: int = 32,
                      invalidate: bool = True) -> Initiator:
        """A new session; ``Skip`` when the target does not grant the ``need`` features."""
        ini = None
        if initiator_id is None and self.run.crowded:   # fresh IDs were refused before
            ini = await self._reuse(features, need, credits, invalidate)
        if ini is None:
            ini = await self._fresh(initiator_id, features, need, credits, invalidate)
        missing = need & ~ini.target.features
        if missing:
            names = [n for n, f in Feature.__members__.items() if f & missing]
            raise Skip(f"the target did not grant {'/'.join(names)} to this session")
        return ini

    async def _fresh(self, initiator_id: bytes | None, features: int, need: int, credits: int,
                     invalidate: bool) -> Initiator:
        ident = initiator_id or self.new_id()
        try:
            return await self._open(ident, features, credits, invalidate)
        except KbtpError as refused:
            if initiator_id is not None:
                raise SetupFailed("HELLO", "HELLO_ACK Status OK", refused.name) from None
            del self._ids[ident]                  # never had a session: nothing to release
            self.run.crowded = True
            ini = await self._reuse(features, need, credits, invalidate)
            if ini is None:
                raise SetupFailed("HELLO with a fresh Initiator ID", "HELLO_ACK Status OK",
                                  f"{refused.name}, and no Initiator ID of an earlier case was "
                                  "accepted either; the target may admit too few initiators at "
                                  "once") from None
            return ini

    async def _reuse(self, features: int, need: int, credits: int, invalidate: bool) -> Initiator | None:
        """A session under the Initiator ID of an earlier case (one granted the ``need``
        features, if any is), for a target that refuses fresh ones: an ID it still keeps
        gives back a range the checker cleaned up, one it forgot is as good as fresh."""
        for ident in list(self.run.retired):
            try:
                ini = await self._open(ident, features, credits, invalidate)
            except KbtpError as refused:
                if refused.name != "ALREADY_BOUND":   # not kept, and no room for it either
                    self.run.retired.remove(ident)
                continue
            if need & ~ini.target.features and ident != self.run.retired[-1]:
                self.sessions.remove(ini)
                self._ids.pop(ident)
                await _quietly(asyncio.wait_for(ini.goodbye(release=True), self.timeout))
                continue
            self.run.retired.remove(ident)
            self.note("the target refused a HELLO with a fresh Initiator ID (no room); the case "
                      "reconnected with the Initiator ID of an earlier case, whose session it "
                      "kept after GOODBYE with RELEASE")
            return ini
        return None

    async def _open(self, ident: bytes, features: int, credits: int = 32,
                    invalidate: bool = True) -> Initiator:
        try:
            ini = await self.wait(Initiator.connect(
                self.url, initiator_id=ident, features=features, credits=credits,
                invalidate=invalidate, frame_listeners=[self.frames], **self._options), "HELLO_ACK")
        except PeerLimit as exc:      # the target asks the checker for more than it spends
            raise Fail("a HELLO_ACK within the checker's limits", exc.detail) from None
        self.sessions.append(ini)
        self._ids[ident] = False
        return ini

    def new_id(self) -> bytes:
        """A fresh Initiator ID, released at the end of the case."""
        ident = secrets.token_bytes(16)
        self._ids[ident] = False
        return ident

    async def hello_status(self, initiator_id: bytes, features: int = 0) -> tuple[str, Initiator | None]:
        """HELLO with ``initiator_id``: the HELLO_ACK Status name and the session if OK."""
        try:
            return "OK", await self._open(initiator_id, features)
        except KbtpError as refused:
            return refused.name, None

    async def reconnect(self, ini: Initiator, features: int = 0) -> Initiator:
        """A new session with ``ini``'s Initiator ID, once the target sees the old one gone:
        HELLOs for as long as the checker waits for any answer (a busy target notices late)."""
        loop = asyncio.get_running_loop()
        deadline, status = loop.time() + self.timeout, ""
        while True:
            status, new = await self.hello_status(ini.initiator_id, features)
            if new is not None:
                return new
            if loop.time() >= deadline:
                raise Fail("a HELLO with the Initiator ID of an ended session accepted within "
                           f"{self.timeout:g} s", f"HELLO_ACK Status {status}")
            await asyncio.sleep(0.3)

    async def raw_qp(self) -> QueuePair:
        """A bare RDMA connection (no HELLO yet) with receive buffers posted."""
        qp = await self.wait(rdma_connect(self.url, MemoryTable(), recv_size=COMPLETION_BUFFER,
                                          frame_listeners=[self.frames], **self._rnic),
                             "an RDMA connection")
        self._qps.append(qp)
        qp.post_recv(4)
        return qp

    async def goodbye(self, ini: Initiator, release: bool) -> None:
        await self.wait(ini.goodbye(release=release), "the connection closed after GOODBYE")
        if release:
            self._ids[ini.initiator_id] = True

    # -- handles -------------------------------------------------------------------------

    async def handles(self, ini: Initiator, count: int = 1) -> list[int]:
        """``count`` handles of ``ini``'s range that no case of this run was given before;
        once every handle of the range was, handles a FREE leaves unbound (OK: it was
        still bound; NOT_VALID: it was not)."""
        base, size = ini.target.handle_base, ini.target.handle_count
        fresh = list(itertools.islice((h for h in range(base, base + size) if h not in self.run.used),
                                      count))
        if len(fresh) < count:
            for h in range(base, base + size):
                if h in fresh or await self._free(ini, h) not in UNBOUND:
                    continue
                fresh.append(h)
                if len(fresh) == count:
                    break
            else:
                raise SetupFailed(f"choosing {count} handles of the range {base:#x}+{size}",
                                  f"{count} handles that FREE leaves unbound", f"only {len(fresh)}")
        self.run.used.update(fresh)
        self._given.setdefault(ini.initiator_id, []).extend(fresh)
        return fresh

    async def _free(self, ini: Initiator, h: int) -> str:
        """The Status of a FREE that makes room for the case."""
        try:
            await self._prepare(ini.free(h), f"FREE of 0x{h:x} (making room for the case)", ini)
        except KbtpError as exc:
            return exc.name
        return "OK"

    async def handle(self, ini: Initiator) -> int:
        return (await self.handles(ini))[0]

    async def claim(self, ini: Initiator, h: int) -> int:
        """Handle ``h`` of ``ini``'s range for the case (the last of a range, say), freed
        first when an earlier case of the run was given it."""
        status = await self._free(ini, h) if h in self.run.used else "OK"
        if status not in UNBOUND:
            raise Broke(Rule.STATUS, f"FREE of 0x{h:x} (making room for the case)", "OK or NOT_VALID",
                        status)
        self.run.used.add(h)
        self._given.setdefault(ini.initiator_id, []).append(h)
        return h

    async def close(self) -> None:
        """Free every handle the case was given and end each of its sessions with GOODBYE
        RELEASE; errors here never change a verdict."""
        for qp in self._qps:
            await _quietly(asyncio.wait_for(qp.close(), self.timeout))
        open_sessions = {ini.initiator_id: ini for ini in self.sessions if not ini.qp.closed}
        for ident, released in self._ids.items():
            given = self._given.get(ident, [])
            if released and not given:
                continue
            ini = open_sessions.get(ident) or await self._rejoin(ident)
            if ini is not None:
                if given:
                    await _quietly(asyncio.wait_for(asyncio.gather(
                        *(ini.free(h) for h in given), return_exceptions=True), self.timeout))
                await _quietly(asyncio.wait_for(ini.goodbye(release=True), self.timeout))
            self.run.retired.append(ident)
        for ini in self.sessions:
            await _quietly(ini.close())
        self.sessions.clear()

    async def _rejoin(self, ident: bytes) -> Initiator | None:
        """A session with ``ident`` for cleaning up, waiting while the target still sees
        the old connection as active."""
        for _ in range(3):
            try:
                return await asyncio.wait_for(Initiator.connect(
                    self.url, initiator_id=ident, features=0, **self._options), self.timeout)
            except KbtpError:
                await asyncio.sleep(0.3)
            except (TimeoutError, Exception):
                return None
        return None

    # -- waiting and judging -------------------------------------------------------------

    async def wait(self, coro: Awaitable, what: str = "a completion") -> Any:
        """Await ``coro``; no answer in time, or a lost connection, is the target's failure."""
        try:
            return await asyncio.wait_for(coro, self.timeout)
        except TimeoutError:
            raise NoAnswer(what, f"nothing within {self.timeout:g} s") from None
        except (ConnectionLost, RemoteError) as exc:
            raise Fail(what, f"the connection failed ({describe(exc, self.timeout)})") from None

    async def setup(self, coro: Awaitable[Result], step: str, session: Initiator | None = None) -> Result:
        """A request of ``session`` that only prepares the case: it must complete OK. When
        it does not, the target broke a rule (``Broke``; NO_SPACE within the session's quota
        breaks the quota's promise), unless the checker asked for more than the quota
        (``SetupFailed``)."""
        try:
            return await self._prepare(coro, step, session)
        except KbtpError as exc:
            if exc.name != "NO_SPACE" or session is None:
                raise Broke(Rule.STATUS, step, "OK", str(exc) or exc.name) from None
            quota, usage = session.target.quota, session.usage
            if usage >= quota:
                raise SetupFailed(step, "OK", f"NO_SPACE: the case needs more than the quota of "
                                              f"{quota}") from None
            raise Broke(Rule.QUOTA, step, "OK", f"NO_SPACE with {usage} of the quota of {quota} "
                                                "in use") from None

    async def _prepare(self, coro: Awaitable[Result], step: str, session: Initiator | None) -> Result:
        """Await a set-up request; no answer, or the connection ending under a request that
        the initiator sent within its credits (on RoCEv2 RNR NAKs, no buffer for it), is
        the target's breach (``Broke``)."""
        closed = session is not None and session.qp.closed     # then the request is never sent
        naks = _rnr_naks(session)
        try:
            return await asyncio.wait_for(coro, self.timeout)
        except TimeoutError:
            refused = _rnr_naks(session) - naks
            if refused:
                raise Broke(Rule.CREDITS, step, "a COMPLETION (the request was within the Request "
                            "Credits)", f"{refused} RNR NAK(s): the request found no receive buffer, "
                            f"and no COMPLETION within {self.timeout:g} s") from None
            raise Broke(Rule.ANSWERED, step, "a COMPLETION", f"nothing within {self.timeout:g} s") from None
        except (ConnectionLost, RemoteError) as exc:
            seen = f"the connection failed ({describe(exc, self.timeout)})"
            if closed:
                raise SetupFailed(step, "an open session", seen) from None
            raise Broke(Rule.CREDITS, step, "a COMPLETION (the request was within the Request Credits)",
                        seen) from None

    async def outcome(self, coro: Awaitable[Result]) -> tuple[str, Result | None]:
        """The status name of a request and its result (None when not completed OK)."""
        try:
            return "OK", await self.wait(coro)
        except KbtpError as exc:
            return exc.name, exc.result

    async def expect(self, coro: Awaitable[Result], status: str, what: str) -> Result | None:
        got, result = await self.outcome(coro)
        if got != status:
            raise Fail(f"{what}: {status}", got)
        return result

    async def expect_each(self, pairs: list[tuple[Coroutine[Any, Any, Result], str, str]]) -> None:
        """``expect`` on each request in order; those a failure leaves unsent are closed."""
        try:
            for coro, status, what in pairs:
                await self.expect(coro, status, what)
        finally:
            close_all(coro for coro, _, _ in pairs)

    async def ok(self, coro: Awaitable[Result], what: str) -> Result:
        result = await self.expect(coro, "OK", what)
        assert result is not None            # a request that completed OK has its Result
        return result

    @staticmethod
    def check(condition: bool, expected: str, seen: Any) -> None:
        if not condition:
            raise Fail(expected, str(seen))

    def note(self, text: str) -> None:
        """Information: a point where the target chose otherwise than the reference did."""
        self.notes.append(text)

    def skip(self, reason: str) -> None:
        raise Skip(reason)

    # -- raw requests --------------------------------------------------------------------

    def hold_reads(self, ini: Initiator) -> ReadHold:
        """Hold back the answers to the target's RDMA Reads on ``ini``'s connection."""
        return ReadHold(ini.qp)

    @staticmethod
    def send(ini: Initiator, messages: list[bytes]) -> None:
        """Post raw requests, in order, without waiting for anything (a failure to deliver
        one ends the connection, which is what a case then sees)."""
        for message in messages:
            ini.qp.send(message, signaled=False)

    async def collect(self, ini: Initiator, count: int, within: float | None = None) -> list[AnyMessage | None]:
        """Up to ``count`` completions of raw requests arriving within ``within`` seconds
        (default ``timeout``), decoded (None for what is no COMPLETION)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if within is None else within)
        out: list[AnyMessage | None] = []
        while len(out) < count and (remaining := deadline - loop.time()) > 0:
            try:
                msg = await asyncio.wait_for(ini.unmatched.get(), remaining)
            except TimeoutError:
                break
            try:
                out.append(None if msg.write_imm else codec.decode(msg.payload, ini.addr_le))
            except codec.Malformed:
                out.append(None)
        return out

    def rid(self) -> int:
        return next(self._rids)

    def encode(self, ini: Initiator, values: AnyMessage) -> bytes:
        return codec.encode({"request_id": self.rid(), **values}, ini.addr_le)

    async def raw(self, ini: Initiator, message: bytes, expect: int = 1) -> list[tuple[AnyMessage | None, Received]]:
        """Send any octets as a request; what came back, decoded where it decodes (a case
        that ends the connection judges ``ini.qp.closed`` itself)."""
        try:
            got = await ini.raw(message, timeout=self.timeout, expect=expect)
        except SessionEnded as ended:
            got = ended.answers
        out = []
        for msg in got:
            try:
                out.append((None if msg.write_imm else codec.decode(msg.payload, ini.addr_le), msg))
            except codec.Malformed:
                out.append((None, msg))
        return out

    async def answer(self, ini: Initiator, message: bytes, what: str) -> AnyMessage:
        """The one COMPLETION a raw request gets; ``Fail`` when none comes or it is no COMPLETION."""
        got = await self.raw(ini, message)
        if not got:
            why = "the connection closed" if ini.qp.closed else f"nothing within {self.timeout:g} s"
            raise Fail(f"{what}: a COMPLETION", why)
        decoded, msg = got[0]
        if decoded is None or decoded["opcode"] != Opcode.COMPLETION:
            raise Fail(f"{what}: a COMPLETION", msg.payload.hex() or "an RDMA Write with Immediate")
        return decoded


def _rnr_naks(session: Initiator | None) -> int:
    """The RNR NAKs ``session``'s connection has had (RoCEv2: a request found no buffer)."""
    return session.qp.stats.get("rnr_naks", 0) if session is not None else 0


def status_name(value: int) -> str:
    return STATUS.describe(value)


async def _quietly(coro: Awaitable) -> None:
    try:
        await coro
    except (TimeoutError, Exception):
        pass
