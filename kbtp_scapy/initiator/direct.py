"""DIRECT_LOAD and DIRECT_ALLOC: one-sided access through the STags a HELLO_ACK grants.

Both follow the text's "Direct Modes" step by step: each RDMA Read is issued only after
the previous one completed, a 16-octet slot read is confirmed by a second read (it is
not guaranteed to be atomic), and the initiator never writes ring slots.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from .. import codec, ring as counters
from ..tables import RING_COUNTER, memory as M
from ..vocab import AnyStruct, EntryFlag, Status
from .limits import Limits
from .results import KbtpError, Result, TargetInfo

if TYPE_CHECKING:
    from ..rnic import QueuePair

T = TypeVar("T")
CONSUMED = M.SLOT_CONSUMED
#: Ticket Timeouts after which a checker counts an unbound ticket abandoned. The text
#: abandons it at one; a target notices a FetchAdd its RNIC executed only by looking at
#: Head, so half a Timeout more is left for that (the reference looks eight times per
#: Timeout, which makes it at most an eighth late).
ABANDONED_AFTER = 1.5


class DirectModes:
    """Mixed into ``Initiator``: needs ``qp``, ``target``, ``addr_le``, ``limits``, ``usage``,
    ``bind`` and ``within`` (every one-sided operation's deadline)."""

    qp: QueuePair
    addr_le: bool
    limits: Limits
    usage: int
    tickets = 0          # taken on our Head and not bound yet
    if TYPE_CHECKING:
        @property
        def target(self) -> TargetInfo: ...

        async def bind(self, handle: int, ticket: int, data_length: int, block_offset: int, *,
                       generation: int = 0) -> Result: ...

        async def within(self, answer: Awaitable[T], what: str, *, fatal: bool = False) -> T: ...

    async def _read(self, stag: int, offset: int, length: int, what: str) -> bytes:
        """An RDMA Read within the deadline; past it the connection ends (``within``)."""
        return await self.within(self.qp.read(stag, offset, length),
                                 f"RDMA Read Response for {what}", fatal=True)

    def _direct(self, key: str) -> tuple[int, int, int]:
        f = self.target.fields
        if f"{key}.stag" not in f:
            feature = "DIRECT_LOAD" if key in ("table", "pool") else "DIRECT_ALLOC"
            why = (" (a target grants DIRECT_ALLOC while it has a partition free: all may be held "
                   "by other sessions, active or retained with bindings; its log says which)"
                   if feature == "DIRECT_ALLOC" else "")
            raise KbtpError(Status.INTERNAL, detail=f"{feature} was not granted in this session's "
                                                    f"HELLO_ACK, so there is no {key} descriptor{why}")
        return f[f"{key}.stag"], f[f"{key}.offset"], f[f"{key}.count"]

    async def _entry(self, stag: int, offset: int) -> AnyStruct:
        raw = await self._read(stag, offset, M.ENTRY_SIZE, "a table entry")
        return codec.decode_struct(M.TABLE_ENTRY, raw, self.addr_le)

    async def direct_load(self, handle: int, *, attempts: int = 8) -> Result:
        """Read the entry, the block, the entry again; valid if both show the same
        Generation with VALID and SEALED. Retried while a concurrent change is seen."""
        stag, base, count = self._direct("table")
        index = handle - self.target.fields["table_base_handle"]
        if not 0 <= index < count:
            raise KbtpError(Status.INVALID_HANDLE, detail="handle outside the table")
        pool_stag = self._direct("pool")[0]
        at = base + index * M.ENTRY_SIZE
        for _ in range(attempts):
            first = await self._entry(stag, at)
            flags = first["entry.flags"]
            if not flags & EntryFlag.VALID:
                raise KbtpError(Status.NOT_VALID, detail="entry not VALID")
            if not flags & EntryFlag.SEALED:
                raise KbtpError(Status.NOT_SEALED, detail="entry not SEALED")
            length = first["entry.data_length"]
            if not self._in_pool(first["entry.block_offset"], length):
                continue        # not an entry the target can have written: read it again
            data = (await self._read(pool_stag, first["entry.block_offset"], length, "a block")
                    if length else b"")
            second = await self._entry(stag, at)
            if second == first:
                return Result(0, 0, first["entry.generation"], length,
                              first["entry.block_offset"], data)
        raise KbtpError(Status.NOT_VALID, detail=f"entry kept changing over {attempts} attempts")

    def _in_pool(self, block_offset: int, length: int) -> bool:
        """A block of the Pool descriptor and a Data Length within the Block Size: never
        read more, or elsewhere, than the HELLO_ACK granted on the word of one entry read."""
        _, pool_base, pool_count = self._direct("pool")
        size = self.target.block_size
        return (length <= size and pool_base <= block_offset
                and block_offset + size <= pool_base + pool_count * size)

    def _ring(self) -> tuple[int, int, int]:
        """Head STag, Head Tagged Offset and n (N = 2^n slots), once the HELLO_ACK's
        DIRECT_ALLOC descriptors are seen to be possible: a Head aligned to 8 octets, and
        N a power of two not smaller than the Partition's blocks (spec "Free-Block Ring")."""
        head_stag, head_offset, heads = self._direct("head")
        slots, blocks = self._direct("ring")[2], self._direct("partition")[2]
        if head_offset % 8 or not heads or not blocks or slots < blocks or slots & (slots - 1):
            raise KbtpError(Status.MALFORMED, detail=f"impossible DIRECT_ALLOC descriptors: Head at "
                            f"{head_offset:#x} (count {heads}), {slots} ring slots, {blocks} blocks")
        return head_stag, head_offset, (slots - 1).bit_length()

    async def take_ticket(self) -> tuple[int, int]:
        """FetchAdd on our Head: (ticket, slot offset), masked on iWARP, unmasked on RoCEv2."""
        head_stag, head_offset, n = self._ring()
        masked = self.qp.masked_atomics
        add = self.qp.fetch_add(head_stag, head_offset, *(
            (RING_COUNTER.masked_add_data, counters.add_mask(n)) if masked else
            (RING_COUNTER.unmasked_add_data,)))
        value = await self.within(add, "FetchAdd answer", fatal=True)
        if masked:
            return counters.split(value, n)
        ticket = value >> RING_COUNTER.ticket_shift
        return ticket, M.SLOT_SIZE * (ticket % (1 << n))

    async def wait_slot(self, ticket: int, offset: int, timeout: float) -> int:
        """Re-read the slot until it holds a block for ``ticket``, then confirm once more.

        The slot counts as empty only when a read sent ``timeout`` seconds or more after
        the first still finds it so, and a block seen is always confirmed (once, however
        late): a slow initiator (a busy host) never mistakes its own pace for the target's."""
        ring_stag, ring_base, _ = self._direct("ring")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        confirmed: int | None = None
        while True:
            asked = loop.time()
            raw = await self._read(ring_stag, ring_base + offset, M.SLOT_SIZE, "a ring slot")
            slot = codec.decode_struct(M.RING_SLOT, raw, self.addr_le)
            ready = slot["slot.sequence"] == ticket & 0xFFFFFFFF and slot["slot.block_offset"] != CONSUMED
            block = slot["slot.block_offset"] if ready else None
            if block is not None and block == confirmed:
                return block
            if asked >= deadline and (block is None or confirmed is not None):
                raise KbtpError(Status.NO_SPACE, detail=f"no block arrived for ticket {ticket}")
            confirmed = block
            if block is None:
                await asyncio.sleep(0.001)

    async def direct_alloc(self, handle: int, data: bytes) -> Result:
        """FetchAdd on Head, read the slot, RDMA Write the data, then BIND."""
        if len(data) > self.target.block_size:
            raise KbtpError(Status.TOO_LARGE, detail="data larger than Block Size")
        partition_stag = self._direct("partition")[0]
        if self.usage + self.tickets >= self.target.quota:    # a ticket counts as usage
            raise KbtpError(Status.NO_SPACE, detail=f"the quota of {self.target.quota} blocks is in use")
        self.tickets += 1
        try:
            ticket, offset = await self.take_ticket()
            # half the Ticket Timeout, as the target's figure says, but never past our deadline
            block = await self.wait_slot(ticket, offset, min(self.target.ticket_timeout_ms / 2000,
                                                             self.limits.wait))
            if data:
                await self.within(self.qp.write(partition_stag, block, data),
                                  "acknowledgement of the RDMA Write", fatal=True)
            return await self.bind(handle, ticket, len(data), block)
        finally:
            self.tickets -= 1
