"""Indirect keys that turn a handle into its table entry's address without arithmetic.

A chain can place a request's 64-bit Block Handle into a WQE's address field only as it
is, or shifted by whole octets (placing octets 1 to 7 of it gives handle * 256). The table
entry of handle h is at 16 * (h - Table Base Handle), which no placement produces. mlx5's
indirect memory keys (UMR with a KLM list) map pieces of a key's address space onto other
keys: with two KLM entries per handle, Tagged Offset h * 256 + j of this key reaches octet
j of h's entry for j < 16, and everything else, including every handle outside the
table, reaches the null key, which reads zeros and drops writes. A zero entry is not VALID,
so a LOAD of a handle outside the table fails the chain's VALID check and goes to software
like any invalid handle: the range check costs no work request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..memory import Access, MemoryRegion, MemoryTable

STRIDE = 256          # one octet of shift
_SPACE = 1 << 64


@dataclass(eq=False)
class HandleAlias(MemoryRegion):
    """Tagged Offset ``(first + i * unit) * 256 + j`` is octet j of entry i, for j below
    ``entry_size``; entries lie ``pitch`` octets apart in the buffer. Handles: unit 1 and
    16-octet entries. Blocks (``Block Offset * 256``): unit and entry the Block Size, so a
    Write longer than a block ends in the null key instead of the next block. With ``wrap``,
    entry i lies where entry ``i mod wrap`` does (a ring's slot of ticket t: t mod N)."""

    first: int = 0
    entries: int = 0
    entry_size: int = 16
    unit: int = 1
    pitch: int = 0
    wrap: int = 0

    def local(self, offset: int, length: int) -> memoryview:
        index, j = divmod(offset - self.first * STRIDE, self.unit * STRIDE)
        if 0 <= index < self.entries and j + length <= self.entry_size:
            at = (index % self.wrap if self.wrap else index) * (self.pitch or self.entry_size) + j
            return self.view[at:at + length]
        return memoryview(bytearray(length))       # the null key


def register_alias(memory: MemoryTable, buffer: Any, first: int, entries: int, entry_size: int, *,
                   unit: int = 1, pitch: int = 0, start: int = 0, connection: object | None = None,
                   access: Access = Access.REMOTE_READ | Access.REMOTE_WRITE, wrap: int = 0) -> HandleAlias:
    """An alias key over ``entries`` entries at ``buffer[start:]`` (``wrap`` of them, if
    given, repeated), bound to ``connection`` (the engine's loopback: no peer reaches it)."""
    stored = min(entries, wrap) if wrap else entries
    length = (stored - 1) * (pitch or entry_size) + entry_size if stored else 0

    def make(stag: int) -> MemoryRegion:
        return HandleAlias(stag, buffer, access, start, length, 0, connection, first=first,
                           entries=entries, entry_size=entry_size, unit=unit, pitch=pitch, wrap=wrap)
    region = memory.register_indirect(make)
    assert isinstance(region, HandleAlias)
    return region


def register_handle_alias(memory: MemoryTable, table: Any, first_handle: int, entries: int,
                          entry_size: int, *, start: int = 0,
                          connection: object | None = None) -> HandleAlias:
    """The alias key over the table entries at ``table[start:]`` (the first is
    ``first_handle``'s)."""
    return register_alias(memory, table, first_handle, entries, entry_size, start=start,
                          connection=connection)


def handle_offset(value: int) -> int:
    """The Tagged Offset a chain places for ``value`` (a handle, a Block Offset): octets 1
    to 7 of it, shifted up one octet."""
    return (value << 8) % _SPACE
