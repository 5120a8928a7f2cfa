"""The reference initiator: a session with a KBTP target over a soft-RNIC connection.

Requests are pipelined up to the credits (the smaller of the target's Request Credits
and our Completion Credits); completions are matched to requests by Request ID. Every
buffer the target may touch is registered for that one request and gone afterwards:
with INVALIDATE (the default, the text's SHOULD) the target's Send with Invalidate
revokes it, otherwise we deregister it on completion.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from .. import codec
from ..rnic import Access, MemoryTable, QueuePair, connect, memory_table
from ..rnic.qp import ConnectionLost, FrameListener, Received, RemoteError, Verb, WorkRequest
from ..tables import memory as M
from ..tables.enums import OPCODES
from ..vocab import AnyMessage, Feature, GoodbyeFlag, Opcode, RequestFlag, Status
from .direct import DirectModes
from .limits import Limits, NoAnswer
from .results import KbtpError, Result, SessionEnded, TargetInfo, Waiting, match_completion

if TYPE_CHECKING:
    from scapy.packet import Packet  # raw() takes one; Scapy stays off the data path

T = TypeVar("T")
ALL_FEATURES = sum(f for f in Feature if f is not Feature.ADDR_LE)
COMPLETION_BUFFER = 256          # HELLO_ACK with every descriptor is 152 octets


def _said(exc: BaseException) -> BaseException:
    """``exc``, or a ConnectionLost that says what happened when ``exc`` says nothing."""
    if str(exc):
        return exc
    lost = ConnectionLost(f"the connection to the target ended ({type(exc).__name__}, the RNIC "
                          "gave no reason)")
    lost.__cause__ = exc
    return lost


class Initiator(DirectModes):
    """Use ``await Initiator.connect(url)``; every operation is a coroutine."""

    def __init__(self, qp: QueuePair, memory: MemoryTable, initiator_id: bytes, credits: int,
                 invalidate: bool, limits: Limits | None = None) -> None:
        self.qp, self.memory, self.initiator_id = qp, memory, initiator_id
        self.limits = limits or Limits()
        self.completion_credits = credits
        self.invalidate = invalidate
        self._target: TargetInfo | None = None
        self.addr_le = False
        self.hello_ack = b""                 # the HELLO_ACK as it came (its header is judged too)
        self._ids = itertools.count(1)
        self._pending: Waiting = {}
        #: answers to no request, the newest ``limits.max_unmatched`` of them (raw mode sees
        #: these); ``dropped`` counts the older ones let go, so a flood costs no memory
        self.unmatched: asyncio.Queue[Received] = asyncio.Queue(self.limits.max_unmatched)
        self.dropped = 0
        #: an answer's deadline passed: a tool that ends on it closes without waiting again
        #: (for a GOODBYE's acknowledgement and the target's close), leaving the session to the
        #: target's retention
        self.silent = False
        self._credits: asyncio.Semaphore | None = None
        self.usage = 0      # handles this session bound and has not freed (spec "Allocation Quotas")

    @classmethod
    async def connect(cls, url: str, *, initiator_id: bytes | None = None,
                      features: int = ALL_FEATURES, credits: int = 32, invalidate: bool = True,
                      frame_listeners: list[FrameListener] | None = None, limits: Limits | None = None,
                      **options) -> Initiator:
        """Connect, send HELLO and wait for HELLO_ACK (within ``limits.wait``: ``NoAnswer``
        after it); ``KbtpError`` if the target refuses, ``PeerLimit`` (one) if the HELLO_ACK's
        figures are past ``limits``."""
        memory = memory_table(options.get("io"))
        qp = await connect(url, memory, recv_size=COMPLETION_BUFFER,
                           frame_listeners=list(frame_listeners or ()), **options)
        self = cls(qp, memory, initiator_id or secrets.token_bytes(16), credits,
                   invalidate and qp.remote_invalidate, limits)
        if not qp.atomics:           # an RDMA device without FetchAdd cannot take tickets
            features &= ~Feature.DIRECT_ALLOC
        qp.post_recv(credits)
        try:
            await self._hello(features)
        except BaseException as exc:
            if isinstance(exc, KbtpError):
                exc.hello_ack = self.hello_ack
            await qp.close()
            raise
        return self

    async def _hello(self, features: int) -> None:
        await self.within(self.qp.send(codec.encode({
            "opcode": Opcode.HELLO, "hello.requested_features": features,
            "hello.completion_credits": self.completion_credits,
            "hello.initiator_id": self.initiator_id})), "acknowledgement of the HELLO's Send")
        msg = await self.within(self.qp.recv(), "HELLO_ACK")
        self.qp.post_recv(1)
        self.hello_ack = msg.payload
        try:
            ack = codec.decode(msg.payload)
        except codec.Malformed as bad:     # a target's fault: said as a status, never a crash
            raise KbtpError(Status.MALFORMED, detail=f"malformed HELLO_ACK: {bad}") from None
        if ack["opcode"] != Opcode.HELLO_ACK:
            raise KbtpError(Status.MALFORMED,
                            detail=f"expected HELLO_ACK, got {OPCODES.describe(ack['opcode'])}")
        if ack["status"]:
            raise KbtpError(ack["status"], detail="HELLO refused")
        fields: Mapping[str, Any] = ack        # its descriptors, read generically
        body = {k.split(".", 1)[1]: v for k, v in fields.items() if k.startswith("hello_ack.")}
        self._target = TargetInfo(body.pop("features"), body.pop("request_credits"),
                                  body.pop("block_size"), body.pop("max_inline"),
                                  body.pop("allocation_quota"), body.pop("handle_base"),
                                  body.pop("handle_count"), body.pop("ticket_timeout"), body)
        self.limits.check(self._target)
        self.addr_le = self._target.feature(Feature.ADDR_LE)
        self._credits = asyncio.Semaphore(min(self._target.request_credits, self.completion_credits))
        self.qp.on_receive(self._receive)

    @property
    def target(self) -> TargetInfo:
        """What the HELLO_ACK granted (``connect`` returns only once it has come)."""
        if self._target is None:
            raise RuntimeError("no HELLO_ACK yet: use Initiator.connect")
        return self._target

    # -- completions ---------------------------------------------------------------------

    def _receive(self, msg: Received | ConnectionLost) -> None:
        """Each completion as the RNIC delivers it: repost the buffer, wake the request."""
        if isinstance(msg, ConnectionLost):
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(_said(msg))
            self._pending.clear()
            return
        arrived = self.qp.rx_ns or time.perf_counter_ns()    # its frame's arrival, if known
        self.qp.post_recv(1)
        self._dispatch(msg, arrived)

    def _dispatch(self, msg: Received, arrived: int = 0) -> None:
        matched = match_completion(msg, self._pending, self.addr_le)
        if matched is None:
            if self.unmatched.full():
                self.unmatched.get_nowait()
                self.dropped += 1
            self.unmatched.put_nowait(msg)
        elif not matched[0].done():         # a caller that gave up is cancelled already
            matched[1].answered_ns = arrived
            matched[0].set_result(matched[1])

    async def _call(self, values: AnyMessage, regions: list, record: bool) -> Result:
        """Send one request and wait for its completion; raises ``KbtpError`` on a status.

        The Send is unsignaled: its failure ends the connection, which fails the wait."""
        if self._credits is None:
            raise RuntimeError("no HELLO_ACK yet: use Initiator.connect")
        async with self._credits:
            if self.qp.error is not None:
                raise _said(self.qp.error)
            rid = next(self._ids)
            future = asyncio.get_running_loop().create_future()
            record_region = None
            if record:
                record_region = self.memory.register(self.memory.buffer(M.COMPLETION_RECORD.size),
                                                     Access.REMOTE_WRITE)
                regions = [*regions, record_region]
                values.update({"cd.stag": record_region.stag, "cd.offset": record_region.base,
                               "cd.reserved": 0})
            self._pending[rid] = (future, record_region)
            values["request_id"] = rid
            try:
                wr = WorkRequest(Verb.SEND, codec.encode(values, self.addr_le))
                sent = time.perf_counter_ns()
                self.qp.post(wr, signaled=False)
                result = await self.within(future, f"COMPLETION of {OPCODES.describe(values['opcode'])} "
                                                   f"(Request ID {rid})")
                result.sent_ns = wr.sent_ns or sent      # its frame's departure, where known
            finally:
                self._pending.pop(rid, None)
                for region in regions:
                    self.memory.deregister(region.stag)
        if result.status:
            raise KbtpError(result.status, result)
        if values["opcode"] in (Opcode.ALLOC_STORE, Opcode.BIND):
            self.usage += 1
        elif values["opcode"] == Opcode.FREE:
            self.usage = max(0, self.usage - 1)
        return result

    def _record(self, record: bool) -> bool:
        """RECORD only when the HELLO_ACK granted RECORD_COMPLETION; else a COMPLETION."""
        return record and self.target.feature(Feature.RECORD_COMPLETION)

    def _flags(self, *, seal: bool = False, inline: bool = False, record: bool = False,
               allow_unsealed: bool = False, invalidate: bool = False) -> int:
        return ((RequestFlag.SEAL if seal else 0) | (RequestFlag.INLINE if inline else 0)
                | (RequestFlag.RECORD if record else 0) | (RequestFlag.ALLOW_UNSEALED if allow_unsealed else 0)
                | (RequestFlag.INVALIDATE if invalidate else 0))

    # -- operations ----------------------------------------------------------------------

    async def load(self, handle: int, *, generation: int = 0, allow_unsealed: bool = False,
                   length: int | None = None, record: bool = False) -> Result:
        """Block Load into a fresh buffer of ``length`` (default Block Size) octets."""
        buf = self.memory.buffer(self.target.block_size if length is None else length)
        record = self._record(record)
        region = self.memory.register(buf, Access.REMOTE_WRITE)
        result = await self._call({
            "opcode": Opcode.LOAD, "handle": handle, "generation": generation,
            "flags": self._flags(allow_unsealed=allow_unsealed, record=record,
                                 invalidate=self.invalidate and not record),
            "dd.stag": region.stag, "dd.offset": region.base, "dd.length": len(buf)}, [region], record)
        if result.data_length > len(buf):  # the target claims more than it could have written
            raise KbtpError(Status.MALFORMED, result,
                            f"a completion Data Length of {result.data_length} past the "
                            f"{len(buf)}-octet buffer")
        result.data = bytes(buf[:result.data_length])
        return result

    async def _store(self, opcode: str, handle: int, data: bytes, generation: int, seal: bool,
                     inline: bool | None, record: bool) -> Result:
        if inline is None:
            inline = len(data) <= self.target.max_inline
        record = self._record(record)
        values: AnyMessage = {"opcode": Opcode[opcode], "handle": handle, "generation": generation}
        regions = []
        if inline:
            values.update({"dd.stag": 0, "dd.offset": 0, "dd.length": len(data), "inline_data": data})
        else:
            src = self.memory.buffer(len(data))
            src[:] = data
            region = self.memory.register(src, Access.REMOTE_READ)
            regions.append(region)
            values.update({"dd.stag": region.stag, "dd.offset": region.base, "dd.length": len(data)})
        values["flags"] = self._flags(seal=seal, inline=inline, record=record,
                                      invalidate=self.invalidate and not inline and not record)
        return await self._call(values, regions, record)

    async def store(self, handle: int, data: bytes, *, generation: int = 0, seal: bool = False,
                    inline: bool | None = None, record: bool = False) -> Result:
        """Block Mapped Store; inline when the data fits Max Inline unless told otherwise."""
        return await self._store("STORE", handle, data, generation, seal, inline, record)

    async def alloc_store(self, handle: int, data: bytes, *, generation: int = 0, seal: bool = False,
                          inline: bool | None = None, record: bool = False) -> Result:
        """Block Unmapped Store: the target allocates a block, binds ``handle`` to it, stores."""
        return await self._store("ALLOC_STORE", handle, data, generation, seal, inline, record)

    async def free(self, handle: int, *, generation: int = 0, record: bool = False) -> Result:
        record = self._record(record)
        return await self._call({"opcode": Opcode.FREE, "handle": handle, "generation": generation,
                                 "flags": self._flags(record=record)}, [], record)

    async def bind(self, handle: int, ticket: int, data_length: int, block_offset: int, *,
                   generation: int = 0) -> Result:
        return await self._call({"opcode": Opcode.BIND, "handle": handle, "generation": generation,
                                 "bind.ticket": ticket, "bind.data_length": data_length,
                                 "bind.block_offset": block_offset}, [], False)

    async def within(self, answer: Awaitable[T], what: str, *, fatal: bool = False) -> T:
        """``answer`` awaited for at most ``limits.wait`` seconds, else ``NoAnswer``. ``fatal``:
        the connection is ended then, for a one-sided operation whose answer never came holds
        back every later completion (they complete in posting order)."""
        try:    # not wait_for: on 3.11 it returns an answer that arrives as the caller cancels
            async with asyncio.timeout(self.limits.wait):
                return await answer
        except TimeoutError:
            why = f"no {what} within {self.limits.wait:g} s"
            self.silent = True
            if fatal:
                self.qp.abort(why)
            raise NoAnswer(why) from None

    async def end(self, release: bool = False) -> None:
        """How a tool ends its session: GOODBYE, or just the close when the target already let
        an answer's deadline pass (``silent``: it is not waited on a second time)."""
        if self.silent:
            await self.close()
        elif not self.qp.closed:
            await self.goodbye(release=release)

    async def goodbye(self, release: bool = False) -> None:
        """End the session; the target closes the connection once it has acted on it.

        The target's close can overtake the acknowledgement of the GOODBYE itself (a lost
        ACK on RoCEv2): the connection ending is the answer either way. A connection that
        had ended before the GOODBYE could be sent raises ``SessionEnded`` when ``release``
        was asked for: the target keeps the bindings for its retention time then."""
        if release and self.qp.error is not None and getattr(self.qp.error, "how", "") != "local":
            raise SessionEnded("GOODBYE with RELEASE not sent, the bindings stay for the target's "
                               "retention time", self.qp.error)
        try:
            await self.within(self.qp.send(codec.encode({"opcode": Opcode.GOODBYE,
                                                         "flags": GoodbyeFlag.RELEASE if release else 0},
                                                        self.addr_le)), "acknowledgement of the GOODBYE's Send")
            await asyncio.wait_for(self.qp.wait_closed(), 5)
        except (TimeoutError, ConnectionLost):
            pass
        await self.close()

    # -- raw access for the tools ----------------------------------------------------------

    async def raw(self, message: bytes | Packet, *, timeout: float = 2.0,
                  expect: int = 1) -> list[Received]:
        """Send any bytes (or Scapy packet) as a request; collect what comes back unmatched,
        up to ``expect`` messages or ``timeout`` seconds of waiting (silence: fewer).

        Raises ``SessionEnded`` when the connection ends first (a Terminate, a DREQ, the
        QP's error state...), with the answers that came before it."""
        got: list[Received] = []
        try:
            await asyncio.wait_for(self.qp.send(bytes(message)), timeout)
        except TimeoutError:             # not even sent in time (held back by the peer): silence
            return got
        except ConnectionLost as exc:
            raise SessionEnded("the request was not sent", exc) from None
        except RemoteError as exc:           # a NAK of the Send: the QP is in error now
            raise SessionEnded("the target refused the Send", self.qp.error or exc) from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(got) < expect:
            if not self.unmatched.empty():
                got.append(self.unmatched.get_nowait())
                continue
            if self.qp.error is not None:
                raise SessionEnded("the connection ended after the request", self.qp.error, got)
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            answer = asyncio.ensure_future(self.unmatched.get())
            ended = asyncio.ensure_future(self.qp.wait_closed())
            try:
                await asyncio.wait([answer, ended], timeout=remaining,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
                if not answer.done():
                    answer.cancel()
            if answer.done() and not answer.cancelled():
                got.append(answer.result())
        return got

    async def close(self) -> None:
        if not self.qp.closed:
            await self.qp.close()
