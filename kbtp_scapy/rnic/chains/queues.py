"""Work queues and completion queues of the chain engine.

A work queue is a ring of WQE slots in a registered region (so earlier work requests can
write into later WQEs), a producer index that the host's doorbell moves and, for a
managed queue (mlx5 cross-channel), a limit that only another queue's ENABLE moves. A
completion queue counts completions (what WAIT watches) and keeps the entries the host
polls.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..memory import MemoryRegion
from .cqe import CQE_SIZE
from .wqe import STRIDE


@dataclass
class Completion:
    wr_id: int
    opcode: int
    status: str = "ok"            # or why the work request failed
    byte_len: int = 0
    queue: int = 0


@dataclass(eq=False)
class CompletionQueue:
    number: int
    polled: bool = False          # the host takes its entries (else only counted)
    moderation: int = 1           # the host hears of every n-th completion (CQ moderation)
    count: int = 0
    entries: deque[Completion] = field(default_factory=deque)
    ring: MemoryRegion | None = None   # the CQE buffer in registered memory (cqe.py), if any
    cqes: int = 0                 # its entries

    def cqe(self, index: int) -> int:
        """Tagged Offset of completion ``index``'s CQE in ``ring``."""
        assert self.ring is not None
        return self.ring.base + (index % self.cqes) * CQE_SIZE


@dataclass(eq=False)
class WorkQueue:
    number: int
    region: MemoryRegion          # the WQE slots, registered: chains write into them
    slots: int
    cq: CompletionQueue
    managed: bool = False         # runs only what an ENABLE allowed
    receive: bool = False
    written: int = 0              # WQEs the host has written
    posted: int = 0               # producer index (the doorbell's)
    enabled: int = 0              # managed queues: WQEs an ENABLE has let run
    next: int = 0                 # consumer index
    inflight: int = 0             # Reads and atomics started, not completed (FENCE waits)
    error: str | None = None

    def limit(self) -> int:
        return min(self.posted, self.enabled) if self.managed else self.posted

    def at(self, index: int) -> int:
        """Tagged Offset of WQE ``index``'s slot."""
        return self.region.base + (index % self.slots) * STRIDE

    def slot(self, index: int) -> memoryview:
        return self.region.local(self.at(index), STRIDE)

    @property
    def free(self) -> int:
        return self.slots - (self.written - self.next)
