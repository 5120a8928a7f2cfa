"""iWARP streams: segment RDMA messages, build TCP conversations, decode captures.

* ``segment_message`` cuts one RDMA message into the DDP segments, framed as MPA
  FPDUs, that an RNIC sends (RFC 5041, RFC 5044 s4); ``reassemble`` undoes it.
* ``IwarpConversation`` writes the packets of a whole connection: TCP handshake, MPA
  Request/Reply (RFC 5044 s7.1, RFC 6581), FPDUs both ways with right sequence and
  acknowledgement numbers, delayed ACKs, FIN.
* ``iter_rdma_messages`` reads captured Scapy packets back into ``RdmaMessage`` objects
  with the streaming decoder of ``kbtp_scapy.decode.iwarp`` (TCP by sequence number,
  MPA connections found by their startup frames, markers, FPDUs, multi-segment
  messages), the one ``kbtp decode`` runs on capture files.
"""
from __future__ import annotations

import os
import struct
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from scapy.config import conf
from scapy.layers.inet import IP, TCP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw
from scapy.utils import wrpcap

from kbtp_scapy.decode.frames import TCP as TCP_PAYLOAD, locate
from kbtp_scapy.decode.iwarp import Assembler, IwarpStreams, parse_ulpdu
from kbtp_scapy.layers.iwarp import (
    DDP,
    DDP_TAGGED_LEN,
    DDP_UNTAGGED_LEN,
    MPA,
    OPCODE_QUEUE,
    RDMAP_OPCODES,
    TAGGED_OPCODES,
    MPAEnhanced,
    MPAReply,
    MPARequest,
    Op,
)
from kbtp_scapy.wire.iwarp_defs import DEFAULT_MSS, MULPDU, mulpdu  # noqa: F401 (MULPDU re-exported)
from kbtp_scapy.wire.message import RdmaMessage
from kbtp_scapy.wire.mpa_markers import insert_markers


def _opcode(op: int | str) -> Op:
    if isinstance(op, str):
        names = {v: k for k, v in RDMAP_OPCODES.items()}
        return Op(names[op]) if op in names else Op[op.upper()]
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


# --- Reassembling messages ----------------------------------------------------------

def reassemble(fpdus: Iterable[Packet | bytes]) -> bytes:
    """The payload of one RDMA message from its marker-free FPDUs, in any order.

    Raises ValueError unless the FPDUs make exactly one complete message.
    """
    ulpdus = (bytes(f)[2:2 + struct.unpack_from("!H", bytes(f))[0]] for f in fpdus)
    segs = [s for s in map(parse_ulpdu, ulpdus) if s is not None]
    asm = Assembler()
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
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            for off in range(lo, hi, self.mss):
                self._segment(src, "PA", stream[off:min(off + self.mss, hi)])
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

def iter_rdma_messages(packets: Iterable[Packet]) -> Iterator[RdmaMessage]:
    """Every RDMA message of the iWARP connections in Scapy packets (Ethernet, raw IP or
    Linux cooked), in capture order of the frame that completed it, decoded by the
    streaming decoder (``kbtp_scapy.decode.iwarp``). Never raises on garbage: a truncated
    or corrupt stream yields what it can (``info["complete"]`` False for a cut message).
    Messages with opcodes no RFC defines are left out."""
    streams = IwarpStreams(sends_only=False)
    found: list[RdmaMessage] = []
    for number, pkt in enumerate(packets, 1):
        linktype = conf.l2types.layer2num.get(type(pkt))
        if linktype is None:
            continue
        try:
            data = bytes(pkt)
        except Exception:  # noqa: BLE001 - a packet Scapy cannot build
            continue
        where = locate(linktype, data)
        if where is not None and where[0] == TCP_PAYLOAD:
            _, src, dst, sport, dport, seq, ack, flags, start, end = where
            found += streams.segment(number, float(pkt.time), src, dst, sport, dport, seq, ack, flags,
                                     data, start, end) or ()
    found += streams.flush()
    found.sort(key=lambda m: (m.frames[-1] if m.frames else 0))
    yield from found
