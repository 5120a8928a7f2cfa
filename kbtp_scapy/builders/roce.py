"""RoCEv2 helpers: segment RDMA messages as a NIC does, build RC conversations for pcaps,
and find the RDMA messages of a capture.

PSN and MSN rules follow the InfiniBand Architecture Specification vol. 1, chapter 9:
every request packet takes the next PSN of the requester; an RDMA Read Request takes as
many PSNs as its response has packets, and the responses reuse them; responses (ACK,
Read Response, Atomic Acknowledge) travel to the requester's QP in its PSN space and
carry the responder's MSN, the count of request messages it has completed.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv6Address, ip_address

from scapy.compat import raw
from scapy.contrib.roce import AETH, BTH, GRH
from scapy.data import DLT_EN10MB
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw
from scapy.utils import PcapWriter

from kbtp_scapy.decode.connections import RoceConnections
from kbtp_scapy.layers.roce import (
    DETH,
    HEADERS,
    IETH,
    OPCODES,
    RETH,
    AtomicAckETH,
    AtomicETH,
    ImmDt,
    add_pad,
    bth_parts,
    icrc_ok,
)
from kbtp_scapy.wire.address import ROCE_PORT
from kbtp_scapy.wire.message import RdmaMessage

__all__ = ["PATH_MTUS", "segment_message", "reassemble", "RoceEndpoint",
           "RcConnection", "iter_rdma_messages"]

PATH_MTUS = (256, 512, 1024, 2048, 4096)
_MASK24 = 0xFFFFFF  # PSNs and MSNs are 24-bit and wrap
_ACK_SYNDROME = 0x1F  # ACK, credit count 31 ("invalid"), as Linux rxe sends it
_OPCODE_NAMES = {code: name for name, code in OPCODES.items()}


def _stack(service: str, op: str, *, dqpn: int, psn: int, headers: Iterable[Packet] = (),
           payload: bytes = b"", **bth_fields) -> Packet:
    """One padded BTH packet: BTH / extension headers / payload / pad."""
    pkt = BTH(opcode=OPCODES[f"{service}_{op}"], dqpn=dqpn, psn=psn & _MASK24, **bth_fields)
    for header in headers:
        pkt /= header
    if payload:
        pkt /= Raw(payload)
    return add_pad(pkt)


def segment_message(kind: str, payload: bytes = b"", *, dqpn: int, psn: int = 0,
                    mtu: int = 1024, service: str = "RC", va: int = 0, rkey: int = 0,
                    imm: int | None = None, inv_rkey: int | None = None, msn: int = 0,
                    syndrome: int = _ACK_SYNDROME, solicited: bool = False,
                    pkey: int = 0xFFFF) -> list[Packet]:
    """The BTH packets (no IP/UDP) that carry one RDMA message, split by path MTU.

    ``kind`` is "send" (with immediate when ``imm`` is given), "send_inv" (``inv_rkey``),
    "write", "write_imm" (``imm``) or "read_response" (AETH with ``syndrome``/``msn``).
    PSNs run from ``psn``; RETH (``va``, ``rkey``, whole length) rides the first Write
    packet, ImmDt or IETH the last packet. RC requests set AckReq on their last packet.
    """
    if mtu not in PATH_MTUS:
        raise ValueError(f"path MTU must be one of {PATH_MTUS}")
    if service not in ("RC", "UC") or (service == "UC" and kind in ("send_inv", "read_response")):
        raise ValueError(f"{kind} is not an operation of service {service}")
    if solicited and kind in ("write", "read_response"):
        raise ValueError("only Sends and Writes with Immediate can be solicited")
    first: tuple[Packet, ...] = ()
    last: tuple[Packet, ...] = ()
    suffix = ""
    if kind == "send":
        family = "SEND"
        if imm is not None:
            suffix, last = "_WITH_IMMEDIATE", (ImmDt(imm=imm),)
    elif kind == "send_inv":
        if inv_rkey is None:
            raise ValueError("send_inv needs inv_rkey")
        family, suffix, last = "SEND", "_WITH_INVALIDATE", (IETH(rkey=inv_rkey),)
    elif kind in ("write", "write_imm"):
        if (imm is not None) != (kind == "write_imm"):
            raise ValueError("imm is given exactly for write_imm")
        family, first = "RDMA_WRITE", (RETH(va=va, rkey=rkey, dlen=len(payload)),)
        if imm is not None:
            suffix, last = "_WITH_IMMEDIATE", (ImmDt(imm=imm),)
    elif kind == "read_response":
        family = "RDMA_READ_RESPONSE"
        first = last = (AETH(syndrome=syndrome, msn=msn),)
    else:
        raise ValueError(f"unknown message kind {kind!r}")
    only = first if kind == "read_response" else first + last
    ackreq = service == "RC" and kind != "read_response"
    chunks = [payload[i:i + mtu] for i in range(0, len(payload), mtu)] or [b""]
    packets = []
    for i, chunk in enumerate(chunks):
        is_last = i == len(chunks) - 1
        if len(chunks) == 1:
            op, headers = "ONLY" + suffix, only
        elif i == 0:
            op, headers = "FIRST", first
        elif is_last:
            op, headers = "LAST" + suffix, last
        else:
            op, headers = "MIDDLE", ()
        packets.append(_stack(service, f"{family}_{op}", dqpn=dqpn, psn=psn + i,
                              headers=headers, payload=chunk, pkey=pkey,
                              ackreq=int(ackreq and is_last),
                              solicited=int(solicited and is_last)))
    return packets


def reassemble(packets: Iterable[Packet]) -> bytes:
    """The payload of one RDMA message from its packets (BTH stacks or whole frames),
    without pad; ValueError unless they form exactly one complete message in PSN order."""
    records = [_record(0, (), _dissected(p)) for p in packets]     # one message: no connection to tell
    messages = list(_messages(records, None))
    if len(messages) != 1 or not messages[0].info["complete"]:
        raise ValueError("packets are not exactly one complete RDMA message")
    return messages[0].payload


@dataclass
class RoceEndpoint:
    """One side of an RC connection: addresses, its QP and the PSN of its first request."""

    ip: str
    mac: str
    qpn: int
    psn: int = 0
    udp_sport: int = 49152  # RoCEv2 puts flow entropy in the UDP source port


class RcConnection:
    """Both NICs of one RC queue-pair connection, as complete Ethernet frames.

    Each operation names its requester, "a" or "b", and appends the frames both NICs
    exchange to ``frames`` with increasing timestamps. Request messages set AckReq on
    their last packet; the responder acknowledges at once unless ``ack=False``, in which
    case one later ACK (``ack()``, or the next acknowledged message) covers them all.
    Read Responses and Atomic Acknowledges acknowledge everything before them.
    IPv4 frames carry UDP checksum 0; IPv6 ones a computed checksum, as IPv6 forbids 0.
    """

    def __init__(self, a: RoceEndpoint, b: RoceEndpoint, *, mtu: int = 1024,
                 start: float = 0.0, step: float = 1e-5, pkey: int = 0xFFFF) -> None:
        if (":" in a.ip) != (":" in b.ip):
            raise ValueError("both endpoints must use the same IP version")
        if mtu not in PATH_MTUS:
            raise ValueError(f"path MTU must be one of {PATH_MTUS}")
        self.ends = {"a": a, "b": b}
        self.mtu, self.start, self.step, self.pkey = mtu, start, step, pkey
        self.frames: list[Packet] = []
        self._next_psn = {"a": a.psn & _MASK24, "b": b.psn & _MASK24}
        self._msn = {"a": 0, "b": 0}            # request messages completed, per responder
        self._owed: dict[str, int | None] = {"a": None, "b": None}  # PSN to ACK, per responder

    @staticmethod
    def _peer(side: str) -> str:
        if side not in ("a", "b"):
            raise ValueError("side is 'a' or 'b'")
        return "b" if side == "a" else "a"

    def _emit(self, side: str, stack: Packet) -> Packet:
        src, dst = self.ends[side], self.ends[self._peer(side)]
        net: Packet
        if ":" in src.ip:
            net = (IPv6(src=src.ip, dst=dst.ip, hlim=64)
                   / UDP(sport=src.udp_sport, dport=ROCE_PORT))
        else:
            net = (IP(src=src.ip, dst=dst.ip, flags="DF", ttl=64)
                   / UDP(sport=src.udp_sport, dport=ROCE_PORT, chksum=0))
        frame = Ether(raw(Ether(src=src.mac, dst=dst.mac) / net / stack))
        frame.time = self.start + len(self.frames) * self.step
        self.frames.append(frame)
        return frame

    def _request(self, side: str, stacks: list[Packet], psns: int, ack: bool) -> list[Packet]:
        """Send a request message that takes ``psns`` PSNs; the peer completes it."""
        frames = [self._emit(side, s) for s in stacks]
        peer = self._peer(side)
        self._owed[peer] = (self._next_psn[side] + psns - 1) & _MASK24
        self._next_psn[side] = (self._next_psn[side] + psns) & _MASK24
        self._msn[peer] = (self._msn[peer] + 1) & _MASK24
        return frames + (self.ack(peer) if ack else [])

    def ack(self, responder: str) -> list[Packet]:
        """The coalesced ACK ``responder`` owes for the requests it received, if any."""
        psn, self._owed[responder] = self._owed[responder], None
        if psn is None:
            return []
        requester = self.ends[self._peer(responder)]
        return [self._emit(responder, BTH(opcode=OPCODES["RC_ACKNOWLEDGE"], dqpn=requester.qpn,
                                          psn=psn, pkey=self.pkey)
                           / AETH(syndrome=_ACK_SYNDROME, msn=self._msn[responder]))]

    def send(self, side: str, payload: bytes, *, imm: int | None = None,
             inv_rkey: int | None = None, solicited: bool = False,
             ack: bool = True) -> list[Packet]:
        """A Send (with Immediate or with Invalidate when given) from ``side``."""
        stacks = segment_message("send_inv" if inv_rkey is not None else "send", payload,
                                 dqpn=self.ends[self._peer(side)].qpn, psn=self._next_psn[side],
                                 mtu=self.mtu, imm=imm, inv_rkey=inv_rkey,
                                 solicited=solicited, pkey=self.pkey)
        return self._request(side, stacks, len(stacks), ack)

    def write(self, side: str, payload: bytes, *, va: int, rkey: int, imm: int | None = None,
              solicited: bool = False, ack: bool = True) -> list[Packet]:
        """An RDMA Write (with Immediate when ``imm`` is given) from ``side``."""
        stacks = segment_message("write_imm" if imm is not None else "write", payload,
                                 dqpn=self.ends[self._peer(side)].qpn, psn=self._next_psn[side],
                                 mtu=self.mtu, va=va, rkey=rkey, imm=imm,
                                 solicited=solicited, pkey=self.pkey)
        return self._request(side, stacks, len(stacks), ack)

    def read(self, side: str, data: bytes, *, va: int, rkey: int) -> list[Packet]:
        """An RDMA Read by ``side`` of ``len(data)`` octets; the peer answers with ``data``."""
        peer = self._peer(side)
        psn = self._next_psn[side]
        request = BTH(opcode=OPCODES["RC_RDMA_READ_REQUEST"], dqpn=self.ends[peer].qpn, psn=psn,
                      ackreq=1, pkey=self.pkey) / RETH(va=va, rkey=rkey, dlen=len(data))
        responses = max(1, -(-len(data) // self.mtu))
        frames = self._request(side, [request], responses, ack=False)
        self._owed[peer] = None  # the response acknowledges the request and all before it
        for stack in segment_message("read_response", data, dqpn=self.ends[side].qpn, psn=psn,
                                     mtu=self.mtu, msn=self._msn[peer], pkey=self.pkey):
            frames.append(self._emit(peer, stack))
        return frames

    def fetch_add(self, side: str, *, va: int, rkey: int, add: int, original: int) -> list[Packet]:
        """A Fetch & Add by ``side``; the peer returns ``original``, the value before it."""
        return self._atomic(side, "RC_FETCH_ADD",
                            AtomicETH(va=va, rkey=rkey, swap_add=add, compare=0), original)

    def compare_swap(self, side: str, *, va: int, rkey: int, compare: int, swap: int,
                     original: int) -> list[Packet]:
        """A Compare & Swap by ``side``; the peer returns ``original``, the value before it."""
        return self._atomic(side, "RC_COMPARE_SWAP",
                            AtomicETH(va=va, rkey=rkey, swap_add=swap, compare=compare), original)

    def _atomic(self, side: str, opcode: str, eth: AtomicETH, original: int) -> list[Packet]:
        peer = self._peer(side)
        psn = self._next_psn[side]
        request = BTH(opcode=OPCODES[opcode], dqpn=self.ends[peer].qpn, psn=psn, ackreq=1,
                      pkey=self.pkey) / eth
        frames = self._request(side, [request], 1, ack=False)
        self._owed[peer] = None
        frames.append(self._emit(peer, BTH(opcode=OPCODES["RC_ATOMIC_ACKNOWLEDGE"],
                                           dqpn=self.ends[side].qpn, psn=psn, pkey=self.pkey)
                                 / AETH(syndrome=_ACK_SYNDROME, msn=self._msn[peer])
                                 / AtomicAckETH(orig_data=original)))
        return frames

    def write_pcap(self, path: str) -> None:
        """Write every frame so far to a pcap file (link type Ethernet), as the octets it
        was built from: rebuilding a dissected frame would move octets that follow an
        upper-layer message (Scapy's Padding) behind the ICRC."""
        with PcapWriter(path, linktype=DLT_EN10MB, sync=False) as out:
            out.write_header(None)
            for frame in self.frames:
                sec, usec = divmod(round(float(frame.time) * 1e6), 1_000_000)
                out.write_packet(frame.original, sec=sec, usec=usec)


# --- finding messages in captures ---------------------------------------------------------

_SINGLE = {"RDMA_READ_REQUEST": "read_request", "COMPARE_SWAP": "atomic_request",
           "FETCH_ADD": "atomic_request", "ATOMIC_ACKNOWLEDGE": "atomic_response",
           "ACKNOWLEDGE": "ack"}
_FAMILIES = {"SEND": "send", "RDMA_WRITE": "write", "RDMA_READ_RESPONSE": "read_response"}


def _role(opcode: int) -> tuple[str | None, str | None]:
    """(family, position) of an RC/UC/UD opcode: position is None for one-packet
    operations; family is None for what carries no RDMA message (CNP, unknown)."""
    if opcode not in HEADERS:
        return None, None
    op = _OPCODE_NAMES[opcode].split("_", 1)[1]
    if op in _SINGLE:
        return _SINGLE[op], None
    for prefix, family in _FAMILIES.items():
        if op.startswith(prefix + "_"):
            return family, op[len(prefix) + 1:].split("_", 1)[0]
    return None, None


@dataclass
class _Record:
    """What one RDMA packet contributes to its message."""

    number: int
    conn: tuple
    bth: BTH
    headers: dict[type[Packet], Packet]
    payload: bytes
    icrc_ok: bool
    family: str | None = field(init=False)
    position: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.family, self.position = _role(self.bth.opcode)


def _dissected(pkt: Packet) -> Packet:
    """``pkt`` dissected from its bytes with this package's bindings; a bare BTH stack
    (no UDP to compute the ICRC over) gets a zero ICRC first."""
    if pkt.original:
        return pkt.__class__(pkt.original)
    bth = pkt.getlayer(BTH)
    if bth is not None and bth.icrc is None and not isinstance(bth.underlayer, (UDP, GRH)):
        pkt = pkt.copy()
        pkt[BTH].icrc = 0
    return pkt.__class__(raw(pkt))


def _record(number: int, conn: tuple, pkt: Packet) -> _Record:
    headers, payload = bth_parts(pkt)
    return _Record(number, conn, pkt[BTH], headers, payload, icrc_ok(pkt))


def _message(records: list[_Record], complete: bool, conns: RoceConnections | None) -> RdmaMessage:
    first, last = records[0], records[-1]
    kind = first.family
    assert kind is not None                  # _messages leaves out records of no family
    if kind == "send" and IETH in last.headers:
        kind = "send_inv"
    elif kind == "write" and ImmDt in last.headers:
        kind = "write_imm"
    info = {"opcode": _OPCODE_NAMES[first.bth.opcode], "psn": first.bth.psn,
            "last_psn": last.bth.psn, "dqpn": first.bth.dqpn, "pkey": first.bth.pkey,
            "packets": len(records), "solicited": bool(last.bth.solicited),
            "ackreq": bool(last.bth.ackreq), "complete": complete,
            "icrc_ok": all(r.icrc_ok for r in records)}
    for record in records:
        for cls, header in record.headers.items():
            info.update(_HEADER_INFO[cls](header))
    if conns is not None:               # the connection as the streaming decoder ties it
        key = _direction(first.conn)
        info.update(connection=conns.of(key), src_qp=conns.source_qp(key))
    return RdmaMessage(transport="roce", kind=kind, frames=[r.number for r in records],
                       conn=first.conn, payload=b"".join(r.payload for r in records), info=info)


_HEADER_INFO = {
    RETH: lambda h: {"va": h.va, "rkey": h.rkey, "dma_length": h.dlen},
    DETH: lambda h: {"qkey": h.qkey, "srcqp": h.srcqp},
    AETH: lambda h: {"syndrome": h.syndrome, "msn": h.msn},
    AtomicETH: lambda h: {"va": h.va, "rkey": h.rkey, "swap_add": h.swap_add,
                          "compare": h.compare},
    AtomicAckETH: lambda h: {"orig_data": h.orig_data},
    ImmDt: lambda h: {"imm": h.imm},
    IETH: lambda h: {"inv_rkey": h.rkey},
}


def _direction(conn: tuple) -> tuple:
    """``(src, dst, destination QP)`` with the addresses as octets, as ``decode.connections`` keys it."""
    return ip_address(conn[0]).packed, ip_address(conn[1]).packed, conn[2]


def _messages(records: Iterable[_Record], conns: RoceConnections | None) -> Iterator[RdmaMessage]:
    """Group packets into messages per connection and stream (requests, read responses)
    by opcode position and consecutive PSN; gaps yield the parts as incomplete messages."""
    open_: dict[tuple, tuple[list[_Record], bool]] = {}
    for rec in records:
        if rec.family is None:
            continue
        if rec.position is None:
            yield _message([rec], True, conns)
            continue
        key = (rec.conn, rec.family == "read_response")
        part = open_.pop(key, None)
        if part is not None:
            prev = part[0][-1]
            if (rec.position in ("FIRST", "ONLY") or prev.family != rec.family
                    or rec.bth.psn != (prev.bth.psn + 1) & _MASK24):
                yield _message(part[0], False, conns)
                part = None
        if part is None:
            part = ([], rec.position in ("FIRST", "ONLY"))
        part[0].append(rec)
        if rec.position in ("LAST", "ONLY"):
            yield _message(part[0], part[1], conns)
        else:
            open_[key] = part
    for records_, _ in open_.values():
        yield _message(records_, False, conns)


def _frames(packets: Iterable[Packet], conns: RoceConnections) -> Iterator[_Record]:
    """RoCE packets of a capture (RoCEv2 on UDP 4791, or RoCEv1) as records, each also
    shown to ``conns`` (the CM and the ACKs tie a connection's QPs); anything that does
    not dissect is skipped, so garbage never raises."""
    for number, pkt in enumerate(packets, 1):
        try:
            pkt = _dissected(pkt)
            bth = pkt.getlayer(BTH)
            if bth is None:
                continue
            lower = bth.underlayer
            if isinstance(lower, UDP) and lower.dport == ROCE_PORT and lower.underlayer is not None:
                conn = (lower.underlayer.src, lower.underlayer.dst, bth.dqpn)
            elif isinstance(lower, GRH):
                conn = (str(IPv6Address(lower.sgid)), str(IPv6Address(lower.dgid)), bth.dqpn)
            else:
                continue
            octets = raw(bth)
            src, dst, _ = _direction(conn)
            conns.packet(src, dst, octets, 0, len(octets))
            yield _record(number, conn, pkt)
        except Exception:  # noqa: BLE001 - a capture may hold anything
            continue


def iter_rdma_messages(packets: Iterable[Packet]) -> Iterator[RdmaMessage]:
    """One RdmaMessage per RDMA message in the packets of a capture (Ethernet or raw IP),
    multi-packet messages reassembled per direction and destination QP by PSN.

    ``conn`` is (source IP, destination IP, destination QP); ``info`` holds the opcode
    name of the first packet, PSNs, extension header values, ``icrc_ok`` (all packets)
    and ``complete`` (False for the pieces of a message with packets missing)."""
    conns = RoceConnections()
    return _messages(_frames(packets, conns), conns)
