"""The target's registered memory: block pool, block table, rings and counters.

Everything a remote peer may be shown lives here as bytes in regions of the RNIC's
``MemoryTable``: the pool (F blocks of Block Size; block i at Block Offset i * S), the
table (one entry per handle of every initiator range), the shared ring for
target-executed allocations, and one ring with its Head per DIRECT_ALLOC partition.
The pool is an anonymous mapping faulted in at start (MAP_POPULATE), as registering
memory with an RNIC pins it: no operation then pays for first-touching its block (25 us
for a fresh 32 KiB block here, against 4 us for the copy itself), and a 1 GiB pool
still starts well inside the two seconds the target allows itself.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

from ..rnic.memory import MemoryTable
from ..tables import memory as M
from .config import TargetConfig
from .ring import FreeRing, ring_log2
from .table import BlockTable


@dataclass(eq=False)
class Partition:
    """A contiguous run of ``quota`` blocks with its own ring and Head (DIRECT_ALLOC)."""

    index: int
    first: int                     # Block Offset of its first block
    blocks: int
    ring: FreeRing
    slots: bytearray               # N ring slots
    heads: memoryview              # Head at 0, Tail at 8
    block_size: int
    owner: bytes | None = None     # Initiator ID holding it

    def release(self) -> None:
        """Back to the pool of partitions, every block free in a fresh ring: the next owner
        must not inherit tickets, deferred frees or a Head that a FetchAdd with wrong Add
        Data left behind (the RNIC executes the owner's atomics unchecked)."""
        self.ring.reset(self.offsets)
        self.owner = None

    @property
    def offsets(self) -> range:
        return range(self.first, self.first + self.blocks * self.block_size, self.block_size)

    def contains(self, block_offset: int) -> bool:
        return self.first <= block_offset < self.first + self.blocks * self.block_size


class TargetMemory:
    """Block Offsets are Tagged Offsets of the Pool STag (spec "Terminology"): ``pool_base``
    + i * Block Size, where ``pool_base`` is 0 on the soft RNIC and the pool's virtual
    address on a verbs device."""

    def __init__(self, config: TargetConfig, memory: MemoryTable, masked: bool) -> None:
        self.config, self.memory = config, memory
        c = config
        self.block_size = c.block_size
        size = c.blocks * c.block_size
        try:
            self.pool = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        except OSError as exc:       # ENOMEM: the pool is populated, so it must fit now
            why = (exc.strerror or "ENOMEM").lower()
            raise MemoryError(f"the pool of {c.blocks} blocks x {c.block_size} octets "
                              f"({size} octets): does not fit in memory ({why})") from None
        self.pool_view = memoryview(self.pool)
        self.pool_base = memory.default_base(self.pool)
        handles = c.max_initiators * c.handles_per_initiator
        self.table_buffer = bytearray(handles * M.ENTRY_SIZE)
        self.table = BlockTable(memoryview(self.table_buffer), c.base_handle, handles, c.addr_le)
        self.offsets = range(self.pool_base, self.pool_base + c.blocks * c.block_size, c.block_size)
        self.shared_ring = self._ring(self.offsets[:c.shared_blocks], masked)[0]
        self.partitions = []
        for k in range(c.direct_partitions):
            blocks = self.offsets[c.shared_blocks + k * c.quota:][:c.quota]
            ring, slots, heads = self._ring(blocks, masked)
            self.partitions.append(Partition(k, blocks.start, c.quota, ring, slots, heads, c.block_size))

    def _ring(self, blocks: range, masked: bool) -> tuple[FreeRing, bytearray, memoryview]:
        n = ring_log2(max(1, len(blocks)))
        slots = bytearray(M.SLOT_SIZE << n)
        heads = memoryview(bytearray(16))     # Head and Tail, each 8-octet aligned
        ring = FreeRing(self.memory, memoryview(slots), heads, n, blocks, masked=masked,
                        addr_le=self.config.addr_le)
        return ring, slots, heads

    def block(self, block_offset: int, length: int | None = None) -> memoryview:
        at = block_offset - self.pool_base
        return self.pool_view[at:at + (self.block_size if length is None else length)]

    def ring_of(self, block_offset: int) -> FreeRing:
        """The ring a block was allocated from, which is where a FREE returns it."""
        for part in self.partitions:
            if part.contains(block_offset):
                return part.ring
        return self.shared_ring
