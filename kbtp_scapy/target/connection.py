"""One initiator connection: HELLO, then requests in order, then GOODBYE or loss.

The target posts one receive buffer per request credit and reposts it once the request
is answered, so an initiator that sends beyond its credits meets the transport's own
refusal (RNR NAK on RoCEv2, DDP Terminate on iWARP; docs/NOTES.md decision 8). It grants
no more Request Credits than the HELLO's Completion Credits. LOAD data and most answers
are posted unsignaled: the connection's ordering puts the data first, as the binding
requires, a failure ends the connection, and the completion of every few answers tells
the backlog (``backlog.py``) what the peer has taken. Only an RDMA Read (a store's data)
is awaited.

Until its HELLO is answered a connection holds a half-open slot (``rnic/admission.py``)
and has ``hello_timeout_s`` to send it; afterwards an idle connection is probed
(``liveness.py``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from .. import codec
from ..rnic.memory import MemoryRegion
from ..rnic.qp import ConnectionLost, QueuePair, Received, RemoteError
from ..tables import memory as M
from ..vocab import AnyMessage, Feature, GoodbyeFlag, HelloAck, Opcode, RequestFlag, Status
from ..wire.address import Address
from .backlog import Backlog
from .direct import TicketWatch, grant_direct_load, grant_partition
from .liveness import Liveness
from .operations import Executor, Outcome
from .ring import FreeRing
from .sessions import InitiatorState, Refused

if TYPE_CHECKING:
    from .server import Target

log = logging.getLogger("kbtp.target")


def peer_of(qp: QueuePair) -> str:
    """The peer's address as a URL, for logs."""
    return str(Address(qp.transport, *qp.remote[:2]))


class Connection:
    def __init__(self, target: Target, qp: QueuePair) -> None:
        self.target, self.qp = target, qp
        self._state: InitiatorState | None = None
        self.features = 0
        self.addr_le = False
        self.credits = 0
        self.windows: list[MemoryRegion] = []
        c = target.config
        self.liveness = Liveness(qp, c.probe_interval_s, c.probe_timeout_s)
        self.backlog = Backlog(c.max_backlog, 2 * c.request_credits)
        self.peer = peer_of(qp)

    @property
    def state(self) -> InitiatorState:
        """The session's initiator; requests are served only once HELLO admitted it."""
        if self._state is None:
            raise RuntimeError(f"connection from {self.peer}: no session before HELLO")
        return self._state

    @property
    def ring(self) -> FreeRing:
        part = self.state.partition
        return part.ring if part is not None else self.target.memory.shared_ring

    async def serve(self) -> None:
        t = self.target
        release = False
        watch = None
        try:
            if not self._admitted():
                return
            if not await self._hello():
                return
            ticket, self.qp.admission = self.qp.admission, None    # a session now
            assert ticket is not None                              # _admitted took it
            ticket.leave()
            log.info("session %s from %s: handles 0x%x+%d quota %d features 0x%x credits %d",
                     self.state.initiator_id.hex()[:8], self.peer, self.state.handle_base,
                     self.state.handle_count, self.state.quota, self.features, self.credits)
            watch = asyncio.create_task(self._watch())
            if t.config.execution == "chains":
                from .chains import ChainRunner  # the chain engine only when asked for
                runner = ChainRunner(self)
                try:
                    release = await runner.serve()
                finally:
                    runner.close()
            else:
                release = await self._requests()
        except (ConnectionLost, RemoteError) as exc:
            log.info("connection from %s lost: %s", self.peer, exc)
        finally:
            if watch is not None:
                watch.cancel()
            for window in self.windows:
                t.rnic_memory.deregister(window.stag)
            if self._state is not None:
                t.sessions.detach(self._state, release)
                log.info("session %s ended%s", self._state.initiator_id.hex()[:8],
                         " (released)" if release else " (retained)")
            if not self.qp.closed:
                await self.qp.close()

    # -- session set-up ------------------------------------------------------------------

    def _admitted(self) -> bool:
        """A half-open slot: the transport took one at set-up; a device's (verbs) QP
        takes it here."""
        if self.qp.admission is None:
            self.qp.admission = self.target.half_open.enter(self.qp.remote[0])
            if self.qp.admission is None:
                log.info("connection from %s refused: too many connections without a "
                         "session", self.peer)
                return False
            self.qp.admission.evict = self.qp.abort
        return True

    async def _hello(self) -> bool:
        t = self.target
        try:
            msg = await asyncio.wait_for(self.qp.recv(), t.config.hello_timeout_s)
        except TimeoutError:
            t.half_open.refused["hello_timeout"] += 1
            log.info("connection from %s closed: no HELLO within %g s", self.peer,
                     t.config.hello_timeout_s)
            return False
        self.qp.post_recv(1)
        try:
            hello = codec.decode(msg.payload)
        except codec.Malformed:
            hello = None
        if hello is None or hello["opcode"] != Opcode.HELLO or not hello["hello.completion_credits"]:
            # Completion Credits 0: no COMPLETION could reach the initiator, so no request
            # could be answered (docs/DECISIONS.md, "A HELLO with no Completion Credits").
            t.metrics.hello("MALFORMED")
            await self._hello_ack(Status.MALFORMED, {})
            return False
        requested = hello["hello.requested_features"]
        offered = t.offered_features(self.qp)
        ident = bytes(hello["hello.initiator_id"])
        partition = bool(requested & offered & Feature.DIRECT_ALLOC)
        try:
            try:
                self._state, restored = t.sessions.admit(ident, partition, self.qp.remote[0])
            except Refused as refusal:
                claim = None
                if refusal.status == "NO_SPACE":
                    claim = await self._displaced(partition)
                    if claim is None:
                        raise
                elif not await self._gone(ident):
                    raise
                self._state, restored = t.sessions.admit(ident, partition, self.qp.remote[0], claim)
        except Refused as refusal:
            t.metrics.hello(refusal.status)
            log.info("HELLO refused: %s", refusal)
            await self._hello_ack(Status[refusal.status], {})
            return False
        self.state.qp = self.qp
        self.state.heard_at = asyncio.get_running_loop().time()
        t.metrics.hello("OK")
        features = requested & offered & ~Feature.ADDR_LE
        if t.config.addr_le:
            features |= Feature.ADDR_LE
        fields: HelloAck = {}
        if features & Feature.DIRECT_LOAD:
            try:
                granted, self.windows = grant_direct_load(t.memory, self.qp)
                fields.update(granted)
            except OSError as exc:        # the RDMA device cannot register it
                log.warning("DIRECT_LOAD not granted to %s: %s", self.peer, exc)
                features &= ~Feature.DIRECT_LOAD
        part = self.state.partition
        windows: list[MemoryRegion] = []
        if features & Feature.DIRECT_ALLOC and part is not None and not self.state.direct_disabled:
            try:
                granted, windows = grant_partition(t.memory, part, self.qp)
                fields.update(granted)
                self.windows += windows
            except OSError as exc:
                log.warning("DIRECT_ALLOC not granted to %s: %s", self.peer, exc)
                features &= ~Feature.DIRECT_ALLOC
        else:
            if features & Feature.DIRECT_ALLOC and part is None:
                active, retained = t.sessions.holders()
                log.warning("DIRECT_ALLOC not granted to %s: no partition left (all %d held: %d by "
                            "active sessions, %d by retained ones, which keep theirs while they "
                            "hold bindings from it; GOODBYE with RELEASE gives one back)",
                            self.peer, len(t.memory.partitions), active, retained)
            features &= ~Feature.DIRECT_ALLOC
        if part is not None and self.state.watch is None:
            self.state.watch = TicketWatch(self.state, t.rnic_memory, t.config.ticket_timeout_ms)
        if self.state.watch is not None:
            self.state.watch.windows = windows
        self.features, self.addr_le = features, bool(features & Feature.ADDR_LE)
        self.state.features = features
        c = t.config
        # never more requests in flight than the initiator can take COMPLETIONs for
        self.credits = min(c.request_credits, hello["hello.completion_credits"])
        self.backlog.limit_messages(2 * max(self.credits, 1))
        await self._hello_ack(0, {
            "hello_ack.features": features, "hello_ack.request_credits": self.credits,
            "hello_ack.block_size": c.block_size, "hello_ack.max_inline": c.max_inline,
            "hello_ack.allocation_quota": self.state.quota,
            "hello_ack.handle_base": self.state.handle_base,
            "hello_ack.handle_count": self.state.handle_count,
            "hello_ack.ticket_timeout": c.ticket_timeout_ms, **fields})
        return True

    async def _displaced(self, partition: bool) -> InitiatorState | None:
        """After a HELLO refused NO_SPACE: the session displaced for this newcomer
        (``Sessions.displace``, the fair share), once its connection's task has retained
        it, for ``admit`` to claim; None if no session may be displaced."""
        sessions = self.target.sessions
        state = sessions.displace(self.qp.remote[0], partition)
        if state is None:
            return None
        if await _detached(state):
            return state
        sessions.unclaim(state)
        return None

    async def _gone(self, ident: bytes) -> bool:
        """Is the connection of the session that holds ``ident`` dead? RoCEv2 has no
        keepalive: a peer that vanished without DREQ looks active until something is
        sent to it, so probe it with a zero-length RDMA Write, which the peer's RNIC
        acknowledges without touching memory, and let the transport's retries decide."""
        state = self.target.sessions.by_id.get(ident)
        if state is None or state.qp is None:
            return False
        try:
            await asyncio.wait_for(state.qp.write(0, 0, b""), self.target.config.probe_timeout_s)
            return False
        except (ConnectionLost, RemoteError):
            pass
        except TimeoutError:
            return False
        return await _detached(state)

    async def _hello_ack(self, status: int, body: HelloAck) -> None:
        await self.qp.send(codec.encode({"opcode": Opcode.HELLO_ACK, "status": status, "hello_ack.features": 0,
                                         **body}))

    # -- requests ------------------------------------------------------------------------

    async def _requests(self) -> bool:
        """Serve requests until GOODBYE (returns whether it asked for RELEASE).

        Requests are executed one at a time in arrival order. The RDMA Reads that fetch
        the data of the stores that arrived together are started first, so they overlap,
        while every check and every change of the table and rings still happens in order.
        """
        t = self.target
        batch: deque[tuple[AnyMessage, asyncio.Future | None, str, float]] = deque()
        loop = asyncio.get_running_loop()
        while True:
            msg: Received | None = await self.qp.recv()
            self.liveness.heard = True
            self.state.heard_at = loop.time()
            while msg is not None:
                arrived = time.perf_counter()
                req, why = self.parse(msg.payload)
                batch.append((req, None if why else t.executor.prefetch(self, req), why, arrived))
                msg = self.qp.recv_nowait()
            while batch:
                req, fetch, why, arrived = batch.popleft()
                opcode = req["opcode"]
                if self.backlog.over:
                    await self._throttle()
                t.metrics.python_request(req["opcode"])
                outcome, why = await self.execute(req, fetch, why)
                if outcome is None:
                    return bool(req["flags"] & GoodbyeFlag.RELEASE)
                # The receive buffer goes back before the completion that hands the credit
                # back: on a real device the completion leaves at once, and the initiator's
                # next request can arrive before the next line of ours runs.
                self.qp.post_recv(1)
                self._complete(req, outcome, why)
                t.metrics.served(opcode, time.perf_counter() - arrived)

    def parse(self, payload: bytes) -> tuple[AnyMessage, str]:
        """A request and why it is malformed ("" when it is not)."""
        try:
            return codec.decode(payload, self.addr_le), ""
        except codec.Malformed as bad:
            return self._malformed(payload, bad.fields), str(bad)

    async def execute(self, req: AnyMessage, fetch: asyncio.Future | None,
                      why: str) -> tuple[Outcome | None, str]:
        """Serve one parsed request: its outcome (None for GOODBYE) and why it is malformed."""
        t, opcode = self.target, req["opcode"]
        if why and req["flags"] & RequestFlag.INLINE:       # decision 5 before decision 4
            return t.executor.failure(Status.TOO_LARGE, req["handle"]), ""
        if why:
            return Outcome(Status.MALFORMED), why
        if opcode == Opcode.GOODBYE:
            t.metrics.operation(opcode, 0)
            return None, ""
        if not Executor.handles(opcode):
            return Outcome(Status.MALFORMED), "not a request opcode"
        return await t.executor.run(self, req, fetch), why

    def _malformed(self, payload: bytes, fields: AnyMessage) -> AnyMessage:
        """Echo the Request ID and Block Handle of a request that cannot be parsed, as far
        as the octets reach (docs/NOTES.md decision 4); what is missing is zero. The
        flags stay when INLINE declares a Length over Max Inline or the Block Size, which
        ``_requests`` answers with TOO_LARGE whatever follows (decision 5)."""
        head = codec.decode_header(payload.ljust(codec.HEADER_SIZE, b"\0"), self.addr_le)
        out: AnyMessage = {"opcode": head["opcode"], "flags": 0,
               "request_id": head["request_id"] if len(payload) >= 12 else 0,
               "handle": head["handle"] if len(payload) >= 20 else 0}
        limit = min(self.target.config.max_inline, self.target.config.block_size)
        if (out["opcode"] in (Opcode.STORE, Opcode.ALLOC_STORE) and fields.get("flags", 0) & RequestFlag.INLINE
                and fields.get("dd.length", 0) > limit):
            out["flags"] = fields["flags"]
        return out

    async def _throttle(self) -> None:
        """Serve nothing more until the peer has taken half of the backlog's bounds;
        terminate the connection when it does not within ``backlog_timeout_s``."""
        t = self.target
        timeout = t.config.backlog_timeout_s
        try:
            await self.backlog.drain(self.qp, timeout)
        except TimeoutError:
            why = (f"{self.backlog.octets} octets in {self.backlog.messages} answers not taken "
                   f"by the peer within {timeout:g} s")
            t.metrics.terminated["backlog"] += 1
            log.info("connection from %s terminated: %s", self.peer, why)
            self.qp.abort(why)
            raise ConnectionLost(why) from None

    async def _watch(self) -> None:
        """Probe the connection while it is silent; end it when the peer is dead."""
        metrics = self.target.metrics
        why = await self.liveness.watch(metrics.probe)
        metrics.terminated["liveness"] += 1
        log.info("connection from %s terminated: %s", self.peer, why)
        self.qp.abort(why)

    def _complete(self, req: AnyMessage, outcome: Outcome, why: str = "") -> None:
        t = self.target
        signaled = self.backlog.signal_next
        t.metrics.operation(req["opcode"], outcome.status)
        if why:
            log.debug("request %d: MALFORMED (%s)", req["request_id"], why)
        flags = req["flags"] if Executor.handles(req["opcode"]) else 0
        if flags & RequestFlag.RECORD and self.features & Feature.RECORD_COMPLETION and "cd.stag" in req:
            record = codec.encode_struct(M.COMPLETION_RECORD, {
                "record.request_id": req["request_id"], "record.status": outcome.status,
                "record.generation": outcome.generation, "record.data_length": outcome.data_length,
                "record.block_offset": outcome.block_offset}, self.addr_le)
            self.backlog.posted(len(record) + self._data_octets(req, outcome), self.qp.write(
                req["cd.stag"], req["cd.offset"], record, imm=req["request_id"] & 0xFFFFFFFF,
                signaled=signaled))
            return
        completion = codec.encode({
            "opcode": Opcode.COMPLETION, "request_id": req["request_id"], "handle": req["handle"],
            "generation": outcome.generation, "status": outcome.status,
            "completion.data_length": outcome.data_length, "completion.reserved": 0,
            "completion.block_offset": outcome.block_offset}, self.addr_le)
        stag = req.get("dd.stag", 0) if flags & RequestFlag.INVALIDATE else 0
        self.backlog.posted(len(completion) + self._data_octets(req, outcome),
                            self.qp.send(completion, invalidate=stag or None, signaled=signaled))

    @staticmethod
    def _data_octets(req: AnyMessage, outcome: Outcome) -> int:
        """The LOAD data written in front of an answer."""
        return outcome.data_length if req["opcode"] == Opcode.LOAD and not outcome.status else 0


async def _detached(state: InitiatorState) -> bool:
    """Wait (a second at most) for the task of ``state``'s ended connection to detach it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 1.0
    while state.active and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return not state.active
