"""ALLOC_STORE chains caught between their ticket and their Send, settled by the host.

A chain takes its ticket (FetchAdd on Head), waits for its slot, consumes it, moves the
data, makes the entry VALID and sends the COMPLETION. When something stops it in between,
the target's Python, which is on no request's path, settles it afterwards from the chain's
own output queue (how far it got) and slot buffer (which ticket, which block), as a real
target's CPU would from the WQEs and buffers it posted (docs/CHAINS.md, finding 12):

- at teardown of a failed connection (its data Read met an invalid STag, say), a ticket
  whose slot was not consumed is given up, a block consumed and not yet bound goes back to
  the ring, and one whose entry the chain made VALID is booked as bound.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .chain_alloc import Steps
from .table import UNBOUND_OFFSET, Entry

if TYPE_CHECKING:
    from .chains import ChainRunner

log = logging.getLogger("kbtp.target")


def caught(runner: ChainRunner) -> Iterator[tuple[int, Steps]]:
    """(chain slot, its steps) of every ALLOC_STORE chain that took a ticket and has not
    sent its COMPLETION."""
    if runner.alloc is None:
        return
    for (j, _), steps in runner.alloc.steps.items():
        if steps.ticket < steps.out.next <= steps.send:
            yield j, steps


def recover(runner: ChainRunner) -> int:
    """Settle the caught chains of a connection that ends; returns the blocks given back."""
    alloc, state = runner.alloc, runner.conn.state
    returned = 0
    for j, steps in caught(runner):
        assert alloc is not None        # caught() yields only where ALLOC_STORE has chains
        at = steps.out.next
        if at <= steps.consume:         # waiting for its slot: the ticket goes, as abandoned
            alloc.ring.give_up(alloc.ticket(steps.out, steps.wait))
            continue
        handle = alloc.bound(j)
        if at > steps.valid:            # bound: only its COMPLETION is missing
            state.bound.add(handle)
            continue
        if at > steps.entry:            # Data Length and Block Offset written, not VALID
            table = runner.target.memory.table
            entry = table.read(handle)
            table.write(handle, Entry(entry.flags, entry.generation, 0, UNBOUND_OFFSET))
        alloc.ring.free(runner.block(j))
        returned += 1
    if returned:
        log.info("connection from %s: %d block(s) of ALLOC_STORE chains it cut short back to "
                 "the ring", runner.conn.peer, returned)
    return returned
