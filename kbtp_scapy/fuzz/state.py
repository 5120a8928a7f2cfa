"""The fuzzer's sessions with the target, and what the wire taught it about each.

Two sessions run side by side: ``own`` (the one being fuzzed) and ``peer``, a second
initiator whose sealed guard blocks sit just past ``own``'s handle range, so a request
that crosses the range edge has something to damage. Each session carries the model of
its range (``model.Knowledge``); everything in it came from HELLO_ACKs, completions and
direct-mode reads, nothing from the target's internals.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from ..harness import HarnessError
from ..initiator import Initiator, KbtpError, PeerLimit
from ..initiator.client import ALL_FEATURES
from ..initiator.limits import NoAnswer as Unanswered, connect_deadline
from ..initiator.results import TargetInfo
from ..rnic.qp import foreign
from .cases import SCRATCH
from .findings import Finding
from .model import UNKNOWN, Entry, Knowledge
from .oracles import check_hello_ack
from .tally import Tally
from .trouble import TRANSPORT_ERRORS, describe

GUARDS = 2
class SetupFault(Exception):
    """The target misbehaved in a step that only sets up the fuzzer's sessions (a guard
    block refused, an answer that never came or came with another Request ID): a
    finding like any other, not a harness error."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.detail)
        self.finding = finding


class Lost(Exception):
    """The session could not be resumed: the target stopped answering HELLO."""


class Rebuild(Exception):
    """The sessions no longer fit the model (another range on reconnect, a RELEASE): start afresh."""


class NoAnswer(Exception):
    """Something the fuzzer asked on a live connection got no answer in time."""


@dataclass
class Session:
    ini: Initiator
    initiator_id: bytes
    known: Knowledge
    guards: dict[int, bytes] = field(default_factory=dict)    # handle -> its sealed content

    @property
    def info(self) -> TargetInfo:
        return self.ini.target

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
    """The two sessions; ``findings`` collects what HELLO_ACKs showed until a case takes them."""

    def __init__(self, url: str, options: dict, timeout: float, frame_listeners: list | None = None,
                 tally: Tally | None = None) -> None:
        self.url, self.options, self.timeout = url, options, timeout
        self.tally = tally or Tally()
        self.frame_listeners = frame_listeners or []
        self._sessions: tuple[Session, Session] | None = None    # (own, peer) once open
        self.scratch: list[int] = []
        self.findings: list[Finding] = []
        self.spoiled = False          # start afresh after this case
        self.reconnects = 0

    @property
    def own(self) -> Session:
        """The session being fuzzed."""
        return self._opened()[0]

    @property
    def peer(self) -> Session:
        """The session whose guards sit past ``own``'s range."""
        return self._opened()[1]

    def _opened(self) -> tuple[Session, Session]:
        if self._sessions is None:
            raise HarnessError("the fuzzer's sessions are not open yet (World.open)")
        return self._sessions

    @property
    def transport(self) -> str:
        return self.url.split("://", 1)[0]

    async def connect(self, initiator_id: bytes | None = None, features: int = ALL_FEATURES) -> Initiator:
        """A session; its HELLO_ACK is judged whether it grants or refuses."""
        try:
            ini = await asyncio.wait_for(Initiator.connect(
                self.url, initiator_id=initiator_id or secrets.token_bytes(16), features=features,
                frame_listeners=self.frame_listeners, **self.options), connect_deadline(self.timeout))
        except PeerLimit as exc:      # it asks the fuzzer for more than it spends
            raise SetupFault(Finding("hello-ack", exc.detail, evidence={"hello_ack": exc.hello_ack.hex()})) from None
        except KbtpError as exc:
            self.findings += check_hello_ack(exc.hello_ack, self.transport, features, self.tally)
            raise
        self.findings += check_hello_ack(ini.hello_ack, self.transport, features, self.tally)
        return ini

    def session(self, ini: Initiator) -> Session:
        return Session(ini, ini.initiator_id, Knowledge(ini.target.handle_base, ini.target.handle_count))

    async def open(self) -> None:
        """Both sessions, each with sealed guard blocks of known content, and ``own``'s
        scratch handles freed, so that the model starts from what the wire showed.

        Not getting two sessions is a harness error (nothing listens, no room). Once the
        target has granted them, a guard or scratch step it fails is its own doing: a
        ``SetupFault`` (only a quota too small for the guards is the harness's)."""
        doing = "opening two sessions"
        try:
            self._sessions = await self._pair()
        except KbtpError as exc:
            raise HarnessError(f"{self.url}: {doing}: {self.refusal(exc)}") from None
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            hint = ("; the target's log may say why it never answered the HELLO" if isinstance(exc, Unanswered)
                    else "; give the address and port of a KBTP target" if foreign(exc)
                    else "; is a KBTP target listening there" + (" (and is --local an address of this host)?"
                                                                 if self.transport == "roce" else "?"))
            raise HarnessError(f"{self.url}: {doing}: {describe(exc, self.timeout)}{hint}") from None
        self._disjoint(self.own, self.peer)
        s = self.own
        try:
            for s in (self.own, self.peer):
                doing = f"storing the guard blocks of the session at 0x{s.base:x}"
                await self._guards(s)
            s = self.own
            doing = "freeing the scratch handles"
            await self._scratch()
        except KbtpError as exc:
            if exc.name == "NO_SPACE" and s.info.quota < GUARDS:
                raise HarnessError(f"{self.url}: {doing}: the quota of {s.info.quota} block(s) leaves "
                                   f"no room for the fuzzer's {GUARDS} guard blocks") from None
            raise SetupFault(Finding("setup", f"{doing} of a fresh session: refused with {exc.name}",
                                     evidence={"handle_base": s.base, "status": exc.name})) from None
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            stray = self._strays(s)
            why = (f"the answer came with Request ID {stray[0]:#x}, which no request had" if stray
                   else describe(exc, self.timeout))
            raise SetupFault(Finding("setup", f"{doing} of a fresh session: {why}",
                                     evidence={"handle_base": s.base,
                                               "stray_request_ids": [hex(r) for r in stray]})) from None

    @staticmethod
    def _strays(s: Session) -> list[int]:
        """Request IDs of answers that matched no request of ``s`` (decoded where they decode)."""
        from .. import codec
        out = []
        while not s.ini.unmatched.empty():
            msg = s.ini.unmatched.get_nowait()
            try:
                out.append(codec.decode(msg.payload, s.ini.addr_le)["request_id"])
            except codec.Malformed:
                padded = bytes(msg.payload).ljust(codec.HEADER_SIZE, b"\0")
                out.append(codec.decode_header(padded, s.ini.addr_le)["request_id"])
        return out

    def refusal(self, exc: KbtpError) -> str:
        """Why a refusal stops the run, and what to do."""
        if exc.name == "NO_SPACE" and "HELLO" in str(exc):
            return ("HELLO refused with NO_SPACE: the target has no room for another initiator. The "
                    "fuzzer needs three sessions at a time and ends each with GOODBYE RELEASE; if "
                    "nothing else uses the target, its RELEASE does not free sessions. Restart the "
                    "target or let it admit more initiators (kbtp target --max-initiators)")
        if "HELLO" in str(exc):
            return f"HELLO refused with {exc.name} for a fresh Initiator ID"
        return f"refused with {exc.name}; the fuzzer cannot set up its sessions without it"

    def _disjoint(self, *sessions: Session) -> None:
        """"Handles of different initiators never overlap"."""
        for i, a in enumerate(sessions):
            for b in sessions[i + 1:]:
                if a.base < b.base + b.count and b.base < a.base + a.count:
                    self.findings.append(Finding("hello-ack", f"two sessions got overlapping handle ranges "
                                                 f"0x{a.base:x}+{a.count} and 0x{b.base:x}+{b.count}"))

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
                for s in opened:
                    await s.ini.goodbye(release=True)
                raise
            opened.append(self.session(ini))
            ranked = sorted(opened, key=lambda x: x.base)
            pair = next(((a, b) for a, b in zip(ranked, ranked[1:]) if a.base + a.count == b.base), None)
        pair = pair or (opened[0], opened[1])
        for extra in opened:
            if extra not in pair:
                await extra.ini.goodbye(release=True)
        return pair

    async def _guards(self, s: Session) -> None:
        for k in range(GUARDS):
            data = f"guard {k} of {s.initiator_id.hex()[:8]} ".encode() * 20
            r = await asyncio.wait_for(s.ini.alloc_store(s.base + k, data, seal=True), self.timeout)
            s.guards[s.base + k] = data
            s.known.set(s.base + k, Entry(True, r.generation, True, len(data), data, r.block_offset,
                                          "the OK of the ALLOC_STORE that stored the guard"))

    async def _scratch(self) -> None:
        own = self.own
        self.scratch = [own.base + GUARDS + k for k in range(SCRATCH)]
        for h in self.scratch:
            try:
                r = await asyncio.wait_for(own.ini.free(h), self.timeout)
                own.known.set(h, Entry(False, r.generation, seen=f"the OK of the FREE of 0x{h:x} at set-up"))
            except KbtpError as exc:
                gen = exc.result.generation if exc.result is not None else None
                own.known.set(h, Entry(False, gen, seen=f"the {exc.name} of the FREE of 0x{h:x} at set-up")
                              if exc.name == "NOT_VALID" else UNKNOWN)

    async def resume(self, s: Session) -> None:
        """Reconnect ``s`` with its Initiator ID after the connection ended."""
        await s.ini.close()
        for attempt in range(20):
            try:
                s.ini = await self.connect(s.initiator_id)
                self.reconnects += 1
                return
            except KbtpError as exc:
                if exc.name == "NO_SPACE":
                    raise HarnessError(f"{self.url}: reconnecting: {self.refusal(exc)}") from None
                if exc.name != "ALREADY_BOUND":
                    raise Lost(f"HELLO with the Initiator ID of a session whose connection ended "
                               f"was refused with {exc.name}") from None
            except TRANSPORT_ERRORS as exc:
                raise Lost(f"no HELLO_ACK on reconnect: {describe(exc, self.timeout)}") from None
            await asyncio.sleep(0.02 * (attempt + 1))
        raise Lost("HELLO with the Initiator ID of a session whose connection ended was answered "
                   "ALREADY_BOUND for 20 attempts over 4 s")

    async def ensure(self) -> None:
        for s in (self.own, self.peer):
            if not s.alive:
                base = s.base
                await self.resume(s)
                if s.base != base:
                    raise Rebuild(f"handle range 0x{base:x} -> 0x{s.base:x} on reconnect")

    async def close(self, release: bool = True) -> None:
        for s in self._sessions or ():
            try:
                if s.alive:
                    await asyncio.wait_for(s.ini.goodbye(release=release), self.timeout)
                elif release:
                    await self.resume(s)
                    await asyncio.wait_for(s.ini.goodbye(release=True), self.timeout)
            except (TimeoutError, Exception):
                await s.ini.close()

    def lookup(self, handle: int) -> Entry:
        """A handle's entry as the model knows it, in either session's range."""
        for s in (self.own, self.peer):
            if s.owns(handle):
                return s.known.entry(handle)
        return UNKNOWN

    def owner(self, handle: int) -> Knowledge | None:
        return next((s.known for s in (self.own, self.peer) if s.owns(handle)), None)

    def bound_blocks(self) -> dict[int, int]:
        return {**self.peer.known.blocks(), **self.own.known.blocks()}
