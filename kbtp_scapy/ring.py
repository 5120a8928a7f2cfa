"""Ring counter arithmetic: masked (RFC 7306) and unmasked (InfiniBand) FetchAdd.

The counter layout (Ticket in bits 63-32, Slot Offset in the low n+4 bits, Add Data and
Add Mask) comes from ``kbtp_scapy.tables.RING_COUNTER``.
"""
from __future__ import annotations

from .tables import RING_COUNTER

_U64 = (1 << 64) - 1


def masked_add(value: int, add: int, mask: int) -> int:
    """RFC 7306 masked Fetch and Add: a set mask bit discards the carry out of that bit,
    so each run of bits ending at a mask bit adds on its own and wraps.

    With the mask bits (each run's top bit) cleared in both operands, one addition
    carries into a top bit but never out of it; the top bits are then the XOR of that
    carry and the operands' own top bits.
    """
    low = (value & ~mask) + (add & ~mask)
    return (low ^ ((value ^ add) & mask)) & _U64


def add_mask(n: int) -> int:
    """Add Mask of the Head and Tail counters of a ring of 2**n slots."""
    return RING_COUNTER.add_mask(n)


def split(counter: int, n: int | None = None) -> tuple[int, int]:
    """(Ticket, Slot Offset) of a counter value; without n, the unmasked form (slot from
    the ticket is the caller's business) gives Slot Offset = low 32 bits."""
    ticket = counter >> RING_COUNTER.ticket_shift
    low = counter & ((1 << RING_COUNTER.ticket_shift) - 1)
    return ticket, low if n is None else low & RING_COUNTER.slot_offset_mask(n)


def join(ticket: int, slot_offset: int = 0) -> int:
    """Counter value holding ``ticket`` and ``slot_offset``."""
    return ((ticket << RING_COUNTER.ticket_shift) | slot_offset) & _U64


def fetch_add(counter: int, n: int, masked: bool = True) -> tuple[int, int, int]:
    """Advance a counter as one allocation or free does: returns (ticket, slot offset,
    new counter). Unmasked (InfiniBand) counters compute the slot as 16 * (ticket mod N)."""
    if masked:
        ticket, offset = split(counter, n)
        return ticket, offset, masked_add(counter, RING_COUNTER.masked_add_data, add_mask(n))
    ticket = counter >> RING_COUNTER.ticket_shift
    offset = RING_COUNTER.slot_size * (ticket % (1 << n))
    return ticket, offset, (counter + RING_COUNTER.unmasked_add_data) & _U64
