"""Scapy layers for iWARP: MPA framing, DDP and RDMAP, with the RDMAP extensions.

MPA is RFC 5044 (startup frames s7.1, FPDU s4) with the enhanced connection setup of
RFC 6581; DDP is RFC 5041 s4; RDMAP is RFC 5040 s4 and RFC 7306 (atomics and
immediate data).  DDP and the RDMAP control octets are one layer, ``DDP``, the way
Wireshark shows them, because the RDMAP control field lives in DDP's RsvdULP bits.

``MPA(data)`` dissects one FPDU down to the RDMAP body; the startup frames are found by
their key, so ``MPA(data)`` also returns an ``MPARequest`` or ``MPAReply``.  Markers
(RFC 5044 s4.3) depend on the stream position, so they are handled by
``kbtp_scapy.wire.mpa_markers``, not here.
"""
from __future__ import annotations

import struct

from scapy.config import conf
from scapy.fields import (
    BitEnumField,
    BitField,
    BitMultiEnumField,
    ByteEnumField,
    ConditionalField,
    FlagsField,
    IntEnumField,
    IntField,
    MultiEnumField,
    PacketField,
    ShortField,
    StrFixedLenField,
    XIntField,
    XLEIntField,
    XLongField,
    XStrLenField,
)
from scapy.packet import Packet, Raw

from ..wire.iwarp_defs import (  # noqa: F401  (re-exported: the layers' vocabulary)
    ATOMIC_OPCODES,
    DDP_TAGGED_LEN,
    DDP_UNTAGGED_LEN,
    FPDU_OVERHEAD,
    INVALIDATE_OPCODES,
    MPA_REP_KEY,
    MPA_REQ_KEY,
    MPA_STARTUP_LEN,
    OPCODE_QUEUE,
    QUEUE_NAMES,
    RDMAP_OPCODES,
    SEND_OPCODES,
    SOLICITED_OPCODES,
    TAGGED_OPCODES,
    TERM_ERRCODES,
    TERM_ETYPES,
    TERM_LAYERS,
    Op,
    crc32c,
    fpdu_pad_len,
)

__all__ = [
    "MPA", "MPARequest", "MPAReply", "MPAEnhanced", "DDP", "RDMAPReadRequest",
    "RDMAPTerminate", "RDMAPAtomicRequest", "RDMAPAtomicResponse", "RDMAPImmediate",
    "Op", "RDMAP_OPCODES", "TAGGED_OPCODES", "SEND_OPCODES", "INVALIDATE_OPCODES",
    "SOLICITED_OPCODES", "OPCODE_QUEUE", "QUEUE_NAMES", "ATOMIC_OPCODES", "TERM_LAYERS",
    "TERM_ETYPES", "TERM_ERRCODES", "MPA_REQ_KEY", "MPA_REP_KEY", "MPA_STARTUP_LEN",
    "FPDU_OVERHEAD", "DDP_TAGGED_LEN", "DDP_UNTAGGED_LEN", "crc32c", "fpdu_pad_len",
]

class _Tolerant(Packet):
    """A top-level dissection that never raises: unparseable input is kept as Raw.

    Nested layers need no help: Scapy already turns a failing payload into Raw.
    """

    def dissect(self, s: bytes) -> None:
        try:
            super().dissect(s)
        except Exception:
            if conf.debug_dissector or self.underlayer is not None:
                raise
            self.fields = {}
            self.raw_packet_cache_fields = {}
            self.raw_packet_cache = b""           # rebuilds to exactly ``s``
            self.remove_payload()
            self.add_payload(conf.raw_layer(s))


# --- MPA startup frames (RFC 5044 s7.1, RFC 6581) -------------------------------------

class MPAEnhanced(_Tolerant):
    """RFC 6581 enhanced connection data (IRD/ORD): the first 4 octets of private data."""

    name = "MPA Enhanced Connection Data (IRD/ORD)"
    fields_desc = [
        BitEnumField("p2p", 0, 1, {0: "client-server", 1: "peer-to-peer"}),
        BitEnumField("rtr_send", 0, 1, {0: "-", 1: "zero-length Send RTR"}),
        BitField("ird", 16, 14),
        BitEnumField("rtr_write", 0, 1, {0: "-", 1: "zero-length RDMA Write RTR"}),
        BitEnumField("rtr_read", 0, 1, {0: "-", 1: "zero-length RDMA Read RTR"}),
        BitField("ord", 16, 14),
    ]


MPA_REVISIONS = {1: "1 (RFC 5044)", 2: "2 (RFC 6581)"}


class _MPAStartup(_Tolerant):
    """Request/Reply frame: key, M C R and enhanced flags, Rev, PD_Length, private data."""

    fields_desc = [
        StrFixedLenField("key", MPA_REQ_KEY, 16),
        FlagsField("flags", "C+S", 4, ["S", "R", "C", "M"]),  # type: ignore[arg-type]  # Scapy takes names; LSB first: S=0x1 ... M=0x8
        BitField("res", 0, 4),
        ByteEnumField("rev", 2, MPA_REVISIONS),
        ShortField("pd_length", None),
    ]

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        if self.pd_length is None:
            p = p[:18] + struct.pack("!H", len(pay))
        return p + pay

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return s[: self.pd_length], s[self.pd_length:]

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        if self.rev == 2 and self.flags.S and len(payload) >= 4:
            return MPAEnhanced
        return Raw


class MPARequest(_MPAStartup):
    """MPA Request frame, sent by the initiator right after the TCP handshake."""

    name = "MPA Request"


class MPAReply(_MPAStartup):
    """MPA Reply frame; the R flag set means the responder rejects the connection."""

    name = "MPA Reply"
    fields_desc = [StrFixedLenField("key", MPA_REP_KEY, 16), *_MPAStartup.fields_desc[1:]]


# --- MPA FPDU (RFC 5044 s4) -----------------------------------------------------------

class MPA(_Tolerant):
    """An MPA FPDU: ULPDU Length, the ULPDU (a DDP segment) as payload, pad and CRC.

    ``ulpdu_len``, ``pad`` and ``crc`` are computed at build time only when left None,
    so a fuzzer can set wrong ones.  The CRC32c is written least significant octet
    first, as Linux siw does and as tshark checks it.  On the wire pad and CRC follow
    the payload; they are fields here, moved into place by post_build/pre_dissect.
    A truncated FPDU dissects with the pad octets it has and no CRC.
    """

    name = "MPA FPDU"
    __slots__ = ["_trailer"]          # trailer octets present when dissected, else None
    fields_desc = [
        ShortField("ulpdu_len", None),
        XStrLenField("pad", None, length_from=lambda p: p._pad_present()),  # type: ignore[arg-type]  # None: from the length
        ConditionalField(XLEIntField("crc", None), lambda p: p._crc_present()),
    ]

    def __init__(self, *args, **kwargs) -> None:
        self._trailer: int | None = None
        super().__init__(*args, **kwargs)

    @classmethod
    def dispatch_hook(cls, _pkt: bytes | None = None, *args, **kargs) -> type[Packet]:
        if _pkt and _pkt[:16] == MPA_REQ_KEY:
            return MPARequest
        if _pkt and _pkt[:16] == MPA_REP_KEY:
            return MPAReply
        return cls

    def _pad_present(self) -> int:
        return min(fpdu_pad_len(self.ulpdu_len or 0), self._trailer or 0)

    def _crc_present(self) -> bool:
        need = fpdu_pad_len(self.ulpdu_len or 0) + 4
        return self._trailer is None or self._trailer >= need

    def copy(self) -> MPA:
        clone = super().copy()
        clone._trailer = self._trailer
        return clone

    def pre_dissect(self, s: bytes) -> bytes:
        """Move pad and CRC before the ULPDU so that the fields parse in order."""
        self._trailer = 0
        if len(s) < 2:
            return s
        end = 2 + struct.unpack("!H", s[:2])[0]
        npad = fpdu_pad_len(end - 2)
        trailer = s[end:end + npad + 4]
        self._trailer = len(trailer)
        if len(trailer) < npad + 4:     # truncated: a partial CRC is left as padding
            return s[:2] + trailer[:npad] + s[2:end] + trailer[npad:]
        return s[:2] + trailer + s[2:end] + s[end + len(trailer):]

    def post_dissect(self, s: bytes) -> bytes:
        self.raw_packet_cache = None      # the cached field octets are in dissect order
        return s

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return s[: self.ulpdu_len], s[self.ulpdu_len:]

    def do_dissect_payload(self, s: bytes) -> None:
        """Octets after an RDMAP body are still ULPDU, before pad and CRC: keep them as
        Raw, since Scapy would move Padding to the very end of the packet."""
        super().do_dissect_payload(s)
        inner = self.getlayer(conf.padding_layer)
        if inner is not None and inner.underlayer is not None:
            under = inner.underlayer
            under.remove_payload()
            under.add_payload(conf.raw_layer(inner.load))

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        head = p[:2] if self.ulpdu_len is not None else struct.pack("!H", len(pay))
        pad, crc = (p[2:-4], p[-4:]) if self._crc_present() else (p[2:], b"")
        if self.pad is None:
            pad = b"\0" * fpdu_pad_len(len(pay))
        if self.crc is None and crc:
            crc = struct.pack("<I", crc32c(head + pay + pad))
        return head + pay + pad + crc

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        return DDP

    def crc_ok(self) -> bool:
        """True when the CRC field matches the FPDU as it stands (marker-free); a CRC
        left None will be computed, so it matches unless the FPDU was cut short."""
        if not self._crc_present():
            return False
        if self.crc is None:
            return True
        ulpdu = self.payload.do_build()
        head = struct.pack("!H", len(ulpdu) if self.ulpdu_len is None else self.ulpdu_len)
        pad = b"\0" * fpdu_pad_len(len(ulpdu)) if self.pad is None else self.pad
        return self.crc == crc32c(head + ulpdu + pad)


# --- DDP with the RDMAP control field (RFC 5041 s4, RFC 5040 s4) ----------------------

def _is_tagged(p: Packet) -> bool:
    return bool(p.tagged) if p.tagged is not None else p.opcode in TAGGED_OPCODES


class _DerivedBitEnumField(BitEnumField):
    """T flag: left None it follows the opcode (Write and Read Response are tagged)."""

    def i2m(self, pkt, x):
        return super().i2m(pkt, int(_is_tagged(pkt)) if x is None else x)


class _QueueField(IntEnumField):
    """QN: left None it follows the opcode (RFC 5040 and RFC 7306 queue numbers)."""

    def i2m(self, pkt, x):
        return super().i2m(pkt, OPCODE_QUEUE.get(pkt.opcode, 0) if x is None else x)


class DDP(_Tolerant):
    """A DDP segment header with its RDMAP control field, as Wireshark shows them.

    Tagged (T=1) segments carry STag and TO; untagged ones carry the Invalidate STag
    (RsvdULP[8:39], RFC 5040 s4), QN, MSN and MO.  ``tagged`` and ``qn`` follow the
    opcode when left None.
    """

    name = "DDP/RDMAP"
    fields_desc = [
        _DerivedBitEnumField("tagged", None, 1, {0: "untagged", 1: "tagged"}),
        BitEnumField("last", 1, 1, {0: "more segments", 1: "last segment"}),
        BitField("rsvd", 0, 4),
        BitEnumField("dv", 1, 2, {1: "DDP version 1 (RFC 5041)"}),
        BitEnumField("rv", 1, 2, {1: "RDMAP version 1 (RFC 5040)"}),
        BitField("rdmap_rsvd", 0, 2),
        BitEnumField("opcode", Op.SEND, 4, RDMAP_OPCODES),
        ConditionalField(XIntField("stag", 0), _is_tagged),
        ConditionalField(XLongField("to", 0), _is_tagged),
        ConditionalField(XIntField("inv_stag", 0), lambda p: not _is_tagged(p)),
        ConditionalField(_QueueField("qn", None, QUEUE_NAMES), lambda p: not _is_tagged(p)),
        ConditionalField(IntField("msn", 1), lambda p: not _is_tagged(p)),
        ConditionalField(IntField("mo", 0), lambda p: not _is_tagged(p)),
    ]

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        """RDMAP bodies start only the first segment of an untagged message."""
        if _is_tagged(self) or self.mo != 0:
            return Raw
        body = _BODIES.get(self.opcode)
        if body is not None:
            return body
        if self.opcode in SEND_OPCODES:
            return _kbtp_class(payload) or Raw
        return Raw


def _kbtp_class(payload: bytes) -> type[Packet] | None:
    """The KBTP layer when the payload looks like KBTP (imported late: no cycle)."""
    try:
        from kbtp_scapy.layers import kbtp
    except ImportError:
        return None
    return kbtp.KBTP if kbtp.looks_like_kbtp(payload) else None


# --- RDMAP message bodies -------------------------------------------------------------

class _Body(_Tolerant):
    """A fixed-size RDMAP body; octets after it are left over, not a payload of it."""

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return b"", s


class RDMAPReadRequest(_Body):
    """RDMA Read Request header (RFC 5040 s4), 28 octets."""

    name = "RDMA Read Request"
    fields_desc = [
        XIntField("sink_stag", 0),
        XLongField("sink_to", 0),
        IntField("read_size", 0),
        XIntField("src_stag", 0),
        XLongField("src_to", 0),
    ]


class _TerminatedDDPField(PacketField):
    """The copied DDP header of a Terminate: 14 octets if its T flag is set, else 18."""

    def getfield(self, pkt: Packet, s: bytes) -> tuple[bytes, Packet]:
        n = DDP_TAGGED_LEN if s and s[0] & 0x80 else DDP_UNTAGGED_LEN
        return s[n:], self.m2i(pkt, s[:n])


class RDMAPTerminate(_Body):
    """Terminate message (RFC 5040 s4): what failed, where, and the copied headers.

    With the D flag the DDP Segment Length and the terminated DDP header follow; with
    the R flag the terminated RDMA Read Request header (28 octets) follows.
    """

    name = "RDMAP Terminate"
    fields_desc = [
        BitEnumField("layer", 0, 4, TERM_LAYERS),
        # Scapy's stubs: depends_on may get None, and MultiEnumField keys are ints; Scapy
        # calls depends_on with the packet, and any hashable is a key
        BitMultiEnumField("etype", 0, 4, TERM_ETYPES, depends_on=lambda p: p.layer),  # type: ignore[union-attr]
        MultiEnumField("errcode", 0, TERM_ERRCODES, fmt="B",  # type: ignore[arg-type]
                       depends_on=lambda p: (p.layer, p.etype)),  # type: ignore[union-attr,return-value,arg-type]
        BitEnumField("hdrct_m", 0, 1, {0: "-", 1: "DDP Segment Length valid"}),
        BitEnumField("hdrct_d", 0, 1, {0: "-", 1: "DDP header included"}),
        BitEnumField("hdrct_r", 0, 1, {0: "-", 1: "RDMAP header included"}),
        BitField("rsvd", 0, 13),
        ConditionalField(ShortField("ddp_seg_len", 0), lambda p: p.hdrct_d),
        ConditionalField(_TerminatedDDPField("ddp_hdr", DDP(), DDP), lambda p: p.hdrct_d),
        ConditionalField(PacketField("rdmap_hdr", RDMAPReadRequest(), RDMAPReadRequest),
                         lambda p: p.hdrct_r),
    ]


class RDMAPAtomicRequest(_Body):
    """Atomic Request (RFC 7306), 52 octets; a non-zero Add Mask with FetchAdd
    is the masked FetchAdd whose set mask bits stop the carry out of that bit."""

    name = "RDMAP Atomic Request"
    fields_desc = [
        BitField("reserved", 0, 28),
        BitEnumField("aopcode", 0, 4, ATOMIC_OPCODES),
        XIntField("req_id", 0),
        XIntField("remote_stag", 0),
        XLongField("remote_to", 0),
        XLongField("data", 0),           # Add Data or Swap Data
        XLongField("mask", 0),           # Add Mask or Swap Mask
        XLongField("compare_data", 0),
        XLongField("compare_mask", 0),
    ]


class RDMAPAtomicResponse(_Body):
    """Atomic Response (RFC 7306): request identifier and the original data."""

    name = "RDMAP Atomic Response"
    fields_desc = [XIntField("orig_req_id", 0), XLongField("orig_data", 0)]


class RDMAPImmediate(_Body):
    """Immediate Data message body (RFC 7306): 8 octets for the receiver's CQ."""

    name = "RDMAP Immediate Data"
    fields_desc = [XLongField("imm", 0)]


_BODIES: dict[int, type[Packet]] = {
    Op.READ_REQUEST: RDMAPReadRequest,
    Op.TERMINATE: RDMAPTerminate,
    Op.IMMEDIATE: RDMAPImmediate,
    Op.IMMEDIATE_SE: RDMAPImmediate,
    Op.ATOMIC_REQUEST: RDMAPAtomicRequest,
    Op.ATOMIC_RESPONSE: RDMAPAtomicResponse,
}

