"""KBTP wire structures: common header, descriptors and the body of every opcode.

Layouts follow docs/NOTES.md section 2; section names cite docs/kbtp-draft.txt.
"""
from __future__ import annotations

from .enums import FEATURES, GOODBYE_FLAGS, OPCODES, REQUEST_FLAGS, STATUS, flag
from .model import Condition, Field, Member, Message, Order, Struct, flatten

A = Order.ADDRESS
VERSION = 1

HEADER = Struct(
    name="header",
    title="KBTP Common Header",
    section="Messages / Common Header",
    items=(
        Field("version", 1, "Version", "Protocol version; 1 for this specification",
              default=VERSION),
        Field("opcode", 1, "Opcode", "Message type", enum=OPCODES, hex=True),
        Field("flags", 2, "Flags", "Per-opcode flags", hex=True, per_opcode_flags=True),
        Field("request_id", 8, "Request ID", "Chosen by the initiator, echoed in the completion"),
        Field("handle", 8, "Block Handle", "64-bit name of a block in the initiator's handle range",
              order=A, hex=True),
        Field("generation", 2, "Generation",
              "In a request the expected generation (0 = any); in a completion the entry's"),
        Field("status", 2, "Status", "Zero in requests; the outcome in completions", enum=STATUS),
    ),
)
HEADER_SIZE = HEADER.size

DATA_DESCRIPTOR = Struct(
    name="data_descriptor",
    title="Data Descriptor",
    section="Descriptors",
    items=(
        Field("stag", 4, "STag", "STag of the initiator's buffer (zero with INLINE)", order=A, hex=True),
        Field("offset", 8, "Tagged Offset", "Tagged Offset of the buffer (zero with INLINE)",
              order=A, hex=True),
        Field("length", 4, "Length", "Buffer length, or the inline data length with INLINE", order=A),
    ),
)

COMPLETION_DESCRIPTOR = Struct(
    name="completion_descriptor",
    title="Completion Descriptor",
    section="Descriptors",
    items=(
        Field("stag", 4, "STag", "STag of the initiator's 24-octet completion record slot",
              order=A, hex=True),
        Field("offset", 8, "Tagged Offset", "Tagged Offset of the completion record slot",
              order=A, hex=True),
        Field("reserved", 4, "Reserved", "Reserved, zero", hex=True, reserved=True),
    ),
)

DIRECT_DESCRIPTOR = Struct(
    name="direct_descriptor",
    title="Direct-mode Descriptor",
    section="Session Establishment (HELLO_ACK)",
    items=(
        Field("stag", 4, "STag", "STag granting the access of this direct mode", hex=True),
        Field("offset", 8, "Tagged Offset", "Tagged Offset of the first octet", hex=True),
        Field("count", 4, "Count", "Number of entries, blocks, slots or counters it covers"),
    ),
)

_RECORD = Condition("flags", flag(REQUEST_FLAGS, "RECORD"))
_INLINE = Condition("flags", flag(REQUEST_FLAGS, "INLINE"))
_DIRECT_LOAD = Condition("features", flag(FEATURES, "DIRECT_LOAD"))
_DIRECT_ALLOC = Condition("features", flag(FEATURES, "DIRECT_ALLOC"))

_DD = Member("dd", DATA_DESCRIPTOR, "Data Descriptor")
_CD = Member("cd", COMPLETION_DESCRIPTOR, "Completion Descriptor", when=_RECORD)
_INLINE_DATA = Field("inline_data", 0, "Inline Data", "Block data carried in the request",
                     when=_INLINE, length_from="dd.length")

HELLO = Struct(
    name="hello", title="HELLO Body", section="Session Establishment", prefix="hello",
    items=(
        Field("requested_features", 2, "Requested Features", "Features the initiator asks for",
              flags=FEATURES, hex=True),
        Field("completion_credits", 2, "Completion Credits",
              "Receive buffers the initiator posted for COMPLETION messages"),
        Field("initiator_id", 16, "Initiator ID",
              "Stable secret random identifier used to restore bindings on reconnection", hex=True),
    ),
)

HELLO_ACK = Struct(
    name="hello_ack", title="HELLO_ACK Body (Target Descriptor)", section="Session Establishment",
    prefix="hello_ack",
    items=(
        Field("features", 2, "Features", "Features the target grants", flags=FEATURES, hex=True),
        Field("request_credits", 2, "Request Credits", "Receive buffers the target posted for requests"),
        Field("block_size", 4, "Block Size", "Octets per block"),
        Field("max_inline", 4, "Max Inline", "Largest inline data the target accepts"),
        Field("allocation_quota", 4, "Allocation Quota", "Blocks this initiator may hold"),
        Field("handle_base", 8, "Handle Base", "First handle of the initiator's range", hex=True),
        Field("handle_count", 4, "Handle Count", "Number of handles in the initiator's range"),
        Field("ticket_timeout", 4, "Ticket Timeout (ms)",
              "Time within which a DIRECT_ALLOC ticket must be bound"),
        Member("table", DIRECT_DESCRIPTOR, "Table descriptor (Count = entries)", when=_DIRECT_LOAD),
        Field("table_base_handle", 8, "Table Base Handle", "Handle of the table's first entry",
              hex=True, when=_DIRECT_LOAD),
        Field("reserved", 8, "Reserved", "Reserved, zero", hex=True, reserved=True, when=_DIRECT_LOAD),
        Member("pool", DIRECT_DESCRIPTOR, "Pool descriptor (read only, Count = F)", when=_DIRECT_LOAD),
        Member("partition", DIRECT_DESCRIPTOR, "Partition descriptor (writable, Count = quota)",
               when=_DIRECT_ALLOC),
        Member("ring", DIRECT_DESCRIPTOR, "Ring descriptor (Count = N)", when=_DIRECT_ALLOC),
        Member("head", DIRECT_DESCRIPTOR, "Head descriptor (Count = 1, offset a multiple of 8)",
               when=_DIRECT_ALLOC),
    ),
)

LOAD = Struct(name="load", title="LOAD Body", section="Operations / Block Load", items=(_DD, _CD))
STORE = Struct(name="store", title="STORE Body", section="Operations / Block Mapped Store",
               items=(_DD, _CD, _INLINE_DATA))
ALLOC_STORE = Struct(name="alloc_store", title="ALLOC_STORE Body",
                     section="Operations / Block Unmapped Store", items=(_DD, _CD, _INLINE_DATA))
FREE = Struct(name="free", title="FREE Body", section="Operations / Block Free", items=(_CD,))

BIND = Struct(
    name="bind", title="BIND Body", section="Direct Modes (DIRECT_ALLOC)", prefix="bind",
    items=(
        Field("ticket", 4, "Ticket", "Ticket returned by the initiator's FetchAdd on its Head"),
        Field("data_length", 4, "Data Length", "Octets the initiator wrote into the block"),
        Field("block_offset", 8, "Block Offset", "Block Offset read from the ticket's slot",
              order=A, hex=True),
    ),
)

COMPLETION = Struct(
    name="completion", title="COMPLETION Body", section="Completion", prefix="completion",
    items=(
        Field("data_length", 4, "Data Length", "Valid octets in the block"),
        Field("reserved", 4, "Reserved", "Reserved, zero", hex=True, reserved=True),
        Field("block_offset", 8, "Block Offset", "Tagged Offset of the block within the Pool STag",
              order=A, hex=True),
    ),
)

GOODBYE = Struct(name="goodbye", title="GOODBYE Body", section="Session Establishment", items=())

# One-line summaries (Info column): (label, key); an empty label shows the value alone.
# Flag names of the opcode follow them.
_C = "COMPLETION"
_RID, _HANDLE = ("rid", "request_id"), ("handle", "handle")
_DATA = (_RID, _HANDLE, ("len", "dd.length"))
MESSAGES = (
    Message(0x01, "HELLO", "Hello", HELLO, addr_le_applies=False, answer="HELLO_ACK",
            summary=(("features", "hello.requested_features"), ("credits", "hello.completion_credits"))),
    Message(0x02, "HELLO_ACK", "Hello Acknowledgement", HELLO_ACK, addr_le_applies=False,
            summary=(("", "status"), ("features", "hello_ack.features"),
                     ("bs", "hello_ack.block_size"), ("handles", "hello_ack.handle_base"))),
    Message(0x10, "LOAD", "Block Load", LOAD, flags=REQUEST_FLAGS, answer=_C, summary=_DATA),
    Message(0x11, "STORE", "Block Mapped Store", STORE, flags=REQUEST_FLAGS, answer=_C, summary=_DATA),
    Message(0x12, "ALLOC_STORE", "Block Unmapped Store", ALLOC_STORE, flags=REQUEST_FLAGS, answer=_C,
            summary=_DATA),
    Message(0x13, "FREE", "Block Free", FREE, flags=REQUEST_FLAGS, answer=_C, summary=(_RID, _HANDLE)),
    Message(0x14, "BIND", "Bind", BIND, answer=_C,
            summary=(_RID, _HANDLE, ("ticket", "bind.ticket"), ("off", "bind.block_offset"))),
    Message(0x20, "COMPLETION", "Completion", COMPLETION,
            summary=(_RID, ("", "status"), ("gen", "generation"), ("off", "completion.block_offset"))),
    Message(0x30, "GOODBYE", "Goodbye", GOODBYE, flags=GOODBYE_FLAGS),
)

BY_OPCODE = {m.opcode: m for m in MESSAGES}
BY_NAME = {m.name: m for m in MESSAGES}
assert set(BY_OPCODE) == set(OPCODES.by_value()), "every opcode has a body layout"
assert all(m.answer is None or m.answer in BY_NAME for m in MESSAGES)
assert all(key in {f.key for f in flatten(HEADER)} | {f.key for f in flatten(m.body)}
           for m in MESSAGES for _, key in m.summary), "summaries name real fields"


def wire_fields() -> dict[str, tuple[Field, Struct]]:
    """Every field of every message by key (``dd.stag``), with the structure that first
    declares it, in table order: the names of the JSON keys and display filters."""
    out: dict[str, tuple[Field, Struct]] = {}
    for struct_ in (HEADER, *(m.body for m in MESSAGES)):
        for f in flatten(struct_):
            out.setdefault(f.key, (f.field, struct_))
    return out


def flag_bits(key: str, field: Field, msg: Message | None) -> list[tuple[str, int]]:
    """(key, mask) of the per-bit fields of a flags word: ``flags.inline`` for the
    header Flags of the message's flag set, ``hello_ack.features.addr_le`` and so on."""
    flag_set = (msg.flags if msg else None) if field.per_opcode_flags else field.flags
    return [(f"{key}.{bit.key}", bit.value) for bit in flag_set.flags] if flag_set else []
