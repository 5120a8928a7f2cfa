"""The reference target: memory, sessions and operations behind a listening RNIC."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import replace

from ..rnic import Address, Listener, QueuePair, listen, memory_table, parse_url
from ..rnic.admission import HalfOpen
from ..rnic.qp import FrameListener
from ..vocab import Feature
from .config import TargetConfig
from .connection import Connection
from .metrics import Metrics
from .operations import Executor
from .pool import TargetMemory
from .ring import FreeRing
from .sessions import InitiatorState, Sessions

log = logging.getLogger("kbtp.target")


class Target:
    """A KBTP target. ``await start(url)``, then it serves until ``close()``."""

    #: what serves each connection (the initiator checker's target observes through it)
    connection_class: type[Connection] = Connection

    def __init__(self, config: TargetConfig, transport: str, io: str | None = None) -> None:
        """``io="verbs"`` puts the target's memory on an RDMA device (``start`` then names
        it with ``device=``); otherwise it is the soft RNIC's."""
        config.validate()
        self.config = config
        self.transport = transport
        self.rnic_memory = memory_table(io, config.memory_order)
        self._build()
        self.half_open = HalfOpen(config.max_half_open, config.max_half_open_per_source)
        self.metrics = Metrics(self)
        self.frame_listeners: list[FrameListener] = []
        self.listener: Listener | None = None
        self.unavailable = 0          # features the RDMA device cannot support
        self._tasks: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None
        self.chain_builds = asyncio.Lock()   # --execution chains: one connection builds at a time

    def _build(self) -> None:
        """Memory, operations and sessions for ``config``."""
        c = self.config
        # iWARP has RFC 7306 masked FetchAdd; InfiniBand's Fetch and Add is unmasked.
        self.memory = TargetMemory(c, self.rnic_memory, masked=self.transport == "iwarp")
        self.executor = Executor(self.memory, c.clear_freed, c.max_inline)
        self.sessions = Sessions(c, self.memory.partitions, self._release)

    @property
    def features(self) -> int:
        """What a HELLO_ACK of this target may grant: RECORD_COMPLETION never over RDMAP
        (spec "Completion"); ADDR_LE is ours to set."""
        offered = self.config.features & (Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC | Feature.RECORD_COMPLETION)
        if self.transport == "iwarp":
            offered &= ~Feature.RECORD_COMPLETION
        return offered & ~self.unavailable

    def offered_features(self, qp: QueuePair) -> int:
        """What the HELLO_ACK on ``qp`` may grant: ``features``, less the direct modes
        for a peer outside ``--trust``."""
        if self.config.trusts(qp.remote[0]):
            return self.features
        return self.features & ~(Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC)

    async def start(self, url: str | Address, **options) -> Address:
        address = url if isinstance(url, Address) else parse_url(url)
        if address.transport != self.transport:
            raise ValueError(f"this target was built for {self.transport}, not {address.transport}")
        limits = {} if options.get("io") == "verbs" else self._setup_limits()
        self.listener = await listen(address, self.rnic_memory, self._serve,
                                     recv_size=self._recv_size(),
                                     posted=self.config.request_credits,
                                     frame_listeners=self.frame_listeners,
                                     **{**limits, **options})
        for name, why in getattr(self.listener, "lacks", {}).items():
            if self.config.features & Feature[name]:
                log.info("not offering %s: %s", name, why)
                self.unavailable |= Feature[name]
        if self.unavailable & Feature.DIRECT_ALLOC and self.config.direct_partitions:
            # No session can have a partition: their blocks go back to the shared ring
            # (nothing was served yet, so the memory is built again).
            self.config = replace(self.config, direct_partitions=0)
            self._build()
        self._watcher = asyncio.create_task(self._watch_tickets())
        return self.listener.address

    def _setup_limits(self) -> dict:
        """The soft RNIC's share of the limits: its half-open cap, set-up deadlines and,
        on iWARP, TCP keepalive and user timeout at the liveness probe's times. (On a
        verbs device the kernel's CM and TCP have their own; the target's half-open cap,
        HELLO deadline, probes and backlog hold on every backend.)"""
        c = self.config
        if self.transport == "iwarp":
            return {"half_open": self.half_open, "mpa_timeout": c.mpa_timeout_s,
                    "keepalive": c.probe_interval_s, "user_timeout": c.probe_timeout_s}
        return {"half_open": self.half_open, "cm_timeout": c.cm_timeout_s,
                "cm_retries": c.cm_retries}

    def _recv_size(self) -> int:
        """Largest request: header, two descriptors and Max Inline octets."""
        return 24 + 16 + 16 + self.config.max_inline

    async def _serve(self, qp: QueuePair) -> None:
        task = asyncio.current_task()
        assert task is not None              # listeners run on_connect as a task
        self._tasks.add(task)
        try:
            await self.connection_class(self, qp).serve()
        finally:
            self._tasks.discard(task)

    async def _watch_tickets(self) -> None:
        """Poll the Head of every DIRECT_ALLOC ring eight times per Ticket Timeout: a
        ticket is abandoned at most an eighth of it late."""
        interval = max(0.005, self.config.ticket_timeout_ms / 8000)
        while True:
            await asyncio.sleep(interval)
            for state in list(self.sessions.by_id.values()):
                if state.watch is not None:
                    state.watch.poll()

    def _release(self, state: InitiatorState) -> None:
        """Free every block an initiator has bound (GOODBYE RELEASE, or retention expired)."""
        table = self.memory.table
        for handle in sorted(state.bound):
            if table.read(handle).valid:    # never free what is not bound, whatever happened
                self.executor.release_block(table.unbind(handle).block_offset)
        state.bound.clear()

    def rings(self) -> Iterator[tuple[str, FreeRing]]:
        yield "shared", self.memory.shared_ring
        for part in self.memory.partitions:
            yield f"partition{part.index}", part.ring

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.listener is not None:
            self.listener.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.listener is not None:
            await self.listener.wait_closed()
