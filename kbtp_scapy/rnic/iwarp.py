"""The iWARP binding of the soft RNIC: MPA revision 2, DDP and RDMAP over the kernel's TCP.

One ``IwarpQP`` is both a ``QueuePair`` and the asyncio ``Protocol`` of its TCP
connection. It runs the MPA startup (RFC 5044 s7.1, RFC 6581 enhanced set-up with a
zero-length RDMA Write as the Ready-to-Receive), then frames DDP segments (RFC 5041)
carrying RDMAP messages (RFC 5040, RFC 7306 atomics) as FPDUs sized to the MULPDU.
Every error a responder detects ends in an RDMAP Terminate and the end of the
connection, since iWARP has no recoverable NAK (RFC 5040 s5.4).

Decisions where the RFCs leave a choice are documented where they are made; each
names the section it follows.
"""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from kbtp_scapy.wire.iwarp_defs import (
    DDP_TAGGED_LEN,
    DDP_UNTAGGED_LEN,
    DEFAULT_MSS,
    FPDU_OVERHEAD,
    INVALIDATE_OPCODES,
    OPCODE_QUEUE,
    SOLICITED_OPCODES,
    Op,
    fpdu_pad_len,
    mulpdu,
)
from kbtp_scapy.wire.mpa_markers import (
    MARKER_INTERVAL,
    MARKER_LEN,
    insert_markers,
    strip_markers,
)

from ..wire import iwarp as w
from ..wire.address import Address
from .admission import HalfOpen
from .memory import AccessError, Fault, MemoryTable
from .qp import (
    BadResponse,
    ConnectionLost,
    QueuePair,
    ReadSink,
    ReceiveError,
    RemoteError,
    Verb,
    WorkRequest,
)

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
_SEND_OPS = {(False, False): Op.SEND, (True, False): Op.SEND_INV,
             (False, True): Op.SEND_SE, (True, True): Op.SEND_SE_INV}
FLUSH_MESSAGES = 8
RTR_DELAY = 0.05          # the longest wait before the RTR (see IwarpQP._on_reply)
OVERRUN_GRACE = 1.0       # the longest a Terminate for a Send without buffer waits
TERMINATE_LINGER = 2.0    # then the stream is reset if TCP could not take it all
READ_CHUNK = 64 << 10     # Read Response octets built ahead of what TCP has taken
RETRY_FIRST, RETRY_MOST = 0.02, 0.5   # seconds between connects the listener reset
NUDGE_AFTER = 0.1         # silence after the RTR that sends a nudge (see IwarpQP._nudge)
"""Messages queued before the stream is written without waiting for the end of the loop
iteration: the peer starts on the first while the rest are built, as an RNIC transmits
as it goes. Waiting for the whole batch saves send calls but makes the two ends take
turns; measured with tools/bench_target.py, 8 about doubles a window of 16 LOADs."""
_QUEUES = 4      # Send, Read/Atomic Request, Terminate, Atomic Response (RFC 5040, RFC 7306)

# RFC 5040 s7.4 / RFC 5041 s7: a refused Write is a DDP tagged buffer error when DDP can
# name it (STag, bounds, stream); the access right is RDMAP's to check, so it is an RDMAP
# Remote Protection Error. Read Requests and atomics are checked by RDMAP entirely. A
# misaligned atomic operand is reported as a bounds violation: the operand does not lie
# where RFC 7306 s5.2 allows one to be (the choice is ours; no code names it exactly).
_WRITE_FAULTS = {
    Fault.INVALID_STAG: (w.LAYER_DDP, w.DDP_TAGGED, 0x00),
    Fault.BOUNDS: (w.LAYER_DDP, w.DDP_TAGGED, 0x01),
    Fault.WRONG_CONNECTION: (w.LAYER_DDP, w.DDP_TAGGED, 0x02),
    Fault.ACCESS: (w.LAYER_RDMAP, w.RDMAP_PROTECTION, 0x02),
    Fault.MISALIGNED: (w.LAYER_DDP, w.DDP_TAGGED, 0x01),
}
_RDMAP_FAULTS = {
    Fault.INVALID_STAG: 0x00, Fault.BOUNDS: 0x01, Fault.ACCESS: 0x02,
    Fault.WRONG_CONNECTION: 0x03, Fault.MISALIGNED: 0x01,
}
_RECEIVE_ERRORS = {ReceiveError.NO_BUFFER: 0x02, ReceiveError.TOO_LONG: 0x05}
_UNEXPECTED_OPCODE = (w.LAYER_RDMAP, w.RDMAP_OPERATION, 0x06)


class _Fatal(Exception):
    """A received segment that ends the stream: the Terminate to send and why."""

    def __init__(self, layer: int, etype: int, code: int, reason: str,
                 rdmap_header: bytes = b"") -> None:
        super().__init__(reason)
        self.term = (layer, etype, code)
        self.rdmap_header = rdmap_header
        self.ddp: tuple[bytes, int] = (b"", 0)     # the DDP header it came in, and its length


class _Overrun(_Fatal):
    """A Send that found no receive buffer: fatal, after the answers to the ones before."""


@dataclass
class _Read:
    """An outstanding RDMA Read: where its Read Response lands (RFC 5040 s4.4)."""

    wr: WorkRequest
    sink_stag: int
    msn: int
    sink: ReadSink


@dataclass
class _Inbound:
    """A peer's RDMA Read Request being answered: where the rest of its Read Response
    comes from and goes to (RFC 5040 s4.4, s4.5)."""

    sink_stag: int
    sink_to: int
    src_stag: int
    src_to: int
    left: int


class IwarpQP(QueuePair, asyncio.Protocol):
    """A queue pair over one TCP connection, from the TCP handshake to the FIN."""

    transport = "iwarp"
    masked_atomics = True

    def __init__(self, memory: MemoryTable, *, active: bool, recv_size: int = 4096,
                 posted: int = 0, crc: bool = True, markers: bool = False,
                 mss: int | None = None, ird: int = 16, ord: int = 16,
                 frame_listeners: Iterable = (), keepalive: float = 0.0,
                 user_timeout: float = 0.0, half_open: HalfOpen | None = None) -> None:
        super().__init__(memory, recv_size=recv_size, posted=posted)
        self.frame_listeners.extend(frame_listeners)
        self.mss, self.ird, self.ord = mss, ird, ord
        self._keepalive, self._user_timeout = keepalive, user_timeout
        self._half_open = half_open
        self._active, self._want_crc, self._want_markers = active, crc, markers
        self._tp: asyncio.Transport | None = None
        self._frames: w.TcpFrames | None = None
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._phase = "startup"          # startup -> rtr (responder, peer-to-peer) -> fpdu
        self._rtr: Op | None = None      # the RTR the responder waits for (RFC 6581 s4)
        self.peer_startup: w.Startup | None = None   # the peer's MPA Request or Reply, as it came
        self._rx = bytearray()
        self._rx_pos = self._tx_pos = 0  # FPDU stream positions, for markers
        self._txbuf = bytearray()
        self._tx_units: list[bytes] = []  # FPDUs of _txbuf, kept only for frame listeners
        self._rx_units: list[bytes] = []  # FPDUs received and not yet shown to listeners
        self._flushing = False
        self._tx_messages = 0             # messages in _txbuf
        self._unwritten: list[WorkRequest] = []   # Sends and Writes still in _txbuf
        self._written: list[WorkRequest] = []     # handed over while TCP is backed up
        self._paused = False              # the transport's buffer is above its high mark
        self._posted_high = posted        # the most receive buffers ever posted at once
        self._overrun: _Fatal | None = None       # a Send found no buffer (see _overrun_at)
        self._gone = asyncio.Event()
        # negotiated at startup
        self.crc = crc
        self.markers_tx = self.markers_rx = False
        self.mulpdu = mulpdu(mss or DEFAULT_MSS)
        self.ord_limit = ord
        # DDP/RDMAP state
        self._msn_tx = [1] * _QUEUES     # RFC 5041 s5.1: MSNs start at 1 on each queue
        self._msn_rx = [1] * _QUEUES
        self._sq: deque[WorkRequest] = deque()       # held back while ORD is exhausted
        self._reads: deque[_Read] = deque()
        self._inbound: deque[_Inbound] = deque()     # at most IRD, answered in order
        self._atomics: dict[int, tuple[WorkRequest, int]] = {}   # Request Identifier
        self._sink_stag = 0x1000
        self._req_id = 0
        self._send_rx: bytearray | None = None       # a multi-segment Send being received
        self._write_rx: tuple | None = None          # (STag, region, next TO)

    @property
    def _stream(self) -> asyncio.Transport:
        """The TCP connection: every caller runs after ``connection_made`` set it."""
        assert self._tp is not None, "no TCP connection yet"
        return self._tp

    @property
    def _tcp(self) -> w.TcpFrames:
        """The connection's frames for the listeners, there from ``connection_made`` on."""
        assert self._frames is not None, "no TCP connection yet"
        return self._frames

    # -- asyncio Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport), "a TCP connection is a stream"
        self._tp = transport
        self.local = transport.get_extra_info("sockname")[:2]
        self.remote = transport.get_extra_info("peername")[:2]
        if not self._active and self._half_open is not None:
            self.admission = self._half_open.enter(self.remote[0])
            if self.admission is None:       # too many set-ups: reset, nothing kept
                self._tp.abort()
                return
            self.admission.evict = self._evicted
        _liveness(transport, self._keepalive, self._user_timeout)
        if self.mss is None:
            self.mss = _emss(transport)
        self._frames = w.TcpFrames(self.local, self.remote, self.mss)
        if self.frame_listeners:
            for direction, frame in self._frames.handshake(self._active):
                self._emit(direction, frame)
        if self._active:
            # RFC 6581 s9: offer peer-to-peer set-up with only the zero-length RDMA Write
            # RTR: it needs no receive buffer (a KBTP credit) and no IRD slot or reply.
            self._write_now(w.build_startup(
                True, self._flags(), 2, self.ird, self.ord, w.IRD_P2P, w.ORD_RTR_WRITE))

    def data_received(self, data: bytes) -> None:
        self.rx_ns = time.perf_counter_ns()     # the arrival of every FPDU in ``data``
        self.stats["bytes_rx"] += len(data)
        self._rx += data
        try:
            if self._phase == "startup":
                self._startup()
            if self._phase in ("rtr", "fpdu"):
                self._fpdus()
        except _Fatal as exc:
            self._terminate(exc)
        self._show_rx()

    def eof_received(self) -> bool:
        """The peer's FIN: ours follows (returning False closes the transport)."""
        if self.frame_listeners:
            self._show_rx()
            self._emit("rx", self._tcp.fin("rx"))
            closing = self._stream.is_closing()
            self._emit("tx", self._tcp.ack("tx") if closing else self._tcp.fin("tx"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone.set()
        reason = ConnectionLost(f"TCP connection lost: {exc}" if exc else
                                "TCP connection closed by the peer", how="reset" if exc else "fin")
        foreign = w.foreign_start(self._rx) if self._phase == "startup" else None
        if foreign is not None:             # a short answer, then the close
            reason = ConnectionLost(self._not_mpa(foreign), how="foreign")
        self._not_ready(reason)
        self.lost(reason)

    def pause_writing(self) -> None:
        """TCP is backed up (the transport holds more than its high-water mark): what
        is handed over from now on completes only once it drains (``resume_writing``),
        so a peer that does not read holds back our completions, not our memory."""
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._complete_written()
        self._serve_reads()

    def _complete_written(self) -> None:
        done, self._written = self._written, []
        for wr in done:
            self.complete(wr)

    def _evicted(self, reason: str) -> None:
        """Its half-open slot went to another source: a reset in MPA set-up, where no
        Terminate can be framed yet; a Terminate once FPDUs flow (no HELLO answered)."""
        log.info("connection from %s: %s", self.remote[0], reason)
        if self._phase == "fpdu":
            self.abort(reason)
        elif self._tp is not None:
            self._tp.abort()
            self.lost(ConnectionLost(reason))

    def lost(self, error: BaseException) -> None:
        self._unwritten, self._written = [], []
        self._inbound.clear()
        super().lost(error)

    def _not_ready(self, error: ConnectionLost) -> None:
        """Fail a set-up still in progress (read at once: nobody may be waiting for it)."""
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()

    # -- MPA startup (RFC 5044 s7.1, RFC 6581) -------------------------------------------

    def _flags(self) -> int:
        return (w.FLAG_C if self._want_crc else 0) | (w.FLAG_M if self._want_markers else 0)

    def _startup(self) -> None:
        foreign = w.foreign_start(self._rx)
        if foreign is not None:             # not worth waiting for: say what came instead
            error = ConnectionLost(self._not_mpa(foreign), how="foreign")
            self._not_ready(error)
            self._close_transport(error)
            return
        size = w.startup_length(self._rx)
        if size is None or len(self._rx) < size:
            return
        frame = bytes(self._rx[:size])
        del self._rx[:size]
        self._received_unit(frame)
        st = self.peer_startup = w.parse_startup(frame)
        if st is None or st.request == self._active:
            self._abort_setup("not an MPA " + ("Reply" if self._active else "Request"))
        elif self._active:
            self._on_reply(st)
        else:
            self._on_request(st)

    def _negotiate(self, peer: w.Startup) -> None:
        """RFC 5044 s7.1: CRCs are used both ways if either end asks; the M bit asks the
        other end to send markers, so each direction has its own setting."""
        self.crc = self._want_crc or bool(peer.flags & w.FLAG_C)
        self.markers_tx = bool(peer.flags & w.FLAG_M)
        self.markers_rx = self._want_markers
        self.mulpdu = mulpdu(self._tcp.mss, self.markers_tx)
        if peer.enhanced:
            self.ord_limit = max(1, min(self.ord, peer.ird))

    def _on_request(self, req: w.Startup) -> None:
        if req.rev not in (1, 2) or len(req.private) > w.MAX_PRIVATE_DATA:
            self._reject(min(req.rev, 2) or 1, f"MPA Request revision {req.rev} or "
                         f"private data length {len(req.private)} not acceptable")
            return
        self._negotiate(req)
        if not req.enhanced:      # revision 1 (or 2 without RFC 6581 data): client-server
            self._write_now(w.build_startup(False, self._flags(), req.rev))
            self._ready()
            return
        ird_bits = ord_bits = 0
        if req.p2p:
            # Our preference among the RTRs the initiator offers (RFC 6581 s4).
            if req.rtr_write:
                self._rtr, ord_bits = Op.WRITE, w.ORD_RTR_WRITE
            elif req.rtr_read:
                self._rtr, ord_bits = Op.READ_REQUEST, w.ORD_RTR_READ
            elif req.rtr_send:
                self._rtr, ird_bits = Op.SEND, w.IRD_RTR_SEND
            else:
                self._reject(2, "MPA Request offers no RTR message")
                return
            ird_bits |= w.IRD_P2P
        self._write_now(w.build_startup(False, self._flags(), 2, self.ird, self.ord_limit,
                                        ird_bits, ord_bits))
        if req.p2p:
            self._phase = "rtr"
        else:
            self._ready()

    def _on_reply(self, rep: w.Startup) -> None:
        if rep.flags & w.FLAG_R:
            self._abort_setup("MPA Reply has the Reject bit set")
            return
        self._negotiate(rep)
        self._phase = "fpdu"
        if rep.enhanced and rep.p2p:
            if not rep.rtr_write:
                self._terminate(_Fatal(w.LAYER_LLP, w.LLP_MPA, 0x07,
                                       "MPA Reply chose an RTR that was not offered"))
                return
            self._put_fpdu(w.tagged_head(True, Op.WRITE, 0, 0, 0), b"")   # the RTR
            self._flush()
            asyncio.get_running_loop().call_later(NUDGE_AFTER, self._nudge, NUDGE_AFTER,
                                                  self.stats["bytes_rx"])
        self._ready()

    def _nudge(self, delay: float, received: int) -> None:
        """Linux siw (6.1 at least) sends its MPA Reply before it installs the socket
        callback that reads the RTR: an RTR, and the first Send after it, that arrive in
        between are left unread until more data comes, and the connection hangs. When we
        have sent since the RTR and heard nothing, send a zero-length RDMA Write (which
        touches no memory) to make siw read what waits; a few times, further apart."""
        if self.closed or self._tp is None or self._tp.is_closing():
            return
        if self.stats["bytes_rx"] != received:
            return                                   # the responder is reading us
        if self.stats["fpdus_tx"] > 1:
            self._put_fpdu(w.tagged_head(True, Op.WRITE, 0, 0, 0), b"")
            self._flush()
            self.stats["nudges"] += 1
        if delay < NUDGE_AFTER * 8:
            asyncio.get_running_loop().call_later(delay * 2, self._nudge, delay * 2, received)

    def _ready(self) -> None:
        self._phase = "fpdu"
        if not self.ready.done():
            self.ready.set_result(None)

    def _reject(self, rev: int, reason: str) -> None:
        self._write_now(w.build_startup(False, self._flags() | w.FLAG_R, rev))
        self._abort_setup(reason)

    def _not_mpa(self, start: str) -> str:
        """Why a peer that speaks another protocol (an HTTP server on the port) is no peer."""
        if self._active:
            return (f"the peer answered with something that is not an MPA Reply (it starts "
                    f"with {start!r}): not an iWARP target")
        return (f"the peer sent something that is not an MPA Request (it starts with "
                f"{start!r}): not an iWARP initiator")

    def _abort_setup(self, reason: str) -> None:
        error = ConnectionLost(f"MPA set-up failed: {reason}")
        self._not_ready(error)
        self._close_transport(error)

    # -- receiving FPDUs -----------------------------------------------------------------

    def _fpdus(self) -> None:
        buf = self._rx
        view = memoryview(buf)
        off, end = 0, len(buf)
        listening, count, skipped = bool(self.frame_listeners), 0, 0
        try:
            while self._phase in ("rtr", "fpdu"):
                if self.markers_rx:
                    at = off + (MARKER_LEN if self._rx_pos % MARKER_INTERVAL == 0 else 0)
                    if end - at < 2:
                        break
                    ulen = buf[at] << 8 | buf[at + 1]
                    clean = ulen + FPDU_OVERHEAD + fpdu_pad_len(ulen)
                    size = w.fpdu_wire_length(clean, self._rx_pos, True)
                    if end - off < size:
                        break
                    wire = bytes(view[off:off + size])
                    fpdu = strip_markers(wire, self._rx_pos)[0]
                    self._rx_pos += size
                else:
                    if end - off < 2:
                        break
                    ulen = buf[off] << 8 | buf[off + 1]
                    size = ulen + FPDU_OVERHEAD + fpdu_pad_len(ulen)
                    if end - off < size:
                        break
                    wire = fpdu = bytes(view[off:off + size])
                off += size
                count += 1
                if listening:
                    self._rx_units.append(wire)
                else:
                    skipped += size
                if self.crc and not w.crc_ok(wire):   # the CRC covers markers (RFC 5044 s4.4)
                    self.stats["crc_errors"] += 1
                    raise _Fatal(w.LAYER_LLP, w.LLP_MPA, 0x02, "MPA CRC error")
                try:
                    self._segment(fpdu, ulen)
                except _Overrun as exc:
                    self._overrun_at(exc)
        finally:
            view.release()
            del buf[:off]
            self.stats["fpdus_rx"] += count
            if skipped:
                self._tcp.skip("rx", skipped)

    def _segment(self, fpdu: bytes, ulen: int) -> None:
        """One DDP segment (RFC 5041 s4) and its RDMAP message (RFC 5040 s4)."""
        c0, c1 = fpdu[2], fpdu[3]
        opcode, last = c1 & 0x0F, bool(c0 & 0x40)
        try:
            if c0 & 0x03 != 1:
                raise _Fatal(w.LAYER_DDP, w.DDP_TAGGED if c0 & 0x80 else w.DDP_UNTAGGED,
                             0x04 if c0 & 0x80 else 0x06, "invalid DDP version")
            if c1 >> 6 != 1:
                raise _Fatal(w.LAYER_RDMAP, w.RDMAP_OPERATION, 0x05, "invalid RDMAP version")
            if self._phase == "rtr" and self._rtr_consumed(ulen, opcode):
                return
            if c0 & 0x80:
                _, _, _, stag, to = w.TAGGED.unpack_from(fpdu)
                data = memoryview(fpdu)[2 + DDP_TAGGED_LEN:2 + ulen]
                if opcode == Op.WRITE:
                    self._rx_write(stag, to, data, last)
                elif opcode == Op.READ_RESPONSE:
                    self._rx_read_response(stag, to, data, last)
                else:
                    raise _Fatal(*_UNEXPECTED_OPCODE, f"tagged opcode {opcode}")
                return
            _, _, _, inv, qn, msn, mo = w.UNTAGGED.unpack_from(fpdu)
            if qn == 0 and self._overrun is not None:
                return          # Sends after one that found no buffer: never delivered
            data = memoryview(fpdu)[2 + DDP_UNTAGGED_LEN:2 + ulen]
            if opcode not in OPCODE_QUEUE and opcode not in _SEND_OPS.values():
                raise _Fatal(*_UNEXPECTED_OPCODE, f"untagged opcode {opcode}")
            if qn != OPCODE_QUEUE.get(opcode, 0):
                raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, 0x01, f"invalid QN {qn}")
            if msn != self._msn_rx[qn]:
                raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, 0x03,
                             f"MSN {msn} on queue {qn}, expected {self._msn_rx[qn]}")
            if last:
                self._msn_rx[qn] += 1
            if qn == 0:
                self._rx_send(opcode, inv, mo, data, last)
            elif mo or not last:
                raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, 0x04, "segmented control message")
            elif opcode == Op.READ_REQUEST:
                self._rx_read_request(data)
            elif opcode == Op.ATOMIC_REQUEST:
                self._rx_atomic_request(data)
            elif opcode == Op.ATOMIC_RESPONSE:
                self._rx_atomic_response(data)
            else:
                self._rx_terminate(data)
        except _Fatal as exc:
            exc.ddp = (fpdu[2:2 + (DDP_TAGGED_LEN if c0 & 0x80 else DDP_UNTAGGED_LEN)], ulen)
            raise

    def _rtr_consumed(self, ulen: int, opcode: int) -> bool:
        """The responder's first FPDU must be the zero-length RTR it chose (RFC 6581 s4);
        True when nothing is left to do with it."""
        header = DDP_TAGGED_LEN if opcode in (Op.WRITE, Op.READ_RESPONSE) else DDP_UNTAGGED_LEN
        body = 28 if opcode == Op.READ_REQUEST else 0
        if opcode != self._rtr or ulen != header + body:
            raise _Fatal(w.LAYER_LLP, w.LLP_MPA, 0x07, "first FPDU is not the agreed RTR")
        if opcode == Op.SEND:       # consumes no receive buffer: it only says "ready"
            self._msn_rx[0] += 1
            self._ready()
            return True
        self._ready()
        return False

    def _rx_send(self, opcode: int, inv: int, mo: int, data: memoryview, last: bool) -> None:
        if mo == 0:
            if not self.posted:
                raise _Overrun(w.LAYER_DDP, w.DDP_UNTAGGED, 0x02, ReceiveError.NO_BUFFER)
            self._send_rx = bytearray()
        elif self._send_rx is None or mo != len(self._send_rx):
            raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, 0x04, f"MO {mo} out of sequence")
        if mo + len(data) > self.recv_size:
            raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, 0x05, ReceiveError.TOO_LONG)
        self._send_rx += data
        if not last:
            return
        payload, self._send_rx = bytes(self._send_rx), None
        invalidate = inv if opcode in INVALIDATE_OPCODES else None
        if invalidate is not None:
            region = self.memory.get(invalidate)
            if region is None or not region.valid:
                # RFC 5040 s6.10: invalidating an STag that is not valid is an error.
                raise _Fatal(w.LAYER_RDMAP, w.RDMAP_PROTECTION, 0x00,
                             f"Send with Invalidate names invalid STag 0x{inv:08x}")
            if region.connection is not None and region.connection is not self:
                raise _Fatal(w.LAYER_RDMAP, w.RDMAP_OPERATION, 0x09,
                             f"STag 0x{inv:08x} cannot be invalidated from this stream")
        try:
            self.deliver_send(payload, invalidate=invalidate,
                              solicited=opcode in SOLICITED_OPCODES)
        except ReceiveError as exc:
            raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, _RECEIVE_ERRORS[exc.reason],
                         exc.reason) from None
        self.stats["messages_rx"] += 1

    def _overrun_at(self, exc: _Fatal) -> None:
        """A Send found no receive buffer (RFC 5041 s7: DDP untagged buffer error). The
        Sends before it were delivered; the Terminate waits until the program on top has
        answered them (it has reposted as many buffers as it ever had) or OVERRUN_GRACE
        has passed, so the requests that had a credit get their answers in front of it.
        Meanwhile every later Send is dropped, and everything else is served as usual
        (a Read Response that an answer waits for, for example)."""
        self._overrun = exc
        if self.posted >= self._posted_high:
            self._terminate(exc)
        else:
            asyncio.get_running_loop().call_later(OVERRUN_GRACE, self._terminate, exc)

    def post_recv(self, count: int = 1) -> None:
        super().post_recv(count)
        self._posted_high = max(self._posted_high, self.posted)
        if self._overrun is not None and self.posted >= self._posted_high:
            # behind the answers queued before it, and the one its program posts next:
            # a buffer goes back before the answer that returns its credit
            asyncio.get_running_loop().call_soon(self._terminate, self._overrun)

    def _rx_write(self, stag: int, to: int, data: memoryview, last: bool) -> None:
        """RFC 5040 s5.1: validate the Write at its first segment, then place each one
        (bounds are still checked per segment, by the region)."""
        n = len(data)
        if n:
            state = self._write_rx
            try:
                if state is None or state[0] != stag or state[2] != to:
                    self.check_write(stag, to, n)
                    region = self.memory.get(stag)
                    assert region is not None      # check_write found it
                else:
                    region = state[1]
                region.local(to, n)[:] = data
            except AccessError as exc:
                raise _Fatal(*_WRITE_FAULTS[exc.fault], str(exc)) from None
            self._write_rx = None if last else (stag, region, to + n)
        elif last:
            self._write_rx = None
        if last:
            self.stats["messages_rx"] += 1

    def _rx_read_response(self, stag: int, to: int, data: memoryview, last: bool) -> None:
        if not self._reads:
            raise _Fatal(*_UNEXPECTED_OPCODE, "Read Response without a Read Request")
        read = self._reads[0]
        if stag != read.sink_stag:
            raise _Fatal(w.LAYER_DDP, w.DDP_TAGGED, 0x00, f"Read Response to STag 0x{stag:08x}")
        try:
            # the sink's Tagged Offset is 0 (_start): the TO is the offset into the Read
            done = read.sink.place(to, data, last)
        except BadResponse as exc:     # as siw: a DDP base-or-bounds error (RFC 5041 s7)
            self.complete(read.wr, error=exc)
            raise _Fatal(w.LAYER_DDP, w.DDP_TAGGED, 0x01, str(exc)) from None
        if done:
            self._reads.popleft()
            self.complete(read.wr, read.sink.data)     # its own buffer: no copy
            self._pump()

    def _rx_read_request(self, body: memoryview) -> None:
        if len(body) < w.READ_REQUEST.size:
            raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, 0x04, "short Read Request")
        header = bytes(body[:w.READ_REQUEST.size])
        sink_stag, sink_to, size, src_stag, src_to = w.READ_REQUEST.unpack(header)
        if len(self._inbound) >= self.ird:
            # RFC 5040 s5.3: a Read Request consumes one of the IRD untagged buffers of
            # queue 1; beyond them there is no buffer for it.
            raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, 0x02,
                         f"Read Request beyond the IRD of {self.ird} outstanding")
        try:
            if size:
                self.check_read(src_stag, src_to, size)
        except AccessError as exc:
            raise _Fatal(w.LAYER_RDMAP, w.RDMAP_PROTECTION, _RDMAP_FAULTS[exc.fault],
                         str(exc), header) from None
        self._inbound.append(_Inbound(sink_stag, sink_to, src_stag, src_to, size))
        self._serve_reads()

    def _serve_reads(self) -> None:
        """Build Read Responses as TCP takes them, READ_CHUNK ahead at most: a peer that
        asks for the whole Pool IRD times and does not read holds TCP's buffer and one
        chunk of the target's memory, not IRD copies of the Pool."""
        while (self._inbound and not self._paused and self._phase == "fpdu"
               and self._tp is not None and not self._tp.is_closing()):
            if len(self._txbuf) >= READ_CHUNK:
                self._flush()       # TCP takes it, or says it is full (pause_writing)
                continue
            read = self._inbound[0]
            count = min(READ_CHUNK, read.left)
            try:
                data = self.serve_read(read.src_stag, read.src_to, count) if count else b""
            except AccessError as exc:    # invalidated since the request was checked
                self._terminate(_Fatal(w.LAYER_RDMAP, w.RDMAP_PROTECTION,
                                       _RDMAP_FAULTS[exc.fault], str(exc)))
                return
            read.left -= count
            self._send_tagged(Op.READ_RESPONSE, read.sink_stag, read.sink_to, data, not read.left)
            read.src_to, read.sink_to = read.src_to + count, (read.sink_to + count) & _U64
            if not read.left:
                self._inbound.popleft()

    def _rx_atomic_request(self, body: memoryview) -> None:
        if len(body) < w.ATOMIC_REQUEST.size:
            raise _Fatal(w.LAYER_DDP, w.DDP_UNTAGGED, 0x04, "short Atomic Request")
        aop, req_id, stag, to, data, mask, compare, cmask = w.ATOMIC_REQUEST.unpack_from(body)
        aop &= 0x0F
        try:
            if aop == w.ATOMIC_FETCH_ADD:
                # RFC 7306 s5.2.1: a zero Add Mask is a plain 64-bit add.
                original = self.serve_fetch_add(stag, to, data, mask or None)
            elif aop == w.ATOMIC_CMP_SWAP and mask == cmask == _U64:
                original = self.serve_compare_swap(stag, to, compare, data)
            elif aop in (w.ATOMIC_SWAP, w.ATOMIC_CMP_SWAP):
                original = self._masked_swap(stag, to, data, mask,
                                             compare if aop == w.ATOMIC_CMP_SWAP else 0,
                                             cmask if aop == w.ATOMIC_CMP_SWAP else 0)
            else:
                raise _Fatal(*_UNEXPECTED_OPCODE, f"atomic opcode {aop}")
        except AccessError as exc:
            raise _Fatal(w.LAYER_RDMAP, w.RDMAP_PROTECTION, _RDMAP_FAULTS[exc.fault],
                         str(exc)) from None
        self._send_untagged(Op.ATOMIC_RESPONSE, w.ATOMIC_RESPONSE.pack(req_id, original))

    def _masked_swap(self, stag: int, to: int, swap: int, smask: int, compare: int,
                     cmask: int) -> int:
        """RFC 7306 s5.2.2/5.2.3: Swap, or CmpSwap with partial masks."""
        view = self.memory.atomic(stag, to, self)
        original = int.from_bytes(view, self.memory.order)
        if not (original ^ compare) & cmask:
            new = original & ~smask | swap & smask
            view[:] = (new & _U64).to_bytes(8, self.memory.order)
        return original

    def _rx_atomic_response(self, body: memoryview) -> None:
        req_id, original = w.ATOMIC_RESPONSE.unpack_from(body)
        entry = self._atomics.pop(req_id, None)
        if entry is None:
            raise _Fatal(*_UNEXPECTED_OPCODE, f"Atomic Response to unknown request {req_id}")
        self.complete(entry[0], original)
        self._pump()

    def _rx_terminate(self, body: memoryview) -> None:
        term = w.parse_terminate(bytes(body))
        reason = term.describe()
        self.stats["terminates_rx"] += 1
        if term.qn == 1:
            for wr, msn in [(r.wr, r.msn) for r in self._reads] + list(self._atomics.values()):
                if msn == term.msn:
                    self.complete(wr, error=RemoteError(reason))
        self._phase = "closed"
        self._close_transport(ConnectionLost(reason, how="terminate"))

    # -- sending -------------------------------------------------------------------------

    def _transmit(self, wr: WorkRequest) -> None:
        if self._sq or (self._needs_ord(wr) and self._ord_used() >= self.ord_limit):
            self._sq.append(wr)     # the send queue stalls in order, as an RNIC's does
        else:
            self._start(wr)

    @staticmethod
    def _needs_ord(wr: WorkRequest) -> bool:
        return wr.verb not in (Verb.SEND, Verb.WRITE)

    def _ord_used(self) -> int:
        return len(self._reads) + len(self._atomics)

    def _pump(self) -> None:
        while self._sq and not (self._needs_ord(self._sq[0])
                                and self._ord_used() >= self.ord_limit):
            self._start(self._sq.popleft())

    def _start(self, wr: WorkRequest) -> None:
        if wr.imm is not None:
            self.complete(wr, error=ValueError("Immediate Data is not offered on iWARP"))
            return
        verb = wr.verb
        if verb is Verb.SEND:
            op = _SEND_OPS[wr.invalidate is not None, wr.solicited]
            self._unwritten.append(wr)    # TCP is reliable: handing it over completes it
            self._send_untagged(op, wr.payload, wr.invalidate or 0)
        elif verb is Verb.WRITE:
            self._unwritten.append(wr)
            self._send_tagged(Op.WRITE, wr.stag, wr.offset, wr.payload)
        elif verb is Verb.READ:
            self._sink_stag = (self._sink_stag + 0x100) & 0xFFFFFFFF or 0x100
            self._reads.append(_Read(wr, self._sink_stag, self._msn_tx[1], ReadSink(wr.length)))
            self._send_untagged(Op.READ_REQUEST, w.READ_REQUEST.pack(
                self._sink_stag, 0, wr.length, wr.stag, wr.offset))
        else:
            self._req_id = (self._req_id + 1) & 0xFFFFFFFF
            self._atomics[self._req_id] = (wr, self._msn_tx[1])
            if verb is Verb.FETCH_ADD:
                body = (w.ATOMIC_FETCH_ADD, self._req_id, wr.stag, wr.offset, wr.add & _U64,
                        (wr.mask or 0) & _U64, 0, 0)
            else:
                body = (w.ATOMIC_CMP_SWAP, self._req_id, wr.stag, wr.offset, wr.add & _U64,
                        _U64, wr.compare & _U64, _U64)
            self._send_untagged(Op.ATOMIC_REQUEST, w.ATOMIC_REQUEST.pack(*body))
        self.stats["messages_tx"] += 1

    def _send_untagged(self, op: int, payload: bytes, inv_stag: int = 0) -> None:
        """One untagged message, segmented at the MULPDU (RFC 5041 s5.2)."""
        qn = OPCODE_QUEUE.get(op, 0)
        msn = self._msn_tx[qn]
        self._msn_tx[qn] = msn + 1
        room = self.mulpdu - DDP_UNTAGGED_LEN
        total = len(payload)
        if total <= room:
            self._put_fpdu(w.untagged_head(True, op, qn, msn, 0, total, inv_stag), payload)
        else:
            view = memoryview(payload)
            for mo in range(0, total, room):
                chunk = bytes(view[mo:mo + room])
                self._put_fpdu(w.untagged_head(mo + room >= total, op, qn, msn, mo,
                                               len(chunk), inv_stag), chunk)
        self._schedule_flush()

    def _send_tagged(self, op: int, stag: int, to: int, payload: bytes, last: bool = True) -> None:
        """A tagged message, or (``last`` False) the first part of one."""
        room = self.mulpdu - DDP_TAGGED_LEN
        total = len(payload)
        if total <= room:
            self._put_fpdu(w.tagged_head(last, op, stag, to, total), payload)
        else:
            view = memoryview(payload)
            for off in range(0, total, room):
                chunk = bytes(view[off:off + room])
                self._put_fpdu(w.tagged_head(last and off + room >= total, op, stag,
                                             (to + off) & _U64, len(chunk)), chunk)
        self._schedule_flush()

    def _put_fpdu(self, head: bytes, payload: bytes) -> None:
        tail = w.fpdu_tail(head, payload, self.crc)
        self.stats["fpdus_tx"] += 1
        if self.markers_tx:
            fpdu = insert_markers(head + payload + tail, self._tx_pos, fix_crc=self.crc)
            self._tx_pos += len(fpdu)
            self._txbuf += fpdu
        else:
            self._txbuf += head
            self._txbuf += payload
            self._txbuf += tail
            if self.frame_listeners:
                fpdu = head + payload + tail
        if self.frame_listeners:
            self._tx_units.append(fpdu)

    def _terminate(self, exc: _Fatal) -> None:
        """RFC 5040 s5.4: report the error with a Terminate, then end the stream."""
        self._overrun = None
        if self._phase == "closed" or self.error is not None:
            return
        ddp, length = exc.ddp
        self._send_untagged(Op.TERMINATE, w.terminate_body(
            *exc.term, ddp_header=ddp, ddp_length=length, rdmap_header=exc.rdmap_header))
        self.stats["terminates_sent"] += 1
        self._phase = "closed"
        error = ConnectionLost(f"sent Terminate: {exc}", how="qp_error")
        self._not_ready(error)
        self._close_transport(error)
        if self._tp is not None and self._tp.get_write_buffer_size():
            # a peer that does not read would keep the stream, and what it holds, for ever
            asyncio.get_running_loop().call_later(TERMINATE_LINGER, self._tp.abort)

    # -- the TCP byte stream -------------------------------------------------------------

    def _schedule_flush(self) -> None:
        """Messages posted in one loop iteration leave in one transport write, and at most
        ``FLUSH_MESSAGES`` of them wait for that."""
        self._tx_messages += 1
        if self._tx_messages >= FLUSH_MESSAGES:
            self._flush()
        elif not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Hand what is queued to TCP; the Sends and Writes in it complete unless TCP is
        backed up (``pause_writing``)."""
        self._flushing = False
        self._tx_messages = 0
        if self._txbuf and self._tp is not None and not self._tp.is_closing():
            data, self._txbuf = self._txbuf, bytearray()
            units, self._tx_units = self._tx_units, []
            self._write_now(data, units)
            for wr in self._unwritten:
                wr.sent_ns = self.tx_ns
            self._written += self._unwritten
            self._unwritten = []
            if not self._paused:
                self._complete_written()

    def _write_now(self, data: bytes | bytearray, units: list[bytes] | None = None) -> None:
        self.stats["bytes_tx"] += len(data)
        self.tx_ns = time.perf_counter_ns()
        if self.frame_listeners:
            self._show_rx()           # what arrived first is shown first
            for frame in self._tcp.data("tx", units or [bytes(data)]):
                self._emit("tx", frame, self.tx_ns)
        else:
            self._tcp.skip("tx", len(data))
        self._stream.write(data)

    def _received_unit(self, unit: bytes) -> None:
        """Keep a startup frame or FPDU for the listeners, or just count its octets."""
        if self.frame_listeners:
            self._rx_units.append(unit)
        else:
            self._tcp.skip("rx", len(unit))

    def _show_rx(self) -> None:
        if self._rx_units:
            units, self._rx_units = self._rx_units, []
            for frame in self._tcp.data("rx", units):
                self._emit("rx", frame, self.rx_ns)

    def _emit(self, direction: str, frame: bytes, ns: int = 0) -> None:
        self.stats["frames_" + direction] += 1
        self.frame(direction, frame, ns)

    def _close_transport(self, error: ConnectionLost) -> None:
        self._flush()
        if self._tp is not None and not self._tp.is_closing():
            if self.frame_listeners:
                self._emit("tx", self._tcp.fin("tx"))
            self._tp.close()
        self.lost(error)

    def abort(self, reason: str) -> None:
        """RDMAP Terminate (catastrophic error, localized to this stream), then the end of
        the stream; what TCP could not deliver yet is discarded (a reset)."""
        self._flush()
        backed_up = self._tp is not None and self._tp.get_write_buffer_size() > 0
        self._terminate(_Fatal(w.LAYER_RDMAP, w.RDMAP_OPERATION, 0x07, reason))
        if backed_up and self._tp is not None:
            self._tp.abort()
        self.lost(ConnectionLost(reason))

    async def _shutdown(self) -> None:
        """Orderly close: what is queued goes out, then FIN (RFC 5044 s7.3 leaves the
        ending of a stream to the LLP)."""
        self._phase = "closed"
        self._close_transport(ConnectionLost("closed locally", how="local"))
        try:
            await asyncio.wait_for(self._gone.wait(), 5)
        except TimeoutError:
            self._stream.abort()


class IwarpListener:
    """Accepts iWARP connections; ``on_connect`` runs once a peer's MPA set-up is done."""

    def __init__(self, server: asyncio.Server, address: Address) -> None:
        self._server = server
        self.address = address
        self.tasks: set[asyncio.Task] = set()
        self.half_open: HalfOpen | None = None

    def close(self) -> None:
        self._server.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed()


def _emss(transport: asyncio.BaseTransport) -> int:
    """The connection's effective MSS, from which RFC 5044 s7.1 derives the MULPDU
    (65483 on loopback, about 1448 on Ethernet), as an RNIC takes it from its TCP."""
    sock = transport.get_extra_info("socket")
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
    except OSError:
        return DEFAULT_MSS


def _liveness(transport: asyncio.BaseTransport, keepalive: float, user_timeout: float) -> None:
    """TCP keepalive after ``keepalive`` idle seconds (three probes ``user_timeout`` / 3
    apart) and TCP_USER_TIMEOUT (RFC 5482): data unacknowledged for ``user_timeout``
    seconds ends the connection, so a peer that vanished without FIN or RST is noticed
    whether or not we were sending. 0 leaves the kernel's defaults."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        if keepalive > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(keepalive)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL,
                            max(1, round((user_timeout or keepalive) / 3)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        if user_timeout > 0:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round(user_timeout * 1000))
    except OSError:
        pass


def _options(recv_size: int = 4096, posted: int = 0, crc: bool = True, markers: bool = False,
             mss: int | None = None, ird: int = 16, ord: int = 16,
             frame_listeners: Iterable = (), connect_timeout: float = 10.0,
             mpa_timeout: float = 10.0, keepalive: float = 0.0, user_timeout: float = 0.0,
             half_open: HalfOpen | None = None) -> tuple[dict, float, float]:
    """QP options, the connect timeout, and a listener's MPA deadline: a connection whose
    MPA set-up (RTR included) is not done ``mpa_timeout`` seconds after its TCP handshake
    is closed. ``keepalive`` and ``user_timeout``: see ``_liveness``; ``half_open``: the
    listener's cap on connections in set-up (``rnic/admission.py``)."""
    return ({"recv_size": recv_size, "posted": posted, "crc": crc, "markers": markers, "mss": mss,
             "ird": ird, "ord": ord, "frame_listeners": tuple(frame_listeners),
             "keepalive": keepalive, "user_timeout": user_timeout, "half_open": half_open},
            connect_timeout, mpa_timeout)


async def connect(host: str, port: int, memory: MemoryTable, **options) -> IwarpQP:
    """TCP connect, MPA Request/Reply and RTR; returns a ready queue pair.

    A listener ends the set-ups beyond its half-open caps before it says a word; like a
    RoCEv2 CM, which sends its REQ again, the connect tries again after a jittered
    backoff until ``connect_timeout`` (a refused connect, nothing listening, is final,
    and so is anything the listener answered)."""
    qp_options, timeout, _ = _options(**options)
    loop = asyncio.get_running_loop()
    qp: IwarpQP | None = None

    def factory() -> IwarpQP:
        nonlocal qp
        qp = IwarpQP(memory, active=True, **qp_options)
        return qp

    backoff = RETRY_FIRST
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    _, made = await loop.create_connection(factory, host, port)
                    await made.ready
                    return made
                except (ConnectionResetError, ConnectionLost):
                    if qp is None or qp.stats["bytes_rx"]:
                        raise           # the listener said something: its word is final
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(2 * backoff, RETRY_MOST)
    except BaseException:
        if qp is not None and qp._tp is not None:
            qp._tp.abort()
        raise


async def listen(host: str, port: int, memory: MemoryTable,
                 on_connect: Callable[[IwarpQP], Coroutine[Any, Any, None]], **options) -> IwarpListener:
    """Listen on ``host:port`` (port 0 picks one: see ``.address``)."""
    qp_options, _, mpa_timeout = _options(**options)
    half_open = qp_options["half_open"]
    loop = asyncio.get_running_loop()
    listener: IwarpListener

    def accepted(qp: IwarpQP, ready: asyncio.Future) -> None:
        if not ready.cancelled() and ready.exception() is None:
            task = loop.create_task(on_connect(qp))
            listener.tasks.add(task)
            task.add_done_callback(listener.tasks.discard)

    def late(qp: IwarpQP) -> None:
        if not qp.ready.done():
            if half_open is not None:
                half_open.refused["mpa_timeout"] += 1
            qp._abort_setup(f"MPA set-up not done within {mpa_timeout:g} s")

    def factory() -> IwarpQP:
        qp = IwarpQP(memory, active=False, **qp_options)
        qp.ready.add_done_callback(lambda ready: accepted(qp, ready))
        handle = loop.call_later(mpa_timeout, late, qp)
        qp.ready.add_done_callback(lambda _: handle.cancel())
        return qp

    server = await loop.create_server(factory, host, port)
    bound = server.sockets[0].getsockname()
    listener = IwarpListener(server, Address("iwarp", bound[0], bound[1]))
    listener.half_open = half_open
    return listener
