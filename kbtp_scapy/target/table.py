"""The block table, as 16-octet entries in registered memory (spec "Block Table").

The target's logic reads and writes the entries where a DIRECT_LOAD initiator reads
them, in the specification's format and byte order, so what a remote reader sees is
exactly what the target acts on.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import codec
from ..tables import memory as M
from ..vocab import EntryFlag

UNBOUND_OFFSET = M.SLOT_CONSUMED   # docs/NOTES.md decision 1: a never-bound entry's Block Offset


@dataclass
class Entry:
    flags: int
    generation: int
    data_length: int
    block_offset: int

    @property
    def valid(self) -> bool:
        return bool(self.flags & EntryFlag.VALID)

    @property
    def sealed(self) -> bool:
        return bool(self.flags & EntryFlag.SEALED)


def next_generation(generation: int) -> int:
    """Add one, skipping zero (spec "Block Unmapped Store" step 4, "Block Free" step 2)."""
    return generation % 0xFFFF + 1


class BlockTable:
    """Entries for handles ``base_handle .. base_handle + count - 1`` in ``view``."""

    def __init__(self, view: memoryview, base_handle: int, count: int, addr_le: bool) -> None:
        self.view, self.base_handle, self.count, self.addr_le = view, base_handle, count, addr_le
        empty = self._pack(Entry(0, 0, 0, UNBOUND_OFFSET))
        view[:count * M.ENTRY_SIZE] = empty * count

    def __contains__(self, handle: int) -> bool:
        return self.base_handle <= handle < self.base_handle + self.count

    def _at(self, handle: int) -> int:
        return (handle - self.base_handle) * M.ENTRY_SIZE

    def _pack(self, entry: Entry) -> bytes:
        return codec.encode_struct(M.TABLE_ENTRY, {
            "entry.flags": entry.flags, "entry.generation": entry.generation,
            "entry.data_length": entry.data_length, "entry.block_offset": entry.block_offset,
        }, self.addr_le)

    def read(self, handle: int) -> Entry:
        at = self._at(handle)
        d = codec.decode_struct(M.TABLE_ENTRY, self.view[at:at + M.ENTRY_SIZE], self.addr_le)
        return Entry(d["entry.flags"], d["entry.generation"], d["entry.data_length"],
                     d["entry.block_offset"])

    def write(self, handle: int, entry: Entry) -> None:
        """Data Length and Block Offset first, then Flags and Generation (spec "Block Table")."""
        at = self._at(handle)
        raw = self._pack(entry)
        self.view[at + 4:at + M.ENTRY_SIZE] = raw[4:]
        self.view[at:at + 4] = raw[:4]

    def bind(self, handle: int, block_offset: int, data_length: int, sealed: bool) -> Entry:
        entry = self.read(handle)
        bound = Entry(EntryFlag.VALID | (EntryFlag.SEALED if sealed else 0), next_generation(entry.generation),
                      data_length, block_offset)
        self.write(handle, bound)
        return bound

    def unbind(self, handle: int) -> Entry:
        """Clear VALID and SEALED and advance the Generation; returns the entry as it was."""
        entry = self.read(handle)
        self.write(handle, Entry(0, next_generation(entry.generation), 0, UNBOUND_OFFSET))
        return entry
