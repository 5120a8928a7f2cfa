"""The completion-queue entry (CQE) format: completions written into registered memory.

mlx5's CQ buffer is host memory, so a chain can read a completion's fields, the receive's
byte count among them, with a loopback Read and place it where a guarding CAS compares it
(docs/CHAINS.md, findings 2 and 13). A CQ created with ``cqes`` has such a buffer: the
completer writes completion i into entry ``i mod cqes``. Fields are in the engine's WQE
byte order (big-endian as mlx5's CQEs, little-endian as rxe's and siw's).
"""
from __future__ import annotations

import functools

from ...tables.model import Field, Order, Struct
from .wqe import packer

A = Order.ADDRESS

CQE = Struct(
    name="chain_cqe", title="Chain CQE", section="docs/CHAINS.md", prefix="cqe",
    items=(
        Field("wr_id", 8, "wr_id", "The completed WQE's wr_id", order=A),
        Field("byte_count", 4, "Byte Count", "Octets a receive placed (a Send's, a Read's)", order=A),
        Field("opcode", 1, "Opcode", "The completed WQE's Op"),
        Field("status", 1, "Status", "0: success; 1: error"),
        Field("queue", 2, "Queue", "The work queue it completed on", order=A),
    ),
)
CQE_SIZE = CQE.size
_PACK = {little: packer(CQE, little) for little in (False, True)}


def encode(little: bool, wr_id: int, byte_count: int, opcode: int, ok: bool, queue: int) -> bytes:
    return _PACK[little].pack(wr_id, byte_count, opcode & 0xFF, 0 if ok else 1, queue)


@functools.cache
def offset_of(name: str) -> int:
    """Octet offset of a CQE field (``byte_count``, ...)."""
    return CQE.offset(name)
