"""Mutations of one request: through the Scapy layers, protocol-aware, and on raw octets.

Field lists come from the tables (``flatten`` of the header and of each opcode's body),
so a new field is fuzzed without a change here. Each mutator takes the request's valid
values, the step's random generator and what the session learned, and returns the octets
to send with a one-line description of what it did.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from scapy.packet import fuzz

from .. import codec
from ..layers.kbtp import KBTP, build_packet
from ..tables import BY_OPCODE, HEADER, flatten
from ..vocab import AnyMessage, RequestFlag
from .cases import unknown_opcodes

U64 = (1 << 64) - 1


@dataclass
class Context:
    """What a mutator may use: the session's byte order, limits and learned values."""

    addr_le: bool
    block_size: int
    max_inline: int
    generation: int            # the generation last learned for the request's handle
    blocks: list[int]          # Block Offsets learned from completions and slots
    ticket: int                # a ticket the session took, or the next one it would take


Mutator = Callable[[dict[str, Any], random.Random, Context], tuple[bytes, str]]


def _fields(opcode: int) -> list[tuple[str, int]]:
    """(key, octets) of every header and body field of ``opcode``; inline data is 0."""
    out = [(f.key, f.field.size) for f in flatten(HEADER)]
    return out + [(f.key, f.field.size) for f in flatten(BY_OPCODE[opcode].body)]


def _interesting(rng: random.Random, size: int, current: int) -> int:
    top = (1 << (8 * size)) - 1
    return rng.choice([0, 1, top, top >> 1, (top >> 1) + 1, (current + 1) & top,
                       (current - 1) & top, current ^ (1 << rng.randrange(8 * size)),
                       rng.getrandbits(8 * size)])


def _scapy(values: dict[str, Any], ctx: Context) -> KBTP:
    return build_packet(values, ctx.addr_le)


def _encode(values: dict[str, Any], ctx: Context) -> bytes:
    """Mutated fields: any key a mutator chose, any value, as the fuzzer means."""
    return codec.encode(cast(AnyMessage, values), ctx.addr_le)


def field(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """One field of the request set to a boundary, neighbour, bit-flipped or random value."""
    key, size = rng.choice(_fields(values["opcode"]))
    if size == 0:
        new: Any = rng.randbytes(rng.choice([0, 1, 7, ctx.max_inline, ctx.max_inline + 1]))
        shown = f"{len(new)} octets"
    else:
        new = _interesting(rng, size, int(values.get(key, 0) or 0))
        shown = hex(new)
    return bytes(_scapy({**values, key: new}, ctx)), f"field {key}={shown}"


def scapy_fuzz(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """Scapy's ``fuzz()`` on the body (or the whole message), its random source seeded."""
    state = random.getstate()
    random.seed(rng.getrandbits(64))
    try:
        pkt = _scapy(values, ctx)
        whole = rng.random() < 0.3
        built = bytes(fuzz(pkt)) if whole else bytes(KBTP(bytes(pkt)[:24], addr_le=ctx.addr_le) /
                                                      fuzz(pkt.payload.copy()))
    finally:
        random.setstate(state)
    return built, f"scapy fuzz() of the {'whole message' if whole else 'body'}"


def flags(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """Flags against the layout: a conditional bit toggled with the body left as it was,
    undefined or Private Use bits, or a descriptor's octets added or removed."""
    raw = _encode(values, ctx)
    choice = rng.randrange(4)
    if choice == 0:
        bit = rng.choice([RequestFlag.INLINE, RequestFlag.RECORD])
        f = values.get("flags", 0) ^ bit
        return raw[:2] + f.to_bytes(2, "big") + raw[4:], f"flags 0x{f:04x} (bit 0x{bit:x} toggled, body kept)"
    if choice == 1:
        bits = rng.choice([0x0020, 0x0100, 0x1000, 0x8000, 0xF000, 0xFFE0])
        f = values.get("flags", 0) | bits
        return raw[:2] + f.to_bytes(2, "big") + raw[4:], f"flags 0x{f:04x} (undefined/Private Use bits)"
    if choice == 2:
        return raw + bytes(16), "16 extra octets (a descriptor the flags do not announce)"
    cut = rng.choice([8, 16, 17])
    return raw[:max(24, len(raw) - cut)], f"{cut} octets cut from the end"


def inline_lie(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """INLINE whose Data Descriptor Length disagrees with the octets that follow."""
    data = values.get("inline_data") or rng.randbytes(rng.choice([1, 8, 64]))
    told = rng.choice([len(data) + 1, max(0, len(data) - 1), 0, ctx.max_inline + 1,
                       ctx.block_size + 1, 0xFFFFFFFF, 2 * len(data)])
    v = {**values, "flags": values.get("flags", 0) | RequestFlag.INLINE, "dd.stag": 0, "dd.offset": 0,
         "dd.length": told, "inline_data": data}
    if values["opcode"] == BY_OPCODE_NAME["LOAD"]:
        v.pop("inline_data")
        return _encode(v, ctx) + data, f"LOAD with INLINE, length {told}, {len(data)} octets after"
    return bytes(_scapy(v, ctx)), f"INLINE length {told} for {len(data)} octets"


def generation(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """Generation zero, stale (one behind, one ahead), wrapped past 0xFFFF, or far off."""
    g = ctx.generation
    new = rng.choice([0, (g - 1) & 0xFFFF, (g + 1) & 0xFFFF, 0xFFFF, g % 0xFFFF + 1,
                      (g + 0x8000) & 0xFFFF, 1])
    return _encode({**values, "generation": new}, ctx), f"generation {new} (learned {g})"


def handle_edge(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """The step chose an edge handle; the request goes as it is, with a random Generation."""
    new = rng.choice([0, ctx.generation])
    return _encode({**values, "generation": new}, ctx), f"handle 0x{values['handle']:x} generation {new}"


def opcode(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """An unknown, Private Use or answer-only opcode, or a Version other than 1."""
    raw = bytearray(_encode(values, ctx))
    if rng.random() < 0.25:
        raw[0] = rng.choice([0, 2, 0x80, 0xFF])
        return bytes(raw), f"version {raw[0]}"
    raw[1] = rng.choice(unknown_opcodes())
    return bytes(raw), f"opcode 0x{raw[1]:02x}"


def raw_bytes(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """Octets of the valid message flipped, overwritten, cut, inserted or appended."""
    raw = bytearray(_encode(values, ctx))
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        how = rng.randrange(5)
        at = rng.randrange(len(raw) + 1) if raw else 0
        if how == 0 and raw:
            at = min(at, len(raw) - 1)
            raw[at] ^= 1 << rng.randrange(8)
            done.append(f"bit flip @{at}")
        elif how == 1 and raw:
            at = min(at, len(raw) - 1)
            raw[at] = rng.randrange(256)
            done.append(f"octet @{at}")
        elif how == 2:
            del raw[at:]
            done.append(f"cut to {at}")
        elif how == 3:
            raw[at:at] = rng.randbytes(rng.choice([1, 4, 8, 16]))
            done.append(f"insert @{at}")
        else:
            raw += rng.randbytes(rng.choice([1, 16, 64]))
            done.append("append")
    return bytes(raw), "bytes: " + ", ".join(done)


def bind_forged(values: dict[str, Any], rng: random.Random, ctx: Context) -> tuple[bytes, str]:
    """BIND with a forged Ticket and/or Block Offset."""
    ticket = rng.choice([ctx.ticket, ctx.ticket + 1, ctx.ticket + 1000, 0, 0xFFFFFFFF,
                         rng.getrandbits(32)])
    known = ctx.blocks or [0]
    offset = rng.choice([rng.choice(known), rng.choice(known) + 1, rng.choice(known) + ctx.block_size,
                         U64, 0, rng.getrandbits(64)])
    v = {**values, "bind.ticket": ticket, "bind.block_offset": offset,
         "bind.data_length": rng.choice([0, 1, ctx.block_size, ctx.block_size + 1])}
    return _encode(v, ctx), f"BIND ticket {ticket} offset 0x{offset:x} length {v['bind.data_length']}"


BY_OPCODE_NAME = {m.name: op for op, m in BY_OPCODE.items()}
MUTATORS: dict[str, Mutator] = {
    "field": field, "scapy_fuzz": scapy_fuzz, "flags": flags, "inline_lie": inline_lie,
    "generation": generation, "handle_edge": handle_edge, "opcode": opcode,
    "bytes": raw_bytes, "bind_forged": bind_forged,
}
