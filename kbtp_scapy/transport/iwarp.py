"""iWARP streams: segment RDMA messages, build TCP conversations, decode captures.

* ``segment_message`` cuts one RDMA message into the DDP segments, framed as MPA
  FPDUs, that an RNIC sends (RFC 5041, RFC 5044 s4); ``reassemble`` undoes it.
* ``IwarpConversation`` writes the packets of a whole connection: TCP handshake, MPA
  Request/Reply (RFC 5044 s7.1, RFC 6581), FPDUs both ways with right sequence and
  acknowledgement numbers, delayed ACKs, FIN.
* ``iter_rdma_messages`` reads captured packets back into ``RdmaMessage`` objects: it
  reassembles TCP by sequence number, finds MPA connections by their startup frames,
  strips markers, frames FPDUs and reassembles multi-segment messages.
"""
from __future__ import annotations

import os
import struct
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from scapy.layers.inet import IP, TCP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw
from scapy.utils import wrpcap

from kbtp_scapy.layers.iwarp import (
    DDP,
    DDP_TAGGED_LEN,
    DDP_UNTAGGED_LEN,
    INVALIDATE_OPCODES,
    MPA,
    MPA_REP_KEY,
    MPA_REQ_KEY,
    MPA_STARTUP_LEN,
    OPCODE_QUEUE,
    RDMAP_OPCODES,
    SOLICITED_OPCODES,
    TAGGED_OPCODES,
    MPAEnhanced,
    MPAReply,
    MPARequest,
    Op,
    RDMAPAtomicRequest,
    RDMAPAtomicResponse,
    RDMAPImmediate,
    RDMAPReadRequest,
    RDMAPTerminate,
    crc32c,
    fpdu_pad_len,
)
from kbtp_scapy.transport.iwarp_defs import DEFAULT_MSS, MULPDU, mulpdu  # noqa: F401 (MULPDU re-exported)
from kbtp_scapy.transport.message import RdmaMessage
from kbtp_scapy.transport.mpa_markers import insert_markers, strip_markers


def _opcode(op: int | str) -> Op:
    if isinstance(op, str):
        names = {v: k for k, v in RDMAP_OPCODES.items()}
        return names[op] if op in names else Op[op.upper()]
    return Op(op)


def segment_message(opcode: int | str, payload: bytes | Packet = b"", *,
                    mulpdu: int = MULPDU, stag: int = 0, to: int = 0, msn: int = 1,
                    qn: int | None = None, inv_stag: int = 0) -> list[MPA]:
    """One RDMA message as the FPDUs an RNIC sends, each ULPDU at most ``mulpdu``.

    Tagged messages (RDMA Write, Read Response) advance the TO by the octets placed;
    untagged ones keep QN and MSN and advance the MO (RFC 5041 segmentation rules).  The L flag
    is set on the last segment only.  A Packet payload that fits in one segment stays
    a Packet, so that ``show()`` names its fields.
    """
    op = _opcode(opcode)
    tagged = op in TAGGED_OPCODES
    room = mulpdu - (DDP_TAGGED_LEN if tagged else DDP_UNTAGGED_LEN)
    if room <= 0:
        raise ValueError(f"MULPDU {mulpdu} leaves no room for data")
    data = bytes(payload)
    offsets = range(0, max(len(data), 1), room)
    fpdus = []
    for off in offsets:
        last = off + room >= len(data)
        if tagged:
            hdr = DDP(tagged=1, last=int(last), opcode=op, stag=stag, to=to + off)
        else:
            hdr = DDP(tagged=0, last=int(last), opcode=op, inv_stag=inv_stag,
                      qn=OPCODE_QUEUE.get(op, 0) if qn is None else qn, msn=msn, mo=off)
        chunk = payload if isinstance(payload, Packet) and len(offsets) == 1 else \
            data[off:off + room]
        fpdus.append(MPA() / hdr / chunk if chunk else MPA() / hdr)
    return fpdus


# --- Parsing FPDUs and reassembling messages ------------------------------------------

@dataclass
class _Segment:
    """One DDP segment as read from an FPDU."""

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


def _parse_ulpdu(ulpdu: bytes) -> _Segment | None:
    """Read a DDP/RDMAP header (RFC 5041 s4, RFC 5040 s4) without Scapy, or None."""
    if len(ulpdu) < 2:
        return None
    tagged, last, opcode = bool(ulpdu[0] & 0x80), bool(ulpdu[0] & 0x40), ulpdu[1] & 0x0F
    if tagged and len(ulpdu) >= DDP_TAGGED_LEN:
        stag, to = struct.unpack_from("!IQ", ulpdu, 2)
        return _Segment(True, last, opcode, stag=stag, to=to, data=ulpdu[DDP_TAGGED_LEN:])
    if not tagged and len(ulpdu) >= DDP_UNTAGGED_LEN:
        inv, qn, msn, mo = struct.unpack_from("!IIII", ulpdu, 2)
        return _Segment(False, last, opcode, inv_stag=inv, qn=qn, msn=msn, mo=mo,
                        data=ulpdu[DDP_UNTAGGED_LEN:])
    return None


@dataclass
class _Message:
    """Segments of one RDMA message put back together."""

    first: _Segment
    data: bytes
    frames: list[int]
    crc_ok: bool | None
    complete: bool
    segments: int


def _merge(segs: list[_Segment], complete: bool) -> _Message:
    crcs = [s.crc_ok for s in segs if s.crc_ok is not None]
    first = min(segs, key=lambda s: s.to if s.tagged else s.mo)
    return _Message(first=first, data=b"".join(s.data for s in segs),
                    frames=sorted({f for s in segs for f in s.frames}),
                    crc_ok=all(crcs) if crcs else None, complete=complete,
                    segments=len(segs))


class _Assembler:
    """Collects segments into messages: untagged by (QN, MSN) and MO, tagged by STag
    and consecutive TOs (RFC 5041).  One instance per stream direction."""

    def __init__(self) -> None:
        self._untagged: dict[tuple[int, int], dict[int, _Segment]] = {}
        self._tagged: dict[int, list[_Segment]] = {}

    def add(self, seg: _Segment) -> list[_Message]:
        if seg.tagged:
            return self._add_tagged(seg)
        parts = self._untagged.setdefault((seg.qn, seg.msn), {})
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
        del self._untagged[(seg.qn, seg.msn)]
        return [_merge(ordered, True)]

    def _add_tagged(self, seg: _Segment) -> list[_Message]:
        done = []
        run = self._tagged.get(seg.stag)
        if run and seg.to != run[-1].to + len(run[-1].data):
            done.append(_merge(self._tagged.pop(seg.stag), False))
        self._tagged.setdefault(seg.stag, []).append(seg)
        if seg.last:
            done.append(_merge(self._tagged.pop(seg.stag), True))
        return done

    def flush(self) -> list[_Message]:
        """Whatever is still incomplete, for a stream that ended early."""
        left = [_merge([p[mo] for mo in sorted(p)], False) for p in self._untagged.values()]
        left += [_merge(run, False) for run in self._tagged.values()]
        self._untagged.clear()
        self._tagged.clear()
        return left


def _read_fpdu(fpdu: bytes, crc: bool) -> _Segment | None:
    """Segment of one marker-free FPDU; CRC checked here only when asked."""
    ulen = struct.unpack_from("!H", fpdu)[0]
    seg = _parse_ulpdu(fpdu[2:2 + ulen])
    if seg is not None and crc:
        seg.crc_ok = struct.unpack("<I", fpdu[-4:])[0] == crc32c(fpdu[:-4])
    return seg


def reassemble(fpdus: Iterable[Packet | bytes]) -> bytes:
    """The payload of one RDMA message from its FPDUs, in any order.

    Raises ValueError unless the FPDUs make exactly one complete message.
    """
    segs = [s for s in (_read_fpdu(bytes(f), False) for f in fpdus) if s is not None]
    asm = _Assembler()
    done = [m for s in sorted(segs, key=lambda s: (s.to, s.mo)) for m in asm.add(s)]
    done += asm.flush()
    if len(done) != 1 or not done[0].complete:
        raise ValueError("the FPDUs do not make exactly one complete message")
    return done[0].data


# --- Building a TCP conversation ------------------------------------------------------

@dataclass
class _End:
    """One side of the connection: its address, sequence state and RDMAP counters."""

    ip: str
    port: int
    mac: str
    seq: int
    rcv_nxt: int = 0
    unacked: int = 0                       # data segments received and not yet ACKed
    markers: bool = False                  # this side inserts markers when sending
    wire_pos: int = 0                      # FPDU stream position, markers included
    msn: dict[int, int] = field(default_factory=lambda: defaultdict(lambda: 1))


class IwarpConversation:
    """The packets of one iWARP connection, for writing captures.

    The constructor emits the TCP handshake and the MPA Request/Reply: revision 2 with
    the RFC 6581 IRD/ORD data (client-server model, no RTR), CRC on, markers off by
    default.  ``send_message``/``send_fpdus`` add FPDUs in either direction; the
    receiver ACKs every second segment and at the end of each burst, as delayed ACK
    does.  ``close`` ends with FIN.  Timestamps grow by ``gap`` seconds a packet.
    """

    def __init__(self, initiator: tuple[str, int], responder: tuple[str, int], *,
                 mss: int = DEFAULT_MSS, crc: bool = True, markers: bool = False,
                 revision: int = 2, ird: int = 16, ord: int = 16, private_data: bytes = b"",
                 start: float = 1_700_000_000.0, gap: float = 0.0001,
                 isn: tuple[int, int] = (0x10000000, 0x20000000)) -> None:
        self.packets: list[Packet] = []
        self.mss = mss
        self.mulpdu = mulpdu(mss, markers)
        self._time = start
        self._gap = gap
        self._ends = (_End(*initiator, "02:00:00:00:00:01", isn[0]),
                      _End(*responder, "02:00:00:00:00:02", isn[1]))
        self._handshake()
        # Revision 1 (RFC 5044) carries no IRD/ORD; tshark 4.0 warns on revision 2's S flag.
        flags = "+".join((["S"] if revision == 2 else []) + (["C"] if crc else [])
                         + (["M"] if markers else [])) or 0
        pdata = MPAEnhanced(ird=ird, ord=ord) / private_data if revision == 2 else Raw(private_data)
        self._segment(0, "PA", bytes(MPARequest(flags=flags, rev=revision) / pdata))
        self._segment(1, "PA", bytes(MPAReply(flags=flags, rev=revision) / pdata))
        self._segment(0, "A")
        for end in self._ends:
            end.markers = markers

    def _segment(self, src: int, flags: str, data: bytes = b"", **tcp) -> None:
        s, d = self._ends[src], self._ends[1 - src]
        net = IPv6(src=s.ip, dst=d.ip) if ":" in s.ip else IP(src=s.ip, dst=d.ip)
        pkt = (Ether(src=s.mac, dst=d.mac) / net /
               TCP(sport=s.port, dport=d.port, seq=s.seq,
                   ack=s.rcv_nxt if "A" in flags else 0, flags=flags, window=65535, **tcp))
        if data:
            pkt /= Raw(data)
        self._time += self._gap
        pkt.time = self._time
        self.packets.append(pkt)
        s.seq = (s.seq + len(data) + ("S" in flags) + ("F" in flags)) & 0xFFFFFFFF
        d.rcv_nxt = s.seq
        d.unacked += bool(data)
        if "A" in flags:
            s.unacked = 0

    def _handshake(self) -> None:
        opts = [("MSS", self.mss)]
        self._segment(0, "S", options=opts)
        self._segment(1, "SA", options=opts)
        self._segment(0, "A")

    def _ack(self, src: int) -> None:
        if self._ends[src].unacked:
            self._segment(src, "A")

    def send_fpdus(self, fpdus: Sequence[Packet | bytes], *, from_initiator: bool = True,
                   per_segment: int = 1, split_at: Sequence[int] | None = None) -> None:
        """Send FPDUs, ``per_segment`` to a TCP segment, or cut the byte stream at the
        offsets ``split_at`` (to split an FPDU across segments); no segment exceeds
        the MSS.  Markers are inserted here when negotiated."""
        src = 0 if from_initiator else 1
        end = self._ends[src]
        wire = []
        for f in fpdus:
            b = bytes(f)
            if end.markers:
                b = insert_markers(b, end.wire_pos)
            end.wire_pos += len(b)
            wire.append(b)
        stream = b"".join(wire)
        if split_at is None:
            sizes = [sum(map(len, wire[i:i + per_segment]))
                     for i in range(0, len(wire), per_segment)]
            split_at = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        cuts = [0, *sorted(c for c in split_at if 0 < c < len(stream)), len(stream)]
        for a, b in zip(cuts, cuts[1:], strict=False):
            for off in range(a, b, self.mss):
                self._segment(src, "PA", stream[off:min(off + self.mss, b)])
                if self._ends[1 - src].unacked >= 2:
                    self._ack(1 - src)
        self._ack(1 - src)

    def send_message(self, opcode: int | str, payload: bytes | Packet = b"", *,
                     from_initiator: bool = True, per_segment: int = 1,
                     split_at: Sequence[int] | None = None, **ddp: int) -> list[MPA]:
        """Segment one RDMA message (MSN counted per queue and direction) and send it;
        returns its FPDUs.  ``ddp`` takes ``segment_message``'s header arguments."""
        op = _opcode(opcode)
        end = self._ends[0 if from_initiator else 1]
        if op not in TAGGED_OPCODES and "msn" not in ddp:
            qn = ddp.get("qn", OPCODE_QUEUE.get(op, 0))
            ddp["msn"] = end.msn[qn]
            end.msn[qn] += 1
        fpdus = segment_message(op, payload, mulpdu=self.mulpdu, **ddp)
        self.send_fpdus(fpdus, from_initiator=from_initiator, per_segment=per_segment,
                        split_at=split_at)
        return fpdus

    def close(self) -> None:
        """FIN from the initiator, FIN+ACK back, final ACK."""
        self._segment(0, "FA")
        self._segment(1, "FA")
        self._segment(0, "A")

    def write(self, path: str | os.PathLike) -> None:
        """Write the packets as a pcap file."""
        wrpcap(str(path), self.packets)


# --- Decoding captures ----------------------------------------------------------------

@dataclass
class _Flow:
    """One direction of a TCP connection as captured."""

    syn: int | None = None
    segments: list[tuple[int, bytes, int]] = field(default_factory=list)  # seq, data, frame


def _tcp_data(net: Packet, tcp: TCP) -> bytes:
    """TCP payload octets, without any link-layer padding after the IP datagram."""
    raw_tcp = bytes(tcp)
    hlen = tcp.dataofs * 4 if tcp.dataofs is not None else \
        len(raw_tcp) - len(bytes(tcp.payload))
    if isinstance(net, IP) and net.len is not None:
        return raw_tcp[hlen:net.len - net.ihl * 4]
    if isinstance(net, IPv6) and net.plen is not None:
        ext = len(bytes(net.payload)) - len(raw_tcp)
        return raw_tcp[hlen:net.plen - ext]
    return raw_tcp[hlen:]


def _collect(packets: Iterable[Packet]) -> dict[tuple, _Flow]:
    flows: dict[tuple, _Flow] = defaultdict(_Flow)
    for frame, pkt in enumerate(packets, 1):
        try:
            net = pkt.getlayer(IP)
            net = pkt.getlayer(IPv6) if net is None else net
            tcp = pkt.getlayer(TCP)
            if net is None or tcp is None or (isinstance(net, IP) and (net.frag or net.flags.MF)):
                continue
            flow = flows[((net.src, tcp.sport), (net.dst, tcp.dport))]
            if tcp.flags.S:
                flow.syn = tcp.seq
            data = _tcp_data(net, tcp)
            if data and not tcp.flags.S:
                flow.segments.append((tcp.seq, data, frame))
        except Exception:           # a frame Scapy could not make sense of
            continue
    return flows


def _signed(d: int) -> int:
    d &= 0xFFFFFFFF
    return d - (1 << 32) if d >= 1 << 31 else d


def _reassemble_tcp(flow: _Flow) -> tuple[bytes, list[tuple[int, int, int]]]:
    """In-order octets of a flow up to its first hole, and (start, end, frame) spans
    saying which frame first delivered them (retransmissions add nothing)."""
    if not flow.segments:
        return b"", []
    base = flow.syn + 1 if flow.syn is not None else flow.segments[0][0]
    rel = [(_signed(seq - base), frame, data) for seq, data, frame in flow.segments]
    if flow.syn is None:
        low = min(r for r, _, _ in rel)
        rel = [(r - low, f, d) for r, f, d in rel]
    stream = bytearray()
    spans = []
    for start, frame, data in sorted(rel, key=lambda x: (x[0], x[1])):
        end = start + len(data)
        if start > len(stream):
            break
        if end > len(stream) and end > 0:
            spans.append((len(stream), end, frame))
            stream += data[len(stream) - start:]
    return bytes(stream), spans


def _frames(spans: list[tuple[int, int, int]], a: int, b: int) -> list[int]:
    i = bisect_left(spans, (a + 1,)) - 1
    out = []
    for start, end, frame in spans[max(i, 0):]:
        if start >= b:
            break
        if end > a:
            out.append(frame)
    return out


@dataclass
class _Startup:
    """An MPA Request or Reply at the start of a flow."""

    request: bool
    flags: int
    length: int                 # octets including private data: FPDUs start after


def _startup(stream: bytes) -> _Startup | None:
    key = stream[:16]
    if key not in (MPA_REQ_KEY, MPA_REP_KEY) or len(stream) < MPA_STARTUP_LEN:
        return None
    pd_length = struct.unpack_from("!H", stream, 18)[0]
    return _Startup(key == MPA_REQ_KEY, stream[16], MPA_STARTUP_LEN + pd_length)


_M, _C, _R = 0x80, 0x40, 0x20
_KINDS = {
    Op.WRITE: "write", Op.READ_REQUEST: "read_request", Op.READ_RESPONSE: "read_response",
    Op.SEND: "send", Op.SEND_SE: "send", Op.SEND_INV: "send_inv",
    Op.SEND_SE_INV: "send_inv", Op.TERMINATE: "terminate", Op.IMMEDIATE: "immediate",
    Op.IMMEDIATE_SE: "immediate", Op.ATOMIC_REQUEST: "atomic_request",
    Op.ATOMIC_RESPONSE: "atomic_response",
}
_BODY_INFO = {
    Op.READ_REQUEST: RDMAPReadRequest, Op.TERMINATE: RDMAPTerminate,
    Op.IMMEDIATE: RDMAPImmediate, Op.IMMEDIATE_SE: RDMAPImmediate,
    Op.ATOMIC_REQUEST: RDMAPAtomicRequest, Op.ATOMIC_RESPONSE: RDMAPAtomicResponse,
}
_BODY_LEN = {cls: len(cls()) for cls in _BODY_INFO.values() if cls is not RDMAPTerminate}


def _to_rdma_message(msg: _Message, conn: tuple) -> RdmaMessage | None:
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
    body = _BODY_INFO.get(op)
    if body is not None:
        if len(payload) >= _BODY_LEN.get(body, 4):
            fields = body(payload).fields
            info.update({k: v for k, v in fields.items() if isinstance(v, int)})
        payload = b""
    return RdmaMessage(transport="iwarp", kind=_KINDS[op], frames=msg.frames,
                       conn=conn, payload=payload, info=info)


def _decode_flow(stream: bytes, spans, startup: _Startup, peer: _Startup | None,
                 conn: tuple) -> list[RdmaMessage]:
    """RDMA messages of one direction of an MPA connection."""
    req, rep = (startup, peer) if startup.request else (peer, startup)
    req_flags, rep_flags = (req.flags if req else 0), (rep.flags if rep else 0)
    if rep_flags & _R:
        return []
    crc = bool((req_flags | rep_flags) & _C)
    # The M flag asks the peer to send markers (RFC 5044 s7.1).
    markers = bool((rep_flags if startup.request else req_flags) & _M)
    base = startup.length
    wire = stream[base:]
    clean, found = strip_markers(wire) if markers else (wire, [])
    mpos = [p for p, _ in found]
    asm = _Assembler()
    done: list[_Message] = []
    c = 0
    while c + 2 <= len(clean):
        ulen = struct.unpack_from("!H", clean, c)[0]
        total = 2 + ulen + fpdu_pad_len(ulen) + 4
        if c + total > len(clean):
            break
        w0 = c + 4 * bisect_left(mpos, c)
        w1 = c + total + 4 * bisect_left(mpos, c + total)
        seg = _read_fpdu(clean[c:c + total], False)
        if seg is not None:
            if crc:
                seg.crc_ok = struct.unpack("<I", wire[w1 - 4:w1])[0] == \
                    crc32c(wire[w0:w1 - 4])
            seg.frames = _frames(spans, base + w0, base + w1)
            done += asm.add(seg)
        c += total
    done += asm.flush()
    msgs = (_to_rdma_message(m, conn) for m in done)
    return [m for m in msgs if m is not None]


def iter_rdma_messages(packets: Iterable[Packet]) -> Iterator[RdmaMessage]:
    """Every RDMA message of the iWARP connections in a capture, in capture order of
    the frame that completed it.  Never raises on garbage: a truncated or corrupt
    stream yields what it can (``info["complete"]`` False for a cut message).
    Messages with opcodes no RFC defines are left out."""
    flows = _collect(packets)
    streams = {key: _reassemble_tcp(flow) for key, flow in flows.items()}
    found = []
    for (src, dst), (stream, spans) in streams.items():
        startup = _startup(stream)
        if startup is None:
            continue
        peer = _startup(streams.get((dst, src), (b"", []))[0])
        if peer is not None and peer.request == startup.request:
            peer = None
        found += _decode_flow(stream, spans, startup, peer, (src, dst))
    found.sort(key=lambda m: (m.frames[-1] if m.frames else 0))
    yield from found
