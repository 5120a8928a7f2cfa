"""Direct modes: the STags a HELLO_ACK grants, and the Ticket Timeout of DIRECT_ALLOC.

DIRECT_LOAD shows the table and the pool read-only. DIRECT_ALLOC gives the initiator a
Partition STag (write access to its partition only, valid on this connection only, as a
memory window bound to it), its ring's slots read-only, and its Head for FetchAdd. The
RNIC executes those FetchAdds without the target's logic, so the target learns of a
ticket only by looking at Head: ``TicketWatch`` polls it, and a ticket still unbound
after the Ticket Timeout is abandoned: the Partition STag is invalidated first (no
Write of the initiator can reach the block any more), then the block goes back to the
ring under a new ticket, and a later BIND for the ticket gets TICKET_ABANDONED.

Every STag granted is a window bound to the connection it was granted on, so no other
connection (another initiator, or the same one after a reconnect) can use it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..rnic.memory import Access, MemoryRegion, MemoryTable
from ..rnic.qp import QueuePair
from ..vocab import HelloAck
from .pool import Partition, TargetMemory
from .ring import TICKET_MASK
from .sessions import InitiatorState

HALF = 1 << 31          # a Ticket ahead of another by less than this is after it


def grant_direct_load(memory: TargetMemory, qp: QueuePair) -> tuple[HelloAck, list[MemoryRegion]]:
    """HELLO_ACK fields and windows for DIRECT_LOAD: table and pool, read-only."""
    rnic: MemoryTable = memory.memory
    table, pool = _register(rnic, qp, (memory.table_buffer, Access.REMOTE_READ, {}),
                            (memory.pool, Access.REMOTE_READ, {"base": memory.pool_base}))
    fields: HelloAck = {
        "hello_ack.table.stag": table.stag, "hello_ack.table.offset": table.base,
        "hello_ack.table.count": memory.table.count,
        "hello_ack.table_base_handle": memory.table.base_handle, "hello_ack.reserved": 0,
        "hello_ack.pool.stag": pool.stag, "hello_ack.pool.offset": pool.base,
        "hello_ack.pool.count": memory.config.blocks,
    }
    return fields, [table, pool]


def grant_partition(memory: TargetMemory, part: Partition, qp: QueuePair) -> tuple[HelloAck, list[MemoryRegion]]:
    """HELLO_ACK fields and windows for DIRECT_ALLOC: the partition (write), its ring's
    slots (read) and its Head (atomic)."""
    window, ring, head = _register(
        memory.memory, qp,
        (memory.pool, Access.REMOTE_WRITE, {"start": part.first - memory.pool_base,
                                            "length": part.blocks * memory.block_size,
                                            "base": part.first}),
        (part.slots, Access.REMOTE_READ, {}), (part.heads.obj, Access.REMOTE_ATOMIC, {"length": 8}))
    fields: HelloAck = {
        "hello_ack.partition.stag": window.stag, "hello_ack.partition.offset": window.base,
        "hello_ack.partition.count": part.blocks,
        "hello_ack.ring.stag": ring.stag, "hello_ack.ring.offset": ring.base,
        "hello_ack.ring.count": part.ring.size,
        "hello_ack.head.stag": head.stag, "hello_ack.head.offset": head.base, "hello_ack.head.count": 1,
    }
    return fields, [window, ring, head]


def _register(rnic: MemoryTable, qp: QueuePair, *specs) -> list[MemoryRegion]:
    """Windows bound to ``qp``, all or none: an RDMA device may refuse one (OSError)."""
    done: list[MemoryRegion] = []
    try:
        for buffer, access, where in specs:
            done.append(rnic.register(buffer, access, connection=qp, **where))
    except OSError:
        for region in done:
            rnic.deregister(region.stag)
        raise
    return done


class TicketWatch:
    """Tickets of one partition ring: taken, bound, abandoned (spec "Allocation Quotas")."""

    def __init__(self, state: InitiatorState, memory: MemoryTable, timeout_ms: int) -> None:
        self.state, self.memory = state, memory
        if state.partition is None:
            raise ValueError("a TicketWatch watches the ring of a partition")
        self.part: Partition = state.partition
        self.timeout = timeout_ms / 1000
        self._seen = self.part.ring.counter("head") >> 32   # first ticket not yet looked at
        self._pending: dict[int, float] = {}                 # ticket -> when first seen
        self._target: set[int] = set()                       # taken by target-executed allocs
        self._abandoned: set[int] = set()
        self.windows: list[MemoryRegion] = []
        # work-request chains take tickets with no Python: they report them before a look,
        # and hear of the initiator's new ones after it (their quota guard's usage counter)
        self.before_poll: Callable[[], None] | None = None
        self.counted: Callable[[int], None] | None = None

    def taken_by_target(self, ticket: int) -> None:
        self._target.add(ticket)

    def outstanding(self, ticket: int) -> bool:
        self.poll()
        return ticket in self._pending

    def abandoned(self, ticket: int) -> bool:
        """Whether ``ticket`` was abandoned, its Ticket Timeout looked at now: a BIND that
        arrives as the timeout passes is TICKET_ABANDONED, not MALFORMED (the ticket would
        be gone from the outstanding ones by the next look)."""
        self.poll()
        return ticket in self._abandoned

    def bound(self, ticket: int) -> None:
        self._pending.pop(ticket)
        self.state.tickets -= 1

    def poll(self) -> None:
        """Notice tickets the initiator took since the last look, then expire old ones."""
        if self.before_poll is not None:
            self.before_poll()
        now = asyncio.get_running_loop().time()
        head = self.part.ring.counter("head") >> 32
        # A trusted initiator's FetchAdd with a wrong Add Data can put any value in Head
        # (the RNIC executes it unchecked). Head never moves backwards, and no initiator
        # waits on more than N unfilled tickets, so Head stays within N of Tail (which
        # only the target moves): learn nothing from another value, rather than walk
        # billions of tickets.
        # Tickets are 32 bits and wrap (spec "Free-Block Ring"): "a after b" is a - b
        # modulo 2^32 below 2^31, as for TCP sequence numbers.
        tail = self.part.ring.counter("tail") >> 32
        new = (head - self._seen) & TICKET_MASK
        room = (tail + self.part.ring.size - head) & TICKET_MASK     # head <= tail + N
        if 0 < new < HALF and room < HALF:
            before = self.state.tickets
            for ticket in ((self._seen + i) & TICKET_MASK for i in range(new)):
                if ticket in self._target:
                    self._target.discard(ticket)
                else:
                    self._pending[ticket] = now
                    self.state.tickets += 1
            self._seen = head
            if self.counted is not None and self.state.tickets > before:
                self.counted(self.state.tickets - before)
        for ticket, since in list(self._pending.items()):
            if now - since > self.timeout:
                self._abandon(ticket)

    def _abandon(self, ticket: int) -> None:
        for window in self.windows:          # first: no Write of the initiator can land
            self.memory.invalidate(window.stag)
        self.state.direct_disabled = True
        del self._pending[ticket]
        self._abandoned.add(ticket)
        self.state.tickets -= 1
        self.part.ring.reclaim(ticket)
