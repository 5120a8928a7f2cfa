"""The completer role: completions into CQs, and the queues that wait on them.

A WAIT blocks its queue until a CQ has a number of completions; the completer wakes the
queues blocked on a CQ when it grows, and tells the host when a polled CQ has entries.
"""
from __future__ import annotations

from collections.abc import Callable

from . import cqe
from .cqe import CQE_SIZE
from .queues import Completion, CompletionQueue, WorkQueue


class Completer:
    def __init__(self, wake: Callable[[WorkQueue], None], little: bool = False) -> None:
        self.little = little
        self.cqs: list[CompletionQueue] = []
        self._waiting: dict[int, list[WorkQueue]] = {}
        self._wake = wake
        self.on_polled: Callable[[CompletionQueue], None] | None = None

    def create(self, polled: bool = False, moderation: int = 1) -> CompletionQueue:
        cq = CompletionQueue(len(self.cqs), polled, max(1, moderation))
        self.cqs.append(cq)
        return cq

    def wait(self, cq: int, queue: WorkQueue) -> None:
        self._waiting.setdefault(cq, []).append(queue)

    def complete(self, cq: CompletionQueue, entry: Completion) -> None:
        if cq.ring is not None:         # the CQE, where loopback work requests can read it
            cq.ring.local(cq.cqe(cq.count), CQE_SIZE)[:] = cqe.encode(
                self.little, entry.wr_id, entry.byte_len, entry.opcode, entry.status == "ok", entry.queue)
        cq.count += 1
        if cq.polled:
            cq.entries.append(entry)
            if self.on_polled is not None and cq.count % cq.moderation == 0:
                self.on_polled(cq)
        for queue in self._waiting.pop(cq.number, ()):
            self._wake(queue)
