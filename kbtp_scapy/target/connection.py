"""One initiator connection: HELLO, then requests in order, then GOODBYE or loss.

The target posts one receive buffer per request credit and reposts it once the request
is answered, so an initiator that sends beyond its credits meets the transport's own
refusal (RNR NAK on RoCEv2, DDP Terminate on iWARP; docs/NOTES.md decision 8). Writes and Sends
are posted unsignaled, without waiting for their acknowledgement: the connection's
ordering puts a LOAD's data before its COMPLETION, as the binding requires, a failure
ends the connection, and only an RDMA Read (a store's data) is awaited.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from .. import codec
from ..rnic import Address
from ..rnic.memory import MemoryRegion
from ..rnic.qp import ConnectionLost, QueuePair, RemoteError
from ..tables import memory as M
from ..tables.enums import GOODBYE_FLAGS, OPCODES, REQUEST_FLAGS, STATUS, flag
from .config import ADDR_LE, DIRECT_ALLOC, DIRECT_LOAD, RECORD_COMPLETION
from .direct import TicketWatch, grant_direct_load, grant_partition
from .operations import Executor, Outcome
from .ring import FreeRing
from .sessions import Initiator, Refused

if TYPE_CHECKING:
    from .server import Target

log = logging.getLogger("kbtp.target")
OP = OPCODES.by_name()
S = STATUS.by_name()
RECORD = flag(REQUEST_FLAGS, "RECORD")
INVALIDATE = flag(REQUEST_FLAGS, "INVALIDATE")
RELEASE = flag(GOODBYE_FLAGS, "RELEASE")
PROBE_TIMEOUT = 10.0     # longer than a RoCEv2 QP's whole retry budget


def peer_of(qp: QueuePair) -> str:
    return str(Address(qp.transport, *qp.remote[:2]))


def _consume(future: asyncio.Future) -> None:
    """A failed RDMA Read fails the connection; the request loop sees that, not here."""
    if not future.cancelled():
        future.exception()


class Connection:
    def __init__(self, target: Target, qp: QueuePair) -> None:
        self.target, self.qp = target, qp
        self.state: Initiator | None = None
        self.features = 0
        self.addr_le = False
        self.windows: list[MemoryRegion] = []

    @property
    def ring(self) -> FreeRing:
        part = self.state.partition
        return part.ring if part is not None else self.target.memory.shared_ring

    @staticmethod
    def discard(future: asyncio.Future) -> None:
        """An RDMA Read whose data is no longer needed (its request failed a check)."""
        future.add_done_callback(_consume)

    async def serve(self) -> None:
        t = self.target
        peer = peer_of(self.qp)
        release = False
        try:
            if not await self._hello():
                return
            log.info("session %s from %s: handles 0x%x+%d quota %d features 0x%x",
                     self.state.initiator_id.hex()[:8], peer, self.state.handle_base,
                     self.state.handle_count, self.state.quota, self.features)
            release = await self._requests()
        except (ConnectionLost, RemoteError) as exc:
            log.info("connection from %s lost: %s", peer, exc)
        finally:
            for window in self.windows:
                t.rnic_memory.deregister(window.stag)
            if self.state is not None:
                t.sessions.detach(self.state, release)
                log.info("session %s ended%s", self.state.initiator_id.hex()[:8],
                         " (released)" if release else " (retained)")
            if not self.qp.closed:
                await self.qp.close()

    # -- session set-up ------------------------------------------------------------------

    async def _hello(self) -> bool:
        t = self.target
        msg = await self.qp.recv()
        self.qp.post_recv(1)
        try:
            hello = codec.decode(msg.payload)
        except codec.Malformed:
            hello = None
        if hello is None or hello["opcode"] != OP["HELLO"]:
            t.metrics.hello("MALFORMED")
            await self._hello_ack(S["MALFORMED"], {})
            return False
        requested = hello["hello.requested_features"]
        offered = t.offered_features(self.qp)
        ident = bytes(hello["hello.initiator_id"])
        try:
            try:
                self.state, restored = t.sessions.admit(ident, bool(requested & offered & DIRECT_ALLOC))
            except Refused as refusal:
                if refusal.status != "ALREADY_BOUND" or not await self._gone(ident):
                    raise
                self.state, restored = t.sessions.admit(ident, bool(requested & offered & DIRECT_ALLOC))
        except Refused as refusal:
            t.metrics.hello(refusal.status)
            log.info("HELLO refused: %s", refusal)
            await self._hello_ack(S[refusal.status], {})
            return False
        self.state.qp = self.qp
        t.metrics.hello("OK")
        features = requested & offered & ~ADDR_LE
        if t.config.addr_le:
            features |= ADDR_LE
        fields: dict[str, Any] = {}
        if features & DIRECT_LOAD:
            try:
                granted, self.windows = grant_direct_load(t.memory, self.qp)
                fields.update(granted)
            except OSError as exc:        # the RDMA device cannot register it
                log.warning("DIRECT_LOAD not granted to %s: %s", peer_of(self.qp), exc)
                features &= ~DIRECT_LOAD
        part = self.state.partition
        windows: list[MemoryRegion] = []
        if features & DIRECT_ALLOC and part is not None and not self.state.direct_disabled:
            try:
                granted, windows = grant_partition(t.memory, part, self.qp)
                fields.update(granted)
                self.windows += windows
            except OSError as exc:
                log.warning("DIRECT_ALLOC not granted to %s: %s", peer_of(self.qp), exc)
                features &= ~DIRECT_ALLOC
        else:
            features &= ~DIRECT_ALLOC
        if part is not None and self.state.watch is None:
            self.state.watch = TicketWatch(self.state, t.rnic_memory, t.config.ticket_timeout_ms)
        if self.state.watch is not None:
            self.state.watch.windows = windows
        self.features, self.addr_le = features, bool(features & ADDR_LE)
        self.state.features = features
        c = t.config
        await self._hello_ack(0, {
            "hello_ack.features": features, "hello_ack.request_credits": c.request_credits,
            "hello_ack.block_size": c.block_size, "hello_ack.max_inline": c.max_inline,
            "hello_ack.allocation_quota": self.state.quota,
            "hello_ack.handle_base": self.state.handle_base,
            "hello_ack.handle_count": self.state.handle_count,
            "hello_ack.ticket_timeout": c.ticket_timeout_ms, **fields})
        return True

    async def _gone(self, ident: bytes) -> bool:
        """Is the connection of the session that holds ``ident`` dead? RoCEv2 has no
        keepalive: a peer that vanished without DREQ looks active until something is
        sent to it, so probe it with a zero-length RDMA Write, which the peer's RNIC
        acknowledges without touching memory, and let the transport's retries decide."""
        state = self.target.sessions.by_id.get(ident)
        if state is None or state.qp is None:
            return False
        try:
            await asyncio.wait_for(state.qp.write(0, 0, b""), PROBE_TIMEOUT)
            return False
        except (ConnectionLost, RemoteError):
            pass
        except asyncio.TimeoutError:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while state.active and loop.time() < deadline:   # its connection task detaches it
            await asyncio.sleep(0.01)
        return not state.active

    async def _hello_ack(self, status: int, body: dict[str, Any]) -> None:
        values = {"opcode": OP["HELLO_ACK"], "status": status, "hello_ack.features": 0, **body}
        await self.qp.send(codec.encode(values))

    # -- requests ------------------------------------------------------------------------

    async def _requests(self) -> bool:
        """Serve requests until GOODBYE (returns whether it asked for RELEASE).

        Requests are executed one at a time in arrival order. The RDMA Reads that fetch
        the data of the stores that arrived together are started first, so they overlap,
        while every check and every change of the table and rings still happens in order.
        """
        t = self.target
        batch: deque[tuple[dict[str, Any], asyncio.Future | None, str]] = deque()
        while True:
            msg = await self.qp.recv()
            while msg is not None:
                try:
                    req, why = codec.decode(msg.payload, self.addr_le), ""
                except codec.Malformed as bad:
                    req, why = self._malformed(msg.payload), str(bad)
                batch.append((req, None if why else t.executor.prefetch(self, req), why))
                msg = self.qp.recv_nowait()
            while batch:
                req, fetch, why = batch.popleft()
                opcode = req["opcode"]
                if why:
                    outcome = Outcome(S["MALFORMED"])
                elif opcode == OP["GOODBYE"]:
                    t.metrics.operation(opcode, 0)
                    return bool(req["flags"] & RELEASE)
                elif not Executor.handles(opcode):
                    outcome, why = Outcome(S["MALFORMED"]), "not a request opcode"
                else:
                    outcome = await t.executor.run(self, req, fetch)
                # The receive buffer goes back before the completion that hands the credit
                # back: on a real device the completion leaves at once, and the initiator's
                # next request can arrive before the next line of ours runs.
                self.qp.post_recv(1)
                self._complete(req, outcome, why)

    def _malformed(self, payload: bytes) -> dict[str, Any]:
        """Echo the Request ID and Block Handle of a request that cannot be parsed, as far
        as the octets reach (docs/NOTES.md decision 4); what is missing is zero."""
        head = codec.decode_header(payload.ljust(codec.HEADER_SIZE, b"\0"), self.addr_le)
        return {"opcode": head["opcode"], "flags": 0,
                "request_id": head["request_id"] if len(payload) >= 12 else 0,
                "handle": head["handle"] if len(payload) >= 20 else 0}

    def _complete(self, req: dict[str, Any], outcome: Outcome, why: str = "") -> None:
        t = self.target
        t.metrics.operation(req["opcode"], outcome.status)
        if why:
            log.debug("request %d: MALFORMED (%s)", req["request_id"], why)
        flags = req["flags"] if Executor.handles(req["opcode"]) else 0
        if flags & RECORD and self.features & RECORD_COMPLETION and "cd.stag" in req:
            record = codec.encode_struct(M.COMPLETION_RECORD, {
                "record.request_id": req["request_id"], "record.status": outcome.status,
                "record.generation": outcome.generation, "record.data_length": outcome.data_length,
                "record.block_offset": outcome.block_offset}, self.addr_le)
            self.qp.write(req["cd.stag"], req["cd.offset"], record,
                          imm=req["request_id"] & 0xFFFFFFFF, signaled=False)
            return
        completion = codec.encode({
            "opcode": OP["COMPLETION"], "request_id": req["request_id"], "handle": req["handle"],
            "generation": outcome.generation, "status": outcome.status,
            "completion.data_length": outcome.data_length, "completion.reserved": 0,
            "completion.block_offset": outcome.block_offset}, self.addr_le)
        stag = req.get("dd.stag", 0) if flags & INVALIDATE else 0
        self.qp.send(completion, invalidate=stag or None, signaled=False)
