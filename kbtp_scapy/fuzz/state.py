"""What the fuzzer learned from the wire: sessions, guard blocks, scratch handles, tickets.

Two sessions run side by side: ``own`` (the one being fuzzed) and ``peer``, a second
initiator whose sealed guard blocks sit just past ``own``'s handle range, so a request
that crosses the range edge has something to damage. Everything here is what HELLO_ACKs
and completions said; nothing is read from the target's internals.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from ..initiator import Initiator, KbtpError
from ..initiator.client import ALL_FEATURES
from ..rnic.qp import ConnectionLost, RemoteError
from .cases import SCRATCH

GUARDS = 2
CONNECT_TIMEOUT = 5.0


class HarnessError(Exception):
    """The run cannot start or go on; no verdict can be given."""


class Lost(Exception):
    """The session could not be resumed: the target stopped answering HELLO."""


class Rebuild(Exception):
    """The target gave a resumed session something else (another range): start afresh."""


@dataclass
class Block:
    """A handle's content as the wire showed it; ``data`` None when not known."""

    data: bytes | None
    generation: int
    sealed: bool = True


@dataclass
class Session:
    ini: Initiator
    initiator_id: bytes
    guards: dict[int, Block] = field(default_factory=dict)

    @property
    def base(self) -> int:
        return self.ini.target.handle_base

    @property
    def count(self) -> int:
        return self.ini.target.handle_count

    def owns(self, handle: int) -> bool:
        return self.base <= handle < self.base + self.count

    @property
    def alive(self) -> bool:
        return not self.ini.qp.closed


class World:
    """The two sessions and the model of ``own``'s scratch handles and tickets."""

    def __init__(self, url: str, options: dict, frame_listeners: list | None = None) -> None:
        self.url, self.options = url, options
        self.frame_listeners = frame_listeners or []
        self.own: Session | None = None
        self.peer: Session | None = None
        self.scratch: dict[int, Block | None] = {}   # handle -> known content, None unknown
        self.bound: dict[int, int] = {}              # Block Offset learned per bound handle
        self.tickets: dict[int, int] = {}            # taken, slot read, not yet bound: ticket -> block
        self.next_ticket = 0
        self.reconnects = 0

    async def connect(self, initiator_id: bytes | None = None, features: int = ALL_FEATURES) -> Initiator:
        ident = initiator_id or secrets.token_bytes(16)
        return await asyncio.wait_for(Initiator.connect(
            self.url, initiator_id=ident, features=features,
            frame_listeners=self.frame_listeners, **self.options), CONNECT_TIMEOUT)

    async def open(self) -> None:
        """Both sessions, each with sealed guard blocks of known content."""
        try:
            self.own, self.peer = await self._pair()
            for sess in (self.own, self.peer):
                await self._guards(sess)
        except KbtpError as exc:
            raise HarnessError(f"{self.url}: the target refused HELLO ({exc.name})") from None
        except (OSError, ConnectionLost, RemoteError, asyncio.TimeoutError, ValueError) as exc:
            raise HarnessError(f"{self.url}: cannot reach a KBTP target ({type(exc).__name__}: {exc})") from None
        self.scratch = {self.own.base + GUARDS + k: None for k in range(SCRATCH)}
        for h in self.scratch:                       # a known start: nothing bound
            try:
                await self.own.ini.free(h)
                self.scratch[h] = Block(None, 0)
            except KbtpError:
                pass

    async def _pair(self, tries: int = 4) -> tuple[Session, Session]:
        """Two sessions whose handle ranges touch, so requests past ``own``'s last handle
        land on ``peer``'s guards; sessions not needed are released."""
        opened: list[Session] = []
        pair = None
        while len(opened) < tries and pair is None:
            try:
                ini = await self.connect()
            except KbtpError:
                if len(opened) >= 2:
                    break
                raise
            opened.append(Session(ini, ini.initiator_id))
            ranked = sorted(opened, key=lambda x: x.base)
            pair = next(((a, b) for a, b in zip(ranked, ranked[1:]) if a.base + a.count == b.base), None)
        pair = pair or (opened[0], opened[1])
        for extra in opened:
            if extra not in pair:
                await extra.ini.goodbye(release=True)
        return pair

    async def _guards(self, s: Session) -> None:
        ini = s.ini
        for k in range(GUARDS):
            data = f"guard {k} of {ini.initiator_id.hex()[:8]} ".encode() * 20
            r = await ini.alloc_store(s.base + k, data, seal=True)
            s.guards[s.base + k] = Block(data, r.generation)

    async def resume(self, s: Session) -> None:
        """Reconnect ``s`` with its Initiator ID after the connection ended."""
        await s.ini.close()
        for attempt in range(20):
            try:
                s.ini = await self.connect(s.initiator_id)
                self.reconnects += 1
                return
            except KbtpError as exc:
                if exc.name != "ALREADY_BOUND":
                    raise Lost(f"HELLO refused on reconnect: {exc.name}") from None
            except (OSError, ConnectionLost, RemoteError, asyncio.TimeoutError) as exc:
                raise Lost(f"no HELLO_ACK on reconnect ({type(exc).__name__}: {exc})") from None
            await asyncio.sleep(0.02 * (attempt + 1))
        raise Lost("HELLO answered ALREADY_BOUND for 20 attempts after the connection ended")

    async def ensure(self) -> None:
        for s in (self.own, self.peer):
            if not s.alive:
                base = s.base
                await self.resume(s)
                if s.base != base:
                    raise Rebuild(f"handle range 0x{base:x} -> 0x{s.base:x} on reconnect")

    async def close(self, release: bool = True) -> None:
        for s in (self.own, self.peer):
            if s is None:
                continue
            try:
                if s.alive:
                    await asyncio.wait_for(s.ini.goodbye(release=release), 5)
                elif release:
                    await self.resume(s)
                    await asyncio.wait_for(s.ini.goodbye(release=True), 5)
            except (Exception, asyncio.TimeoutError):
                await s.ini.close()

    def forget(self, handle: int) -> None:
        """A request with an effect the wire did not show fully: ``handle`` is unknown now."""
        if handle in self.scratch:
            self.scratch[handle] = None
