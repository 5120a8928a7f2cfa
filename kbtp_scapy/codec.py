"""Fast KBTP codec: bytes <-> plain dicts, with no Scapy objects.

Layouts are compiled once from ``kbtp_scapy.tables`` into ``struct.Struct`` objects, one
per opcode, per combination of its conditional items, per byte order. Dict keys are the
display-filter names without ``kbtp.`` (``request_id``, ``dd.stag``, ``hello_ack.features``).
This is what the reference target's data path uses.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from itertools import product
from typing import Any, cast, overload

from .tables import (
    BY_OPCODE,
    HEADER,
    HEADER_SIZE,
    OPCODES,
    VERSION,
    Condition,
    FlatField,
    Order,
    Struct,
    flatten,
)
from .vocab import AnyMessage, AnyStruct, MessageRecord, StructRecord

_INT_CODES = {1: "B", 2: "H", 4: "I", 8: "Q"}
_VERSION_AT, _OPCODE_AT = HEADER.offset("version"), HEADER.offset("opcode")
_FLAGS = slice(HEADER.offset("flags"), HEADER.offset("flags") + HEADER.item("flags").size)


class Malformed(ValueError):
    """A message that cannot be parsed; ``fields`` holds what could be decoded."""

    def __init__(self, reason: str, fields: AnyMessage):
        super().__init__(reason)
        self.reason = reason
        self.fields = fields


@dataclass(frozen=True)
class _Layout:
    """One concrete wire layout: fixed fields, then optional rest-of-message bytes.

    Each byte order has its own Struct: in the little-endian one, address fields are
    octet strings converted with ``int.from_bytes(..., "little")``.
    """

    keys: tuple[str, ...]
    size: int
    tail: FlatField | None               # variable-size field taking the rest
    tail_length: str                     # the key of the field holding its length ("": no tail)
    unpack_be: Callable[[bytes | memoryview], dict[str, Any]]
    unpack_le: Callable[[bytes | memoryview], dict[str, Any]]
    pack_be: Callable[[Mapping[str, Any]], bytes]
    pack_le: Callable[[Mapping[str, Any]], bytes]


def _compile(fields: list[FlatField]) -> _Layout:
    fixed = [f for f in fields if f.field.size]
    tail = next((f for f in fields if not f.field.size), None)
    length_key = ""
    if tail is not None:
        if tail.field.length_from is None:
            raise TypeError(f"{tail.key}: a variable-size field needs length_from in the tables")
        length_key = tail.field.length_from
    keys = tuple(f.key for f in fixed)
    be = _generate(fixed, little=False)
    le = _generate(fixed, little=True)
    return _Layout(keys, struct.calcsize(">" + "".join(_code(f, False) for f in fixed)), tail,
                   length_key,
                   be["unpack"], le["unpack"], be["pack"], le["pack"])


def _code(f: FlatField, little: bool) -> str:
    if f.field.is_bytes or (little and f.field.order is Order.ADDRESS and f.field.size > 1):
        return f"{f.field.size}s"
    return _INT_CODES[f.field.size]


def _generate(fixed: list[FlatField], little: bool) -> dict[str, Callable]:
    """Straight-line pack and unpack functions for one layout and byte order, generated
    from the tables (as dataclasses generates methods): this runs once per message on
    the target's data path, where loops over field lists would dominate."""
    fmt = struct.Struct(">" + "".join(_code(f, little) for f in fixed))
    unpacked, packed = [], []
    for i, f in enumerate(fixed):
        value = f"(x if (x := g({f.key!r})) is not None else {f.field.default})"
        if f.field.is_bytes:
            unpacked.append(f"{f.key!r}: a[{i}]")
            packed.append(f"_blob(g({f.key!r}), {f.field.size})")
        elif _code(f, little).endswith("s"):
            unpacked.append(f"{f.key!r}: _from(a[{i}], 'little')")
            packed.append(f"{value}.to_bytes({f.field.size}, 'little')")
        else:
            unpacked.append(f"{f.key!r}: a[{i}]")
            packed.append(value)
    src = (f"def unpack(buf):\n    a = _unpack_from(buf)\n    return {{{', '.join(unpacked)}}}\n"
           f"def pack(v):\n    g = v.get\n    return _pack({', '.join(packed)})\n")
    scope: dict[str, Callable[..., Any]] = {"_unpack_from": fmt.unpack_from, "_pack": fmt.pack, "_from": int.from_bytes,
             "_blob": _blob}
    exec(src, scope)  # noqa: S102 - source built from the field tables only
    return scope


def _blob(value: Any, size: int) -> bytes:
    """A fixed-size octet-string field given as bytes, an int, or not at all."""
    if value is None:
        return bytes(size)
    return value.to_bytes(size, "big") if isinstance(value, int) else value


@dataclass(frozen=True)
class _Opcode:
    """What decoding needs to know about one opcode before choosing its layout."""

    opcode: int
    conditions: tuple[Condition, ...]
    features: FlatField | None      # the body's controlling word besides the header Flags
    features_offset: int            # its offset from the start of the message
    features_size: int
    addr_le_applies: bool
    layouts: dict = field(default_factory=dict)  # (flags, features) masked -> _Layout

    def layout(self, flags: int, features: int) -> _Layout:
        key = (flags, features)
        found = self.layouts.get(key)
        if found is None:
            present = tuple(bool((flags if c.source == "flags" else features) & c.mask)
                            for c in self.conditions)
            found = self.layouts[key] = _message_layout(self.opcode, present)
        return found


def _opcode_info(opcode: int) -> _Opcode:
    body = BY_OPCODE[opcode].body
    sources = {c.source for c in body.conditions} - {"flags"}
    assert len(sources) <= 1, "one body-level controlling word per message"
    features = next((f for f in flatten(body) if f.field.name in sources), None)
    offset = HEADER_SIZE + body.offset(features.field.name) if features else 0
    return _Opcode(opcode, body.conditions, features, offset,
                   features.field.size if features else 0, BY_OPCODE[opcode].addr_le_applies)


_OPCODES = {op: _opcode_info(op) for op in BY_OPCODE}


@cache
def _message_layout(opcode: int, present: tuple[bool, ...]) -> _Layout:
    on = {c for c, p in zip(_OPCODES[opcode].conditions, present) if p}
    fields = [f for f in list(flatten(HEADER)) + list(flatten(BY_OPCODE[opcode].body))
              if f.when is None or f.when in on]
    return _compile(fields)


_STRUCT_LAYOUTS: dict[str, _Layout] = {}


def _struct_layout(struct_: Struct) -> _Layout:
    """Compiled once per structure, found by name: hashing the frozen table itself on
    every call would cost more than the unpacking (the target reads entries and slots
    on every operation)."""
    layout = _STRUCT_LAYOUTS.get(struct_.name)
    if layout is None:
        layout = _STRUCT_LAYOUTS[struct_.name] = _compile(list(flatten(struct_)))
    return layout


_HEADER_LAYOUT = _compile(list(flatten(HEADER)))


def _addr_le(opcode: int, addr_le: bool) -> bool:
    info = _OPCODES.get(opcode)
    return addr_le and (info is None or info.addr_le_applies)


def _unpack(layout: _Layout, buf: bytes | memoryview, le: bool) -> dict[str, Any]:
    return layout.unpack_le(buf) if le else layout.unpack_be(buf)


def _features_of(info: _Opcode, buf: bytes) -> int:
    off, end = info.features_offset, info.features_offset + info.features_size
    if info.features is None or len(buf) < end:
        return 0
    return int.from_bytes(buf[off:end], "big")


def message_length(opcode: int, flags: int, features: int = 0, inline_length: int = 0) -> int:
    """Length a well-formed message of this opcode has for these Flags and Features."""
    layout = _OPCODES[opcode].layout(flags, features)
    return layout.size + (inline_length if layout.tail is not None else 0)


_PRIVATE_OPCODES = range(OPCODES.private_range[0], OPCODES.private_range[1] + 1)


def looks_like_kbtp(data: bytes) -> bool:
    """Cheap recognition for transports guessing what a Send carries: Version 1 and a
    known or Private Use opcode in a buffer that holds at least a header."""
    if len(data) < HEADER_SIZE or data[_VERSION_AT] != VERSION:
        return False
    return data[_OPCODE_AT] in BY_OPCODE or data[_OPCODE_AT] in _PRIVATE_OPCODES


def opcode_of(buf: bytes) -> int | None:
    """The Opcode octet of whatever ``buf`` holds, None when it is too short: a look at a
    message without decoding it (a checker watching for one kind)."""
    return buf[_OPCODE_AT] if len(buf) > _OPCODE_AT else None


_RID_AT = HEADER.offset("request_id")
_RID_END = _RID_AT + HEADER.item("request_id").size


def request_id_of(buf: bytes, addr_le: bool = False) -> int | None:
    """The Request ID of whatever octets ``buf`` holds (a mutated or cut request), None when
    they do not reach its end: what an answer must echo."""
    if len(buf) < _RID_END:
        return None
    return decode_header(bytes(buf[:_RID_END]).ljust(HEADER_SIZE, b"\0"), addr_le)["request_id"]


def _header(buf: bytes, le: bool) -> AnyMessage:
    return cast(AnyMessage, _unpack(_HEADER_LAYOUT, buf, le))


def decode_header(buf: bytes, addr_le: bool = False) -> AnyMessage:
    """The common header alone, whatever follows it (``buf`` has at least 24 octets)."""
    return _header(buf, _addr_le(buf[_OPCODE_AT], addr_le))


def decode(buf: bytes, addr_le: bool = False) -> AnyMessage:
    """Decode one KBTP message; raise ``Malformed`` (with the decodable fields) if it is not one."""
    if len(buf) < HEADER_SIZE:
        raise Malformed(f"truncated: {len(buf)} octets, the header alone needs {HEADER_SIZE}", {})
    opcode = buf[_OPCODE_AT]
    le = _addr_le(opcode, addr_le)
    if buf[_VERSION_AT] != VERSION:
        raise Malformed(f"version {buf[_VERSION_AT]} is not {VERSION}", _header(buf, le))
    info = _OPCODES.get(opcode)
    if info is None:
        raise Malformed(f"opcode {OPCODES.describe(opcode)} has no layout",
                        _header(buf, le))
    flags = int.from_bytes(buf[_FLAGS], "big")
    layout = info.layout(flags, _features_of(info, buf))
    if len(buf) < layout.size:
        raise Malformed(f"truncated: {len(buf)} octets, {BY_OPCODE[opcode].name} with these "
                        f"flags needs {layout.size}", _header(buf, le))
    out = _unpack(layout, buf, le)
    if layout.tail is not None:
        data = bytes(buf[layout.size:])
        out[layout.tail.key] = data
        declared = out[layout.tail_length]
        if declared != len(data):
            raise Malformed(f"inline data is {len(data)} octets, the descriptor says {declared}",
                            cast(AnyMessage, out))
    elif len(buf) > layout.size:
        raise Malformed(f"{len(buf) - layout.size} octets after the end of "
                        f"{BY_OPCODE[opcode].name}", cast(AnyMessage, out))
    return cast(AnyMessage, out)


def auto_flags(opcode: int, values: Mapping[str, Any], source: str) -> int:
    """Bits of a controlling word implied by which conditional items ``values`` carries."""
    return sum(cond.mask for cond, keys in _gated_keys(opcode)
               if cond.source == source and any(k in values for k in keys))


@cache
def _gated_keys(opcode: int) -> tuple[tuple[Condition, tuple[str, ...]], ...]:
    """Each condition of the body with the keys of the leaf fields it gates."""
    flat = list(flatten(BY_OPCODE[opcode].body))
    return tuple((c, tuple(f.key for f in flat if f.when == c)) for c in BY_OPCODE[opcode].body.conditions)


# The first form checks a dict literal's keys against every message's; the second takes
# a record typed as one message; the function itself reads any mapping of those keys.
@overload
def encode(values: AnyMessage, addr_le: bool = False) -> bytes: ...
@overload
def encode(values: MessageRecord, addr_le: bool = False) -> bytes: ...
def encode(values: Mapping[str, Any], addr_le: bool = False) -> bytes:
    """Encode a message from a dict keyed as ``decode`` returns.

    Missing fields are zero (Version 1). Unset Flags and Features are derived from the
    conditional items given, and an unset Data Descriptor Length from the inline data;
    values that are given are used as they are, so a caller can lie on purpose.
    """
    opcode = values["opcode"]
    info = _OPCODES.get(opcode)
    if info is None:
        head = _pack(_HEADER_LAYOUT, values, _addr_le(opcode, addr_le))
        return head + bytes(values.get("payload", b""))
    fill = {}
    flags = values.get("flags")
    if flags is None:
        flags = fill["flags"] = auto_flags(opcode, values, "flags")
    features = 0
    if info.features is not None:
        given = values.get(info.features.key)
        if given is None:
            given = fill[info.features.key] = auto_flags(opcode, values, "features")
        features = given
    layout = info.layout(flags, features)
    tail = b""
    if layout.tail is not None:
        tail = bytes(values.get(layout.tail.key) or b"")
        if values.get(layout.tail_length) is None:
            fill[layout.tail_length] = len(tail)
    if fill:
        values = {**values, **fill}
    return _pack(layout, values, addr_le and info.addr_le_applies) + tail


def _pack(layout: _Layout, values: Mapping[str, Any], le: bool) -> bytes:
    return layout.pack_le(values) if le else layout.pack_be(values)


def decode_struct(struct_: Struct, buf: bytes | memoryview, addr_le: bool = False) -> AnyStruct:
    """Decode a memory structure (table entry, ring slot, completion record)."""
    layout = _struct_layout(struct_)
    if len(buf) < layout.size:
        raise Malformed(f"truncated {struct_.title}: {len(buf)} of {layout.size} octets", {})
    return cast(AnyStruct, _unpack(layout, buf, addr_le))


def encode_struct(struct_: Struct, values: StructRecord, addr_le: bool = False) -> bytes:
    """Encode a memory structure from a dict keyed as ``decode_struct`` returns."""
    return _pack(_struct_layout(struct_), values, addr_le)


def layout_variants() -> list[tuple[int, tuple[bool, ...]]]:
    """Every (opcode, conditional-items-present) combination, for exhaustive tests."""
    return [(op, present) for op, info in _OPCODES.items()
            for present in product((False, True), repeat=len(info.conditions))]
