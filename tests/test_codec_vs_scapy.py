"""Differential test: the codec and the Scapy layers, both generated from the tables,
produce and accept the same bytes for every layout, in both byte orders."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kbtp_scapy import codec, tables as T
from kbtp_scapy.layers.kbtp import KBTP, MEMORY_CLASSES, build_packet, packet_fields


def _value(f: T.Field):
    if f.size == 0:
        return st.binary(max_size=64)
    if f.is_bytes:
        return st.binary(min_size=f.size, max_size=f.size)
    return st.integers(0, (1 << (8 * f.size)) - 1)


@st.composite
def messages(draw):
    opcode, present = draw(st.sampled_from(codec.layout_variants()))
    msg = T.BY_OPCODE[opcode]
    conds = codec._OPCODES[opcode].conditions
    on = {c for c, p in zip(conds, present) if p}
    values = {}
    for f in list(T.flatten(T.HEADER)) + list(T.flatten(msg.body)):
        if f.when is None or f.when in on:
            values[f.key] = draw(_value(f.field))
    values["opcode"] = opcode
    values["version"] = 1
    # Controlling words must agree with the items drawn, extra bits are free.
    flags = values["flags"] & ~sum(c.mask for c in conds if c.source == "flags")
    values["flags"] = flags | sum(c.mask for c in on if c.source == "flags")
    for c in conds:
        if c.source == "features":
            key = f"{msg.body.prefix}.features"
            values[key] = (values[key] & ~sum(x.mask for x in conds if x.source == "features")) | sum(
                x.mask for x in on if x.source == "features")
    if "inline_data" in values:
        values["dd.length"] = len(values["inline_data"])
    return values


@settings(max_examples=3000, deadline=None)
@given(messages(), st.booleans())
def test_codec_and_scapy_agree(values, addr_le):
    wire = codec.encode(values, addr_le=addr_le)
    assert bytes(build_packet(values, addr_le=addr_le)) == wire
    assert codec.decode(wire, addr_le=addr_le) == values
    assert packet_fields(KBTP(wire, addr_le=addr_le)) == values


@settings(max_examples=500, deadline=None)
@given(messages())
def test_addr_le_moves_only_address_fields(values):
    be, le = codec.encode(values), codec.encode(values, addr_le=True)
    msg = T.BY_OPCODE[values["opcode"]]
    offset = 0
    for f in list(T.flatten(T.HEADER)) + list(T.flatten(msg.body)):
        if f.key not in values:
            continue
        size = f.field.size or len(values[f.key])
        a, b = be[offset:offset + size], le[offset:offset + size]
        if f.field.order is T.Order.ADDRESS and msg.addr_le_applies:
            assert b == a[::-1]
        else:
            assert a == b
        offset += size


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(T.MEMORY_STRUCTS), st.data(), st.booleans())
def test_memory_structures_agree(struct_, data, addr_le):
    flat = list(T.flatten(struct_))
    values = {f.key: data.draw(_value(f.field)) for f in flat}
    wire = codec.encode_struct(struct_, values, addr_le)
    cls = MEMORY_CLASSES[struct_.name]
    assert {f.key: int(cls(wire, addr_le=addr_le).getfieldval(f.field.name)) for f in flat} == values
    assert bytes(cls(addr_le=addr_le, **{f.field.name: values[f.key] for f in flat})) == wire
    assert codec.decode_struct(struct_, wire, addr_le) == values
