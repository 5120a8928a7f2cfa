"""An indirect key that turns a handle into its table entry's address without arithmetic.

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
    """``buffer`` holds ``entries`` entries of ``entry_size`` octets for handles from
    ``first_handle``; Tagged Offset h * 256 + j is octet j of h's entry."""

    first_handle: int = 0
    entries: int = 0
    entry_size: int = 16

    def local(self, offset: int, length: int) -> memoryview:
        handle, j = divmod(offset, STRIDE)
        index = handle - self.first_handle
        if 0 <= index < self.entries and j + length <= self.entry_size:
            at = index * self.entry_size + j
            return self.view[at:at + length]
        return memoryview(bytearray(length))       # the null key


def register_handle_alias(memory: MemoryTable, table: Any, first_handle: int, entries: int,
                          entry_size: int, *, start: int = 0, connection: object | None = None,
                          access: Access = Access.REMOTE_READ | Access.REMOTE_WRITE) -> HandleAlias:
    """The alias key over the entries at ``table[start:]`` (the first is ``first_handle``'s),
    bound to ``connection`` (the engine's loopback: no peer reaches it)."""
    def make(stag: int) -> MemoryRegion:
        return HandleAlias(stag, table, access, start, entries * entry_size, 0, connection,
                           first_handle=first_handle, entries=entries, entry_size=entry_size)
    region = memory.register_indirect(make)
    assert isinstance(region, HandleAlias)
    return region


def handle_offset(handle: int) -> int:
    """The Tagged Offset the chain places for ``handle``: octets 1 to 7 of it, shifted up."""
    return (handle << 8) % _SPACE
