"""The Invariant CRC of a captured RoCE frame, from its octets (no Scapy).

tshark 4.0 shows ``infiniband.invariant.crc`` but never checks it, and a packet whose ICRC
is wrong is one the receiving NIC dropped: the message it carried never arrived. The
ICRC (IBA vol. 1, 7.8.1; annex A16.8.1 for RoCEv1, A17.4.5 for RoCEv2) is CRC-32 over
8 octets of ones standing for the absent LRH, the network header with its variant fields
set to ones, the UDP header (RoCEv2) with its checksum set to ones, the BTH with its
reserved octet set to ones, and the rest of the packet up to the ICRC, which is stored
least significant octet first.
"""
from __future__ import annotations

import struct
import zlib

_LRH = zlib.crc32(b"\xff" * 8)
_ICRC = struct.Struct("<I")


def icrc_ok(data: bytes, net: int, bth: int, end: int) -> bool:
    """Whether the ICRC ending at ``data[end]`` is right for the packet whose network
    header (IPv4, IPv6 or the RoCEv1 GRH) starts at ``net`` and whose BTH starts at ``bth``."""
    if end - bth < 16 or end > len(data):
        return False
    head = bytearray(data[net:bth + 12])
    version = head[0] >> 4
    if version == 4:
        head[1] = 0xFF                               # Type of Service
        head[8] = 0xFF                               # Time to Live
        head[10:12] = b"\xff\xff"                    # header checksum
    else:                                            # IPv6, or the GRH of RoCEv1
        head[0] |= 0x0F                              # Traffic Class and Flow Label
        head[1:4] = b"\xff\xff\xff"
        head[7] = 0xFF                               # Hop Limit
    if version == 4 or bth - net > 40:               # RoCEv2: the UDP header ends at the BTH
        head[bth - net - 2:bth - net] = b"\xff\xff"  # UDP checksum
    head[bth - net + 4] = 0xFF                       # BTH reserved octet (resv8a)
    crc = zlib.crc32(data[bth + 12:end - 4], zlib.crc32(bytes(head), _LRH))
    return crc == _ICRC.unpack_from(data, end - 4)[0]
