"""The free-block ring: slots and Head/Tail counters in registered memory (spec "Free-Block Ring").

Allocation and free follow the text's rules literally, on the bytes a remote peer sees:
FetchAdd on Head (through the same atomic the RNIC executes for remote peers, masked on
iWARP and unmasked on RoCEv2), wait until the slot holds the ticket's block, consume it;
free is FetchAdd on Tail and a slot write, deferred while the slot is still unconsumed.
A ticket that is abandoned (DIRECT_ALLOC's Ticket Timeout) has its block taken back and
returned under a new ticket, even if its slot is only filled later.
"""
from __future__ import annotations

import asyncio
import sys
from array import array
from collections.abc import Awaitable, Callable, Sequence

from .. import codec, ring as counters
from ..rnic.memory import MemoryTable
from ..tables import RING_COUNTER, memory as M

CONSUMED = M.SLOT_CONSUMED
TICKET_MASK = 0xFFFFFFFF     # Tickets and Sequences are 32 bits, and wrap


def ring_log2(blocks: int) -> int:
    """n such that N = 2**n is the smallest power of two not smaller than ``blocks``."""
    return max(0, (blocks - 1).bit_length())


class FreeRing:
    """N = 2**n slots in ``slots`` and two counters (Head at 0, Tail at 8) in ``heads``."""

    def __init__(self, memory: MemoryTable, slots: memoryview, heads: memoryview, n: int,
                 blocks: Sequence[int], *, masked: bool, addr_le: bool) -> None:
        self.memory, self.slots, self.n, self.masked, self.addr_le = memory, slots, n, masked, addr_le
        self.size = 1 << n
        self.head, self.tail = heads[0:8], heads[8:16]
        self.add = RING_COUNTER.masked_add_data if masked else RING_COUNTER.unmasked_add_data
        self.mask = counters.add_mask(n) if masked else None
        self._changed = asyncio.Event()
        self.reset(blocks)

    def reset(self, blocks: Sequence[int]) -> None:
        """The initial state of the text's "Initialization" rule, with ``blocks`` free:
        at start, and when a partition's owner is gone (whatever it did to its Head)."""
        self._deferred: dict[int, tuple[int, int]] = {}   # slot offset -> (ticket, block)
        self._abandoned: set[int] = set()                  # tickets whose blocks go back
        f = len(blocks)
        self._initialise_slots(blocks)
        self._store(self.head, counters.join(0, 0))
        self._store(self.tail, counters.join(f, M.SLOT_SIZE * (f % self.size) if self.masked else 0))

    def _initialise_slots(self, blocks: Sequence[int]) -> None:
        """Slot s < F holds {s, s-th block}; the others {s - N mod 2**32, consumed}.

        Filled column-wise (one C-level copy per field) so a 1 GiB pool starts at once;
        the offsets and orders come from the ring slot table.
        """
        f, size = len(blocks), self.size
        sequences = array("I", range(f))
        sequences.extend((s - size) & TICKET_MASK for s in range(f, size))
        offsets = array("Q", blocks)
        offsets.extend([CONSUMED] * (size - f))
        little = sys.byteorder == "little"
        if little:                       # Sequence is always in network order
            sequences.byteswap()
        if little != self.addr_le:       # Block Offset is an address field
            offsets.byteswap()
        per_slot = M.SLOT_SIZE
        self.slots[:size * per_slot] = bytes(size * per_slot)
        seq_at, off_at = M.RING_SLOT.offset("sequence"), M.RING_SLOT.offset("block_offset")
        self.slots.cast("I")[seq_at // 4::per_slot // 4] = memoryview(sequences)
        self.slots.cast("Q")[off_at // 8::per_slot // 8] = memoryview(offsets)

    # -- bytes ---------------------------------------------------------------------------

    def _store(self, view: memoryview, value: int) -> None:
        view[:] = value.to_bytes(8, self.memory.order)

    def counter(self, which: str = "head") -> int:
        return int.from_bytes(self.head if which == "head" else self.tail, self.memory.order)

    def slot(self, offset: int) -> tuple[int, int]:
        d = codec.decode_struct(M.RING_SLOT, self.slots[offset:offset + M.SLOT_SIZE], self.addr_le)
        return d["slot.sequence"], d["slot.block_offset"]

    def _write_slot(self, offset: int, sequence: int, block: int) -> None:
        raw = codec.encode_struct(M.RING_SLOT, {"slot.sequence": sequence, "slot.reserved": 0,
                                                "slot.block_offset": block}, self.addr_le)
        # Block Offset before Sequence: a reader that sees the Sequence sees the block.
        self.slots[offset + 8:offset + 16] = raw[8:]
        self.slots[offset:offset + 8] = raw[:8]

    def offset_of(self, ticket: int) -> int:
        return M.SLOT_SIZE * (ticket % self.size)

    def _fetch_add(self, view: memoryview) -> tuple[int, int]:
        value = self.memory.fetch_add(view, self.add, self.mask)
        ticket, low = counters.split(value, self.n if self.masked else None)
        return ticket, low if self.masked else self.offset_of(ticket)

    # -- allocation ----------------------------------------------------------------------

    def take_ticket(self) -> tuple[int, int]:
        """FetchAdd on Head: (ticket, slot offset)."""
        return self._fetch_add(self.head)

    def ready(self, ticket: int, offset: int) -> int | None:
        """The block the slot holds for ``ticket``, or None while it does not yet."""
        sequence, block = self.slot(offset)
        return block if sequence == ticket & TICKET_MASK and block != CONSUMED else None

    async def allocate(self, pause: Callable[[int], Awaitable[None]] | None = None,
                       timeout: float = 5.0) -> tuple[int, int]:
        """A target-executed allocation: (ticket, block offset), the slot consumed.

        ``pause`` runs between the FetchAdd and the slot read (the test hook that
        reproduces the specification's deferred-free example).
        """
        ticket, offset = self.take_ticket()
        if pause is not None:
            await pause(ticket)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (block := self.ready(ticket, offset)) is None:
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.give_up(ticket)
                raise TimeoutError(f"ring slot for ticket {ticket} never filled")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass
        self.consume(offset)
        return ticket, block

    def give_up(self, ticket: int) -> None:
        """An allocation that stops waiting for its slot gives its ticket up as an abandoned
        one is: the block, once the slot is filled, goes straight back under a new ticket.
        Left taken, the block would stay in the slot for good, and every later free to that
        slot would be deferred behind it (the model check's counterexample, docs/RING_CHECK.md)."""
        self.reclaim(ticket)

    def consume(self, offset: int) -> None:
        """Mark a slot consumed, then write a free that was waiting for it."""
        sequence, _ = self.slot(offset)
        self._write_slot(offset, sequence, CONSUMED)
        deferred = self._deferred.pop(offset, None)
        if deferred is not None:
            self._fill(offset, *deferred)

    # -- free ----------------------------------------------------------------------------

    def free(self, block: int) -> None:
        """FetchAdd on Tail, then write the slot, or defer while it is unconsumed.

        A work-request chain consumes slots without ``consume``: a deferred free of a slot
        it consumed is written first, else this free would take the slot over and the
        allocation the deferred free is for would wait for good (docs/RING_CHECK.md)."""
        ticket, offset = self._fetch_add(self.tail)
        self.settle()
        if self.slot(offset)[1] == CONSUMED:
            self._fill(offset, ticket, block)
        else:
            self._deferred[offset] = (ticket, block)

    def _fill(self, offset: int, ticket: int, block: int) -> None:
        self._write_slot(offset, ticket & TICKET_MASK, block)
        self._changed.set()
        if ticket in self._abandoned:
            self._abandoned.discard(ticket)
            self.consume(offset)
            self.free(block)

    def settle(self) -> int:
        """Write the deferred frees whose slots were consumed behind the ring's back (by a
        work-request chain's Write of all ones); returns how many were written."""
        written = 0
        while (offset := next((o for o in self._deferred if self.slot(o)[1] == CONSUMED),
                              None)) is not None:
            self._fill(offset, *self._deferred.pop(offset))   # may defer another free
            written += 1
        return written

    def snapshot(self) -> tuple[bytes, bytes, tuple[tuple[int, tuple[int, int]], ...], tuple[int, ...]]:
        """Everything the ring's behaviour depends on, hashable: slots, counters, deferred
        frees and abandoned tickets (the state of the model checker, ``ring_check.py``)."""
        return (bytes(self.slots[:self.size * M.SLOT_SIZE]), bytes(self.head) + bytes(self.tail),
                tuple(sorted(self._deferred.items())), tuple(sorted(self._abandoned)))

    def restore(self, snapshot: tuple[bytes, bytes, tuple[tuple[int, tuple[int, int]], ...],
                                      tuple[int, ...]]) -> None:
        slots, heads, deferred, abandoned = snapshot
        self.slots[:len(slots)] = slots
        self.head[:], self.tail[:] = heads[:8], heads[8:]
        self._deferred, self._abandoned = dict(deferred), set(abandoned)

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    def deferred_blocks(self) -> list[int]:
        return [block for _, block in self._deferred.values()]

    # -- abandoned tickets (DIRECT_ALLOC) -------------------------------------------------

    def reclaim(self, ticket: int) -> None:
        """Take back the block of an abandoned ticket and return it under a new ticket."""
        offset = self.offset_of(ticket)
        block = self.ready(ticket, offset)
        if block is None:
            self._abandoned.add(ticket)    # filled later: _fill sends it straight back
            return
        self.consume(offset)
        self.free(block)

    def occupancy(self) -> int:
        """Blocks in the ring: tickets issued by Tail minus tickets taken from Head."""
        return (self.counter("tail") >> 32) - (self.counter("head") >> 32)
