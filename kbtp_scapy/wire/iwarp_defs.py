"""iWARP constants and arithmetic (RFC 5040, 5041, 5044, 6581, 7306), free of Scapy.

The soft RNIC's data path needs the RDMAP opcodes, header sizes, CRC32c and the MULPDU
formula; keeping them apart from the Scapy layers spares it Scapy's import time and
memory. ``kbtp_scapy.layers.iwarp`` builds its layers on these names.
"""
from __future__ import annotations

from enum import IntEnum

import google_crc32c

DEFAULT_MSS = 1460
MARKER_INTERVAL = 512           # RFC 5044 s4.3: a marker every 512 octets of the stream

MPA_REQ_KEY = b"MPA ID Req Frame"
MPA_REP_KEY = b"MPA ID Rep Frame"
MPA_STARTUP_LEN = 20            # key, flags, Rev, PD_Length (RFC 5044 s7.1)
FPDU_OVERHEAD = 6               # ULPDU Length and CRC (RFC 5044 s4)
DDP_TAGGED_LEN = 14             # RFC 5041 s4.2, with the RDMAP control octet
DDP_UNTAGGED_LEN = 18           # RFC 5041 s4.3


def crc32c(data: bytes) -> int:
    """CRC32c (Castagnoli, the iSCSI polynomial of RFC 3385) that MPA uses."""
    return google_crc32c.value(bytes(data))


def fpdu_pad_len(ulpdu_len: int) -> int:
    """Octets of pad after a ULPDU so that the FPDU ends on a 4-octet boundary."""
    return -(2 + ulpdu_len) % 4


class Op(IntEnum):
    """RDMAP opcodes: RFC 5040 s4 (0-7) and RFC 7306 (8-11)."""

    WRITE = 0
    READ_REQUEST = 1
    READ_RESPONSE = 2
    SEND = 3
    SEND_INV = 4
    SEND_SE = 5
    SEND_SE_INV = 6
    TERMINATE = 7
    IMMEDIATE = 8
    IMMEDIATE_SE = 9
    ATOMIC_REQUEST = 10
    ATOMIC_RESPONSE = 11


RDMAP_OPCODES: dict[int, str] = {
    Op.WRITE: "RDMA Write",
    Op.READ_REQUEST: "RDMA Read Request",
    Op.READ_RESPONSE: "RDMA Read Response",
    Op.SEND: "Send",
    Op.SEND_INV: "Send with Invalidate",
    Op.SEND_SE: "Send with Solicited Event",
    Op.SEND_SE_INV: "Send with Solicited Event and Invalidate",
    Op.TERMINATE: "Terminate",
    Op.IMMEDIATE: "Immediate Data",
    Op.IMMEDIATE_SE: "Immediate Data with Solicited Event",
    Op.ATOMIC_REQUEST: "Atomic Request",
    Op.ATOMIC_RESPONSE: "Atomic Response",
}
TAGGED_OPCODES = frozenset({Op.WRITE, Op.READ_RESPONSE})
SEND_OPCODES = frozenset({Op.SEND, Op.SEND_INV, Op.SEND_SE, Op.SEND_SE_INV})
INVALIDATE_OPCODES = frozenset({Op.SEND_INV, Op.SEND_SE_INV})
SOLICITED_OPCODES = frozenset({Op.SEND_SE, Op.SEND_SE_INV, Op.IMMEDIATE_SE})

# DDP untagged queues (RFC 5040, RFC 7306): atomic requests share the Read
# Request queue (they use the same IRD/ORD credits); atomic responses have their own.
QUEUE_NAMES = {
    0: "Send queue",
    1: "RDMA Read Request / Atomic Request queue",
    2: "Terminate queue",
    3: "Atomic Response queue",
}
OPCODE_QUEUE: dict[int, int] = {
    Op.READ_REQUEST: 1, Op.ATOMIC_REQUEST: 1, Op.TERMINATE: 2, Op.ATOMIC_RESPONSE: 3,
}

ATOMIC_OPCODES = {0: "FetchAdd", 1: "Swap", 2: "CmpSwap"}     # RFC 7306

# Terminate: Layer, EType and Error Code (RFC 5040 and RFC 5041 error codes, RFC 5044
# error semantics, RFC 6581 additions).
TERM_LAYERS = {0: "RDMAP", 1: "DDP", 2: "LLP (MPA)"}
TERM_ETYPES = {
    0: {0: "Local Catastrophic Error", 1: "Remote Protection Error",
        2: "Remote Operation Error"},
    1: {0: "Local Catastrophic Error", 1: "Tagged Buffer Error",
        2: "Untagged Buffer Error", 3: "Reserved for the LLP"},
    2: {0: "MPA Error"},
}
_RDMAP_UNSPECIFIED = {0xFF: "Unspecified Error"}
TERM_ERRCODES = {
    (0, 1): {0x00: "Invalid STag", 0x01: "Base or bounds violation",
             0x02: "Access rights violation",
             0x03: "STag not associated with RDMAP Stream", 0x04: "TO wrap",
             0x09: "STag cannot be Invalidated", **_RDMAP_UNSPECIFIED},
    (0, 2): {0x05: "Invalid RDMAP version", 0x06: "Unexpected OpCode",
             0x07: "Catastrophic error, localized to RDMAP Stream",
             0x08: "Catastrophic error, global", 0x09: "STag cannot be Invalidated",
             **_RDMAP_UNSPECIFIED},
    (1, 1): {0x00: "Invalid STag", 0x01: "Base or bounds violation",
             0x02: "STag not associated with DDP Stream", 0x03: "TO wrap",
             0x04: "Invalid DDP version"},
    (1, 2): {0x01: "Invalid QN", 0x02: "Invalid MSN - no buffer available",
             0x03: "Invalid MSN - MSN range is not valid", 0x04: "Invalid MO",
             0x05: "DDP Message too long for available buffer",
             0x06: "Invalid DDP version"},
    (2, 0): {0x01: "TCP connection closed, terminated or lost", 0x02: "MPA CRC Error",
             0x03: "MPA Marker and ULPDU Length field mismatch",
             0x04: "Invalid MPA Request Frame or MPA Response Frame",
             0x05: "Local Catastrophic Error", 0x06: "Insufficient IRD Resources",
             0x07: "No Matching RTR Option"},
}


def mulpdu(emss: int = DEFAULT_MSS, markers: bool = False) -> int:
    """Largest ULPDU that keeps one FPDU in one TCP segment (RFC 5044's MULPDU formula).

    FPDU overhead is 6 octets, the FPDU is padded to 4, and with markers every 512
    octets of the segment may hold one more 4-octet marker.
    """
    marker_room = 4 * -(-emss // MARKER_INTERVAL) if markers else 0
    return emss - (FPDU_OVERHEAD + marker_room + emss % 4)


MULPDU = mulpdu()
