"""MPA markers (RFC 5044 s4.3): insert and strip them by position in the stream.

A marker is 4 octets, a reserved 16-bit zero and FPDUPTR, placed every 512 octets of
TCP sequence space counted from the first octet of the first FPDU in that direction
(right after the MPA Reply, or after the Request for the initiator's direction).  Its
FPDUPTR is the distance back from the marker to the start of the FPDU it sits in; a
marker falling exactly where an FPDU starts has FPDUPTR 0 and belongs to that FPDU.
Positions here are such stream offsets, markers included ("wire" positions).
"""
from __future__ import annotations

import struct

from .iwarp_defs import MARKER_INTERVAL, crc32c

MARKER_LEN = 4


def marker(fpduptr: int) -> bytes:
    """The 4 octets of a marker pointing ``fpduptr`` octets back."""
    return struct.pack("!HH", 0, fpduptr & 0xFFFF)


def insert_markers(fpdu: bytes, pos: int, *, fix_crc: bool = True) -> bytes:
    """Insert the markers due inside one FPDU that starts at wire position ``pos``.

    The MPA CRC covers the markers inside its FPDU (RFC 5044 CRC rules), so by default the
    last 4 octets are recomputed (least significant octet first); ``fix_crc=False``
    keeps them as given.
    """
    out = bytearray()
    i = 0
    while i < len(fpdu):
        gap = -(pos + len(out)) % MARKER_INTERVAL
        if gap == 0:
            out += marker(len(out))
            gap = MARKER_INTERVAL - MARKER_LEN
        out += fpdu[i:i + gap]
        i += gap
    if fix_crc and len(out) >= 4:
        out[-4:] = struct.pack("<I", crc32c(bytes(out[:-4])))
    return bytes(out)


def strip_markers(data: bytes, pos: int = 0) -> tuple[bytes, list[tuple[int, bytes]]]:
    """Remove the markers from wire octets starting at position ``pos``.

    Returns the marker-free octets and, for each marker, the offset in those octets
    where it stood and its own 4 octets (needed to check the CRC of an FPDU that
    contained it).  A marker cut short by the end of ``data`` is dropped.
    """
    clean = bytearray()
    markers: list[tuple[int, bytes]] = []
    i = 0
    while i < len(data):
        nxt = i + (-(pos + i) % MARKER_INTERVAL)   # index of the next marker
        clean += data[i:nxt]
        if nxt >= len(data):
            break
        markers.append((len(clean), bytes(data[nxt:nxt + MARKER_LEN])))
        i = nxt + MARKER_LEN
    return bytes(clean), markers
