"""Target memory structures that remote peers read (spec "Target Memory Structures").

The block table entry and ring slot are read by DIRECT_LOAD / DIRECT_ALLOC; the
completion record is written by the target for RECORD; the ring counters Head and Tail
are changed only by FetchAdd.
"""
from __future__ import annotations

from dataclasses import dataclass

from .enums import ENTRY_FLAGS, STATUS
from .model import Field, Order, Struct

A = Order.ADDRESS

TABLE_ENTRY = Struct(
    name="table_entry", title="Block Table Entry", section="Target Memory Structures / Block Table",
    prefix="entry",
    items=(
        Field("flags", 2, "Flags", "VALID and SEALED", flags=ENTRY_FLAGS, hex=True),
        Field("generation", 2, "Generation", "Changes on every bind and unbind; never zero once bound"),
        Field("data_length", 4, "Data Length", "Valid octets in the block"),
        Field("block_offset", 8, "Block Offset", "Tagged Offset of the block within the Pool STag",
              order=A, hex=True),
    ),
)

RING_SLOT = Struct(
    name="ring_slot", title="Ring Slot", section="Target Memory Structures / Free-Block Ring",
    prefix="slot",
    items=(
        Field("sequence", 4, "Sequence (Ticket)", "Ticket for which the slot holds a block"),
        Field("reserved", 4, "Reserved", "Reserved, zero", hex=True, reserved=True),
        Field("block_offset", 8, "Block Offset", "Free block; all ones when consumed",
              order=A, hex=True),
    ),
)

COMPLETION_RECORD = Struct(
    name="completion_record", title="Completion Record", section="Completion", prefix="record",
    items=(
        Field("request_id", 8, "Request ID", "Request ID of the completed request"),
        Field("status", 2, "Status", "Outcome", enum=STATUS),
        Field("generation", 2, "Generation", "The entry's current generation"),
        Field("data_length", 4, "Data Length", "Valid octets in the block"),
        Field("block_offset", 8, "Block Offset", "Tagged Offset of the block", order=A, hex=True),
    ),
)

MEMORY_STRUCTS = (TABLE_ENTRY, RING_SLOT, COMPLETION_RECORD)

SLOT_CONSUMED = (1 << 64) - 1
"""Block Offset value of a consumed (empty) ring slot."""

ENTRY_SIZE = TABLE_ENTRY.size
SLOT_SIZE = RING_SLOT.size


@dataclass(frozen=True)
class RingCounter:
    """Layout of the Head and Tail counters (spec "Free-Block Ring"; RFC 7306 masked FetchAdd).

    Ticket in bits 63-32; Slot Offset (slot number times the slot size) in the low n+4
    bits. With the InfiniBand unmasked Fetch and Add the low 32 bits stay zero and the
    slot is 16 * (ticket mod N).
    """

    size: int = 8
    order: Order = Order.MEMORY
    ticket_shift: int = 32
    slot_size: int = SLOT_SIZE
    masked_add_data: int = 0x0000000100000010
    unmasked_add_data: int = 0x0000000100000000

    def add_mask(self, n: int) -> int:
        """Add Mask for a ring of 2**n slots: carries stop after bit 63, bit 31 and bit n+3."""
        return (1 << 63) | (1 << 31) | (1 << (n + 3))

    def slot_offset_mask(self, n: int) -> int:
        return (1 << (n + 4)) - 1


RING_COUNTER = RingCounter()
