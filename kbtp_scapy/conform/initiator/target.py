"""The checking target: the reference target, observed, and misbehaving where a case says.

It is ``kbtp_scapy.target.Target`` with three seams, none a copy of its logic:
``connection_class`` (a ``Connection`` that records the HELLO, the requests as they are
taken and the completions as they leave, and lets a ``Behaviour`` hold, reorder,
duplicate or invent completions and change the HELLO_ACK), an ``Executor`` whose
operations a ``Behaviour`` may answer itself, and the responder side of each queue pair
(``serve_read``, ``check_read``, ``check_write``, ``serve_fetch_add``), which records
every one-sided access of the initiator and lets a ``Behaviour`` change what a Read
returns (a torn slot, a decoy block, an entry whose Generation moved).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ... import codec
from ...rnic.memory import AccessError
from ...rnic.qp import QueuePair
from ...target.config import TargetConfig
from ...target.connection import Connection
from ...target.operations import Executor, Outcome
from ...target.server import Target
from ...vocab import AnyMessage, HelloAck, Opcode
from .observe import Access, Record, Session

#: HELLO_ACK descriptor key -> region name
GRANTS = {"hello_ack.table.stag": "table", "hello_ack.pool.stag": "pool",
          "hello_ack.partition.stag": "partition", "hello_ack.ring.stag": "ring",
          "hello_ack.head.stag": "head"}

#: Why a case that watches or changes the initiator's one-sided accesses cannot run on
#: ``--io verbs``: the device answers them in the kernel, the checker sees none of them.
DEVICE_RESPONDER = ("it judges the initiator's RDMA Reads, Writes or atomics on target memory, "
                    "which an RDMA device (--io verbs) serves in the kernel, out of the checker's "
                    "sight: run it with the checking target on the soft RNIC (--io udp)")


class Behaviour:
    """How the checking target deviates from the reference target in one case; every
    method left as it is behaves as the reference target does."""

    def hello_ack(self, conn: CheckedConnection, body: HelloAck) -> None:
        """Change the HELLO_ACK body before it is sent."""

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        """Send the completion of ``req`` (``send()``), now, later, or with others."""
        send()

    async def operation(self, conn: CheckedConnection, req: AnyMessage,
                        run: Callable[[], Awaitable[Outcome]]) -> Outcome:
        """Execute ``req`` (``await run()``) or answer it otherwise."""
        return await run()

    def read(self, conn: CheckedConnection, access: Access, data: bytes) -> bytes:
        """What an RDMA Read of the initiator returns (``data``: what memory holds)."""
        return data

    def hello_ack_octets(self, conn: CheckedConnection, message: bytes) -> bytes:
        """The HELLO_ACK as sent (``message``: as encoded)."""
        return message

    def placed(self, conn: CheckedConnection, payload: bytes) -> None:
        """A Send of the initiator placed in a receive buffer, in wire order with its
        RDMA Writes (called by the RNIC as the Send lands, before the target takes it)."""


class CheckingExecutor(Executor):
    """The reference operations, each offered to the case's ``Behaviour`` first."""

    behaviour: Behaviour

    async def run(self, conn: Connection, req: AnyMessage,
                  fetch: asyncio.Future | None = None) -> Outcome:
        assert isinstance(conn, CheckedConnection)
        return await self.behaviour.operation(conn, req, lambda: Executor.run(self, conn, req, fetch))


class CheckedConnection(Connection):
    """A reference connection that records what the initiator does."""

    target: CheckingTarget

    def __init__(self, target: Target, qp: QueuePair) -> None:
        super().__init__(target, qp)
        assert isinstance(target, CheckingTarget)
        self.session = target.record.new()
        self.session.mpa = getattr(qp, "peer_startup", None)
        self.behaviour = target.behaviour
        self.read_hold: Any = None        # a ReadHold of this connection, made when a case needs one
        _observe(qp, self)

    async def serve(self) -> None:
        try:
            await super().serve()
        finally:
            self.session.closed = time.monotonic()

    async def _hello_ack(self, status: int, body: HelloAck) -> None:
        if not status:
            self.behaviour.hello_ack(self, body)
            self.session.granted = body.copy()
            granted: Mapping[str, object] = body      # GRANTS' keys are HelloAck's, named at run time
            self.session.stags = {stag: name for k, name in GRANTS.items()
                                  if isinstance(stag := granted.get(k), int)}
            self.session.addr_le = self.addr_le
            self.credits = body.get("hello_ack.request_credits", self.credits)
        ack: HelloAck = {"opcode": Opcode.HELLO_ACK, "status": status, "hello_ack.features": 0}
        ack.update(body)
        message = codec.encode(ack)
        sent = self.qp.send(self.behaviour.hello_ack_octets(self, message))
        assert sent is not None          # signaled: the HELLO_ACK is awaited, as the reference's is
        await sent

    def _complete(self, req: AnyMessage, outcome: Outcome, why: str = "") -> None:
        def send() -> None:
            if self.qp.closed:
                return
            self.session.completed(req["request_id"], outcome.status, outcome.block_offset,
                                   outcome.generation)
            Connection._complete(self, req, outcome, why)
        self.behaviour.complete(self, req, outcome, send)

    def send_completion(self, request_id: int, handle: int, status: int, data_length: int = 0,
                        block_offset: int = 0, generation: int = 0) -> None:
        """A COMPLETION of the checker's own making (a duplicate, an unknown Request ID)."""
        if self.qp.closed:
            return
        self.qp.send(codec.encode({
            "opcode": Opcode.COMPLETION, "request_id": request_id, "handle": handle,
            "generation": generation, "status": status, "completion.data_length": data_length,
            "completion.reserved": 0, "completion.block_offset": block_offset}, self.addr_le),
            signaled=False)


def _observe(qp: QueuePair, conn: CheckedConnection) -> None:
    """Record what the initiator sends and accesses on ``qp`` (instance attributes shadow
    the queue pair's methods, as ``conform/hold.py`` does on the initiator's side)."""
    session: Session = conn.session
    recv, recv_nowait = qp.recv, qp.recv_nowait

    def note(msg: Any) -> Any:
        if msg is not None and not msg.write_imm:
            taken = session.taken(msg.payload)
            if session.hello is None and codec.opcode_of(taken.payload) == Opcode.HELLO:
                session.hello_raw = taken.payload
                session.hello = taken.decoded or {}
        return msg

    async def recv_observed() -> Any:
        return note(await recv())

    def recv_nowait_observed() -> Any:
        return note(recv_nowait())

    qp.recv, qp.recv_nowait = recv_observed, recv_nowait_observed   # type: ignore[method-assign]
    deliver_send = qp.deliver_send

    def placed(payload: bytes, **kwargs: Any) -> None:
        deliver_send(payload, **kwargs)
        conn.behaviour.placed(conn, bytes(payload))

    qp.deliver_send = placed                                               # type: ignore[method-assign]
    if session.hidden:                           # an RDMA device's responder: not ours to watch
        return
    duplicate = [False]
    served: dict[tuple[int, int, int], bytes] = {}
    now = time.monotonic
    if hasattr(qp, "_duplicate"):                # RoCEv2: a retransmitted request
        dup = qp._duplicate

        def duplicate_observed(*args: Any) -> None:
            duplicate[0] = True
            try:
                dup(*args)
            finally:
                duplicate[0] = False
        qp._duplicate = duplicate_observed

    serve_read, check_read, check_write = qp.serve_read, qp.check_read, qp.check_write
    serve_fetch_add = qp.serve_fetch_add

    def access(kind: str, stag: int, offset: int, length: int, **extra: Any) -> Access:
        a = Access(now(), kind, session.region(stag), stag, offset, length, **extra)
        session.observed.append(a)
        return a

    def read(stag: int, offset: int, length: int) -> bytes:
        key = (stag, offset, length)
        if duplicate[0] and key in served:
            access("read", stag, offset, length, duplicate=True)
            return served[key]
        try:
            data = serve_read(stag, offset, length)
        except AccessError as exc:
            access("read", stag, offset, length, refused=exc.fault.value)
            raise
        a = access("read", stag, offset, length)
        a.served = served[key] = bytes(conn.behaviour.read(conn, a, data))
        return a.served

    def checked_read(stag: int, offset: int, length: int) -> None:
        """A whole Read Request, checked before its first Read Response is built (iWARP):
        one the RNIC refuses here never reaches ``serve_read``, so it is recorded here."""
        try:
            check_read(stag, offset, length)
        except AccessError as exc:
            access("read", stag, offset, length, refused=exc.fault.value)
            raise

    def checked_write(stag: int, offset: int, length: int) -> None:
        """An RDMA Write, checked before its first octet is placed (its whole length on
        RoCEv2, its first segment's on iWARP: what lands is judged from memory)."""
        try:
            check_write(stag, offset, length)
        except AccessError as exc:
            access("write", stag, offset, length, refused=exc.fault.value)
            raise
        access("write", stag, offset, length)

    def fetch_add(stag: int, offset: int, add: int, mask: int | None) -> int:
        try:
            value = serve_fetch_add(stag, offset, add, mask)
        except AccessError as exc:
            access("fetch_add", stag, offset, 8, add=add, mask=mask, refused=exc.fault.value)
            raise
        a = access("fetch_add", stag, offset, 8, add=add, mask=mask)
        a.served = value.to_bytes(8, "big")      # the counter before the add: the ticket taken
        return value

    qp.serve_read, qp.check_write = read, checked_write                         # type: ignore[method-assign]
    qp.check_read = checked_read                                               # type: ignore[method-assign]
    qp.serve_fetch_add = fetch_add                                             # type: ignore[method-assign]


class CheckingTarget(Target):
    """A reference target whose connections are observed into ``record``."""

    connection_class = CheckedConnection

    def __init__(self, config: TargetConfig, transport: str, behaviour: Behaviour | None = None,
                 io: str | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.record = Record(DEVICE_RESPONDER if io == "verbs" else "")
        super().__init__(config, transport, io)

    def _build(self) -> None:
        super()._build()
        c = self.config
        executor = CheckingExecutor(self.memory, c.clear_freed, c.max_inline)
        executor.behaviour = self.behaviour
        self.executor = executor
