"""Scapy layers for every KBTP message, descriptor and memory structure.

Nothing here restates a layout: each class is generated from ``kbtp_scapy.tables``.
``KBTP`` is the common header and dispatches on Opcode to a body layer (``KBTPLoad``,
``KBTPCompletion``, ...); descriptors are sub-packets; Flags, Features and descriptor
Length are filled in when left unset and kept when set, so a fuzzer can lie.

Byte order of address fields (docs/NOTES.md decision 7): big-endian unless the session chose
ADDR_LE. ``conf.contribs["kbtp"]["addr_le"]`` sets the default; ``KBTP(..., addr_le=True)``
(or on any memory-structure layer) overrides it for one packet and its sub-layers.
"""
from __future__ import annotations

import functools
import re
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scapy.config import conf
from scapy.fields import (
    ByteEnumField,
    ByteField,
    ConditionalField,
    Field,
    FlagsField,
    IntField,
    LongField,
    MultipleTypeField,
    PacketField,
    ShortEnumField,
    ShortField,
    StrField,
    XByteField,
    XIntField,
    XLongField,
    XShortField,
    XStrFixedLenField,
)
from scapy.packet import Packet, Raw, bind_layers

if TYPE_CHECKING:
    from scapy.fields import _FieldContainer  # ConditionalField and MultipleTypeField

    FieldsDesc = list[Field | _FieldContainer]

from .. import tables as T
from ..codec import looks_like_kbtp
from ..summary import describe

conf.contribs.setdefault("kbtp", {}).setdefault("addr_le", False)

_INT_CODE = {1: "B", 2: "H", 4: "I", 8: "Q"}


class _KBTPPacket(Packet):
    """Base of every KBTP layer: carries the optional per-packet ADDR_LE override."""

    __slots__ = ["addr_le", "truncated"]

    def __init__(self, _pkt: bytes = b"", *args: Any, addr_le: bool | None = None, **kwargs: Any):
        object.__setattr__(self, "addr_le", addr_le)
        object.__setattr__(self, "truncated", False)
        super().__init__(_pkt, *args, **kwargs)

    def copy(self):
        clone = super().copy()
        object.__setattr__(clone, "addr_le", self.addr_le)
        return clone

    def clone_with(self, payload=None, **kargs):
        clone = super().clone_with(payload=payload, **kargs)
        object.__setattr__(clone, "addr_le", self.addr_le)
        return clone

    def show2(self, dump: bool = False, indent: int = 3, lvl: str = "", label_lvl: str = ""):
        return self.__class__(bytes(self), addr_le=self.addr_le).show(dump, indent, lvl, label_lvl)

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        """Fill a controlling word of this structure left unset (HELLO_ACK Features)
        from the conditional items given."""
        for name in {c.source for c in self._struct.conditions} - {"flags"}:
            if self.getfieldval(name) is None:
                p = _write_word(p, self._struct, name, _derived_word(self, name))
        return p + pay

    def do_dissect(self, s: bytes) -> bytes:
        try:
            return super().do_dissect(s)
        except struct.error:
            return self._dissect_truncated(s)

    def _dissect_truncated(self, s: bytes) -> bytes:
        """Bad input decodes as far as it can: fields that fit are kept, the others are
        left unset (None), and the octets left over go on to the next layer as Raw."""
        raw = s
        fields = iter(self.fields_desc)
        for f in fields:
            try:
                rest, value = f.getfield(self, s)
            except struct.error:
                self.fields[f.name] = None
                break
            if not (f.isconditional and value is None):
                self.fields[f.name] = value
            s = rest
        for f in fields:
            self.fields[f.name] = None
        self.raw_packet_cache = raw[:len(raw) - len(s)]
        self.explicit = 1
        object.__setattr__(self, "truncated", True)
        return s

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        return Raw if self.truncated else super().guess_payload_class(payload)

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes | None]:
        """Structures end where their table ends (inline data is a field); the rest is padding."""
        return b"", s


def session_addr_le(pkt: Packet | None) -> bool:
    """Whether address fields of ``pkt`` are little-endian, looking up through its layers."""
    while pkt is not None:
        if isinstance(pkt, KBTP):
            msg = T.BY_OPCODE.get(pkt.opcode)
            if msg is not None and not msg.addr_le_applies:
                return False
        if isinstance(pkt, _KBTPPacket) and pkt.addr_le is not None:
            return bool(pkt.addr_le)
        pkt = pkt.parent if pkt.parent is not None else pkt.underlayer
    return bool(conf.contribs["kbtp"]["addr_le"])


class AddrField(Field[int, int]):
    """An integer in the ADDRESS byte-order class: big-endian or ADDR_LE per session."""

    __slots__ = ["size", "hex"]

    def __init__(self, name: str, default: int | None, size: int, hex: bool = False):
        super().__init__(name, default, fmt=">" + _INT_CODE[size])
        self.size = size
        self.hex = hex

    def addfield(self, pkt: Packet, s: bytes, val: int | None) -> bytes:
        order = "<" if session_addr_le(pkt) else ">"
        return s + struct.pack(order + _INT_CODE[self.size], self.i2m(pkt, val))

    def getfield(self, pkt: Packet, s: bytes) -> tuple[bytes, int]:
        order = "<" if session_addr_le(pkt) else ">"
        return s[self.size:], struct.unpack(order + _INT_CODE[self.size], s[:self.size])[0]

    def i2repr(self, pkt: Packet | None, x: int | None) -> str:
        if x is None or not self.hex:
            return super().i2repr(pkt, x)  # type: ignore[arg-type]  # Scapy's stub: int; it shows None too
        return f"0x{x:x}"


class DescriptorField(PacketField):
    """A descriptor sub-packet; a missing one is sent as zeros, and its Length can be
    filled in from a sibling variable-size field (the inline data)."""

    __slots__ = ["fill"]

    def __init__(self, name: str, default: Packet | None, cls: type[Packet],
                 fill: dict[str, str] | None = None):
        super().__init__(name, default, cls)
        self.fill = fill or {}

    # Scapy's stubs: BasePacket (no getfieldval) and a cls that may take octets; here it
    # is a Packet class of the tables, built empty
    def i2m(self, pkt: Packet | None, i: Packet | None) -> bytes:  # type: ignore[override]
        i = self.cls() if i is None else i.copy()  # type: ignore[call-arg]
        for target, source in self.fill.items():
            data = pkt.getfieldval(source) if pkt is not None else None
            if i.getfieldval(target) is None and data is not None:
                i.setfieldval(target, len(data))
        i.parent = pkt
        return bytes(i)


def _class_name(name: str) -> str:
    return "KBTP" + "".join(part.capitalize() for part in re.split(r"[_\s]+", name))


def _enum_codec(enum: T.Enumeration) -> tuple[Callable[[int], str], Callable[[str], int]]:
    names = enum.by_name()
    return (lambda v: None if v is None else enum.describe(v)), names.__getitem__


def _flag_names(flag_set: T.FlagSet) -> list[str]:
    by_bit = {f.value.bit_length() - 1: f.name for f in flag_set.flags}
    return [by_bit.get(b, f"PRIVATE{b}" if flag_set.private_use_mask >> b & 1 else f"BIT{b}")
            for b in range(flag_set.bits)]


def _scalar_field(f: T.Field, default: Any) -> Field:
    if f.size == 0:
        return StrField(f.name, default)
    if f.is_bytes:
        return XStrFixedLenField(f.name, default if default is not None else b"\0" * f.size, f.size)
    if f.order is T.Order.ADDRESS:
        return AddrField(f.name, default, f.size, f.hex)
    if f.enum is not None:
        return {1: ByteEnumField, 2: ShortEnumField}[f.size](f.name, default, _enum_codec(f.enum))
    if f.flags is not None:
        return FlagsField(f.name, default, 8 * f.size, _flag_names(f.flags))
    plain = {1: ByteField, 2: ShortField, 4: IntField, 8: LongField}
    hexed = {1: XByteField, 2: XShortField, 4: XIntField, 8: XLongField}
    return (hexed if f.hex else plain)[f.size](f.name, default)


def _header_flags_field(f: T.Field) -> MultipleTypeField:
    """Flags named per opcode (the request flags, RELEASE for GOODBYE), bare hex otherwise."""
    variants: list[tuple[Field, Any, str] | tuple[Field, Any]] = []
    for flag_set in dict.fromkeys(m.flags for m in T.MESSAGES if m.flags is not None):
        ops = {m.opcode for m in T.MESSAGES if m.flags is flag_set}
        variants.append((FlagsField(f.name, None, 8 * f.size, _flag_names(flag_set)),
                         lambda pkt, ops=ops: pkt.opcode in ops))
    return MultipleTypeField(variants, XShortField(f.name, None))


def _present(pkt: Packet, cond: T.Condition) -> bool:
    """Presence of a conditional item: from the controlling word, or, while that word is
    unset on a packet being built, from whether any item under the same condition was given."""
    if cond.source == "flags":
        header = pkt.underlayer if isinstance(pkt.underlayer, KBTP) else None
        word = header.flags if header is not None else None
    else:
        word = pkt.getfieldval(cond.source)
    if word is not None:
        return bool(int(word) & cond.mask)
    return any(pkt.getfieldval(name) is not None for name in pkt._struct.gated(cond))


def _derived_word(pkt: Packet, source: str) -> int:
    """The controlling word ``source`` implied by the conditional items of ``pkt`` given."""
    return sum(c.mask for c in pkt._struct.conditions if c.source == source and _present(pkt, c))


def _write_word(p: bytes, struct_: T.Struct, name: str, word: int) -> bytes:
    """``p`` with the field ``name`` of ``struct_`` (at its fixed offset) set to ``word``."""
    at, size = struct_.offset(name), struct_.item(name).size
    return p[:at] + word.to_bytes(size, "big") + p[at + size:]


_struct_classes: dict[str, type[Packet]] = {}


def _fields_desc(struct_: T.Struct) -> FieldsDesc:
    """Scapy fields of a structure, in table order, with their conditions and defaults."""
    fields_desc: FieldsDesc = []
    for item in struct_.items:
        if isinstance(item, T.Member):
            cls = _struct_classes.get(item.struct.name) or _struct_class(item.struct)
            fill = {f.length_target[1]: f.name for f in struct_.items
                    if isinstance(f, T.Field) and f.length_target and f.length_target[0] == item.name}
            fld: Field | _FieldContainer = DescriptorField(item.name, None if item.when else cls(), cls, fill)
        elif item.per_opcode_flags:
            fld = _header_flags_field(item)
        else:
            fld = _scalar_field(item, _default(struct_, item))
        if item.when is not None:
            fld = ConditionalField(fld, functools.partial(_present, cond=item.when))
        fields_desc.append(fld)
    return fields_desc


def _filled_lengths() -> set[tuple[str, str]]:
    """(structure, field) pairs whose value is filled in from a variable-size field's length."""
    return {(msg.body.member(f.length_target[0]).struct.name, f.length_target[1])
            for msg in T.MESSAGES for f in msg.body.items
            if isinstance(f, T.Field) and f.length_target}


_FILLED = _filled_lengths()


def _default(struct_: T.Struct, item: T.Field) -> int | None:
    """None (computed at build time) for conditional items, controlling words and lengths
    filled from data; otherwise the table's default."""
    controls = any(c.source == item.name for c in struct_.conditions)
    if item.when is not None or controls or item.size == 0 or (struct_.name, item.name) in _FILLED:
        return None
    return item.default


def _struct_class(struct_: T.Struct, name: str | None = None, **attrs: Any) -> type[Packet]:
    """Generate the Scapy class of a structure from its table."""
    doc = f"{struct_.title} (kbtp-draft, {struct_.section}); generated from kbtp_scapy.tables."
    cls = type(name or _class_name(struct_.name), (_KBTPPacket,),
               {"name": f"KBTP {struct_.title}", "fields_desc": _fields_desc(struct_),
                "__doc__": doc, "__module__": __name__, "_struct": struct_, **attrs})
    _struct_classes[struct_.name] = cls
    return cls


class KBTP(_KBTPPacket):
    """KBTP Common Header (24 octets); the body layer follows according to the Opcode."""

    name = "KBTP"
    fields_desc = _fields_desc(T.HEADER)

    _struct = T.HEADER
    extract_padding = Packet.extract_padding  # the body follows the header

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        """Flags left unset follow the conditional body items given (RECORD, INLINE)."""
        if self.flags is None:
            body = self.payload
            word = _derived_word(body, "flags") if isinstance(body, _KBTPPacket) else 0
            p = _write_word(p, T.HEADER, "flags", word)
        return p + pay

    def hashret(self) -> bytes:
        return struct.pack(">Q", self.request_id or 0)

    def answers(self, other: Packet) -> int:
        """The message the tables name as the answer to ``other``, with its Request ID
        (a COMPLETION answers LOAD, STORE, ALLOC_STORE, FREE, BIND; HELLO_ACK answers HELLO)."""
        if not isinstance(other, KBTP) or other.opcode not in T.BY_OPCODE:
            return 0
        answer = T.BY_OPCODE[other.opcode].answer
        return int(answer is not None and T.BY_NAME[answer].opcode == self.opcode
                   and other.request_id == self.request_id)

    def mysummary(self) -> str:
        if self.opcode is None:
            return "KBTP [truncated]"
        return "KBTP " + describe(packet_fields(self)) + (" [truncated]" if self.truncated else "")


BODY_CLASSES: dict[int, type[Packet]] = {}
for _msg in T.MESSAGES:
    _cls = _struct_class(_msg.body, _class_name(_msg.name))
    BODY_CLASSES[_msg.opcode] = _cls
    globals()[_cls.__name__] = _cls
    bind_layers(KBTP, _cls, opcode=_msg.opcode)

MEMORY_CLASSES: dict[str, type[Packet]] = {}
for _struct in T.MEMORY_STRUCTS:
    _cls = _struct_class(_struct)
    MEMORY_CLASSES[_struct.name] = _cls
    globals()[_cls.__name__] = _cls

KBTPDataDescriptor = _struct_classes[T.DATA_DESCRIPTOR.name]
KBTPCompletionDescriptor = _struct_classes[T.COMPLETION_DESCRIPTOR.name]
KBTPDirectDescriptor = _struct_classes[T.DIRECT_DESCRIPTOR.name]


def guess_kbtp(data: bytes) -> type[Packet]:
    """Layer class for the payload of an RDMA Send: KBTP when it looks like it, else Raw."""
    return KBTP if looks_like_kbtp(data) else Raw


def packet_fields(pkt: Packet) -> dict[str, Any]:
    """Flat ``{key: value}`` of a KBTP packet, keyed as the codec and the JSON output are;
    items absent from the wire are left out."""
    header = pkt if isinstance(pkt, KBTP) else pkt.getlayer(KBTP)
    if header is None:
        raise ValueError(f"no KBTP layer in {pkt.summary()}")
    out = {f.key: _plain(header.getfieldval(f.field.name)) for f in T.flatten(T.HEADER)
           if header.getfieldval(f.field.name) is not None}
    body = header.payload
    if isinstance(body, _KBTPPacket):
        for f in T.flatten(body._struct):
            value = body
            for name in f.path:
                value = value.getfieldval(name) if value is not None else None
            if value is not None:
                out[f.key] = _plain(value)
    return out


def build_packet(values: dict[str, Any], addr_le: bool | None = None) -> KBTP:
    """A KBTP packet from a flat dict as ``packet_fields`` returns; missing keys keep
    the layers' defaults (so Flags, Features and Length are computed)."""
    opcode = values["opcode"]
    header = KBTP(addr_le=addr_le, **{f.field.name: values[f.key]
                                      for f in T.flatten(T.HEADER) if f.key in values})
    body_cls = BODY_CLASSES.get(opcode)
    if body_cls is None:
        return header / Raw(values.get("payload", b""))
    body = body_cls()
    for f in T.flatten(body_cls._struct):
        if f.key not in values:
            continue
        target = body
        for name in f.path[:-1]:
            sub = target.getfieldval(name)
            if sub is None:
                sub = target.get_field(name).cls()  # type: ignore[union-attr]  # a ConditionalField passes .cls on
                target.setfieldval(name, sub)
            target = sub
        target.setfieldval(f.path[-1], values[f.key])
    return header / body


def _plain(value: Any) -> Any:
    """Scapy's FlagValue as a plain int; bytes stay bytes. Fields a truncated packet
    did not reach are left out by the callers."""
    return value if isinstance(value, bytes) else int(value)


__all__ = (["KBTP", "KBTPDataDescriptor", "KBTPCompletionDescriptor", "KBTPDirectDescriptor",
            "AddrField", "BODY_CLASSES", "MEMORY_CLASSES", "build_packet", "guess_kbtp",
            "looks_like_kbtp", "packet_fields", "session_addr_le"]
           + [c.__name__ for c in BODY_CLASSES.values()]
           + [c.__name__ for c in MEMORY_CLASSES.values()])
