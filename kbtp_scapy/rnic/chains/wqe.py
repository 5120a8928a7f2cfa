"""The work-queue entry (WQE) format of the chain engine: bytes in registered memory.

A WQE is what a chain's earlier work requests write into: a receive's scatter list or a
loopback RDMA Read places a request's Data Descriptor, a table entry's Block Offset or a
ring counter's Slot Offset into a later WQE's fields, and a Compare and Swap on a WQE's
control word turns it on or off (RedN's conditional). So the layout is a table
(``kbtp_scapy.tables.model``), like KBTP's own, and the engine decodes a WQE from memory
only when it starts it.

Control word (8 octets, what a guarding CAS compares whole): Opcode, Flags, Target (the
queue an ENABLE enables, or the completion queue a WAIT watches) and a 4-octet Guard the
chain fills with the value that must match. Then the remote fields in the order of
KBTP's Data Descriptor (STag, Tagged Offset, Length), so one scatter entry places a whole
descriptor; then Count, the operands of atomics and of WAIT_DATA, the wr_id and the STag
a Send with Invalidate invalidates. Scatter/gather entries follow: Length, Address, Key,
in the order of a table entry's Data Length and Block Offset, so one scatter entry places
both. Every field is in the engine's WQE byte order: big-endian as mlx5's WQEs, or
little-endian as rxe's and siw's (then KBTP's ADDR_LE lets address fields land unchanged).
"""
from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass, field
from typing import Literal

from ...tables.model import Field, Order, Struct

A = Order.ADDRESS     # every WQE field follows the engine's byte order (codec's addr_le)
ByteOrder = Literal["little", "big"]


def byteorder(little: bool) -> ByteOrder:
    return "little" if little else "big"

WQE_HEADER = Struct(
    name="chain_wqe", title="Chain WQE", section="docs/CHAINS.md", prefix="wqe",
    items=(
        Field("opcode", 1, "Opcode", "Operation (Op)"),
        Field("flags", 1, "Flags", "SIGNALED, FENCE, LOOPBACK, SOLICITED, INVALIDATE", hex=True),
        Field("target", 2, "Target", "Queue an ENABLE enables; CQ a WAIT watches", order=A),
        Field("guard", 4, "Guard", "Value a guarding CAS expects in this control word", order=A, hex=True),
        Field("remote_stag", 4, "Remote STag", "STag of the remote (or loopback) buffer", order=A, hex=True),
        Field("remote_offset", 8, "Remote Offset", "Tagged Offset in it", order=A, hex=True),
        Field("length", 4, "Length", "RDMA Read length", order=A),
        Field("count", 4, "Count", "WAIT: completions; ENABLE: WQEs (0: all posted)", order=A),
        Field("sge_count", 2, "SGE Count", "Scatter/gather entries that follow", order=A),
        Field("cond", 2, "Condition", "WAIT_DATA: EQ or NE", order=A),
        Field("operand", 8, "Operand", "Add Data; Compare Data; WAIT_DATA value", order=A, hex=True),
        Field("operand2", 8, "Operand 2", "Add Mask; Swap Data; WAIT_DATA mask", order=A, hex=True),
        Field("wr_id", 8, "wr_id", "Returned in the completion", order=A),
        Field("invalidate", 4, "Invalidate STag", "Send with Invalidate", order=A, hex=True),
        Field("reserved", 4, "Reserved", "Zero", order=A, reserved=True),
    ),
)

SGE = Struct(
    name="chain_sge", title="Chain scatter/gather entry", section="docs/CHAINS.md", prefix="sge",
    items=(
        Field("length", 4, "Length", "Octets", order=A),
        Field("addr", 8, "Address", "Tagged Offset in the key's region", order=A, hex=True),
        Field("key", 4, "Key", "STag of the local region (lkey)", order=A, hex=True),
    ),
)

def packer(table: Struct, little: bool) -> struct.Struct:
    """The table's fields as one precompiled struct (a WQE is decoded per work request)."""
    codes = {1: "B", 2: "H", 4: "I", 8: "Q"}
    return struct.Struct(("<" if little else ">") + "".join(codes[f.size] for f in table.items))


_HEAD = {little: packer(WQE_HEADER, little) for little in (False, True)}
_SGE = {little: packer(SGE, little) for little in (False, True)}

HEADER_SIZE = WQE_HEADER.size
SGE_SIZE = SGE.size
MAX_SGE = 8
STRIDE = HEADER_SIZE + MAX_SGE * SGE_SIZE     # one WQE slot
CONTROL_SIZE = 8
ALL = 0                                       # ENABLE Count: everything posted


class Op(enum.IntEnum):
    NOP = 0
    SEND = 1
    WRITE = 2
    READ = 3
    FETCH_ADD = 4          # masked (RFC 7306) when Operand 2 is non-zero
    CAS = 5
    WAIT = 6               # until CQ Target has Count completions (mlx5 cross-channel)
    ENABLE = 7             # let queue Target run Count more WQEs (mlx5 SEND_EN / RECV_EN)
    WAIT_DATA = 8          # until (word at remote & Operand 2) Cond Operand (wait-on-data)
    RECV = 9


_OPS = {op.value: op for op in Op}


class Flag(enum.IntFlag):
    SIGNALED = 0x01
    FENCE = 0x02           # start only once earlier Reads and atomics completed
    LOOPBACK = 0x04        # remote side is this RNIC's own memory (a loopback QP)
    SOLICITED = 0x08
    INVALIDATE = 0x10


class Cond(enum.IntEnum):
    EQ = 0
    NE = 1


@dataclass
class Sge:
    key: int
    addr: int
    length: int


@dataclass
class Wqe:
    """A decoded WQE (what the engine acts on) or one to encode (what a chain posts)."""

    op: Op
    flags: int = 0
    target: int = 0
    guard: int = 0
    remote_stag: int = 0
    remote_offset: int = 0
    length: int = 0
    count: int = 0
    cond: int = 0
    operand: int = 0
    operand2: int = 0
    wr_id: int = 0
    invalidate: int = 0
    sges: list[Sge] = field(default_factory=list)

    def encode(self, little: bool) -> bytes:
        if len(self.sges) > MAX_SGE:
            raise ValueError(f"a WQE has at most {MAX_SGE} scatter/gather entries")
        head = _HEAD[little].pack(
            int(self.op), int(self.flags), self.target, self.guard, self.remote_stag,
            self.remote_offset, self.length, self.count, len(self.sges), self.cond, self.operand,
            self.operand2, self.wr_id, self.invalidate, 0)
        sge = _SGE[little]
        return (head + b"".join(sge.pack(s.length, s.addr, s.key) for s in self.sges)).ljust(STRIDE, b"\0")

    @classmethod
    def decode(cls, raw: bytes | memoryview, little: bool) -> Wqe:
        (opcode, flags, target, guard, stag, offset, length, count, sge_count, cond, operand,
         operand2, wr_id, invalidate, _) = _HEAD[little].unpack_from(raw)
        op = _OPS.get(opcode)
        if op is None:
            raise ValueError(f"unknown WQE opcode {opcode}")
        sge = _SGE[little]
        sges = [Sge(key, addr, n) for n, addr, key in
                (sge.unpack_from(raw, HEADER_SIZE + i * SGE_SIZE) for i in range(min(sge_count, MAX_SGE)))]
        return cls(op, flags, target, guard, stag, offset, length, count, cond, operand, operand2,
                   wr_id, invalidate, sges)

    def control(self, little: bool) -> int:
        """The control word as the 64-bit value a CAS on it compares. The engine runs its
        atomics in its WQE byte order, so a guard's octets compare as they were placed."""
        return int.from_bytes(self.encode(little)[:CONTROL_SIZE], byteorder(little))


@functools.cache
def offset_of(name: str) -> int:
    """Octet offset of a header field within a WQE (``remote_offset``, ``guard``, ...)."""
    return WQE_HEADER.offset(name)


@functools.cache
def sge_offset(index: int, name: str) -> int:
    """Octet offset of a field of scatter/gather entry ``index`` within a WQE."""
    return HEADER_SIZE + index * SGE_SIZE + SGE.offset(name)
