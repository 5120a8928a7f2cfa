"""KBTP enumerations and flag sets (spec sections "Messages", "Status Codes", "IANA").

The upper quarter of every value space is Private Use (IANA Considerations): opcodes
0xC0-0xFF, status 0xC000-0xFFFF, flag and feature bits 12-15.
"""
from __future__ import annotations

from .model import Enumeration, FlagSet, Value

PRIVATE_BITS = 0xF000

OPCODES = Enumeration(
    name="opcode",
    title="Opcode",
    bits=8,
    values=(
        Value(0x01, "HELLO", "Session set-up request from the initiator"),
        Value(0x02, "HELLO_ACK", "Session set-up answer: the Target Descriptor"),
        Value(0x10, "LOAD", "Block Load: the target writes a stored block to the initiator"),
        Value(0x11, "STORE", "Block Mapped Store into an already bound block"),
        Value(0x12, "ALLOC_STORE", "Block Unmapped Store: allocate a free block, bind it, write it"),
        Value(0x13, "FREE", "Block Free: unbind the handle and return its block"),
        Value(0x14, "BIND", "Bind a block taken by DIRECT_ALLOC to a handle"),
        Value(0x20, "COMPLETION", "The target's answer to a request"),
        Value(0x30, "GOODBYE", "End of session"),
    ),
    private_use=(0xC0, 0xFF),
)

STATUS = Enumeration(
    name="status",
    title="Status",
    bits=16,
    values=(
        Value(0, "OK", "Success"),
        Value(1, "INVALID_HANDLE", "Handle outside the authorized range"),
        Value(2, "STALE_GENERATION", "Generation mismatch"),
        Value(3, "NOT_VALID", "Entry not bound"),
        Value(4, "ALREADY_BOUND", "Unmapped Store to a bound handle"),
        Value(5, "NO_SPACE", "Quota exceeded or ring empty"),
        Value(6, "SEALED", "Store to a sealed block"),
        Value(7, "NOT_SEALED", "Load of an unsealed block"),
        Value(8, "TOO_LARGE", "Length exceeds block or buffer"),
        Value(9, "MALFORMED", "Request cannot be parsed"),
        Value(10, "INTERNAL", "Target failure"),
        Value(11, "TICKET_ABANDONED", "BIND for a ticket that was reclaimed"),
    ),
    private_use=(0xC000, 0xFFFF),
)

REQUEST_FLAGS = FlagSet(
    name="request_flags",
    title="Flags of LOAD, STORE, ALLOC_STORE and FREE",
    bits=16,
    flags=(
        Value(0x0001, "INLINE", "Data follows the request"),
        Value(0x0002, "SEAL", "Seal the block after the store"),
        Value(0x0004, "RECORD", "Complete with a completion record; a Completion Descriptor is present"),
        Value(0x0008, "INVALIDATE", "Complete with Send with Invalidate of the Data Descriptor's STag"),
        Value(0x0010, "ALLOW_UNSEALED", "A load may return an unsealed block"),
    ),
    private_use_mask=PRIVATE_BITS,
)

GOODBYE_FLAGS = FlagSet(
    name="goodbye_flags",
    title="Flags of GOODBYE",
    bits=16,
    flags=(Value(0x0001, "RELEASE", "The target frees all handles bound by the initiator"),),
    private_use_mask=PRIVATE_BITS,
)

FEATURES = FlagSet(
    name="features",
    title="Features",
    bits=16,
    flags=(
        Value(0x0001, "DIRECT_LOAD", "Table and Pool STags for one-sided loads"),
        Value(0x0002, "DIRECT_ALLOC", "Partition, Ring and Head STags for one-sided allocation"),
        Value(0x0004, "RECORD_COMPLETION", "Completion records written by RDMA Write with Immediate"),
        Value(0x0008, "ADDR_LE", "Address fields are little-endian in this session"),
    ),
    private_use_mask=PRIVATE_BITS,
)

ENTRY_FLAGS = FlagSet(
    name="entry_flags",
    title="Block table entry flags",
    bits=16,
    flags=(
        Value(0x0001, "VALID", "The handle is bound"),
        Value(0x0002, "SEALED", "The block will not change until it is freed"),
    ),
)

ENUMERATIONS = (OPCODES, STATUS)
FLAG_SETS = (REQUEST_FLAGS, GOODBYE_FLAGS, FEATURES, ENTRY_FLAGS)


def flag(flag_set: FlagSet, name: str) -> int:
    """Value of a named bit, so other tables refer to bits by name, not by number."""
    for f in flag_set.flags:
        if f.name == name:
            return f.value
    raise KeyError(name)
