"""What a case works with: sessions with the target under test, and ways to judge them.

Every session is the reference initiator's, opened with a fresh random Initiator ID and
with the run's frame listener, so the frames of a case can be kept for its pcap. At the
end of a case every Initiator ID it used is released (GOODBYE with RELEASE, reconnecting
first when its connection is gone), so cases do not use up the target's handle ranges.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from typing import Any, Awaitable

from .. import codec
from ..initiator import Initiator, KbtpError, Result
from ..initiator.client import ALL_FEATURES, COMPLETION_BUFFER
from ..initiator.results import TargetInfo
from ..rnic import MemoryTable, QueuePair, connect as rdma_connect
from ..rnic.qp import ConnectionLost, Received, RemoteError
from ..tables.enums import FEATURES, OPCODES, STATUS
from .registry import Fail, Skip

OP = OPCODES.by_name()
FEATURE = {f.name: f.value for f in FEATURES.flags}

class FrameBuffer:
    """A frame listener that keeps ``(time, frame)`` of the current case in memory."""

    def __init__(self) -> None:
        self.frames: list[tuple[float, bytes]] = []

    def __call__(self, direction: str, frame: bytes) -> None:
        self.frames.append((time.time(), bytes(frame)))

class Ctx:
    """One case's view of the target: ``url``, the probe's ``info``, ``timeout`` per wait."""

    def __init__(self, url: str, transport: str, info: TargetInfo, *, timeout: float,
                 local: str | None, frames: FrameBuffer) -> None:
        self.url, self.transport, self.info, self.timeout = url, transport, info, timeout
        self.frames = frames
        self._options: dict[str, Any] = {"local": local} if local else {}
        self.sessions: list[Initiator] = []
        self._qps: list[QueuePair] = []
        self._ids: dict[bytes, bool] = {}          # Initiator ID -> released
        self._rids = itertools.count(0x7000_0000)  # raw Request IDs, apart from the initiator's
        self.notes: list[str] = []

    # -- sessions ------------------------------------------------------------------------

    async def connect(self, *, features: int = ALL_FEATURES, need: int = 0,
                      initiator_id: bytes | None = None, credits: int = 32,
                      invalidate: bool = True) -> Initiator:
        """A new session; ``Skip`` when the target does not grant the ``need`` features."""
        try:
            ini = await self._open(initiator_id or self.new_id(), features, credits, invalidate)
        except KbtpError as refused:
            raise RuntimeError(f"the target refused a HELLO ({refused.name}); it may admit too "
                               "few initiators at once for this case") from None
        missing = need & ~ini.target.features
        if missing:
            names = [n for n, v in FEATURE.items() if v & missing]
            raise Skip(f"the target did not grant {'/'.join(names)} to this session")
        return ini

    async def _open(self, ident: bytes, features: int, credits: int = 32,
                    invalidate: bool = True) -> Initiator:
        ini = await self.wait(Initiator.connect(
            self.url, initiator_id=ident, features=features, credits=credits,
            invalidate=invalidate, frame_listeners=[self.frames], **self._options), "HELLO_ACK")
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
        """A new session with ``ini``'s Initiator ID, once the target sees the old one gone."""
        status = ""
        for _ in range(10):
            status, new = await self.hello_status(ini.initiator_id, features)
            if new is not None:
                return new
            await asyncio.sleep(0.3)
        raise Fail("a HELLO with the Initiator ID of an ended session accepted",
                   f"HELLO_ACK Status {status}")

    async def raw_qp(self) -> QueuePair:
        """A bare RDMA connection (no HELLO yet) with receive buffers posted."""
        qp = await self.wait(rdma_connect(self.url, MemoryTable(), recv_size=COMPLETION_BUFFER,
                                          frame_listeners=[self.frames], **self._options),
                             "an RDMA connection")
        self._qps.append(qp)
        qp.post_recv(4)
        return qp

    async def goodbye(self, ini: Initiator, release: bool) -> None:
        await self.wait(ini.goodbye(release=release), "the connection closed after GOODBYE")
        if release:
            self._ids[ini.initiator_id] = True

    async def close(self) -> None:
        """Release every Initiator ID the case used; errors here never change a verdict."""
        for qp in self._qps:
            await _quietly(asyncio.wait_for(qp.close(), self.timeout))
        for ini in self.sessions:
            if not ini.qp.closed:
                try:
                    await asyncio.wait_for(ini.goodbye(release=True), self.timeout)
                    self._ids[ini.initiator_id] = True
                except (Exception, asyncio.TimeoutError):
                    await _quietly(ini.close())
        for ident, released in self._ids.items():
            for _ in range(3 if not released else 0):
                try:
                    ini = await asyncio.wait_for(Initiator.connect(
                        self.url, initiator_id=ident, features=0, **self._options), self.timeout)
                except KbtpError:
                    await asyncio.sleep(0.3)        # the old connection is still seen as active
                    continue
                except (Exception, asyncio.TimeoutError):
                    break
                await _quietly(asyncio.wait_for(ini.goodbye(release=True), self.timeout))
                break
        self.sessions.clear()

    # -- waiting and judging -------------------------------------------------------------

    async def wait(self, coro: Awaitable, what: str = "a completion") -> Any:
        """Await ``coro``; no answer in time, or a lost connection, is the target's failure."""
        try:
            return await asyncio.wait_for(coro, self.timeout)
        except asyncio.TimeoutError:
            raise Fail(what, f"nothing within {self.timeout:g} s") from None
        except (ConnectionLost, RemoteError) as exc:
            raise Fail(what, f"the connection failed ({exc})") from None

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

    async def ok(self, coro: Awaitable[Result], what: str) -> Result:
        return await self.expect(coro, "OK", what)

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

    def rid(self) -> int:
        return next(self._rids)

    def encode(self, ini: Initiator, values: dict[str, Any]) -> bytes:
        return codec.encode({"request_id": self.rid(), **values}, ini.addr_le)

    async def raw(self, ini: Initiator, message: bytes, expect: int = 1) -> list[tuple[dict | None, Received]]:
        """Send any octets as a request; what came back, decoded where it decodes."""
        got = await ini.raw(message, timeout=self.timeout, expect=expect)
        out = []
        for msg in got:
            try:
                out.append((None if msg.write_imm else codec.decode(msg.payload, ini.addr_le), msg))
            except codec.Malformed:
                out.append((None, msg))
        return out

    async def answer(self, ini: Initiator, message: bytes, what: str) -> dict:
        """The one COMPLETION a raw request gets; ``Fail`` when none comes or it is no COMPLETION."""
        got = await self.raw(ini, message)
        if not got:
            why = "the connection closed" if ini.qp.closed else f"nothing within {self.timeout:g} s"
            raise Fail(f"{what}: a COMPLETION", why)
        decoded, msg = got[0]
        if decoded is None or decoded["opcode"] != OP["COMPLETION"]:
            raise Fail(f"{what}: a COMPLETION", msg.payload.hex() or "an RDMA Write with Immediate")
        return decoded

def status_name(value: int) -> str:
    return STATUS.describe(value)

async def _quietly(coro: Awaitable) -> None:
    try:
        await coro
    except (Exception, asyncio.TimeoutError):
        pass
