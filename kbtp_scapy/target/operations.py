"""LOAD, STORE, ALLOC_STORE, FREE and BIND, validated before any memory is touched.

Each check follows the text ("Operations" and "Direct Modes") in its order: the handle's
range, the lengths, the Generation, then the operation's own steps. A failed check
returns its status and has no other effect. docs/NOTES.md decisions 2, 3 and 5 fix what the
text leaves open; the project's other choices are in docs/DECISIONS.md.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..vocab import AnyMessage, EntryFlag, Opcode, RequestFlag, Status
from .pool import TargetMemory
from .ring import FreeRing
from .sessions import InitiatorState
from .table import Entry

if TYPE_CHECKING:
    from .connection import Connection


@dataclass
class Outcome:
    """What a COMPLETION (or completion record) reports."""

    status: int = 0
    generation: int = 0
    data_length: int = 0
    block_offset: int = 0


class Failed(Exception):
    def __init__(self, status: str):
        super().__init__(status)
        self.status = Status[status]


Pause = Callable[[int], Awaitable[None]]


async def _settled(fetch: asyncio.Future) -> None:
    """Wait for an RDMA Read whose data a failed request no longer needs. Its answer may
    revoke the buffer the Read reads (Send with Invalidate, or the initiator deregisters
    it on completion); a retransmission of the Read arriving after that would meet an
    invalid STag and fail the whole connection. So the answer waits for the Read, as a
    fenced work request waits for the Reads before it (IBV_SEND_FENCE). A failed Read
    fails the connection, which the request loop sees."""
    await asyncio.wait([fetch])
    if not fetch.cancelled():
        fetch.exception()


class Executor:
    """The operations on one target's memory; connections call ``run``."""

    def __init__(self, memory: TargetMemory, clear_freed: bool, max_inline: int) -> None:
        self.memory = memory
        self.table = memory.table
        self.block_size = memory.block_size
        self.clear_freed = clear_freed
        self.max_inline = max_inline
        self.before_slot_read: Pause | None = None   # test hook: pause after FetchAdd on Head
        self.allocate_timeout = 5.0     # a slot that never fills is a target failure (INTERNAL)

    async def run(self, conn: Connection, req: AnyMessage,
                  fetch: asyncio.Future | None = None) -> Outcome:
        """Execute one request; ``fetch`` is its data's RDMA Read if ``prefetch`` began it."""
        handler = self._handlers[req["opcode"]]
        try:
            return await handler(self, conn, req, fetch)
        except Failed as failure:
            if fetch is not None:
                await _settled(fetch)
            return self.failure(failure.status, req["handle"])

    def prefetch(self, conn: Connection, req: AnyMessage) -> asyncio.Future | None:
        """Start the RDMA Read of a store's data as the request arrives, when the checks
        that no earlier request can change (opcode, range, length) already pass. Reading
        the initiator's buffer has no effect on the target, so a read wasted on a request
        that then fails a later check is harmless."""
        if req["opcode"] not in (Opcode.STORE, Opcode.ALLOC_STORE) or req["flags"] & RequestFlag.INLINE:
            return None
        length = req["dd.length"]
        if not 0 < length <= self.block_size or not conn.state.owns(req["handle"]):
            return None
        return conn.qp.read(req["dd.stag"], req["dd.offset"], length)

    def failure(self, status: int, handle: int) -> Outcome:
        """docs/NOTES.md decision 2: zero length and offset; the Generation if the handle is
        readable."""
        generation = self.table.read(handle).generation if handle in self.table else 0
        return Outcome(status, generation)

    # -- shared checks -------------------------------------------------------------------

    def _entry(self, req: AnyMessage, own: InitiatorState | None) -> Entry:
        """Range (own range when ``own``), then Generation; returns the entry."""
        handle = req["handle"]
        if handle not in self.table or (own is not None and not own.owns(handle)):
            raise Failed("INVALID_HANDLE")
        entry = self.table.read(handle)
        if req["generation"] and req["generation"] != entry.generation:
            raise Failed("STALE_GENERATION")
        return entry

    def _store_length(self, req: AnyMessage) -> int:
        length = req["dd.length"]
        if length > self.block_size or (req["flags"] & RequestFlag.INLINE and length > self.max_inline):
            raise Failed("TOO_LARGE")    # docs/NOTES.md decision 5
        return length

    async def _data(self, conn: Connection, req: AnyMessage, length: int,
                    fetch: asyncio.Future | None) -> bytes:
        """The store's data: inline, or RDMA Read from the initiator's Data Descriptor."""
        if req["flags"] & RequestFlag.INLINE:
            return req.get("inline_data", b"")
        if not length:
            return b""
        return await (fetch or conn.qp.read(req["dd.stag"], req["dd.offset"], length))

    # -- operations ----------------------------------------------------------------------

    async def load(self, conn: Connection, req: AnyMessage,
                  fetch: asyncio.Future | None = None) -> Outcome:
        entry = self._entry(req, None)
        if not entry.valid:
            raise Failed("NOT_VALID")
        if not entry.sealed and not req["flags"] & RequestFlag.ALLOW_UNSEALED:
            raise Failed("NOT_SEALED")
        if entry.data_length > req["dd.length"]:
            raise Failed("TOO_LARGE")
        if entry.data_length:
            conn.qp.write(req["dd.stag"], req["dd.offset"],
                          bytes(self.memory.block(entry.block_offset, entry.data_length)),
                          signaled=False)
        return Outcome(0, entry.generation, entry.data_length, entry.block_offset)

    async def store(self, conn: Connection, req: AnyMessage,
                   fetch: asyncio.Future | None = None) -> Outcome:
        length = self._store_length(req)
        entry = self._entry(req, conn.state)
        if not entry.valid:
            raise Failed("NOT_VALID")
        if entry.sealed:
            raise Failed("SEALED")
        data = await self._data(conn, req, length, fetch)
        self.memory.block(entry.block_offset, len(data))[:] = data
        flags = entry.flags | (EntryFlag.SEALED if req["flags"] & RequestFlag.SEAL else 0)
        self.table.write(req["handle"], Entry(flags, entry.generation, len(data), entry.block_offset))
        return Outcome(0, entry.generation, len(data), entry.block_offset)

    async def alloc_store(self, conn: Connection, req: AnyMessage,
                         fetch: asyncio.Future | None = None) -> Outcome:
        length = self._store_length(req)
        state = conn.state
        entry = self._entry(req, state)
        if entry.valid:
            raise Failed("ALREADY_BOUND")
        if state.watch is not None:
            state.watch.poll()       # tickets FetchAdd took since the last look count now
        if state.usage >= state.quota:
            raise Failed("NO_SPACE")
        data = await self._data(conn, req, length, fetch)
        ring = conn.ring
        state.tickets += 1
        try:
            ticket, block = await ring.allocate(self._pause(ring, conn), self.allocate_timeout)
        except TimeoutError:
            raise Failed("INTERNAL") from None
        finally:
            state.tickets -= 1
        self.memory.block(block, len(data))[:] = data
        bound = self.table.bind(req["handle"], block, len(data), bool(req["flags"] & RequestFlag.SEAL))
        state.bound.add(req["handle"])
        return Outcome(0, bound.generation, len(data), block)

    def _pause(self, ring: FreeRing, conn: Connection) -> Pause | None:
        hook = self.before_slot_read
        watch = conn.state.watch
        if watch is None and hook is None:
            return None

        async def pause(ticket: int) -> None:
            if watch is not None:
                watch.taken_by_target(ticket)
            if hook is not None:
                await hook(ticket)
        return pause

    async def free(self, conn: Connection, req: AnyMessage,
                  fetch: asyncio.Future | None = None) -> Outcome:
        entry = self._entry(req, conn.state)
        if not entry.valid:
            raise Failed("NOT_VALID")
        self.table.unbind(req["handle"])
        conn.state.bound.discard(req["handle"])
        self.release_block(entry.block_offset)
        return Outcome(0, self.table.read(req["handle"]).generation, 0, entry.block_offset)

    def release_block(self, block: int) -> None:
        """Return a block to its ring, cleared when it may reach another trust domain."""
        ring = self.memory.ring_of(block)
        if self.clear_freed and ring is self.memory.shared_ring:
            self.memory.block(block)[:] = bytes(self.block_size)
        ring.free(block)

    async def bind(self, conn: Connection, req: AnyMessage,
                  fetch: asyncio.Future | None = None) -> Outcome:
        state, watch = conn.state, conn.state.watch
        if watch is None:
            raise Failed("MALFORMED")     # no DIRECT_ALLOC in this session: nothing to bind
        length = req["bind.data_length"]
        if length > self.block_size:
            raise Failed("TOO_LARGE")
        entry = self._entry(req, state)
        if entry.valid:
            raise Failed("ALREADY_BOUND")
        ticket = req["bind.ticket"]
        if watch.abandoned(ticket):
            raise Failed("TICKET_ABANDONED")
        ring = watch.part.ring
        offset = ring.offset_of(ticket)
        block = ring.ready(ticket, offset)
        if block is None or block != req["bind.block_offset"] or not watch.outstanding(ticket):
            raise Failed("MALFORMED")     # the slot of that ticket does not hold that block
        if len(state.bound) >= state.quota:
            raise Failed("NO_SPACE")
        ring.consume(offset)
        watch.bound(ticket)
        bound = self.table.bind(req["handle"], block, length, sealed=True)
        state.bound.add(req["handle"])
        return Outcome(0, bound.generation, length, block)

    _handlers: dict[int, Callable[[Executor, Connection, AnyMessage, asyncio.Future | None], Awaitable[Outcome]]]
    _handlers = {Opcode.LOAD: load, Opcode.STORE: store, Opcode.ALLOC_STORE: alloc_store,
                 Opcode.FREE: free, Opcode.BIND: bind}

    @classmethod
    def handles(cls, opcode: int) -> bool:
        return opcode in cls._handlers
