"""Byte-level iWARP headers for the soft RNIC's data path, and the frames shown to listeners.

The Scapy layers in ``kbtp_scapy.layers.iwarp`` define the same formats; they are the
test oracle, while this module packs and unpacks with precompiled ``struct.Struct``s so
that per-FPDU work stays cheap. ``TcpFrames`` synthesises the Ethernet/IP/TCP frames
that carried a connection's octets; it runs only when someone listens.
"""
from __future__ import annotations

import hashlib
import socket
import struct
from dataclasses import dataclass

import google_crc32c

from kbtp_scapy.wire.iwarp_defs import (
    DDP_TAGGED_LEN,
    DDP_UNTAGGED_LEN,
    MPA_REP_KEY,
    MPA_REQ_KEY,
    MPA_STARTUP_LEN,
    TERM_ERRCODES,
    TERM_ETYPES,
    TERM_LAYERS,
    fpdu_pad_len,
)
from kbtp_scapy.wire.mpa_markers import MARKER_INTERVAL, MARKER_LEN

# --- MPA startup frames (RFC 5044 s7.1, RFC 6581 s9) ---------------------------------

FLAG_M, FLAG_C, FLAG_R, FLAG_S = 0x80, 0x40, 0x20, 0x10   # octet 16 of a startup frame
MAX_PRIVATE_DATA = 512                                     # RFC 5044 s7.1 PD_Length limit
IRD_P2P, IRD_RTR_SEND = 0x8000, 0x4000                     # RFC 6581 s9.1 control bits
ORD_RTR_WRITE, ORD_RTR_READ = 0x8000, 0x4000
IRD_ORD_MASK = 0x3FFF
_STARTUP = struct.Struct("!16sBBH")
_IRD_ORD = struct.Struct("!HH")


@dataclass
class Startup:
    """A parsed MPA Request or Reply; ``ird``/``ord``/RTR fields come from RFC 6581 data."""

    request: bool
    flags: int
    rev: int
    private: bytes
    enhanced: bool = False
    ird: int = 0
    ord: int = 0
    p2p: bool = False
    rtr_send: bool = False
    rtr_write: bool = False
    rtr_read: bool = False


def build_startup(request: bool, flags: int, rev: int, ird: int | None = None,
                  ord: int | None = None, ird_bits: int = 0, ord_bits: int = 0) -> bytes:
    """An MPA Request/Reply; with ``ird`` set it carries the RFC 6581 IRD/ORD word pair."""
    private = b""
    if ird is not None:
        if ord is None:
            raise TypeError("build_startup: ird and ord go together")
        flags |= FLAG_S
        private = _IRD_ORD.pack(ird_bits | ird & IRD_ORD_MASK, ord_bits | ord & IRD_ORD_MASK)
    key = MPA_REQ_KEY if request else MPA_REP_KEY
    return _STARTUP.pack(key, flags, rev, len(private)) + private


def startup_length(data: bytes | bytearray) -> int | None:
    """Octets of the whole startup frame at the front of ``data``, None until known."""
    if len(data) < MPA_STARTUP_LEN:
        return None
    return MPA_STARTUP_LEN + int.from_bytes(data[18:20], "big")


def foreign_start(data: bytes | bytearray) -> str | None:
    """How ``data`` starts (its first line, at most a key's length) when it cannot be the
    start of an MPA Request or Reply: an HTTP server's answer, say; None while it can."""
    head = bytes(data[:len(MPA_REQ_KEY)])
    if not head or MPA_REQ_KEY.startswith(head) or MPA_REP_KEY.startswith(head):
        return None
    return head.split(b"\r")[0].split(b"\n")[0].decode("ascii", "backslashreplace")


def parse_startup(frame: bytes) -> Startup | None:
    """The startup frame (exactly ``startup_length`` octets), or None if the key is wrong."""
    key, flags, rev, _ = _STARTUP.unpack_from(frame)
    if key not in (MPA_REQ_KEY, MPA_REP_KEY):
        return None
    st = Startup(key == MPA_REQ_KEY, flags, rev, bytes(frame[MPA_STARTUP_LEN:]))
    if rev == 2 and flags & FLAG_S and len(st.private) >= 4:
        ird, ord_ = _IRD_ORD.unpack_from(st.private)
        st.enhanced = True
        st.ird, st.ord = ird & IRD_ORD_MASK, ord_ & IRD_ORD_MASK
        st.p2p, st.rtr_send = bool(ird & IRD_P2P), bool(ird & IRD_RTR_SEND)
        st.rtr_write, st.rtr_read = bool(ord_ & ORD_RTR_WRITE), bool(ord_ & ORD_RTR_READ)
    return st


# --- FPDUs (RFC 5044 s4) with DDP/RDMAP headers (RFC 5041 s4, RFC 5040 s4) ------------

_DDP_RDMAP_VERSION = 0x01, 0x40          # DV = 1 in octet 0, RV = 1 in octet 1
TAGGED = struct.Struct("!HBBIQ")          # ULPDU Length, ctrl, rdmap, STag, TO
UNTAGGED = struct.Struct("!HBBIIII")      # ULPDU Length, ctrl, rdmap, Inv STag, QN, MSN, MO
LENGTH = struct.Struct("!H")
CRC = struct.Struct("<I")                 # least significant octet first (NOTES.md s3)
READ_REQUEST = struct.Struct("!IQIIQ")    # sink STag, sink TO, size, source STag, source TO
ATOMIC_REQUEST = struct.Struct("!IIIQQQQQ")   # RFC 7306: opcode, id, STag, TO, data, masks
ATOMIC_RESPONSE = struct.Struct("!IQ")    # RFC 7306: request identifier, original data
TERM_CTRL = struct.Struct("!I")
_PADS = (b"", b"\0", b"\0\0", b"\0\0\0")
ATOMIC_FETCH_ADD, ATOMIC_SWAP, ATOMIC_CMP_SWAP = 0, 1, 2


def ctrl_octets(tagged: bool, last: bool, opcode: int) -> tuple[int, int]:
    """DDP control octet (T, L, DV) and RDMAP control octet (RV, opcode)."""
    return (0x80 * tagged | 0x40 * last | _DDP_RDMAP_VERSION[0],
            _DDP_RDMAP_VERSION[1] | opcode)


def fpdu_tail(head: bytes, payload: bytes, crc: bool) -> bytes:
    """Pad and CRC32c that close an FPDU of ``head`` + ``payload`` (zero CRC when off)."""
    pad = _PADS[fpdu_pad_len(len(head) - 2 + len(payload))]
    if not crc:
        return pad + b"\0\0\0\0"
    value = google_crc32c.extend(google_crc32c.value(head), payload) if payload else \
        google_crc32c.value(head)
    return pad + CRC.pack(google_crc32c.extend(value, pad) if pad else value)


def tagged_head(last: bool, opcode: int, stag: int, to: int, length: int) -> bytes:
    c0, c1 = ctrl_octets(True, last, opcode)
    return TAGGED.pack(DDP_TAGGED_LEN + length, c0, c1, stag, to)


def untagged_head(last: bool, opcode: int, qn: int, msn: int, mo: int, length: int,
                  inv_stag: int = 0) -> bytes:
    c0, c1 = ctrl_octets(False, last, opcode)
    return UNTAGGED.pack(DDP_UNTAGGED_LEN + length, c0, c1, inv_stag, qn, msn, mo)


def crc_ok(fpdu: bytes) -> bool:
    """Whether the last 4 octets of a complete FPDU are its CRC32c."""
    return CRC.unpack_from(fpdu, len(fpdu) - 4)[0] == google_crc32c.value(fpdu[:-4])


def fpdu_wire_length(clean_len: int, pos: int, markers: bool) -> int:
    """Octets an FPDU of ``clean_len`` takes at stream position ``pos`` (RFC 5044 s4.3:
    a marker every 512 octets, counted from the first FPDU)."""
    if not markers:
        return clean_len
    wire = clean_len
    while True:
        first = -pos % MARKER_INTERVAL
        count = 0 if first >= wire else 1 + (wire - 1 - first) // MARKER_INTERVAL
        if clean_len + MARKER_LEN * count == wire:
            return wire
        wire = clean_len + MARKER_LEN * count


# --- Terminate (RFC 5040 s4.8, error codes s7.4; RFC 5041 s7) ------------------------

LAYER_RDMAP, LAYER_DDP, LAYER_LLP = 0, 1, 2
RDMAP_PROTECTION, RDMAP_OPERATION = 1, 2
DDP_TAGGED, DDP_UNTAGGED = 1, 2
LLP_MPA = 0
HDR_M, HDR_D, HDR_R = 0x8000, 0x4000, 0x2000


def terminate_body(layer: int, etype: int, code: int, ddp_header: bytes = b"",
                   ddp_length: int = 0, rdmap_header: bytes = b"") -> bytes:
    """Terminate Control, then the terminated DDP segment's length and header (D, M),
    then the terminated Read Request header (R)."""
    bits = (HDR_M | HDR_D if ddp_header else 0) | (HDR_R if rdmap_header else 0)
    body = TERM_CTRL.pack(layer << 28 | etype << 24 | code << 16 | bits)
    if ddp_header:
        body += LENGTH.pack(ddp_length) + ddp_header
    return body + rdmap_header


@dataclass
class Terminate:
    """A received Terminate, with the QN/MSN of the message it names when it has one."""

    layer: int
    etype: int
    code: int
    qn: int | None = None
    msn: int | None = None
    stag: int | None = None

    def describe(self) -> str:
        layer = TERM_LAYERS.get(self.layer, f"layer {self.layer}")
        etype = TERM_ETYPES.get(self.layer, {}).get(self.etype, f"type {self.etype}")
        code = TERM_ERRCODES.get((self.layer, self.etype), {}).get(self.code,
                                                                   f"code 0x{self.code:02x}")
        where = f" (STag 0x{self.stag:08x})" if self.stag is not None else \
            f" (queue {self.qn} MSN {self.msn})" if self.qn is not None else ""
        return f"Terminate from peer: {layer} {etype}: {code}{where}"


def parse_terminate(body: bytes) -> Terminate:
    ctrl = TERM_CTRL.unpack_from(body)[0] if len(body) >= 4 else 0
    term = Terminate(ctrl >> 28, ctrl >> 24 & 0xF, ctrl >> 16 & 0xFF)
    hdr = body[6:]
    if ctrl & HDR_D and len(hdr) >= DDP_TAGGED_LEN:
        if hdr[0] & 0x80:
            term.stag = int.from_bytes(hdr[2:6], "big")
        elif len(hdr) >= DDP_UNTAGGED_LEN:
            term.qn, term.msn = struct.unpack_from("!II", hdr, 6)
    return term


# --- Frames for listeners: Ethernet / IPv4 or IPv6 / TCP ------------------------------

_ETH = struct.Struct("!6s6sH")
_IPV4 = struct.Struct("!BBHHHBBH4s4s")
_IPV6 = struct.Struct("!IHBB16s16s")
_TCP = struct.Struct("!HHIIBBHHH")
_PSEUDO4 = struct.Struct("!4s4sBBH")
_PSEUDO6 = struct.Struct("!16s16sIxxxB")
_SYN, _FIN, _PSH, _ACK = 0x02, 0x01, 0x08, 0x10
_WINDOW = 65535


def _digest(*parts: object) -> bytes:
    return hashlib.blake2s(repr(parts).encode()).digest()


def isn(src: tuple[str, int], dst: tuple[str, int]) -> int:
    """Initial sequence number of the direction ``src`` -> ``dst``: both ends of a
    connection compute the same value, so their captures agree."""
    return int.from_bytes(_digest("isn", src, dst)[:4], "big")


def mac(end: tuple[str, int]) -> bytes:
    """A locally administered MAC address for an endpoint."""
    return b"\x02" + _digest("mac", end)[:5]


class TcpFrames:
    """The frames of one TCP connection seen from ``local``, with real addresses and
    ports and sequence numbers derived from the 4-tuple (``isn``)."""

    def __init__(self, local: tuple[str, int], remote: tuple[str, int], mss: int) -> None:
        self.local, self.remote, self.mss = local, remote, mss
        self.v6 = ":" in local[0]
        family = socket.AF_INET6 if self.v6 else socket.AF_INET
        self._addr = {"tx": socket.inet_pton(family, local[0]),
                      "rx": socket.inet_pton(family, remote[0])}
        self._mac = {"tx": mac(local), "rx": mac(remote)}
        self._port = {"tx": local[1], "rx": remote[1]}
        self._seq = {"tx": isn(local, remote), "rx": isn(remote, local)}
        self._ip_id = {"tx": 0, "rx": 0}

    def handshake(self, active: bool) -> list[tuple[str, bytes]]:
        """SYN, SYN-ACK, ACK; ``active`` when the local end connected."""
        first, second = ("tx", "rx") if active else ("rx", "tx")
        mss = struct.pack("!BBH", 2, 4, self.mss)
        return [(first, self._segment(first, _SYN, b"", mss, ack=False)),
                (second, self._segment(second, _SYN | _ACK, b"", mss)),
                (first, self._segment(first, _ACK, b""))]

    def data(self, direction: str, units: list[bytes]) -> list[bytes]:
        """Segments carrying ``units`` (FPDUs or startup frames) in ``direction`` ("tx" or
        "rx"): one whole unit per segment, aligned as an MPA-aware TCP sends them (RFC 5044
        s4.1) and as hardware RNICs do; a larger unit is cut at the MSS. tshark 4.0 needs
        that too: it passes only the first Send of a segment to the KBTP heuristic, and
        finds markers only in segments of one FPDU."""
        frames, segment = [], b""
        for unit in units:
            if segment:
                frames.append(self._segment(direction, _PSH | _ACK, segment))
                segment = b""
            segment += unit
            while len(segment) > self.mss:
                frames.append(self._segment(direction, _PSH | _ACK, segment[:self.mss]))
                segment = segment[self.mss:]
        if segment:
            frames.append(self._segment(direction, _PSH | _ACK, segment))
        return frames

    def skip(self, direction: str, octets: int) -> None:
        """Account for octets sent while nobody listened, so later frames stay in sequence."""
        self._seq[direction] = (self._seq[direction] + octets) & 0xFFFFFFFF

    def fin(self, direction: str) -> bytes:
        return self._segment(direction, _FIN | _ACK, b"")

    def ack(self, direction: str) -> bytes:
        return self._segment(direction, _ACK, b"")

    def _segment(self, d: str, flags: int, data: bytes, options: bytes = b"",
                 ack: bool = True) -> bytes:
        from scapy.utils import checksum  # only frame listeners pay for importing Scapy
        o = "rx" if d == "tx" else "tx"
        seq = self._seq[d]
        self._seq[d] = (seq + len(data) + bool(flags & (_SYN | _FIN))) & 0xFFFFFFFF
        hlen = 20 + len(options)
        tcp = _TCP.pack(self._port[d], self._port[o], seq, self._seq[o] if ack else 0,
                        hlen // 4 << 4, flags, _WINDOW, 0, 0) + options
        src, dst = self._addr[d], self._addr[o]
        length = hlen + len(data)
        if self.v6:
            pseudo = _PSEUDO6.pack(src, dst, length, socket.IPPROTO_TCP)
            net = _IPV6.pack(6 << 28, length, socket.IPPROTO_TCP, 64, src, dst)
            ethertype = 0x86DD
        else:
            pseudo = _PSEUDO4.pack(src, dst, 0, socket.IPPROTO_TCP, length)
            self._ip_id[d] = ident = (self._ip_id[d] + 1) & 0xFFFF
            net = _IPV4.pack(0x45, 0, 20 + length, ident, 0x4000, 64, socket.IPPROTO_TCP,
                             0, src, dst)
            net = net[:10] + struct.pack("!H", checksum(net)) + net[12:]
            ethertype = 0x0800
        tcp = tcp[:16] + struct.pack("!H", checksum(pseudo + tcp + data)) + tcp[18:]
        return _ETH.pack(self._mac[o], self._mac[d], ethertype) + net + tcp + data


__all__ = [
    "Startup", "TcpFrames", "Terminate", "build_startup", "crc_ok", "ctrl_octets",
    "fpdu_tail", "fpdu_wire_length", "parse_startup", "parse_terminate", "startup_length",
    "tagged_head", "terminate_body", "untagged_head",
]
