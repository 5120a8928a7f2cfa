"""Check the invariant the ring rules promise: no block lost, none handed out twice.

With no operation in flight, every block of the pool is either free (in exactly one
ring, between Head and Tail, or in a deferred free) or bound by exactly one table entry.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .server import Target


def audit(target: Target) -> list[str]:
    """Problems found in the target's memory; empty when the invariant holds."""
    where: Counter[int] = Counter()
    problems = []
    for name, ring in target.rings():
        head, tail = ring.counter("head") >> 32, ring.counter("tail") >> 32
        for ticket in range(head, tail):
            block = ring.ready(ticket, ring.offset_of(ticket))
            if block is not None:
                where[block] += 1
        for block in ring.deferred_blocks():
            where[block] += 1
        if tail - head - ring.deferred > ring.size:
            problems.append(f"ring {name}: {tail - head} tickets between Head and Tail")
    table = target.memory.table
    for handle in range(table.base_handle, table.base_handle + table.count):
        entry = table.read(handle)
        if entry.valid:
            where[entry.block_offset] += 1
    expected = set(target.memory.offsets)
    for block, n in sorted(where.items()):
        if block not in expected:
            problems.append(f"block offset 0x{block:x} is not a block of the pool")
        elif n > 1:
            problems.append(f"block offset 0x{block:x} is free or bound {n} times")
    for block in sorted(expected - set(where)):
        problems.append(f"block offset 0x{block:x} is neither free nor bound (lost)")
    return problems
