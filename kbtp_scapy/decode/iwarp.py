"""iWARP streams as frames arrive: TCP reassembly, MPA framing, DDP reassembly.

Each TCP direction is put back in sequence order (retransmissions add nothing, segments
after a hole wait for it), and its octets are framed as the MPA Request or Reply (RFC
5044 s7.1, RFC 6581) and then FPDUs (RFC 5044 s4), markers removed where the peer asked
for them (M flag) and CRC32c checked where either side asked for it (C flag). FPDUs give
DDP segments (RFC 5041), which make RDMAP messages (RFC 5040, RFC 7306): untagged ones by
queue, MSN and MO, tagged ones by STag and consecutive Tagged Offsets.

Memory per connection is bounded: octets after a hole are held up to
``MAX_OUT_OF_ORDER``; a hole is given up when the receiver has acknowledged the octets
the capture lacks (they were lost by the capture, not the network) or when that bound is
reached, and framing then resumes at the first segment that starts with a valid FPDU
(its CRC, or DDP/RDMAP versions and a segment-aligned end without CRC), as MPA-aware
senders (RFC 5044 s4.1, Linux siw, hardware RNICs) align FPDUs to segments. Incomplete
DDP messages are held up to ``MAX_PENDING`` octets. Nothing assumes the soft RNIC's
habits: MPA revision 1 or 2, markers and CRC either way, any ports and sequence numbers.

``IwarpStreams(sends_only=True)`` is what ``kbtp decode`` runs: tagged segments and
untagged ones other than Sends are skipped after their DDP header, and a Send that fits
one FPDU (the usual KBTP message) becomes a message without further bookkeeping.
``sends_only=False`` yields every RDMAP message with its header values, for
``builders.iwarp.iter_rdma_messages``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ..codec import looks_like_kbtp
from ..wire.iwarp import (
    ATOMIC_REQUEST,
    ATOMIC_RESPONSE,
    FLAG_C,
    FLAG_M,
    FLAG_R,
    READ_REQUEST,
    Startup,
    crc_ok,
    fpdu_wire_length,
    parse_startup,
    startup_length,
)
from ..wire.iwarp_defs import (
    DDP_TAGGED_LEN,
    DDP_UNTAGGED_LEN,
    INVALIDATE_OPCODES,
    MARKER_INTERVAL,
    MPA_REP_KEY,
    MPA_REQ_KEY,
    RDMAP_OPCODES,
    SEND_OPCODES,
    SOLICITED_OPCODES,
    Op,
)
from ..wire.message import RdmaMessage
from ..wire.mpa_markers import strip_markers
from .frames import address

MAX_OUT_OF_ORDER = 4 << 20      # octets held after a hole, per direction
MAX_PENDING = 16 << 20          # octets of incomplete DDP messages, per direction
MAX_CLOSED = 1 << 16            # connections remembered as not iWARP
MAX_UNFRAMED = 1 << 18          # octets searched for an FPDU start after a hole

_M32 = 0xFFFFFFFF
_FIN, _SYN, _RST, _ACK = 0x01, 0x02, 0x04, 0x10
_STARTUP, _FPDU, _RESYNC, _DEAD = range(4)
_KEYS = (MPA_REQ_KEY, MPA_REP_KEY)
_UNTAGGED = struct.Struct("!IIII")          # Invalidate STag, QN, MSN, MO (RFC 5041 s4.3)
_TAGGED = struct.Struct("!IQ")              # STag, TO (RFC 5041 s4.2)
_SENDS = frozenset(int(op) for op in SEND_OPCODES)


# --- DDP segments into RDMAP messages --------------------------------------------------

@dataclass
class Segment:
    """One DDP segment as read from an FPDU; ``frames`` carried its octets."""

    tagged: bool
    last: bool
    opcode: int
    stag: int = 0
    to: int = 0
    inv_stag: int = 0
    qn: int = 0
    msn: int = 0
    mo: int = 0
    data: bytes = b""
    crc_ok: bool | None = None
    frames: list[int] = field(default_factory=list)
    time: float | None = None


def parse_ulpdu(ulpdu: bytes) -> Segment | None:
    """Read a DDP/RDMAP header (RFC 5041 s4, RFC 5040 s4), or None if it is cut short."""
    if len(ulpdu) < 2:
        return None
    tagged, last, opcode = bool(ulpdu[0] & 0x80), bool(ulpdu[0] & 0x40), ulpdu[1] & 0x0F
    if tagged and len(ulpdu) >= DDP_TAGGED_LEN:
        stag, to = _TAGGED.unpack_from(ulpdu, 2)
        return Segment(True, last, opcode, stag=stag, to=to, data=ulpdu[DDP_TAGGED_LEN:])
    if not tagged and len(ulpdu) >= DDP_UNTAGGED_LEN:
        inv, qn, msn, mo = _UNTAGGED.unpack_from(ulpdu, 2)
        return Segment(False, last, opcode, inv_stag=inv, qn=qn, msn=msn, mo=mo,
                       data=ulpdu[DDP_UNTAGGED_LEN:])
    return None


@dataclass
class Message:
    """Segments of one RDMA message put back together."""

    first: Segment
    data: bytes
    frames: list[int]
    crc_ok: bool | None
    complete: bool
    segments: int
    time: float | None = None


def _merge(segs: list[Segment], complete: bool) -> Message:
    crcs = [s.crc_ok for s in segs if s.crc_ok is not None]
    first = min(segs, key=lambda s: s.to if s.tagged else s.mo)
    latest = max(segs, key=lambda s: s.frames[-1] if s.frames else 0)
    return Message(first=first, data=b"".join(s.data for s in segs),
                   frames=sorted({f for s in segs for f in s.frames}),
                   crc_ok=all(crcs) if crcs else None, complete=complete,
                   segments=len(segs), time=latest.time)


class Assembler:
    """Collects segments into messages: untagged by (QN, MSN) and MO, tagged by STag
    and consecutive TOs (RFC 5041). One instance per stream direction; ``size`` is the
    octets it holds."""

    def __init__(self) -> None:
        self._untagged: dict[tuple[int, int], dict[int, Segment]] = {}
        self._tagged: dict[int, list[Segment]] = {}
        self.size = 0

    def holds(self, qn: int, msn: int) -> bool:
        """Whether segments of that untagged message are waiting."""
        return (qn, msn) in self._untagged

    def add(self, seg: Segment) -> list[Message]:
        self.size += len(seg.data)
        if seg.tagged:
            return self._add_tagged(seg)
        key = (seg.qn, seg.msn)
        parts = self._untagged.setdefault(key, {})
        parts[seg.mo] = seg
        ordered = [parts[mo] for mo in sorted(parts)]
        ends = [s.mo + len(s.data) for s in ordered if s.last]
        pos = 0
        for s in ordered:
            if s.mo != pos:
                return []
            pos += len(s.data)
        if not ends or pos != ends[0]:
            return []
        del self._untagged[key]
        self.size -= pos
        return [_merge(ordered, True)]

    def _add_tagged(self, seg: Segment) -> list[Message]:
        done = []
        run = self._tagged.get(seg.stag)
        if run and seg.to != run[-1].to + len(run[-1].data):
            done.append(self._pop_tagged(seg.stag, False))
        self._tagged.setdefault(seg.stag, []).append(seg)
        if seg.last:
            done.append(self._pop_tagged(seg.stag, True))
        return done

    def _pop_tagged(self, stag: int, complete: bool) -> Message:
        run = self._tagged.pop(stag)
        self.size -= sum(len(s.data) for s in run)
        return _merge(run, complete)

    def flush(self) -> list[Message]:
        """Whatever is still incomplete, for a stream that ended early."""
        left = [_merge([p[mo] for mo in sorted(p)], False) for p in self._untagged.values()]
        left += [_merge(run, False) for run in self._tagged.values()]
        self._untagged.clear()
        self._tagged.clear()
        self.size = 0
        return left


_KINDS = {
    Op.WRITE: "write", Op.READ_REQUEST: "read_request", Op.READ_RESPONSE: "read_response",
    Op.SEND: "send", Op.SEND_SE: "send", Op.SEND_INV: "send_inv",
    Op.SEND_SE_INV: "send_inv", Op.TERMINATE: "terminate", Op.IMMEDIATE: "immediate",
    Op.IMMEDIATE_SE: "immediate", Op.ATOMIC_REQUEST: "atomic_request",
    Op.ATOMIC_RESPONSE: "atomic_response",
}


def _body_info(op: Op, body: bytes) -> dict:
    """Header values of the RDMAP messages that carry a fixed body (RFC 5040 s4.4, s4.8;
    RFC 7306 s5), named as the Scapy layers name them; {} when the body is cut short."""
    if op == Op.READ_REQUEST and len(body) >= READ_REQUEST.size:
        return dict(zip(("sink_stag", "sink_to", "read_size", "src_stag", "src_to"),
                        READ_REQUEST.unpack_from(body)))
    if op == Op.ATOMIC_REQUEST and len(body) >= ATOMIC_REQUEST.size:
        word, *rest = ATOMIC_REQUEST.unpack_from(body)
        return {"reserved": word >> 4, "aopcode": word & 0xF,
                **dict(zip(("req_id", "remote_stag", "remote_to", "data", "mask",
                            "compare_data", "compare_mask"), rest))}
    if op == Op.ATOMIC_RESPONSE and len(body) >= ATOMIC_RESPONSE.size:
        return dict(zip(("orig_req_id", "orig_data"), ATOMIC_RESPONSE.unpack_from(body)))
    if op in (Op.IMMEDIATE, Op.IMMEDIATE_SE) and len(body) >= 8:
        return {"imm": int.from_bytes(body[:8], "big")}
    if op == Op.TERMINATE and len(body) >= 4:
        ctrl = int.from_bytes(body[:4], "big")
        info = {"layer": ctrl >> 28, "etype": ctrl >> 24 & 0xF, "errcode": ctrl >> 16 & 0xFF,
                "hdrct_m": ctrl >> 15 & 1, "hdrct_d": ctrl >> 14 & 1, "hdrct_r": ctrl >> 13 & 1,
                "rsvd": ctrl & 0x1FFF}
        if info["hdrct_d"] and len(body) >= 6:
            info["ddp_seg_len"] = int.from_bytes(body[4:6], "big")
        return info
    return {}


def to_rdma_message(msg: Message, conn: tuple) -> RdmaMessage | None:
    """The transport-neutral view of a reassembled message; None for opcodes no RFC defines."""
    first = msg.first
    if first.opcode not in _KINDS:
        return None
    op = Op(first.opcode)
    info: dict = {"opcode": RDMAP_OPCODES[op], "tagged": first.tagged,
                  "solicited": op in SOLICITED_OPCODES, "crc_ok": msg.crc_ok,
                  "complete": msg.complete, "segments": msg.segments}
    if first.tagged:
        info.update(stag=first.stag, to=first.to)
    else:
        info.update(qn=first.qn, msn=first.msn)
    if op in INVALIDATE_OPCODES:
        info["inv_stag"] = first.inv_stag
    payload = msg.data
    if op not in (Op.WRITE, Op.READ_RESPONSE) and op not in SEND_OPCODES:
        info.update(_body_info(op, payload))
        payload = b""
    return RdmaMessage("iwarp", _KINDS[op], msg.frames, conn, payload, info, msg.time)


# --- one direction of a TCP connection ---------------------------------------------------

def _signed(d: int) -> int:
    d &= _M32
    return d - (1 << 32) if d >= 1 << 31 else d


class _Flow:
    """One direction of a TCP connection: sequence state, unframed octets, MPA state."""

    __slots__ = ("asm", "base", "buf", "conn", "crc", "fin", "fpdu_at", "key", "markers", "off",
                 "ooo", "ooo_size", "peer", "seq", "skip", "spans", "startup", "state")

    def __init__(self, key: tuple, conn: tuple, seq: int) -> None:
        self.key = key                  # (src, sport, dst, dport), addresses as octets
        self.conn = conn                # ((src, sport), (dst, dport)), addresses as text
        self.seq = seq                  # next expected TCP sequence number ...
        self.off = 0                    # ... and its offset in the stream
        self.ooo: dict[int, tuple[bytes, int, float]] = {}   # offset -> segment after a hole
        self.ooo_size = 0
        self.buf = bytearray()          # in-order octets not framed yet, from offset base
        self.base = 0
        self.spans: list[tuple[int, int, int, float]] = []   # start, end, frame, time
        self.state = _STARTUP
        self.startup: Startup | None = None   # its MPA Request or Reply
        self.peer: _Flow | None = None
        self.markers: bool | None = None  # decided at the first FPDU
        self.crc = False
        self.fpdu_at = 0                # stream offset of the first FPDU (markers count from it)
        self.asm = Assembler()
        self.skip: set[tuple[int, int]] = set()   # (QN, MSN) of Sends that are not KBTP
        self.fin = False


class IwarpStreams:
    """The iWARP connections of a capture, fed one TCP segment at a time."""

    def __init__(self, sends_only: bool = True) -> None:
        self.sends_only = sends_only
        self._flows: dict[tuple, _Flow] = {}
        self._closed: dict[tuple, None] = {}     # not iWARP, or over: ignore their segments

    def segment(self, frame: int, time: float, src: bytes, dst: bytes, sport: int, dport: int,
                seq: int, ack: int, flags: int, data: bytes, start: int, end: int
                ) -> list[RdmaMessage] | None:
        """One TCP segment (payload ``data[start:end]``); the messages it completes."""
        key = (src, sport, dst, dport)
        flow = self._flows.get(key)
        out: list[RdmaMessage] = []
        if flags & _SYN:
            if flow is not None and flow.seq == (seq + 1) & _M32:
                return None                         # a retransmitted SYN
            if flow is not None:
                self._close(flow, out)
            self._closed.pop(key, None)
            flow = self._open(key, (seq + 1) & _M32)
        elif flow is None:
            if end <= start or key in self._closed or flags & _RST:
                if flags & _ACK:
                    self._acked(key, ack, out)
                return out or None
            flow = self._open(key, seq)            # a capture that starts mid-connection
        if end > start and flow.state != _DEAD:
            self._data(flow, seq, data[start:end], frame, time, out)
        if flags & _ACK:
            self._acked(key, ack, out)
        if flags & _RST:
            self._close(flow, out)
            if flow.peer is not None:
                self._close(flow.peer, out)
        elif flags & _FIN:
            flow.fin = True
            if flow.peer is None or flow.peer.fin:
                self._close(flow, out)
                if flow.peer is not None:
                    self._close(flow.peer, out)
        elif flow.state == _DEAD:
            self._forget(flow)
        return out or None

    def flush(self) -> list[RdmaMessage]:
        """Messages still incomplete when the capture ends."""
        out: list[RdmaMessage] = []
        for flow in list(self._flows.values()):
            self._close(flow, out)
        return out

    # -- connections ------------------------------------------------------------------------
    def _open(self, key: tuple, seq: int) -> _Flow:
        src, sport, dst, dport = key
        flow = self._flows[key] = _Flow(key, ((address(src), sport), (address(dst), dport)), seq)
        peer = self._flows.get((dst, dport, src, sport))
        if peer is not None:
            flow.peer, peer.peer = peer, flow
        return flow

    def _forget(self, flow: _Flow) -> None:
        key = flow.key
        if self._flows.get(key) is flow:
            del self._flows[key]
            self._closed[key] = None
            if len(self._closed) > MAX_CLOSED:
                del self._closed[next(iter(self._closed))]
        if flow.peer is not None and flow.peer.peer is flow:
            flow.peer.peer = None

    def _close(self, flow: _Flow, out: list) -> None:
        """The direction ends: octets after a hole are framed as far as they go, and what
        is still incomplete comes out as incomplete messages."""
        if flow.ooo and flow.state in (_FPDU, _RESYNC):
            self._gap(flow, min(flow.ooo), out)
        if flow.state in (_FPDU, _RESYNC):
            self._emit(flow, flow.asm.flush(), out)
        flow.state = _DEAD
        flow.buf, flow.spans, flow.ooo = bytearray(), [], {}
        self._forget(flow)

    # -- TCP ---------------------------------------------------------------------------------
    def _data(self, flow: _Flow, seq: int, data: bytes, frame: int, time: float, out: list) -> None:
        d = _signed(seq - flow.seq)
        if d == 0:
            self._append(flow, data, frame, time, out)
        elif d < 0:
            if -d < len(data):                  # a resend that also carries new octets
                self._append(flow, data[-d:], frame, time, out)
            else:
                return                          # a retransmission: nothing new
        else:
            at = flow.off + d
            if len(data) > len(flow.ooo.get(at, (b"",))[0]):
                flow.ooo_size += len(data) - len(flow.ooo.get(at, (b"",))[0])
                flow.ooo[at] = (data, frame, time)
            if flow.ooo_size > MAX_OUT_OF_ORDER:
                self._gap(flow, min(flow.ooo), out)
            return
        if flow.ooo:
            self._drain(flow, out)

    def _drain(self, flow: _Flow, out: list) -> None:
        """Segments held after a hole that the stream has now reached."""
        while flow.ooo:
            at = min(flow.ooo)
            if at > flow.off:
                return
            data, frame, time = flow.ooo.pop(at)
            flow.ooo_size -= len(data)
            if at + len(data) > flow.off:
                self._append(flow, data[flow.off - at:], frame, time, out)

    def _acked(self, key: tuple, ack: int, out: list) -> None:
        """The receiver acknowledged octets of the reverse direction the capture never
        showed while later ones wait: the capture lost them, stop waiting."""
        src, sport, dst, dport = key
        rev = self._flows.get((dst, dport, src, sport))
        if rev is not None and rev.ooo and _signed(ack - rev.seq) > 0:
            hole_end = rev.off + _signed(ack - rev.seq)
            if min(rev.ooo) <= hole_end:
                self._gap(rev, min(rev.ooo), out)

    def _gap(self, flow: _Flow, to: int, out: list) -> None:
        """Octets up to stream offset ``to`` are lost: drop what cannot be framed across
        the hole, resume at ``to`` and look for the next FPDU start."""
        flow.seq = (flow.seq + to - flow.off) & _M32
        flow.off = flow.base = to
        flow.buf, flow.spans = bytearray(), []
        if flow.state == _STARTUP:
            flow.state = _DEAD
        elif flow.state == _FPDU:
            flow.state = _RESYNC
        self._drain(flow, out)

    def _append(self, flow: _Flow, data: bytes, frame: int, time: float, out: list) -> None:
        start = flow.off
        flow.off += len(data)
        flow.seq = (flow.seq + len(data)) & _M32
        if flow.state == _DEAD:
            return
        flow.buf += data
        flow.spans.append((start, flow.off, frame, time))
        if flow.state == _STARTUP:
            self._startup(flow)
        if flow.state == _RESYNC:
            self._resync(flow)
        if flow.state == _FPDU:
            self._frame(flow, out)

    # -- MPA ---------------------------------------------------------------------------------
    def _startup(self, flow: _Flow) -> None:
        buf = flow.buf
        head = bytes(buf[:16])
        if not any(k.startswith(head) for k in _KEYS):
            flow.state = _DEAD
            return
        n = startup_length(buf)
        if n is None or len(buf) < n:
            return
        flow.startup = parse_startup(bytes(buf[:n]))
        self._consume(flow, n)
        flow.fpdu_at = flow.base
        flow.state = _FPDU

    def _negotiated(self, flow: _Flow) -> bool:
        """Markers and CRC of this direction, from both startup frames; False when the
        Reply rejected the connection."""
        own = flow.startup
        assert own is not None          # parsed before the flow reached its FPDUs
        peer = flow.peer.startup if flow.peer is not None else None
        if peer is not None and peer.request == own.request:
            peer = None
        req, rep = (own, peer) if own.request else (peer, own)
        req_flags, rep_flags = (req.flags if req else 0), (rep.flags if rep else 0)
        if rep_flags & FLAG_R:
            return False
        flow.crc = bool((req_flags | rep_flags) & FLAG_C)
        flow.markers = bool((rep_flags if own.request else req_flags) & FLAG_M)   # asked by the peer
        return True

    def _length(self, flow: _Flow, i: int) -> tuple[int, int] | None:
        """(ULPDU Length, octets the FPDU takes on the wire) of the FPDU at ``buf[i]``."""
        buf = flow.buf
        avail = len(buf) - i
        if not flow.markers:
            if avail < 2:
                return None
            ulen = buf[i] << 8 | buf[i + 1]
            return ulen, 2 + ulen + (-(2 + ulen) % 4) + 4
        pos = flow.base + i - flow.fpdu_at
        ahead = -pos % MARKER_INTERVAL                   # octets before the next marker
        a, b = (i + 4, i + 5) if ahead == 0 else (i, i + 5) if ahead == 1 else (i, i + 1)
        if avail <= b - i:
            return None
        ulen = buf[a] << 8 | buf[b]
        return ulen, fpdu_wire_length(2 + ulen + (-(2 + ulen) % 4) + 4, pos, True)

    def _frame(self, flow: _Flow, out: list) -> None:
        """Cut the unframed octets into FPDUs and hand each to DDP."""
        if not flow.buf:
            return                      # (the peer's startup frame may still be coming)
        if flow.markers is None and not self._negotiated(flow):
            flow.state = _DEAD
            return
        buf, i = flow.buf, 0
        while True:
            found = self._length(flow, i)
            if found is None or len(buf) - i < found[1]:
                break
            ulen, size = found
            wire = bytes(buf[i:i + size])
            clean = strip_markers(wire, flow.base + i - flow.fpdu_at)[0] if flow.markers else wire
            self._fpdu(flow, clean, ulen, wire, flow.base + i, flow.base + i + size, out)
            i += size
        if i:
            self._consume(flow, i)

    def _consume(self, flow: _Flow, n: int) -> None:
        del flow.buf[:n]
        flow.base += n
        spans = flow.spans
        k = 0
        while k < len(spans) and spans[k][1] <= flow.base:
            k += 1
        if k:
            del spans[:k]

    def _frames(self, flow: _Flow, a: int, b: int) -> tuple[list[int], float | None]:
        """Frames that carried stream octets [a, b), and the time of the latest."""
        frames, latest, when = [], -1, None
        for start, end, frame, time in flow.spans:
            if start >= b:
                break
            if end > a:
                frames.append(frame)
                if frame > latest:
                    latest, when = frame, time
        frames.sort()
        return frames, when

    def _resync(self, flow: _Flow) -> None:
        """After a hole: drop octets until a segment starts with a valid FPDU."""
        while flow.spans:
            start = flow.spans[0][0]
            if start > flow.base:
                self._consume(flow, start - flow.base)
            verdict = self._valid_fpdu(flow)
            if verdict is None:
                if len(flow.buf) > MAX_UNFRAMED:
                    self._consume(flow, flow.spans[0][1] - flow.base)
                    continue
                return
            if verdict:
                flow.state = _FPDU
                return
            self._consume(flow, flow.spans[0][1] - flow.base)

    def _valid_fpdu(self, flow: _Flow) -> bool | None:
        """Whether an FPDU starts at ``buf[0]``; None until enough octets are there."""
        if flow.markers is None and not self._negotiated(flow):
            flow.state = _DEAD
            return False
        found = self._length(flow, 0)
        if found is None:
            return None
        ulen, size = found
        if len(flow.buf) < size:
            return None if size <= MAX_UNFRAMED else False
        wire = bytes(flow.buf[:size])
        if flow.crc:
            return crc_ok(wire)
        clean = strip_markers(wire, flow.base - flow.fpdu_at)[0] if flow.markers else wire
        ctrl, rctrl = clean[2], clean[3]
        if ctrl & 0x3F != 0x01 or rctrl & 0xF0 != 0x40:
            return False
        if ulen < (DDP_TAGGED_LEN if ctrl & 0x80 else DDP_UNTAGGED_LEN):
            return False
        end = flow.base + size
        return any(e == end for _, e, _, _ in flow.spans)

    # -- DDP ---------------------------------------------------------------------------------
    def _fpdu(self, flow: _Flow, clean: bytes, ulen: int, wire: bytes, a: int, b: int,
              out: list) -> None:
        if ulen < 2:
            return
        if self.sends_only:
            ctrl = clean[2]
            if ctrl & 0x80 or clean[3] & 0x0F not in _SENDS or ulen < DDP_UNTAGGED_LEN:
                return
            inv, qn, msn, mo = _UNTAGGED.unpack_from(clean, 4)
            data = clean[2 + DDP_UNTAGGED_LEN:2 + ulen]
            if mo == 0:
                if not looks_like_kbtp(data):
                    if not ctrl & 0x40:
                        flow.skip.add((qn, msn))
                        if len(flow.skip) > 1024:
                            flow.skip.clear()
                    return
                if ctrl & 0x40 and not flow.asm.holds(qn, msn):
                    frames, time = self._frames(flow, a, b)
                    op = Op(clean[3] & 0x0F)
                    info = {"opcode": RDMAP_OPCODES[op], "tagged": False,
                            "solicited": op in SOLICITED_OPCODES, "crc_ok": None,
                            "complete": True, "segments": 1, "qn": qn, "msn": msn}
                    if op in INVALIDATE_OPCODES:
                        info["inv_stag"] = inv
                    out.append(RdmaMessage("iwarp", _KINDS[op], frames, flow.conn, data, info, time))
                    return
            elif (qn, msn) in flow.skip:
                if ctrl & 0x40:
                    flow.skip.discard((qn, msn))
                return
            seg = Segment(False, bool(ctrl & 0x40), clean[3] & 0x0F, inv_stag=inv, qn=qn,
                          msn=msn, mo=mo, data=data)
        else:
            parsed = parse_ulpdu(clean[2:2 + ulen])
            if parsed is None:
                return
            seg = parsed
            if flow.crc:
                seg.crc_ok = crc_ok(wire)
        seg.frames, seg.time = self._frames(flow, a, b)
        done = flow.asm.add(seg)
        if flow.asm.size > MAX_PENDING:
            done += flow.asm.flush()
        self._emit(flow, done, out)

    @staticmethod
    def _emit(flow: _Flow, done: list[Message], out: list) -> None:
        for msg in done:
            rdma = to_rdma_message(msg, flow.conn)
            if rdma is not None:
                out.append(rdma)
