"""Find the RoCE or TCP payload of a captured frame by octet arithmetic, without Scapy.

``locate(linktype, data)`` walks the link layer (Ethernet with 802.1Q/802.1ad tags, Linux
cooked v1 and v2, BSD loopback, raw IP), IPv4 (unfragmented) or IPv6 (skipping hop-by-hop,
routing, destination-options and AH headers), then UDP to port 4791 (RoCEv2) or TCP; a
RoCEv1 frame (EtherType 0x8915) is found by its GRH. Addresses stay raw octets here;
``address`` turns them into text once per distinct address.
"""
from __future__ import annotations

import socket
from functools import lru_cache

from ..wire.address import ROCE_PORT

ROCE, TCP, CUT = 1, 2, 3        # first item of what locate() returns

#: Link types this module reads (pcap LINKTYPE_ values).
ETHERNET, NULL, RAW, RAW_BSD, RAW_OPENBSD, LOOP, SLL, IPV4, IPV6, SLL2 = 1, 0, 101, 12, 14, 108, 113, 228, 229, 276
SUPPORTED = frozenset((ETHERNET, NULL, RAW, RAW_BSD, RAW_OPENBSD, LOOP, SLL, IPV4, IPV6, SLL2))
#: Names of link types met in RDMA work that this module cannot read.
UNSUPPORTED_NAMES = {197: "ERF (Endace; native InfiniBand from DAG cards)", 247: "native InfiniBand",
                     105: "IEEE 802.11", 127: "IEEE 802.11 radiotap", 220: "Linux USB"}

_VLAN = (0x8100, 0x88A8, 0x9100)
_IPV6_SKIP = (0, 43, 60)          # hop-by-hop, routing, destination options: (len + 1) * 8
_AF_INET6 = (10, 24, 28, 30)      # AF_INET6 on Linux, NetBSD/OpenBSD, FreeBSD, macOS


def linktype_name(linktype: int) -> str:
    """``link type 197, ERF (...)`` for messages about link types this module cannot read."""
    name = UNSUPPORTED_NAMES.get(linktype)
    return f"link type {linktype}, {name}" if name else f"link type {linktype}"


def _network(linktype: int, data: bytes) -> tuple[int, int]:
    """(EtherType, offset of the network header); EtherType 0 when unknown."""
    if linktype == ETHERNET:
        if len(data) < 14:
            return 0, 0
        et, off = data[12] << 8 | data[13], 14
        while et in _VLAN and len(data) >= off + 4:
            et, off = data[off + 2] << 8 | data[off + 3], off + 4
        return et, off
    if linktype in (RAW, RAW_BSD, RAW_OPENBSD, IPV4, IPV6):
        version = data[0] >> 4 if data else 0
        return (0x0800 if version == 4 else 0x86DD if version == 6 else 0), 0
    if linktype == SLL:
        return (data[14] << 8 | data[15], 16) if len(data) >= 16 else (0, 0)
    if linktype == SLL2:
        return (data[0] << 8 | data[1], 20) if len(data) >= 20 else (0, 0)
    if linktype in (NULL, LOOP) and len(data) >= 4:
        family = int.from_bytes(data[:4], "big" if linktype == LOOP or data[0] == 0 else "little")
        return (0x0800 if family == 2 else 0x86DD if family in _AF_INET6 else 0), 4
    return 0, 0


def locate(linktype: int, data: bytes) -> tuple | None:
    """Where the frame's RoCE or TCP payload is, or None for anything else:

    * ``(ROCE, src, dst, start, end, net)``: the BTH starts at ``data[start]``, the ICRC
      ends at ``end``; ``src``/``dst`` are the IP addresses (GIDs for RoCEv1), whose
      header (the GRH for RoCEv1) starts at ``net``;
    * ``(TCP, src, dst, sport, dport, seq, ack, flags, start, end)``: TCP payload
      ``data[start:end]``;
    * ``(CUT,)``: the IP datagram is longer than what was captured (snap length).
    """
    if linktype == ETHERNET and len(data) >= 34 and data[12] == 8 and data[13] == 0:
        et, off = 0x0800, 14             # the usual case, before the general walk
    else:
        et, off = _network(linktype, data)
    n = len(data)
    if et == 0x0800:
        if n < off + 20 or data[off] >> 4 != 4 or (data[off + 6] & 0x3F) | data[off + 7]:
            return None                   # not IPv4, or a fragment
        start = off + (data[off] & 0x0F) * 4
        end = off + (data[off + 2] << 8 | data[off + 3])
        proto = data[off + 9]
        src, dst = data[off + 12:off + 16], data[off + 16:off + 20]
    elif et == 0x86DD:
        if n < off + 40:
            return None
        start = off + 40
        end = start + (data[off + 4] << 8 | data[off + 5])
        proto = data[off + 6]
        src, dst = data[off + 8:off + 24], data[off + 24:off + 40]
        while proto in _IPV6_SKIP or proto == 51:
            if n < start + 8:
                return None
            size = (data[start + 1] + 2) * 4 if proto == 51 else (data[start + 1] + 1) * 8
            proto, start = data[start], start + size
    elif et == 0x8915:                    # RoCEv1: GRH (IBA vol. 1, 8.3) then BTH
        if n < off + 52 or data[off + 6] != 0x1B:
            return None
        end = off + 40 + (data[off + 4] << 8 | data[off + 5])
        if end > n:
            return (CUT,)
        return ROCE, data[off + 8:off + 24], data[off + 24:off + 40], off + 40, end, off
    else:
        return None
    if end > n:
        return (CUT,)
    if proto == 17:
        if end < start + 8 + 16 or (data[start + 2] << 8 | data[start + 3]) != ROCE_PORT:
            return None
        return ROCE, src, dst, start + 8, end, off
    if proto == 6 and end >= start + 20:
        head = data[start:start + 20]
        return (TCP, src, dst, head[0] << 8 | head[1], head[2] << 8 | head[3],
                int.from_bytes(head[4:8], "big"), int.from_bytes(head[8:12], "big"), head[13],
                start + (head[12] >> 4) * 4, end)
    return None


@lru_cache(maxsize=4096)
def address(raw: bytes) -> str:
    """An IPv4 or IPv6 address (or GID) as text."""
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)
