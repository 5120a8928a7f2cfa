"""The RoCEv2 reliable connection of the soft RNIC: requester and responder of one QP.

``RoceQP`` is the RC requester and responder of IB vol. 1 chapter 9 (sections cited
below); its datagrams come and go through the ``Device`` of ``roce.py``. Where the
specification leaves a choice, this implementation:

- sends no end-to-end credits (AETH credit field 0x1F, "invalid"); a Send without a posted
  receive gets an RNR NAK (9.7.5.2.8) and is retried after the RNR timer;
- limits the packets in flight to ``window`` PSNs (a Read counts its response packets);
- sets AckReq on the last packet of a message and every ``ACK_EVERY`` packets within one,
  and the responder answers with one ACK per batch of datagrams (9.7.5.1.1 coalescing);
- retransmits go-back-N from the oldest unacknowledged PSN after ``ack_timeout``, doubling
  per consecutive timeout up to 16 times the base, failing after ``retry_count`` (9.7.6);
  a Read whose responses stopped short is re-issued for the rest (9.7.5.1.3);
- goes to the error state on both ends after a NAK other than sequence error / RNR, as
  Linux rxe does for class A and C responder errors (9.9.3.1): the requester sends DREQ;
- keeps the results of the last 1024 atomics for duplicates (9.4.5, 9.7.5.1.6).
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..wire import roce as w
from ..wire.roce import MASK24, psn_diff
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

if TYPE_CHECKING:
    from .roce import Device

MTUS = (256, 512, 1024, 2048, 4096)
ACK_EVERY = 16            # AckReq within long messages, so the window keeps moving
ATOMIC_CACHE = 1024       # saved atomic results for duplicate requests
CM_INTERVAL = 0.25        # CM MAD retransmission interval, seconds

_SEND, _WRITE, _READ, _ATOMIC = range(4)
# opcodes of a message's packets by position: first, middle, last, only (IB 9.2.1)
_CODES = {
    (_SEND, None): (w.SEND_FIRST, w.SEND_MIDDLE, w.SEND_LAST, w.SEND_ONLY),
    (_SEND, "imm"): (w.SEND_FIRST, w.SEND_MIDDLE, w.SEND_LAST_IMM, w.SEND_ONLY_IMM),
    (_SEND, "inv"): (w.SEND_FIRST, w.SEND_MIDDLE, w.SEND_LAST_INV, w.SEND_ONLY_INV),
    (_WRITE, None): (w.WRITE_FIRST, w.WRITE_MIDDLE, w.WRITE_LAST, w.WRITE_ONLY),
    (_WRITE, "imm"): (w.WRITE_FIRST, w.WRITE_MIDDLE, w.WRITE_LAST_IMM, w.WRITE_ONLY_IMM),
}
_SEND_START = frozenset((w.SEND_FIRST, w.SEND_ONLY, w.SEND_ONLY_IMM, w.SEND_ONLY_INV))
_SEND_END = frozenset((w.SEND_LAST, w.SEND_LAST_IMM, w.SEND_LAST_INV, w.SEND_ONLY,
                       w.SEND_ONLY_IMM, w.SEND_ONLY_INV))
_WRITE_START = frozenset((w.WRITE_FIRST, w.WRITE_ONLY, w.WRITE_ONLY_IMM))
_WRITE_END = frozenset((w.WRITE_LAST, w.WRITE_LAST_IMM, w.WRITE_ONLY, w.WRITE_ONLY_IMM))
_WITH_IMM = frozenset((w.SEND_LAST_IMM, w.SEND_ONLY_IMM, w.WRITE_LAST_IMM, w.WRITE_ONLY_IMM))
_WITH_INV = frozenset((w.SEND_LAST_INV, w.SEND_ONLY_INV))
_NAK_NAMES = {w.NAK_INVALID_REQUEST: "invalid request", w.NAK_REMOTE_ACCESS:
              "remote access error", w.NAK_REMOTE_OP: "remote operational error"}


class _Op:
    """A posted work request with its PSN range in the send queue."""

    __slots__ = ("codes", "count", "data", "first", "got", "kind", "sink", "tail", "wr")

    def __init__(self, wr: WorkRequest, kind: int, first: int, count: int) -> None:
        self.wr, self.kind, self.first, self.count = wr, kind, first, count
        self.data = memoryview(wr.payload)
        self.codes: tuple = ()
        self.tail: int | None = None     # ImmDt or IETH of the last packet
        self.sink: ReadSink | None = None
        self.got = 0                     # Read Response packets received in order


class RoceQP(QueuePair):
    """One RC queue pair on a ``Device``."""

    transport = "roce"
    masked_atomics = False

    def __init__(self, memory: MemoryTable, device: Device, *, recv_size: int = 4096,
                 posted: int = 0, mtu: int = 1024, ack_timeout: float = 0.05, retry_count: int = 7,
                 rnr_retry: int = 7, rnr_timer: int = 16, window: int = 128,
                 frame_listeners: Iterable = ()) -> None:
        super().__init__(memory, recv_size=recv_size, posted=posted)
        if mtu not in MTUS:
            raise ValueError(f"mtu must be one of {MTUS}")
        self.frame_listeners.extend(frame_listeners)
        self.mtu, self.ack_timeout, self.retry_count = mtu, ack_timeout, retry_count
        self.rnr_retry, self.rnr_timer, self.window = rnr_retry, rnr_timer, window
        self._dev = device
        self._loop = device.loop
        self.qpn = device.attach(self)
        self.local = device.address
        self.comm_id = secrets.randbits(32)
        self.remote_comm_id = 0
        self.remote_qpn = 0
        self.established = False
        self.on_established: Callable[[RoceQP], None] | None = None
        self._cm_state = "setup"        # setup, open, closing, closed
        self._drep: asyncio.Future | None = None
        self._tx: w.Path | None = None
        self._rx: w.Path | None = None
        self._rx_from: tuple[str, int] | None = None   # the source _rx is for
        # requester (IB 9.7.4): PSNs assigned, sent, acknowledged
        self.start_psn = secrets.randbits(24)
        self._npsn = self._spsn = self._una = self._sent = self.start_psn
        self._sq: deque[_Op] = deque()
        self._cursor = 0                # index in _sq of the op holding _spsn
        self._retries = 0
        self._rnr_left = rnr_retry
        self._rnr_wait = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._gap: int | None = None    # Read Response PSN already re-requested
        # responder (IB 9.7.5)
        self._epsn = 0
        self._msn = 0
        self._ack_due = False
        self._nak_gap = False           # a NAK was sent for _epsn: once per gap (9.7.5.2.1)
        self._fatal: tuple[int, int] | None = None
        self._atomics: dict[int, int] = {}
        self._rx_kind: int | None = None
        self._chunks: list[bytes] = []
        self._rx_len = 0
        self._w_stag = self._w_va = self._w_left = 0

    # -- set-up --------------------------------------------------------------------------

    def setup(self, remote: tuple[str, int], remote_qpn: int, remote_psn: int,
              mtu: int) -> None:
        """Ready to receive (RTR) and send (RTS) once the CM exchange gave the peer's QP.

        ``remote`` is the peer's (IP, RoCEv2 UDP port): every packet goes there, whatever
        source port the peer's packets come from. Each side's CM message carries the PSN
        it will receive with, so we send from the peer's ``remote_psn`` and expect our own
        ``start_psn``: what Linux's CM does for every device (ib_send_cm_req takes the REQ's
        Starting PSN as the active side's receive PSN, cm_req_handler as the passive
        side's send PSN, the REP's likewise), as rxe captures show. The path MTU is the
        REQ's for both ends, as the path record it names is shared (IB 12.6.5); a
        listener's own ``mtu`` option has no say, as with Linux's CM."""
        self.remote = remote
        self.remote_qpn = remote_qpn
        self._epsn = self.start_psn
        self._npsn = self._spsn = self._una = self._sent = remote_psn
        self.mtu = mtu
        self._tx = w.Path(self.local, remote)
        self._rx = w.Path(remote, self.local)
        self._rx_from = remote

    def establish(self) -> None:
        """RTU received, or the first packet from the peer (IB 12.9.8.3: communication
        established)."""
        if not self.established:
            self.established = True
            self._cm_state = "open"
            if self.on_established is not None:
                self.on_established(self)

    # -- sending packets ----------------------------------------------------------------

    def _out(self, parts: list, pad: int) -> None:
        assert self._tx is not None, "no path before connect()"
        parts = w.seal(self._tx, parts, pad)
        self.tx_ns = time.perf_counter_ns()
        if self.frame_listeners:     # first: a capture's time is the send's, not after it
            self.frame("tx", self._tx.frame(b"".join(parts)), self.tx_ns)
        self._dev.send(parts, self.remote)
        self.stats["frames_tx"] += 1

    def _send_aeth(self, psn: int, syndrome: int) -> None:
        """ACK, RNR NAK or NAK (IB 9.7.5.2): AETH with our MSN."""
        self._out([w.BTH_U32.pack(w.ACKNOWLEDGE, 0, w.DEFAULT_PKEY, self.remote_qpn, psn,
                                  syndrome << 24 | self._msn)], 0)

    # -- requester side (IB 9.7.4, 9.7.5.1) ---------------------------------------------

    def _transmit(self, wr: WorkRequest) -> None:
        verb = wr.verb
        if verb is Verb.SEND or verb is Verb.WRITE:
            kind = _SEND if verb is Verb.SEND else _WRITE
            if wr.imm is not None and wr.invalidate is not None:
                self.complete(wr, error=ValueError("no opcode carries both ImmDt and IETH"))
                return
            count = max(1, -(-len(wr.payload) // self.mtu))
        elif verb is Verb.READ:
            kind, count = _READ, max(1, -(-wr.length // self.mtu))
        else:
            kind, count = _ATOMIC, 1
        op = _Op(wr, kind, self._npsn, count)
        if kind == _READ:
            op.sink = ReadSink(wr.length)
        elif kind != _ATOMIC:
            extra = "inv" if wr.invalidate is not None and kind == _SEND else (
                "imm" if wr.imm is not None else None)
            op.codes = _CODES[kind, extra]
            op.tail = wr.invalidate if extra == "inv" else wr.imm
        self._npsn = (self._npsn + count) & MASK24
        self._sq.append(op)
        self._pump()

    def _pump(self) -> None:
        """Transmit from ``_spsn`` while the window allows (IB 9.7.4.1)."""
        if self.error is not None or self._rnr_wait:
            return
        idle = self._spsn == self._una
        sq = self._sq
        while self._spsn != self._npsn and psn_diff(self._spsn, self._una) < self.window:
            op = sq[self._cursor]
            i = psn_diff(self._spsn, op.first)
            if op.kind == _READ:
                self._send_read(op, i)
                i = op.count
            elif op.kind == _ATOMIC:
                self._send_atomic(op)
                i = 1
            else:
                self._send_segment(op, i)
                i += 1
            if not op.wr.sent_ns:         # its first packet, not a retransmission
                op.wr.sent_ns = self.tx_ns
            if psn_diff(self._spsn, self._sent) < 0:
                self.stats["retransmits"] += 1
            self._spsn = (op.first + i) & MASK24
            if psn_diff(self._spsn, self._sent) > 0:
                self._sent = self._spsn
            if i == op.count:
                self._cursor += 1
        if idle and self._spsn != self._una:
            self._arm()

    def _send_segment(self, op: _Op, i: int) -> None:
        """Packet ``i`` of a Send or RDMA Write, segmented at the path MTU (IB 9.7.2)."""
        mtu, n = self.mtu, op.count
        chunk = op.data[i * mtu:(i + 1) * mtu]
        pad = -len(chunk) & 3
        last = i == n - 1
        psn = (op.first + i) & MASK24
        word = psn | 0x80000000 if last or i % ACK_EVERY == ACK_EVERY - 1 else psn
        fl = pad << 4 | (0x80 if last and op.wr.solicited else 0)
        codes = op.codes
        opcode = codes[3] if n == 1 else codes[0] if i == 0 else codes[2] if last else codes[1]
        wr = op.wr
        if op.kind == _WRITE and i == 0:
            if opcode == w.WRITE_ONLY_IMM:
                head = w.BTH_RETH_IMM.pack(opcode, fl, w.DEFAULT_PKEY, self.remote_qpn, word,
                                           wr.offset, wr.stag, len(wr.payload), op.tail)
            else:
                head = w.BTH_RETH.pack(opcode, fl, w.DEFAULT_PKEY, self.remote_qpn, word,
                                       wr.offset, wr.stag, len(wr.payload))
        elif last and op.tail is not None:
            head = w.BTH_U32.pack(opcode, fl, w.DEFAULT_PKEY, self.remote_qpn, word, op.tail)
        else:
            head = w.BTH.pack(opcode, fl, w.DEFAULT_PKEY, self.remote_qpn, word)
        self._out([head, chunk] if chunk else [head], pad)

    def _send_read(self, op: _Op, i: int) -> None:
        """RDMA READ REQUEST for the octets from response packet ``i`` on (IB 9.4.3,
        9.7.5.1.3: a retried Read may ask for the remainder with a later PSN)."""
        done = i * self.mtu
        wr = op.wr
        self._out([w.BTH_RETH.pack(w.READ_REQUEST, 0, w.DEFAULT_PKEY, self.remote_qpn,
                                   (op.first + i) & MASK24 | 0x80000000, wr.offset + done,
                                   wr.stag, wr.length - done)], 0)

    def _send_atomic(self, op: _Op) -> None:
        wr = op.wr
        opcode = w.FETCH_ADD if wr.verb is Verb.FETCH_ADD else w.COMPARE_SWAP
        self._out([w.BTH_ATOMIC.pack(opcode, 0, w.DEFAULT_PKEY, self.remote_qpn,
                                     op.first | 0x80000000, wr.offset, wr.stag,
                                     wr.add & 0xFFFFFFFFFFFFFFFF,
                                     wr.compare & 0xFFFFFFFFFFFFFFFF)], 0)

    def _arm(self) -> None:
        """(Re)start the transport timer (IB 9.7.6.1.1) from now."""
        self._deadline = self._loop.time() + self.ack_timeout * min(1 << self._retries, 16)
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._loop.time() >= self._deadline and self.error is None:
            # Answers already queued are no timeout: a busy event loop (a peer in this very
            # process, or user code) may have run this timer before reading the socket.
            self._dev.poll()
        if self.error is not None or self._spsn == self._una:
            return
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
            return
        self._retries += 1
        if self._retries > self.retry_count:
            self.lost(ConnectionLost("transport retry counter exceeded (no ACK)", how="qp_error"))
            return
        self.stats["timeouts"] += 1
        self._go_back(self._una)
        self._pump()
        self._arm()

    def _go_back(self, psn: int) -> None:
        """Resume transmission at ``psn`` (go-back-N)."""
        self._spsn = psn
        self._gap = None
        for index, op in enumerate(self._sq):
            if psn_diff(psn, op.first) < op.count:
                self._cursor = index
                return
        self._cursor = len(self._sq)

    def _advance(self, una: int) -> None:
        """The oldest unacknowledged PSN moved forward: restart the timer and never
        transmit below it (a go-back-N that an acknowledgement overtook)."""
        self._una = una
        if psn_diff(self._spsn, una) < 0:
            self._go_back(una)
        self._retries = 0
        self._rnr_left = self.rnr_retry
        self._deadline = self._loop.time() + self.ack_timeout

    def _retire(self, op: _Op, result: object = None) -> None:
        """The oldest operation is answered: out of the send queue, complete it."""
        self._sq.popleft()
        self._cursor -= 1
        self._advance((op.first + op.count) & MASK24)
        self.complete(op.wr, result)

    def _ack_upto(self, psn: int) -> bool:
        """Everything up to ``psn`` is acknowledged (an ACK, or implied by a later response
        or NAK: IB 9.7.5.1.2). Completes Sends and Writes; False when a Read or atomic in
        that range still lacks its response, which therefore was lost."""
        if psn_diff(psn, self._una) < 0:
            return True
        sq = self._sq
        while sq:
            op = sq[0]
            d = psn_diff(psn, op.first)
            if d < 0:
                break
            if op.kind >= _READ:
                return False
            if d < op.count - 1:                # part of a long Send or Write
                self._advance((psn + 1) & MASK24)
                break
            self._retire(op)
        return True

    def _find(self, psn: int) -> _Op | None:
        for op in self._sq:
            d = psn_diff(psn, op.first)
            if d < 0:
                return None
            if d < op.count:
                return op
        return None

    def _on_ack(self, psn: int, syndrome: int) -> None:
        kind = syndrome >> 5
        if psn_diff(psn, self._npsn) >= 0:
            return                      # names nothing we sent
        if kind == 0:
            if not self._ack_upto(psn):
                self._go_back(self._una)     # a Read/atomic response was lost
            return
        if psn_diff(psn, self._una) < 0:
            return                      # stale
        if not self._ack_upto((psn - 1) & MASK24):
            self._go_back(self._una)
            return
        if kind == 1:
            self._on_rnr(psn, syndrome & 0x1F)
        elif kind == 3 and syndrome & 0x1F == w.NAK_PSN_SEQ:
            if not self._rnr_wait:
                self.stats["seq_naks"] += 1
                self._go_back(psn)
        elif kind == 3:
            why = _NAK_NAMES.get(syndrome & 0x1F, f"NAK code {syndrome & 0x1F}")
            op = self._find(psn)
            if op is not None:
                self.complete(op.wr, error=RemoteError(f"peer answered with NAK: {why}"))
            self.lost(ConnectionLost(f"queue pair in error state after NAK: {why}", how="qp_error"))

    def _on_rnr(self, psn: int, code: int) -> None:
        """RNR NAK: wait the responder's timer, then retry from ``psn`` (IB 9.7.5.2.8)."""
        self.stats["rnr_naks"] += 1
        if self.rnr_retry != 7:
            self._rnr_left -= 1
            if self._rnr_left < 0:
                op = self._find(psn)
                if op is not None:
                    self.complete(op.wr, error=RemoteError("RNR retry count exceeded"))
                self.lost(ConnectionLost("RNR retry count exceeded", how="qp_error"))
                return
        self._go_back(psn)
        self._rnr_wait = True
        self._loop.call_later(w.RNR_TIMER[code], self._rnr_resume)

    def _rnr_resume(self) -> None:
        self._rnr_wait = False
        self._deadline = self._loop.time() + self.ack_timeout
        self._pump()

    def _on_read_response(self, opcode: int, psn: int, payload: memoryview) -> None:
        op = self._find(psn)
        if op is None or op.kind != _READ:
            self.stats["stale_responses"] += 1
            return
        expect = (op.first + op.got) & MASK24
        if psn != expect:
            # a Read Response packet was lost: ask once for the rest (9.7.5.1.3)
            if (psn_diff(psn, expect) > 0 and self._gap != expect
                    and self._ack_upto((op.first - 1) & MASK24)):
                self._go_back(expect)
                self._gap = expect
                self.stats["read_gaps"] += 1
            return
        if op is not self._sq[0] and not self._ack_upto((op.first - 1) & MASK24):
            self._go_back(self._una)
            return
        assert op.sink is not None          # made when the Read was posted
        last = opcode == w.READ_RESP_LAST or opcode == w.READ_RESP_ONLY
        try:
            if last != (op.got == op.count - 1) or (not last and len(payload) != self.mtu):
                raise BadResponse(f"Read Response packet {op.got} of {op.count} is "
                                  f"{'last' if last else 'not last'}, {len(payload)} octets "
                                  f"at a path MTU of {self.mtu}")
            op.sink.place(op.got * self.mtu, payload, last)
        except BadResponse as exc:
            # IB 9.9.2.3: a bad response completes the Read in error, the QP goes to the
            # error state (our DREQ tells the peer)
            self.stats["bad_responses"] += 1
            self.complete(op.wr, error=exc)
            self.lost(ConnectionLost(f"queue pair in error state: {exc}", how="qp_error"))
            return
        op.got += 1
        self._gap = None
        if last:
            self._retire(op, op.sink.data)    # its own buffer: no copy
        else:
            self._advance((psn + 1) & MASK24)

    def _on_atomic_ack(self, psn: int, original: int) -> None:
        op = self._find(psn)
        if op is None or op.kind != _ATOMIC:
            self.stats["stale_responses"] += 1
            return
        if op is not self._sq[0] and not self._ack_upto((op.first - 1) & MASK24):
            self._go_back(self._una)
            return
        self._retire(op, original)

    # -- receiving (called by the Device) ------------------------------------------------

    def receive(self, data: memoryview, n: int) -> None:
        """One datagram with a good ICRC addressed to this QP."""
        opcode, fl, _pkey, _qpn, word = w.BTH.unpack_from(data)
        psn = word & MASK24
        if not self.established:
            if self.remote_qpn == 0:
                return
            self.establish()
        hdr = 12 + w.EXT_LEN.get(opcode, 4096)
        if hdr + 4 + (fl >> 4 & 3) > n or opcode == w.UD_SEND_ONLY:
            self.stats["malformed"] += 1
        elif opcode <= w.READ_REQUEST or opcode >= w.COMPARE_SWAP:
            self._on_request(data, n, opcode, fl, psn, word >> 31)
        elif self.error is not None:
            return
        elif opcode == w.ACKNOWLEDGE:
            self._on_ack(psn, data[12])
        elif opcode == w.ATOMIC_ACKNOWLEDGE:
            self._on_atomic_ack(psn, w.U64.unpack_from(data, 16)[0])
        else:
            self._on_read_response(opcode, psn, data[hdr:n - 4 - (fl >> 4 & 3)])

    def flush(self) -> None:
        """End of a receive batch: one coalesced ACK, then what the window admits."""
        if self.error is not None:
            return
        if self._ack_due:
            self._ack_due = False
            self._send_aeth((self._epsn - 1) & MASK24, w.SYN_ACK)
        if self._spsn != self._npsn:
            self._pump()

    # -- responder side (IB 9.7.5.2, 9.7.3) ---------------------------------------------

    def _on_request(self, data: memoryview, n: int, opcode: int, fl: int, psn: int,
                    ackreq: int) -> None:
        if self._fatal is not None:
            if psn == self._fatal[1]:
                self._send_aeth(psn, self._fatal[0])
            return
        if self.error is not None:
            return
        d = psn_diff(psn, self._epsn)
        if d > 0:
            if not self._nak_gap:     # IB 9.7.5.2.1: one NAK per sequence error
                self._nak_gap = True
                self.stats["naks_sent"] += 1
                self._send_aeth(self._epsn, w.SYN_NAK | w.NAK_PSN_SEQ)
            self.stats["out_of_sequence"] += 1
            return
        if d < 0:
            self._duplicate(data, opcode, psn)
            return
        payload = data[12 + w.EXT_LEN[opcode]:n - 4 - (fl >> 4 & 3)]
        if opcode <= w.SEND_ONLY_IMM or opcode in _WITH_INV:
            ok = self._recv_send(data, opcode, fl, psn, payload)
        elif opcode <= w.WRITE_ONLY_IMM:
            ok = self._recv_write(data, opcode, psn, payload)
        elif opcode == w.READ_REQUEST:
            ok = self._recv_read(data, psn)
        else:
            ok = self._recv_atomic(data, opcode, psn)
        if ok:
            self._nak_gap = False
            if opcode != w.READ_REQUEST:
                self._epsn = (self._epsn + 1) & MASK24
            if ackreq and (opcode < w.READ_REQUEST or opcode in _WITH_INV):
                self._ack_due = True

    def _rnr(self, psn: int) -> bool:
        """No receive posted: RNR NAK, the PSN stays expected (IB 9.7.5.2.8)."""
        self._nak_gap = True
        self.stats["rnr_naks_sent"] += 1
        self._send_aeth(psn, w.SYN_RNR | self.rnr_timer)
        return False

    def _error(self, psn: int, code: int, why: str) -> bool:
        """A class A or C responder error: NAK, then the error state (IB 9.9.3.1)."""
        self._fatal = (w.SYN_NAK | code, psn)
        self.stats["naks_sent"] += 1
        self._send_aeth(psn, w.SYN_NAK | code)
        self.lost(ConnectionLost(f"responder error: {why}", how="qp_error"))
        return False

    def _access_error(self, psn: int, exc: AccessError) -> bool:
        code = w.NAK_INVALID_REQUEST if exc.fault is Fault.MISALIGNED else w.NAK_REMOTE_ACCESS
        return self._error(psn, code, str(exc))

    def _recv_send(self, data: memoryview, opcode: int, fl: int, psn: int,
                   payload: memoryview) -> bool:
        mtu = self.mtu
        if opcode in _SEND_START:
            if self._rx_kind is not None:
                return self._error(psn, w.NAK_INVALID_REQUEST, "Send starts inside a message")
            if self.posted == 0:
                return self._rnr(psn)
        elif self._rx_kind != _SEND:
            return self._error(psn, w.NAK_INVALID_REQUEST, "Send continues no message")
        size = len(payload)
        if opcode not in _SEND_END:
            if size != mtu:
                return self._error(psn, w.NAK_INVALID_REQUEST, "Send packet not of path MTU")
            if self._rx_len + size > self.recv_size:
                return self._error(psn, w.NAK_INVALID_REQUEST, ReceiveError.TOO_LONG)
            self._rx_kind = _SEND
            self._chunks.append(bytes(payload))
            self._rx_len += size
            return True
        if size > mtu:
            return self._error(psn, w.NAK_INVALID_REQUEST, "Send packet beyond path MTU")
        extra = w.U32.unpack_from(data, 12)[0] if opcode in _WITH_IMM or opcode in _WITH_INV \
            else None
        message = b"".join(self._chunks) + payload if self._chunks else bytes(payload)
        try:
            self.deliver_send(message, invalidate=extra if opcode in _WITH_INV else None,
                              solicited=bool(fl & 0x80),
                              imm=extra if opcode in _WITH_IMM else None)
        except ReceiveError as exc:
            if exc.reason == ReceiveError.NO_BUFFER:
                return self._rnr(psn)
            return self._error(psn, w.NAK_INVALID_REQUEST, exc.reason)
        self._rx_kind, self._chunks, self._rx_len = None, [], 0
        self._msn = (self._msn + 1) & MASK24
        return True

    def _recv_write(self, data: memoryview, opcode: int, psn: int,
                    payload: memoryview) -> bool:
        size = len(payload)
        if opcode in _WRITE_START:
            if self._rx_kind is not None:
                return self._error(psn, w.NAK_INVALID_REQUEST, "Write starts inside a message")
            va, stag, length = w.RETH.unpack_from(data, 12)
            if length:     # a zero-length Write names no memory: no R_Key check (IB 9.4.1)
                try:
                    self.check_write(stag, va, length)
                except AccessError as exc:
                    return self._access_error(psn, exc)
            self._w_stag, self._w_va, self._w_left = stag, va, length
        elif self._rx_kind != _WRITE:
            return self._error(psn, w.NAK_INVALID_REQUEST, "Write continues no message")
        last = opcode in _WRITE_END
        if size > self._w_left or (size != self._w_left if last else size != self.mtu):
            return self._error(psn, w.NAK_INVALID_REQUEST, "Write length mismatch")
        if opcode in _WITH_IMM and self.posted == 0:
            return self._rnr(psn)
        if size:
            try:
                self.serve_write(self._w_stag, self._w_va, payload)
            except AccessError as exc:
                return self._access_error(psn, exc)
        self._w_va += size
        self._w_left -= size
        if not last:
            self._rx_kind = _WRITE
            return True
        self._rx_kind = None
        if opcode in _WITH_IMM:
            self.deliver_write_imm(
                w.U32.unpack_from(data, 28 if opcode == w.WRITE_ONLY_IMM else 12)[0])
        self._msn = (self._msn + 1) & MASK24
        return True

    def _recv_read(self, data: memoryview, psn: int) -> bool:
        if self._rx_kind is not None:
            return self._error(psn, w.NAK_INVALID_REQUEST, "Read inside a message")
        va, stag, length = w.RETH.unpack_from(data, 12)
        try:
            octets = self.serve_read(stag, va, length) if length else b""
        except AccessError as exc:
            return self._access_error(psn, exc)
        self._msn = (self._msn + 1) & MASK24
        count = max(1, -(-length // self.mtu))
        self._epsn = (self._epsn + count) & MASK24
        self._ack_due = False         # the response acknowledges everything before it
        self._respond_read(psn, octets)
        return True

    def _respond_read(self, psn: int, octets: bytes) -> None:
        """READ RESPONSE FIRST/MIDDLE/LAST/ONLY at the request's PSNs (IB 9.7.5.2.5)."""
        mtu, view = self.mtu, memoryview(octets)
        count = max(1, -(-len(octets) // mtu))
        aeth = w.SYN_ACK << 24 | self._msn
        for i in range(count):
            chunk = view[i * mtu:(i + 1) * mtu]
            pad = -len(chunk) & 3
            p = (psn + i) & MASK24
            if count == 1:
                opcode = w.READ_RESP_ONLY
            elif i == 0:
                opcode = w.READ_RESP_FIRST
            elif i == count - 1:
                opcode = w.READ_RESP_LAST
            else:
                opcode = w.READ_RESP_MIDDLE
            if opcode == w.READ_RESP_MIDDLE:
                head = w.BTH.pack(opcode, pad << 4, w.DEFAULT_PKEY, self.remote_qpn, p)
            else:
                head = w.BTH_U32.pack(opcode, pad << 4, w.DEFAULT_PKEY, self.remote_qpn, p, aeth)
            self._out([head, chunk] if chunk else [head], pad)

    def _recv_atomic(self, data: memoryview, opcode: int, psn: int) -> bool:
        if self._rx_kind is not None:
            return self._error(psn, w.NAK_INVALID_REQUEST, "atomic inside a message")
        va, stag, swap_add, compare = w.ATOMIC_ETH.unpack_from(data, 12)
        try:
            if opcode == w.FETCH_ADD:
                original = self.serve_fetch_add(stag, va, swap_add, None)
            else:
                original = self.serve_compare_swap(stag, va, compare, swap_add)
        except AccessError as exc:
            return self._access_error(psn, exc)
        atomics = self._atomics
        atomics[psn] = original
        if len(atomics) > ATOMIC_CACHE:
            del atomics[next(iter(atomics))]
        self._msn = (self._msn + 1) & MASK24
        self._ack_due = False
        self._send_atomic_ack(psn, original)
        return True

    def _send_atomic_ack(self, psn: int, original: int) -> None:
        self._out([w.BTH_AETH_ATOMICACK.pack(w.ATOMIC_ACKNOWLEDGE, 0, w.DEFAULT_PKEY,
                                             self.remote_qpn, psn,
                                             w.SYN_ACK << 24 | self._msn, original)], 0)

    def _duplicate(self, data: memoryview, opcode: int, psn: int) -> None:
        """A request below the expected PSN (IB 9.7.5.2.2): Sends and Writes are only
        acknowledged again, a Read is executed again, an atomic answered from the cache."""
        self.stats["duplicates"] += 1
        if opcode == w.READ_REQUEST:
            va, stag, length = w.RETH.unpack_from(data, 12)
            try:
                octets = self.serve_read(stag, va, length) if length else b""
            except AccessError as exc:
                self._access_error(psn, exc)
                return
            self._respond_read(psn, octets)
        elif opcode == w.FETCH_ADD or opcode == w.COMPARE_SWAP:
            original = self._atomics.get(psn)
            if original is not None:     # never executed twice; unknown ones are dropped
                self._send_atomic_ack(psn, original)
        else:
            self._ack_due = True

    # -- connection ----------------------------------------------------------------------

    def lost(self, error: BaseException) -> None:
        """Error state (IB 10.3.1): everything outstanding fails; tell the peer by DREQ."""
        if self.error is not None:
            return
        super().lost(error)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # what was queued is flushed (IB 10.8.3.3): give its memory back now, not when
        # the device lets go of the QP
        self._sq.clear()
        self._cursor = 0
        self._npsn = self._spsn = self._una
        self._chunks, self._atomics = [], {}
        if self._cm_state == "open":
            self._cm_state = "closing"
            self._dev.send_dreq(self)
            self._loop.call_later(2.0, self._dev.detach, self)
        elif self._cm_state == "setup":
            self._dev.detach(self)

    def peer_closed(self) -> None:
        """The peer sent DREQ (and got DREP). A DREQ that crosses ours ends our wait for
        DREP as well (IB 12.9.6: DREQ received in DREQ Sent, DREP and TimeWait)."""
        if self._drep is not None and not self._drep.done():
            self._drep.set_result(None)
        self._cm_state = "closed"
        self.lost(ConnectionLost("closed by peer (CM DREQ)", how="dreq"))
        self._dev.detach(self)

    async def _shutdown(self) -> None:
        """Drain what is posted (bounded), then DREQ and wait for DREP (IB 12.9.8.5)."""
        if self._sq and self.error is None:
            pending = [self.completion(op.wr) for op in self._sq]
            await asyncio.wait(pending, timeout=self.ack_timeout * 16 * (self.retry_count + 1))
            for future in pending:        # a refusal is the connection's end, seen elsewhere
                if future.done() and not future.cancelled():
                    future.exception()
        if self._cm_state == "open":
            self._cm_state = "closing"
            self._drep = self._loop.create_future()
            for _ in range(4):
                self._dev.send_dreq(self)
                done, _ = await asyncio.wait([self._drep], timeout=CM_INTERVAL)
                if done:
                    break
        self._cm_state = "closed"
        self._dev.detach(self)

