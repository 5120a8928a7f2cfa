"""RoCE extended transport headers that ``scapy.contrib.roce`` lacks, bound by BTH opcode.

``scapy.contrib.roce`` provides BTH (with the ICRC), AETH, GRH and CNP. This module adds
RETH, DETH, AtomicETH, AtomicAckETH, ImmDt and IETH (InfiniBand Architecture
Specification vol. 1, section 9.3) and lets the BTH opcode select the header sequence of
every RC, UC and UD opcode, over RoCEv2 (IPv4 or IPv6) and RoCEv1 (GRH).

The pad octets (BTH PadCnt, 0 to 3, between payload and ICRC) are kept in a ``BTHPad``
layer so that the upper layer sees exactly the message payload, while the frame still
rebuilds byte for byte (Scapy's own ``Padding`` would move them behind the ICRC).
The first packet of a Send carries the KBTP header; its payload is dissected as KBTP
when ``looks_like_kbtp`` accepts it.
"""
from __future__ import annotations

import struct
import zlib

from scapy.compat import raw
from scapy.config import conf
from scapy.contrib.roce import AETH, BTH, GRH
from scapy.fields import (
    ByteEnumField,
    IntField,
    StrField,
    X3BytesField,
    XByteField,
    XIntField,
    XLongField,
)
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import NoPayload, Packet, bind_bottom_up

__all__ = [
    "RETH", "DETH", "AtomicETH", "AtomicAckETH", "ImmDt", "IETH", "BTHPad",
    "OPCODES", "HEADERS", "MESSAGE_START", "add_pad", "bth_parts", "icrc_ok",
]


class RETH(Packet):
    """RDMA Extended Transport Header: target of an RDMA Write or Read."""

    name = "RETH"
    fields_desc = [XLongField("va", 0), XIntField("rkey", 0), IntField("dlen", 0)]


class DETH(Packet):
    """Datagram Extended Transport Header (UD): Q_Key and source QP."""

    name = "DETH"
    fields_desc = [XIntField("qkey", 0), XByteField("reserved", 0), X3BytesField("srcqp", 0)]


class AtomicETH(Packet):
    """Atomic Extended Transport Header of Compare & Swap and Fetch & Add."""

    name = "AtomicETH"
    fields_desc = [XLongField("va", 0), XIntField("rkey", 0),
                   XLongField("swap_add", 0), XLongField("compare", 0)]


class AtomicAckETH(Packet):
    """Atomic Acknowledge Extended Transport Header: the remote data before the atomic."""

    name = "AtomicAckETH"
    fields_desc = [XLongField("orig_data", 0)]


class ImmDt(Packet):
    """Immediate Data Extended Transport Header."""

    name = "ImmDt"
    fields_desc = [XIntField("imm", 0)]


class IETH(Packet):
    """Invalidate Extended Transport Header: the R_Key a Send with Invalidate revokes."""

    name = "IETH"
    fields_desc = [XIntField("rkey", 0)]


class BTHPad(Packet):
    """The BTH PadCnt octets that align the payload to 4 octets; covered by the ICRC."""

    name = "BTH Pad"
    fields_desc = [StrField("pad", b"")]


# Opcode names scapy.contrib.roce does not know (IBA 9.2: Send with Invalidate, RC only).
_opcode_field = BTH.fields_desc[0]  # ByteEnumField "opcode"
assert isinstance(_opcode_field, ByteEnumField)
assert _opcode_field.i2s is not None and _opcode_field.s2i is not None     # a dict enum
for _code, _name in ((0x16, "RC_SEND_LAST_WITH_INVALIDATE"),
                     (0x17, "RC_SEND_ONLY_WITH_INVALIDATE")):
    _opcode_field.i2s[_code] = _name
    _opcode_field.s2i[_name] = _code

#: BTH opcode value by name, e.g. ``OPCODES["RC_SEND_ONLY"] == 0x04``.
OPCODES: dict[str, int] = _opcode_field.s2i

_COMMON = {  # operations shared by RC and UC, with the headers that follow the BTH
    "SEND_FIRST": (), "SEND_MIDDLE": (), "SEND_LAST": (), "SEND_LAST_WITH_IMMEDIATE": (ImmDt,),
    "SEND_ONLY": (), "SEND_ONLY_WITH_IMMEDIATE": (ImmDt,),
    "RDMA_WRITE_FIRST": (RETH,), "RDMA_WRITE_MIDDLE": (), "RDMA_WRITE_LAST": (),
    "RDMA_WRITE_LAST_WITH_IMMEDIATE": (ImmDt,), "RDMA_WRITE_ONLY": (RETH,),
    "RDMA_WRITE_ONLY_WITH_IMMEDIATE": (RETH, ImmDt),
}
_RC_ONLY = {
    "RDMA_READ_REQUEST": (RETH,), "RDMA_READ_RESPONSE_FIRST": (AETH,),
    "RDMA_READ_RESPONSE_MIDDLE": (), "RDMA_READ_RESPONSE_LAST": (AETH,),
    "RDMA_READ_RESPONSE_ONLY": (AETH,), "ACKNOWLEDGE": (AETH,),
    "ATOMIC_ACKNOWLEDGE": (AETH, AtomicAckETH), "COMPARE_SWAP": (AtomicETH,),
    "FETCH_ADD": (AtomicETH,), "SEND_LAST_WITH_INVALIDATE": (IETH,),
    "SEND_ONLY_WITH_INVALIDATE": (IETH,),
}
_UD = {"SEND_ONLY": (DETH,), "SEND_ONLY_WITH_IMMEDIATE": (DETH, ImmDt)}

#: The extension headers between the BTH and the payload, by BTH opcode (IBA 9.2, 9.3).
HEADERS: dict[int, tuple[type[Packet], ...]] = {
    OPCODES[f"{svc}_{op}"]: hdrs
    for svc, table in (("RC", _COMMON), ("RC", _RC_ONLY), ("UC", _COMMON), ("UD", _UD))
    for op, hdrs in table.items()
}

#: Opcodes whose payload is the start of a Send message, where a KBTP header sits.
MESSAGE_START = frozenset(
    OPCODES[f"{svc}_{op}"] for svc in ("RC", "UC") for op in
    ("SEND_FIRST", "SEND_ONLY", "SEND_ONLY_WITH_IMMEDIATE")
) | {OPCODES["RC_SEND_ONLY_WITH_INVALIDATE"], OPCODES["UD_SEND_ONLY"],
     OPCODES["UD_SEND_ONLY_WITH_IMMEDIATE"]}


def _next_layer(lower: Packet | None, payload: bytes) -> type[Packet]:
    """The class of what follows ``lower``: the next header of its opcode's sequence, else
    the message payload (KBTP at the start of a Send, Raw otherwise)."""
    depth, bth = 0, lower
    while bth is not None and not isinstance(bth, BTH):
        depth, bth = depth + 1, bth.underlayer
    if bth is None:
        return conf.raw_layer
    headers = HEADERS.get(bth.opcode, ())
    if depth < len(headers):
        return headers[depth]
    # QP0 and QP1 carry management datagrams, never KBTP.
    if bth.opcode in MESSAGE_START and bth.dqpn > 1:
        from kbtp_scapy.layers.kbtp import (  # lazy: kbtp may import us
            KBTP,
            looks_like_kbtp,
        )
        if looks_like_kbtp(payload):
            return KBTP
    return conf.raw_layer


class _Next(Packet):
    """Binding placeholder: resolves, at dissection, to the class ``_next_layer`` picks.

    Going through a binding (not ``guess_payload_class``) keeps a failing upper layer
    inside Scapy's dissection guard, which falls back to Raw."""

    @classmethod
    def dispatch_hook(cls, _pkt: bytes | None = None, *args, **kargs) -> type[Packet]:
        return _next_layer(kargs.get("_underlayer"), _pkt or b"")


def _bth_do_dissect_payload(self: BTH, s: bytes) -> None:
    """Dissect the BTH payload without its pad octets, then keep those in a BTHPad."""
    cut = len(s) - min(self.padcount, len(s))
    Packet.do_dissect_payload(self, s[:cut])
    if s[cut:]:
        self.add_payload(BTHPad(s[cut:], _internal=1))


BTH.do_dissect_payload = _bth_do_dissect_payload  # type: ignore[method-assign,assignment]  # patching Scapy's BTH
for _code in HEADERS:
    if not any(fval.get("opcode") == _code for fval, _ in BTH.payload_guess):
        bind_bottom_up(BTH, _Next, opcode=_code)
for _layer in (AETH, RETH, DETH, AtomicETH, AtomicAckETH, ImmDt, IETH):
    bind_bottom_up(_layer, _Next)


def add_pad(pkt: Packet) -> Packet:
    """Set the BTH PadCnt and append the pad octets so the payload ends on a 4-octet
    boundary (IBA 9.2.3); call it on a built stack before serialising. Returns ``pkt``."""
    bth = pkt[BTH]
    old = bth.getlayer(BTHPad)
    if old is not None:
        old.underlayer.remove_payload()
    count = -len(raw(bth.payload)) % 4
    bth.padcount = count
    if count:
        bth.add_payload(BTHPad(pad=bytes(count)))
    return pkt


def bth_parts(pkt: Packet) -> tuple[dict[type[Packet], Packet], bytes]:
    """The extension headers of a dissected RoCE packet, by class, and its message payload
    exactly as the upper layer receives it: no headers, no pad, no Ethernet trailer.
    A header that did not dissect (truncated frame) ends the headers; what follows is payload."""
    bth = pkt[BTH]
    headers: dict[type[Packet], Packet] = {}
    layer = bth.payload
    for cls in HEADERS.get(bth.opcode, ()):
        if not isinstance(layer, cls):
            break
        headers[cls] = layer
        layer = layer.payload
    if isinstance(layer, (NoPayload, BTHPad, conf.padding_layer)):
        return headers, b""
    return headers, layer.original


def _roce_v1_icrc(grh_bytes: bytes) -> bytes:
    """ICRC of a RoCEv1 packet (GRH ... ICRC), which scapy.contrib.roce does not compute:
    CRC-32 over 8 octets of ones for the absent LRH, the GRH with Traffic Class, Flow
    Label and Hop Limit set to ones, the BTH with its reserved octet set to ones, the rest."""
    masked = bytearray(grh_bytes[:-4])
    masked[0] |= 0x0F
    masked[1:4] = b"\xff\xff\xff"
    masked[7] = 0xFF
    masked[44] = 0xFF
    return struct.pack("<I", zlib.crc32(b"\xff" * 8 + bytes(masked)))


def icrc_ok(frame: bytes | Packet) -> bool:
    """Recompute the ICRC of a received RoCEv2 (or RoCEv1) frame and compare it with the
    stored one. Bytes are read as Ethernet. The computation is scapy.contrib.roce's for
    RoCEv2; trailing Ethernet padding is ignored, as the ICRC ends the IP datagram."""
    pkt: Packet
    try:
        if isinstance(frame, (bytes, bytearray)):
            pkt = Ether(bytes(frame))
        else:
            pkt = frame.__class__(raw(frame))
    except struct.error:  # Scapy's Ether raises on frames shorter than its header
        return False
    bth = pkt.getlayer(BTH)
    if bth is None:
        return False
    lower = bth.underlayer
    if isinstance(lower, GRH):
        data = raw(lower)[:40 + lower.paylen]
        return len(data) == 40 + lower.paylen >= 56 and _roce_v1_icrc(data) == data[-4:]
    ip = lower.underlayer if isinstance(lower, UDP) else None
    if not isinstance(ip, (IP, IPv6)):
        return False
    data = raw(ip)
    size = ip.len if isinstance(ip, IP) else 40 + ip.plen
    if len(data) < size or size < 4:
        return False
    data = data[:size]
    fresh = ip.__class__(data, stop_dissection_after=BTH).getlayer(BTH)
    return fresh is not None and fresh.compute_icrc(b"") == data[-4:]
