"""The transport-neutral view of one RDMA message found in a capture."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RdmaMessage:
    """One reassembled RDMA message, as a decoder of either binding yields it.

    ``kind`` is one of "send", "send_inv", "write", "write_imm" (RoCEv2 RDMA Write with
    Immediate), "immediate" (RFC 7306 Immediate Data), "read_request", "read_response",
    "atomic_request", "atomic_response", "terminate", "ack". A Send with Immediate is a
    "send" with ``info["imm"]``.
    ``frames`` are the 1-based capture frame numbers that carried it, in order;
    ``conn`` names the connection and direction (src, dst) so a decoder can keep
    per-connection state.  ``payload`` is the upper-layer payload with transport
    padding removed; ``info`` holds transport header values (STag, offset, PSN...).
    ``time`` is the capture time of the last frame, when the decoder knows it.
    """

    transport: str                 # "iwarp" or "roce"
    kind: str
    frames: list[int]
    conn: tuple
    payload: bytes = b""
    info: dict = field(default_factory=dict)
    time: float | None = None
