"""Byte-level RoCEv2 packets for the soft RNIC's data path, and the frames shown to listeners.

``kbtp_scapy.layers.roce`` and ``scapy.contrib.roce`` define the same formats; they are
the test oracle, while this module packs and unpacks with precompiled ``struct.Struct``s
so that per-packet work stays cheap. References are to the InfiniBand Architecture
Specification vol. 1: BTH 9.2, extended transport headers 9.3, AETH syndromes 9.7.5.2,
ICRC 7.8.1 as annex A17 applies it to RoCEv2 (IP/UDP pseudo header with variant fields
masked).

A packet is handed to the socket as a list of buffers (headers, payload view, pad, ICRC)
so a payload is never copied on its way out.
"""
from __future__ import annotations

import functools
import ipaddress
import socket
import struct
import zlib
from collections.abc import Callable, Sequence

MASK24 = 0xFFFFFF
HALF24 = 0x800000
DEFAULT_PKEY = 0xFFFF
CM_QPN = 1                      # QP1: the General Service Interface, where CM MADs go
CM_QKEY = 0x80010000            # the well-known GSI Q_Key (IB 13.5.1)
ICRC_LEN = 4

# --- BTH opcodes (IB 9.2.1, table 35): RC, plus UD SEND ONLY for MADs -------------------
SEND_FIRST, SEND_MIDDLE, SEND_LAST, SEND_LAST_IMM = 0x00, 0x01, 0x02, 0x03
SEND_ONLY, SEND_ONLY_IMM = 0x04, 0x05
WRITE_FIRST, WRITE_MIDDLE, WRITE_LAST, WRITE_LAST_IMM = 0x06, 0x07, 0x08, 0x09
WRITE_ONLY, WRITE_ONLY_IMM = 0x0A, 0x0B
READ_REQUEST = 0x0C
READ_RESP_FIRST, READ_RESP_MIDDLE, READ_RESP_LAST, READ_RESP_ONLY = 0x0D, 0x0E, 0x0F, 0x10
ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE, COMPARE_SWAP, FETCH_ADD = 0x11, 0x12, 0x13, 0x14
SEND_LAST_INV, SEND_ONLY_INV = 0x16, 0x17
UD_SEND_ONLY = 0x64

# --- AETH syndrome (IB 9.7.5.2, table 43) ---------------------------------------------
SYN_ACK = 0x1F                  # ACK with credit count 0x1F: "invalid", no end-to-end credits
SYN_RNR = 0x20                  # RNR NAK; low 5 bits are the RNR timer code
SYN_NAK = 0x60                  # NAK; low 5 bits are the NAK code
NAK_PSN_SEQ, NAK_INVALID_REQUEST, NAK_REMOTE_ACCESS, NAK_REMOTE_OP = 0, 1, 2, 3

#: Minimum RNR NAK timer in seconds by 5-bit code (IB 9.7.5.2.8, table 45).
RNR_TIMER = tuple(ms / 1000 for ms in (
    655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96,
    1.28, 1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92,
    122.88, 163.84, 245.76, 327.68, 491.52))

# --- headers: BTH alone and BTH followed by each extension sequence (IB 9.2, 9.3) ------
# BTH: opcode · SE|MigReq|PadCnt|TVer (SE 0x80, PadCnt << 4, MigReq and TVer 0) · P_Key ·
# resv8a|DestQP · AckReq|resv7|PSN (AckReq 0x80000000)
BTH = struct.Struct("!BBHII")
BTH_RETH = struct.Struct("!BBHIIQII")           # + VA, R_Key, DMA Length
BTH_RETH_IMM = struct.Struct("!BBHIIQIII")      # + RETH, ImmDt
BTH_U32 = struct.Struct("!BBHIII")              # + ImmDt, IETH or AETH
BTH_AETH_ATOMICACK = struct.Struct("!BBHIIIQ")  # + AETH, original data
BTH_ATOMIC = struct.Struct("!BBHIIQIQQ")        # + VA, R_Key, Swap/Add, Compare
BTH_DETH = struct.Struct("!BBHIIII")            # + Q_Key, source QP
RETH = struct.Struct("!QII")
ATOMIC_ETH = struct.Struct("!QIQQ")
U32 = struct.Struct("!I")
U64 = struct.Struct("!Q")
ICRC = struct.Struct("<I")                      # stored least significant octet first

#: Octets of extension headers after the BTH, by opcode.
EXT_LEN = {
    SEND_FIRST: 0, SEND_MIDDLE: 0, SEND_LAST: 0, SEND_LAST_IMM: 4, SEND_ONLY: 0,
    SEND_ONLY_IMM: 4, WRITE_FIRST: 16, WRITE_MIDDLE: 0, WRITE_LAST: 0, WRITE_LAST_IMM: 4,
    WRITE_ONLY: 16, WRITE_ONLY_IMM: 20, READ_REQUEST: 16, READ_RESP_FIRST: 4,
    READ_RESP_MIDDLE: 0, READ_RESP_LAST: 4, READ_RESP_ONLY: 4, ACKNOWLEDGE: 4,
    ATOMIC_ACKNOWLEDGE: 12, COMPARE_SWAP: 28, FETCH_ADD: 28, SEND_LAST_INV: 4,
    SEND_ONLY_INV: 4, UD_SEND_ONLY: 8,
}
PAD = (b"", b"\0", b"\0\0", b"\0\0\0")


def psn_diff(a: int, b: int) -> int:
    """``a - b`` in 24-bit PSN space, as a signed distance (IB 9.7.1: half the space ahead)."""
    d = (a - b) & MASK24
    return d - 0x1000000 if d >= HALF24 else d


class Path:
    """One direction between two UDP endpoints: what the ICRC and a synthesized frame
    need to know of the IP and UDP headers the kernel writes around a datagram.

    The receiver cannot see the sender's IP header through a socket, so both sides compute
    the ICRC over the header the sender's kernel writes: IPv4 with DF set and
    Identification 0 (Linux's choice for DF datagrams of unconnected sockets), IPv6 without
    extension headers; TOS/Traffic Class, Flow Label, TTL/Hop Limit and the checksums are
    masked anyway (annex A17.4.5)."""

    __slots__ = ("_eth", "_pre", "dport", "dst", "last_id", "sport", "src", "v6")

    _V4 = struct.Struct("!QBBHHHBBH4s4sHHHH")
    _V6 = struct.Struct("!QIHBB16s16sHHHH")

    def __init__(self, src: tuple[str, int], dst: tuple[str, int]) -> None:
        self.v6 = ":" in src[0]
        family = socket.AF_INET6 if self.v6 else socket.AF_INET
        self.src = socket.inet_pton(family, src[0])
        self.dst = socket.inet_pton(family, dst[0])
        self.sport, self.dport = src[1], dst[1]
        self.last_id = 0
        self._pre: dict[int, int] = {}
        self._eth = mac(dst[0]) + mac(src[0]) + (b"\x86\xdd" if self.v6 else b"\x08\x00")

    def _prefix(self, n: int) -> int:
        """CRC-32 state after the 8 octets of ones (absent LRH), IP and UDP headers, for a
        datagram of ``n`` octets; cached, as packet sizes repeat."""
        crc = self._pre.get(n)
        if crc is None:
            if self.v6:
                head = self._V6.pack(2**64 - 1, 0x6FFFFFFF, n + 8, 17, 0xFF, self.src, self.dst,
                                     self.sport, self.dport, n + 8, 0xFFFF)
            else:
                head = self._V4.pack(2**64 - 1, 0x45, 0xFF, n + 28, 0, 0x4000, 0xFF, 17, 0xFFFF,
                                     self.src, self.dst, self.sport, self.dport, n + 8, 0xFFFF)
            crc = self._pre[n] = zlib.crc32(head)
        return crc

    def icrc(self, parts: Sequence[bytes | memoryview], n: int) -> int:
        """ICRC of a datagram of ``n`` octets (ICRC included) whose other octets are
        ``parts``, the first starting with the BTH; its resv8a octet is masked to ones."""
        head = parts[0]
        crc = zlib.crc32(b"\xff", zlib.crc32(head[:4], self._prefix(n)))
        crc = zlib.crc32(head[5:], crc)
        for part in parts[1:]:
            crc = zlib.crc32(part, crc)
        return crc

    def check(self, data: memoryview) -> bool:
        """Whether a received datagram's ICRC is right.

        The ICRC covers the sender's IPv4 Identification (annex A17.4.5.1 masks TOS, TTL
        and the checksum only), which a UDP socket never shows: Linux's own sockets send
        ID 0 with DF set, but rxe and NICs send a running ID. CRC-32 is linear, so the
        difference between the ICRC received and the one for ID 0 says which ID (if any)
        makes it right; it is kept in ``last_id`` for the frame the packet came in."""
        n = len(data)
        if n < 16:
            return False
        got = ICRC.unpack_from(data, n - 4)[0]
        diff = self.icrc((data[:-4],), n) ^ got
        self.last_id = 0
        if not diff:
            return True
        if self.v6:
            return False
        ident = _id_solver(n)(diff)
        if ident is None:
            return False
        self.last_id = ident
        return True

    def frame(self, datagram: bytes, ident: int = 0) -> bytes:
        """The Ethernet frame that carried ``datagram``: UDP checksum 0 (annex A17.4.3),
        IPv4 with DF and Identification ``ident``, TTL/Hop Limit 64."""
        n = len(datagram)
        udp = struct.pack("!HHHH", self.sport, self.dport, n + 8, 0)
        if self.v6:
            ip = struct.pack("!IHBB16s16s", 0x60000000, n + 8, 17, 64, self.src, self.dst)
        else:
            ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, n + 28, ident, 0x4000, 64, 17, 0,
                             self.src, self.dst)
            ip = ip[:10] + struct.pack("!H", _ip_checksum(ip)) + ip[12:]
        return self._eth + ip + udp + datagram


@functools.lru_cache(maxsize=2048)
def _id_solver(n: int) -> Callable[[int], int | None]:
    """For IPv4 datagrams of ``n`` octets: the Identification that turns an ICRC computed
    with ID 0 into the one received (their XOR), or None if none does.

    The ICRC runs over 8 octets of ones, the 20-octet IP header, the UDP header and the
    datagram less its ICRC; the ID is octets 12-13 of that. Flipping ID bit j changes
    the CRC by a fixed vector (the CRC of that one bit against zeros), so the XOR to
    explain is a sum of some of the 16 vectors: Gaussian elimination finds which."""
    length = 36 + n - 4
    zeros = zlib.crc32(bytes(length))
    basis: list[tuple[int, int, int]] = []       # (pivot bit, vector, ID bits behind it)
    for j in range(16):
        msg = bytearray(length)
        msg[12 + (15 - j) // 8] = 1 << (j % 8)
        vec, bits = zlib.crc32(msg) ^ zeros, 1 << j
        for pivot, v, b in basis:
            if vec & pivot:
                vec, bits = vec ^ v, bits ^ b
        if vec:
            pivot = vec & -vec
            basis = [(p, v ^ vec, b ^ bits) if v & pivot else (p, v, b) for p, v, b in basis]
            basis.append((pivot, vec, bits))

    def solve(diff: int) -> int | None:
        ident = 0
        for pivot, v, b in basis:
            if diff & pivot:
                diff, ident = diff ^ v, ident ^ b
        return None if diff else ident
    return solve


def _ip_checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def mac(ip: str) -> bytes:
    """A frame's Ethernet address for ``ip``: zeros on loopback, as Linux's lo shows it,
    else a locally administered address made from the IP's low octets."""
    addr = ipaddress.ip_address(ip)
    if addr.is_loopback:
        return bytes(6)
    return b"\x02" + addr.packed[-5:] if addr.version == 6 else b"\x02\x00" + addr.packed


def seal(path: Path, parts: list, pad: int) -> list:
    """Append ``pad`` octets (the BTH PadCnt, IB 9.2.3) and the ICRC to a packet's buffers
    (headers first, then payload); returns the buffers ready for ``sendmsg``."""
    if pad:
        parts.append(PAD[pad])
    n = ICRC_LEN
    for part in parts:
        n += len(part)
    parts.append(ICRC.pack(path.icrc(parts, n)))
    return parts
