"""The vocabulary the field tables are written in.

Everything that knows a KBTP layout (Scapy layers, the codec, the Lua dissector, the
field reference) reads it from instances of these classes, never from its own copy.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


class Order(enum.Enum):
    """Byte-order class of a field (spec section "Conventions"; docs/NOTES.md decision 7)."""

    NETWORK = "network"  # always big-endian
    ADDRESS = "address"  # big-endian, little-endian in sessions whose target chose ADDR_LE
    MEMORY = "memory"    # the target's memory byte order (ring counters, RFC 7306)


@dataclass(frozen=True)
class Value:
    """One named value of an enumeration or one bit of a flag set."""

    value: int
    name: str
    doc: str

    @property
    def key(self) -> str:
        """Lower-case name used in display-filter and JSON keys (``kbtp.flags.inline``)."""
        return self.name.lower()


@dataclass(frozen=True)
class Enumeration:
    """An IANA-style value space; its upper quarter is reserved for Private Use."""

    name: str
    title: str
    bits: int
    values: tuple[Value, ...]
    private_use: tuple[int, int] | None = None

    @property
    def private_range(self) -> tuple[int, int]:
        """(first, last) Private Use value of a table that has them."""
        if self.private_use is None:
            raise ValueError(f"{self.name} has no Private Use range")
        return self.private_use

    def by_value(self) -> dict[int, str]:
        return {v.value: v.name for v in self.values}

    def by_name(self) -> dict[str, int]:
        return {v.name: v.value for v in self.values}

    def describe(self, value: int) -> str:
        """Name of a value; Private Use and unknown values are named as such, never guessed."""
        name = self.by_value().get(value)
        if name is not None:
            return name
        if self.private_use and self.private_use[0] <= value <= self.private_use[1]:
            return f"Private Use (0x{value:x})"
        return f"Unknown (0x{value:x})"


@dataclass(frozen=True)
class FlagSet:
    """Named bits of a 16-bit flags or features word."""

    name: str
    title: str
    bits: int
    flags: tuple[Value, ...]
    private_use_mask: int = 0

    @property
    def defined_mask(self) -> int:
        mask = 0
        for flag in self.flags:
            mask |= flag.value
        return mask

    def names(self, value: int) -> list[str]:
        """Names of the set bits; undefined ones as hex, Private Use ones labelled."""
        out = [f.name for f in self.flags if value & f.value]
        rest = value & ~self.defined_mask
        if rest & self.private_use_mask:
            out.append(f"PRIVATE(0x{rest & self.private_use_mask:x})")
        if rest & ~self.private_use_mask:
            out.append(f"UNDEFINED(0x{rest & ~self.private_use_mask:x})")
        return out


_INT_OPERATORS = ("__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__invert__")


class _WireFlagType(enum.EnumType):
    """Gives every flag class int's bitwise operators, which EnumType replaces with Flag's
    in each class it builds."""

    def __new__(metacls, cls: str, bases: tuple[type, ...], classdict: enum._EnumDict,
                **kwds: Any) -> _WireFlagType:
        flags = super().__new__(metacls, cls, bases, classdict, **kwds)
        for op in _INT_OPERATORS:
            setattr(flags, op, getattr(int, op))
        return flags


class WireFlag(enum.IntFlag, metaclass=_WireFlagType):
    """Base of the generated flag sets (``kbtp_scapy.vocab``): bits of a word of a
    message, where bits the set does not declare (Private Use, undefined) are data too.

    A member is an int with a name (``Feature.ADDR_LE.name``, ``Feature["ADDR_LE"]``,
    ``list(Feature)``). Bitwise operators give plain ints, as the int constants these
    classes replaced did: ``~RequestFlag.INLINE`` is -2, which keeps every other bit of
    the word, where IntFlag's own complement keeps only the declared bits; and ``&`` and
    ``|`` run at int speed on the data paths (Flag's take half a microsecond). The names
    of a whole word are the table's: ``FlagSet.names``.
    """

    if TYPE_CHECKING:
        def __and__(self, other: int) -> int: ...  # type: ignore[override]
        def __rand__(self, other: int) -> int: ...  # type: ignore[override]
        def __or__(self, other: int) -> int: ...  # type: ignore[override]
        def __ror__(self, other: int) -> int: ...  # type: ignore[override]
        def __xor__(self, other: int) -> int: ...  # type: ignore[override]
        def __rxor__(self, other: int) -> int: ...  # type: ignore[override]
        def __invert__(self) -> int: ...  # type: ignore[override]


@dataclass(frozen=True)
class Condition:
    """An item is present when ``(value of the controlling word) & mask`` is non-zero.

    ``source`` is "flags" (the common header's Flags) or "features" (the Features field
    of the same body, as in HELLO_ACK).
    """

    source: str
    mask: int


@dataclass(frozen=True)
class Field:
    """One field of a structure.

    ``size`` is in octets; 0 means "the rest of the message" (inline data).
    ``default`` is what an encoder writes when no value is given.
    ``length_from`` names the field (by key, ``member.field``) whose value, when left
    unset, is filled in from this variable-size field's length.
    """

    name: str
    size: int
    title: str
    doc: str
    order: Order = Order.NETWORK
    hex: bool = False
    enum: Enumeration | None = None
    flags: FlagSet | None = None
    per_opcode_flags: bool = False
    reserved: bool = False
    when: Condition | None = None
    length_from: str | None = None
    default: int = 0

    @property
    def is_bytes(self) -> bool:
        return self.size == 0 or self.size > 8

    @property
    def length_target(self) -> tuple[str, str] | None:
        """(member, field) that ``length_from`` names."""
        if self.length_from is None:
            return None
        member, name = self.length_from.split(".", 1)
        return member, name


@dataclass(frozen=True)
class Member:
    """A sub-structure (a descriptor) placed inside another structure."""

    name: str
    struct: Struct
    title: str
    when: Condition | None = None

    @property
    def size(self) -> int:
        return self.struct.size


Item = Field | Member


@dataclass(frozen=True)
class Struct:
    """A fixed sequence of fields and members, as one diagram of the specification draws it."""

    name: str
    title: str
    section: str
    items: tuple[Item, ...]
    prefix: str = ""

    @property
    def size(self) -> int:
        """Size with every conditional item present (variable-size items count 0)."""
        return sum(item.size for item in self.items)

    def item(self, name: str) -> Item:
        for item in self.items:
            if item.name == name:
                return item
        raise KeyError(name)

    def member(self, name: str) -> Member:
        """The sub-structure item ``name`` (a descriptor)."""
        item = self.item(name)
        if not isinstance(item, Member):
            raise KeyError(f"{name} is a field of {self.name}, not a sub-structure")
        return item

    def offset(self, name: str) -> int:
        """Offset of an item that no conditional item precedes (its place is fixed)."""
        offset = 0
        for item in self.items:
            if item.name == name:
                return offset
            if item.when is not None or not item.size:
                break
            offset += item.size
        raise KeyError(f"{name} has no fixed offset in {self.name}")

    @property
    def conditions(self) -> tuple[Condition, ...]:
        """The distinct conditions that gate items of this structure, in wire order."""
        return tuple(dict.fromkeys(i.when for i in self.items if i.when is not None))

    def gated(self, cond: Condition) -> tuple[str, ...]:
        """Names of the items that ``cond`` gates."""
        return tuple(i.name for i in self.items if i.when == cond)


@dataclass(frozen=True)
class Message:
    """One opcode: its body layout and the flag set its header Flags use."""

    opcode: int
    name: str
    title: str
    body: Struct
    flags: FlagSet | None = None
    addr_le_applies: bool = True
    answer: str | None = None      # name of the message that answers this one
    summary: tuple[tuple[str, str], ...] = ()  # (label, key) shown in one-line summaries
    doc: str = ""


@dataclass(frozen=True)
class FlatField:
    """A leaf field with its dotted key (``dd.stag``) and the condition that gates it."""

    key: str
    field: Field
    when: Condition | None = None
    path: tuple[str, ...] = ()


def flatten(struct: Struct, prefix: str = "", when: Condition | None = None) -> Iterator[FlatField]:
    """Yield the leaf fields of ``struct`` in wire order with their dotted keys.

    Keys are what the JSON output and the display filters use after ``kbtp.``; the
    ``path`` is the chain of item names inside the Scapy layers (``("dd", "stag")``).
    """
    base = ".".join(p for p in (prefix, struct.prefix) if p)
    yield from _flatten_items(struct.items, base, when, ())


def _flatten_items(items, base, when, path) -> Iterator[FlatField]:
    for item in items:
        cond = item.when or when
        key = f"{base}.{item.name}" if base else item.name
        if isinstance(item, Member):
            yield from _flatten_items(item.struct.items, key, cond, path + (item.name,))
        else:
            yield FlatField(key, item, cond, path + (item.name,))
