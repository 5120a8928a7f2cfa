"""ALLOC_STORE chains caught between their ticket and their Send, settled by the host.

A chain takes its ticket (FetchAdd on Head), waits for its slot, consumes it, moves the
data, makes the entry VALID and sends the COMPLETION. When something stops it in between,
the target's Python, which is on no request's path, settles it afterwards from the chain's
own output queue (how far it got) and slot buffer (which ticket, which block), as a real
target's CPU would from the WQEs and buffers it posted (docs/CHAINS.md, finding 12):

- at teardown of a failed connection (its data Read met an invalid STag, say), a ticket
  whose slot was not consumed is given up, a block consumed and not yet bound goes back to
  the ring, and one whose entry the chain made VALID is booked as bound;
- a chain that waits for its slot is answered by a timer per connection as the software
  target would answer it: NO_SPACE when the session is at its quota without it (finding
  14), INTERNAL once its slot has not filled within the software target's allocation
  timeout (finding 11); its ticket is given up.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..vocab import Status
from .chain_alloc import Steps
from .table import UNBOUND_OFFSET, Entry

if TYPE_CHECKING:
    from .chains import ChainRunner

log = logging.getLogger("kbtp.target")
_PERIOD = 0.05                  # seconds between the watchdog's looks, at most


def caught(runner: ChainRunner) -> Iterator[tuple[int, Steps]]:
    """(chain slot, its steps) of every ALLOC_STORE chain that took a ticket and has not
    sent its COMPLETION."""
    for (j, _), steps in runner.alloc.steps.items():
        if steps.ticket < steps.out.next <= steps.send:
            yield j, steps


def recover(runner: ChainRunner) -> int:
    """Settle the caught chains of a connection that ends; returns the blocks given back."""
    alloc, state = runner.alloc, runner.conn.state
    returned = 0
    for j, steps in caught(runner):
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


class Watchdog:
    """A connection's timer that looks, while a chain waits for its ring slot (requests
    complete in order, so at most one), at what the software target would answer it. With
    the session at its quota without the chain (a DIRECT_ALLOC initiator's own tickets took
    the rest, before a look of the ticket watch told the chains' usage counter: finding 14),
    NO_SPACE at once; after as long as the software target's allocation timeout, INTERNAL
    (finding 11). Either way the chain's ticket is given up and its queue flushed."""

    def __init__(self, runner: ChainRunner, timeout: float) -> None:
        self.runner, self.timeout = runner, timeout
        self.period = min(timeout / 4, _PERIOD)
        self.seen: tuple[int, float] | None = None      # (request, first caught waiting)
        self.timer = runner.loop.call_later(self.period, self._look)

    def _look(self) -> None:
        r = self.runner
        self.timer = r.loop.call_later(self.period, self._look)
        if not r.engine.requester.data_waiters:         # no WAIT_DATA blocked: no chain waits
            self.seen = None
            return
        waiting = [(j, steps) for j, steps in caught(r) if steps.out.next <= steps.consume]
        if not waiting:
            self.seen = None
            return
        (j, steps), = waiting
        k, now = r.done_cq.count, r.loop.time()         # the request it runs is the next to complete
        assert k % r.slots == j, (k, j)
        if self.seen is None or self.seen[0] != k:
            self.seen = (k, now)
        state = r.conn.state
        r.account()                     # the handles chains bound count now: no request may
        if state.watch is not None:     # come to make the runner book them before the answer
            state.watch.poll()          # the initiator's own tickets count now
        if state.usage >= state.quota:
            status = Status.NO_SPACE
        elif now - self.seen[1] >= self.timeout:
            status = Status.INTERNAL
        else:
            return
        ticket = r.alloc.ticket(steps.out, steps.wait)
        log.log(logging.INFO if status == Status.NO_SPACE else logging.WARNING,
                "connection from %s: the ALLOC_STORE chain of request %d waited %.3f s for the "
                "ring slot of ticket %d; answered %s", r.conn.peer, k, now - self.seen[1], ticket,
                status.name)
        self.seen = None
        r.alloc.ring.give_up(ticket)
        r.engine.flush(steps.out)
        r.fail(k, status)

    def stop(self) -> None:
        self.timer.cancel()
