"""The verbs a soft RNIC offers on one reliable connection, independent of the binding.

A ``QueuePair`` is what KBTP code (target and initiator) talks to. Its requester side
posts Sends, RDMA Writes, RDMA Reads and atomics, each returning a future that completes
in posting order, as a NIC's completion queue does. Its responder side is driven by the
transport: an incoming Send lands in a posted receive buffer (those are what KBTP's
credits count), and incoming Writes, Reads and atomics are checked against the
``MemoryTable`` and executed there, or refused with ``AccessError`` so the transport can
NAK (RoCEv2) or Terminate (iWARP) exactly as the binding prescribes.

Transports subclass it: ``rnic/iwarp.py`` (kernel TCP, MPA, DDP, RDMAP) and
``rnic/roce.py`` (UDP, BTH, reliable connection). They implement ``_transmit`` and
``_shutdown`` and call the ``deliver_*``/``serve_*``/``complete``/``lost`` methods.
"""
from __future__ import annotations

import asyncio
import enum
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from .admission import Ticket
from .memory import Access, MemoryTable

_REMOTE_READ = int(Access.REMOTE_READ)
_REMOTE_WRITE = int(Access.REMOTE_WRITE)


class Verb(enum.Enum):
    SEND = "send"
    WRITE = "write"
    READ = "read"
    FETCH_ADD = "fetch_add"
    COMPARE_SWAP = "compare_swap"


@dataclass(eq=False)
class WorkRequest:
    """One posted operation; the transport fills ``result`` through ``QueuePair.complete``."""

    verb: Verb
    payload: bytes = b""           # Send payload, Write data
    stag: int = 0                  # remote STag (Write, Read, atomics)
    offset: int = 0                # remote Tagged Offset
    length: int = 0                # Read length
    invalidate: int | None = None  # Send with Invalidate: the peer's STag to invalidate
    solicited: bool = False
    imm: int | None = None         # Immediate Data (RoCEv2 Write/Send with Immediate)
    add: int = 0                   # FetchAdd Add Data, or Compare and Swap swap value
    mask: int | None = None        # RFC 7306 Add Mask; None is the unmasked (InfiniBand) add
    compare: int = 0
    future: asyncio.Future | None = field(default=None, repr=False)   # None: unsignaled
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    sent_ns: int = 0               # when its first frame left (perf_counter_ns; 0: not known)


def _check(wr: WorkRequest) -> None:
    """Refuse at posting, as ibv_post_send does with EINVAL, a field its wire header
    cannot carry: found later, inside a transport's send path, it would strand the
    operation with no completion."""
    # a negative value shifted right stays non-zero too
    if (wr.stag | wr.length | len(wr.payload) | (wr.invalidate or 0) | (wr.imm or 0)) >> 32 \
            or wr.offset >> 64:
        raise ValueError(f"work request out of range: STag 0x{wr.stag:x}, Tagged Offset "
                         f"0x{wr.offset:x}, length {wr.length or len(wr.payload)} (32, 64 and "
                         "32 bits at most)")


@dataclass
class Received:
    """A receive completion: a Send placed in a posted buffer, or a Write with Immediate."""

    payload: bytes
    invalidated: int | None = None   # STag the Send with Invalidate invalidated here
    imm: int | None = None
    solicited: bool = False
    write_imm: bool = False          # RDMA Write with Immediate (no payload delivered here)


class ReceiveError(Exception):
    """An incoming Send that no posted buffer can take (RNR on RoCEv2, DDP error on iWARP)."""

    NO_BUFFER = "no posted receive buffer"
    TOO_LONG = "message longer than the posted receive buffer"

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ConnectionLost(Exception):
    """The connection ended (closed, reset, Terminate, retries exhausted); ``how`` says
    which of ``ENDINGS`` it was, for a tool that reports what became of a connection."""

    def __init__(self, *args: object, how: str = "lost") -> None:
        super().__init__(*args)
        self.how = how


def foreign(exc: BaseException) -> bool:
    """The peer speaks another protocol (an HTTP server on the port): no KBTP peer there,
    and no waiting helps."""
    return isinstance(exc, ConnectionLost) and exc.how == "foreign"


#: how a connection can end, as ``ConnectionLost.how`` names it
ENDINGS = {
    "terminate": "the peer sent an RDMAP Terminate",
    "dreq": "the peer disconnected (CM DREQ)",
    "fin": "the peer closed its TCP stream (FIN)",
    "reset": "the TCP connection was reset",
    "qp_error": "the queue pair went to the error state",
    "local": "closed locally",
    "lost": "the connection ended",
    "foreign": "the peer speaks another protocol",
}


class RemoteError(Exception):
    """The peer refused one of our operations (a NAK, or a Terminate naming it)."""


class BadResponse(RemoteError):
    """A response that does not answer its request as the binding requires: the peer's
    protocol error, which fails the request and ends the connection (a ``RemoteError``,
    so whoever handles a refused operation handles it)."""


class ReadSink:
    """Where one RDMA Read's response lands, and the one rule both bindings keep for it:
    the Read Response carries, in order, exactly the octets the Read Request asked for
    (RFC 5040 s4.4: the Read Response's length is the Read Message Size; IB 9.9.2.3: a
    response of another length is a bad response, an error completion and the error
    state). Linux siw Terminates a Read Response that runs past the sink or ends short
    (a DDP base-or-bounds error, ``siw_rresp_check_ntoh``); taken as whole, a short one
    would hand the caller zeros it never read."""

    __slots__ = ("data", "placed")

    def __init__(self, length: int) -> None:
        self.data = bytearray(length)
        self.placed = 0

    def place(self, offset: int, payload: bytes | memoryview, last: bool) -> bool:
        """Place the segment at ``offset`` octets into the Read; True once the Read is
        complete (``last``). ``BadResponse`` when the segment is out of order, runs past
        the requested length, or is the last one and leaves octets unread."""
        end = offset + len(payload)
        size = len(self.data)
        if offset != self.placed:
            raise BadResponse(f"Read Response segment at offset {offset}, expected {self.placed}")
        if end > size:
            raise BadResponse(f"Read Response longer than its Read Request ({end} octets "
                              f"and more for {size})")
        if last and end != size:
            raise BadResponse(f"Read Response of {end} octets for a Read Request of {size}")
        self.data[offset:end] = payload
        self.placed = end
        return last


FrameListener = Callable[[str, bytes, int], None]
"""Called with "tx" or "rx", the whole link-layer (Ethernet) frame and its time
(``perf_counter_ns``): the RNIC's one stamp, so a capture and the RNIC's own timings agree."""


class QueuePair:
    """One RDMA connection's send and receive queues over a shared ``MemoryTable``."""

    transport = ""            # "iwarp" or "roce"
    masked_atomics = False    # RFC 7306 masked FetchAdd (iWARP) or unmasked (InfiniBand)
    atomics = True            # the binding's FetchAdd can be posted at all (not on siw)
    remote_invalidate = True  # a peer's Send with Invalidate can end our buffers' STags

    def __init__(self, memory: MemoryTable, *, recv_size: int = 4096, posted: int = 0) -> None:
        """``posted`` receive buffers exist from the start: a listener's peer may send at
        once, before any code of ours runs on the new connection."""
        self.memory = memory
        self.recv_size = recv_size
        self.local: tuple[str, int] = ("", 0)
        self.remote: tuple[str, int] = ("", 0)
        self.frame_listeners: list[FrameListener] = []
        self.stats: Counter[str] = Counter()
        self._posted = posted
        self._received: asyncio.Queue[Received | ConnectionLost] = asyncio.Queue()
        self._on_receive: Callable[[Received | ConnectionLost], None] | None = None
        self._outstanding: deque[WorkRequest] = deque()
        self._closed = asyncio.Event()
        self.error: ConnectionLost | None = None
        self.admission: Ticket | None = None    # the slot of a half-open connection
        #: perf_counter_ns of the last frame put on the wire and of the last one that came,
        #: where the transport sends and receives them itself (0: it does not say)
        self.tx_ns = self.rx_ns = 0

    # -- requester side ------------------------------------------------------------------

    @overload
    def post(self, wr: WorkRequest, signaled: Literal[True] = ...) -> asyncio.Future: ...
    @overload
    def post(self, wr: WorkRequest, signaled: bool) -> asyncio.Future | None: ...

    def post(self, wr: WorkRequest, signaled: bool = True) -> asyncio.Future | None:
        """Queue an operation; the returned future completes in posting order.

        An unsignaled operation (``signaled=False``, as IBV_SEND_SIGNALED left out) has no
        future: a later signaled one's completion covers it, and its failure ends the
        connection, which every waiter sees."""
        _check(wr)
        if signaled:
            wr.future = asyncio.get_running_loop().create_future()
        if self.error is not None:
            if wr.future is not None:
                wr.future.set_exception(ConnectionLost(str(self.error), how=self.error.how))
            return wr.future
        self._outstanding.append(wr)
        self._transmit(wr)
        return wr.future

    @overload
    def send(self, payload: bytes, *, invalidate: int | None = None, solicited: bool = False,
             imm: int | None = None, signaled: Literal[True] = ...) -> asyncio.Future: ...
    @overload
    def send(self, payload: bytes, *, invalidate: int | None = None, solicited: bool = False,
             imm: int | None = None, signaled: bool) -> asyncio.Future | None: ...

    def send(self, payload: bytes, *, invalidate: int | None = None, solicited: bool = False,
             imm: int | None = None, signaled: bool = True) -> asyncio.Future | None:
        return self.post(WorkRequest(Verb.SEND, payload, invalidate=invalidate,
                                     solicited=solicited, imm=imm), signaled)

    @overload
    def write(self, stag: int, offset: int, data: bytes, *, imm: int | None = None,
              signaled: Literal[True] = ...) -> asyncio.Future: ...
    @overload
    def write(self, stag: int, offset: int, data: bytes, *, imm: int | None = None,
              signaled: bool) -> asyncio.Future | None: ...

    def write(self, stag: int, offset: int, data: bytes, *, imm: int | None = None,
              signaled: bool = True) -> asyncio.Future | None:
        return self.post(WorkRequest(Verb.WRITE, data, stag, offset, len(data), imm=imm), signaled)

    def read(self, stag: int, offset: int, length: int) -> asyncio.Future:
        """RDMA Read; the future's result is the octets read, in a bytearray of its own."""
        return self.post(WorkRequest(Verb.READ, b"", stag, offset, length))

    def fetch_add(self, stag: int, offset: int, add: int, mask: int | None = None) -> asyncio.Future:
        """FetchAdd on the peer's 8-octet operand; the result is the original value."""
        return self.post(WorkRequest(Verb.FETCH_ADD, b"", stag, offset, 8, add=add, mask=mask))

    def compare_swap(self, stag: int, offset: int, compare: int, swap: int) -> asyncio.Future:
        return self.post(WorkRequest(Verb.COMPARE_SWAP, b"", stag, offset, 8, add=swap,
                                     compare=compare))

    def complete(self, wr: WorkRequest, result: Any = None,
                 error: BaseException | None = None) -> None:
        """Called by the transport when ``wr`` is acknowledged, answered or refused."""
        wr.done, wr.result, wr.error = True, result, error
        while self._outstanding and self._outstanding[0].done:
            head = self._outstanding.popleft()
            if head.future is None or head.future.done():
                continue
            if head.error is not None:
                head.future.set_exception(head.error)
            else:
                head.future.set_result(head.result)

    def completion(self, wr: WorkRequest) -> asyncio.Future:
        """The future of ``wr``, made now for an unsignaled one (done at once if ``wr``
        already is), so that a close can wait for everything posted."""
        if wr.future is None:
            wr.future = asyncio.get_running_loop().create_future()
            if wr not in self._outstanding:
                wr.future.set_result(None)
        return wr.future

    def unacknowledged(self) -> list[WorkRequest]:
        return [wr for wr in self._outstanding if not wr.done]

    # -- receive queue -------------------------------------------------------------------

    def post_recv(self, count: int = 1) -> None:
        """Post ``count`` receive buffers of ``recv_size`` octets."""
        self._posted += count

    @property
    def posted(self) -> int:
        return self._posted

    @property
    def undelivered(self) -> int:
        """Receive completions queued for ``recv`` and not yet taken."""
        items: deque[Received | BaseException] = self._received._queue  # type: ignore[attr-defined]
        return sum(not isinstance(item, BaseException) for item in items)

    def on_receive(self, callback: Callable[[Received | ConnectionLost], None]) -> None:
        """Hand every receive completion to ``callback`` as it happens, instead of queueing
        it for ``recv`` (an event-driven completion channel: no task hop per message);
        the end of the connection arrives as a ``ConnectionLost``. What is queued already
        goes to it first."""
        while not self._received.empty():
            callback(self._received.get_nowait())
        self._on_receive = callback

    async def recv(self) -> Received:
        """The next receive completion; raises ``ConnectionLost`` once the connection ends."""
        item = await self._received.get()
        if isinstance(item, BaseException):
            self._received.put_nowait(item)   # every later call sees the end too
            raise item
        return item

    def recv_nowait(self) -> Received | None:
        """A receive completion that is already there, or None (never waits)."""
        if self._received.empty():
            return None
        item = self._received.get_nowait()
        if isinstance(item, BaseException):
            self._received.put_nowait(item)
            raise item
        return item

    def deliver_send(self, payload: bytes, *, invalidate: int | None = None,
                     solicited: bool = False, imm: int | None = None) -> None:
        """Place an incoming Send; ``ReceiveError`` (nothing consumed) when it cannot be."""
        if self._posted == 0:
            raise ReceiveError(ReceiveError.NO_BUFFER)
        if len(payload) > self.recv_size:
            raise ReceiveError(ReceiveError.TOO_LONG)
        self._posted -= 1
        invalidated = None
        if invalidate is not None and self.memory.invalidate(invalidate):
            invalidated = invalidate
        self.stats["recv"] += 1
        self._deliver(Received(payload, invalidated, imm, solicited))

    def deliver_write_imm(self, imm: int) -> None:
        """RDMA Write with Immediate consumes a receive buffer (InfiniBand semantics)."""
        if self._posted == 0:
            raise ReceiveError(ReceiveError.NO_BUFFER)
        self._posted -= 1
        self._deliver(Received(b"", imm=imm, write_imm=True))

    def _deliver(self, item: Received | ConnectionLost) -> None:
        if self._on_receive is not None:
            self._on_receive(item)
        else:
            self._received.put_nowait(item)

    # -- responder side: executed on our memory -----------------------------------------

    def serve_write(self, stag: int, offset: int, data: bytes | memoryview) -> None:
        self.memory.remote_write(stag, offset, data, self)

    def serve_read(self, stag: int, offset: int, length: int) -> bytes:
        return self.memory.remote_read(stag, offset, length, self)

    def check_read(self, stag: int, offset: int, length: int) -> None:
        """Validate a whole Read Request before its first Read Response segment is built."""
        self.memory.remote(stag, offset, length, _REMOTE_READ, self)

    def check_write(self, stag: int, offset: int, length: int) -> None:
        """Validate a whole tagged Write before its first segment is placed."""
        self.memory.remote(stag, offset, length, _REMOTE_WRITE, self)

    def serve_fetch_add(self, stag: int, offset: int, add: int, mask: int | None) -> int:
        return self.memory.fetch_add(self.memory.atomic(stag, offset, self), add, mask)

    def serve_compare_swap(self, stag: int, offset: int, compare: int, swap: int) -> int:
        return self.memory.compare_swap(self.memory.atomic(stag, offset, self), compare, swap)

    # -- connection ----------------------------------------------------------------------

    def lost(self, error: BaseException) -> None:
        """The connection is gone: fail everything outstanding, wake every receiver."""
        if self.error is not None:
            return
        self.error = error if isinstance(error, ConnectionLost) else ConnectionLost(str(error), how="qp_error")
        for wr in self._outstanding:
            if wr.future is not None and not wr.future.done():
                wr.future.set_exception(self.error)
                wr.future.exception()     # consumed: nobody may be awaiting a Write's future
        self._outstanding.clear()
        if self.admission is not None:
            self.admission.leave()
        self._deliver(self.error)
        self._closed.set()

    def abort(self, reason: str) -> None:
        """End the connection at once for a local reason, as the binding prescribes for a
        local error (RoCEv2: the error state, which tells the peer by DREQ; iWARP: an
        RDMAP Terminate, then the end of the stream), dropping what is still queued."""
        self.lost(ConnectionLost(reason))

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        """Orderly close (TCP FIN after MPA; CM DREQ/DREP on RoCEv2)."""
        if not self.closed:
            await self._shutdown()
            self.lost(ConnectionLost("closed locally", how="local"))

    # -- for transports ------------------------------------------------------------------

    def frame(self, direction: str, frame: bytes, ns: int = 0) -> None:
        """Show ``frame`` to the listeners, stamped ``ns`` (now, unless the transport stamped it)."""
        ns = ns or time.perf_counter_ns()
        for listener in self.frame_listeners:
            listener(direction, frame, ns)

    def _transmit(self, wr: WorkRequest) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError
