"""The specification's four examples are normative test vectors (docs/NOTES.md section 2).

The expected bytes below are typed from docs/kbtp-draft.txt, section "Examples", not
produced by the code under test.
"""
from __future__ import annotations

import pytest

from kbtp_scapy import codec, ring
from kbtp_scapy.layers.kbtp import (
    KBTP,
    KBTPAllocStore,
    KBTPCompletion,
    KBTPRingSlot,
    packet_fields,
)
from kbtp_scapy.tables import RING_SLOT, SLOT_CONSUMED

ALLOC_STORE = bytes.fromhex(
    "01 12 00 01 00 00 00 00 00 00 00 07 00 00 00 00 00 00 40 01 00 00 00 00"
    " 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 08 4b 56 42 4c 4f 43 4b 21")
COMPLETION = bytes.fromhex(
    "01 20 00 00 00 00 00 00 00 00 00 07 00 00 00 00 00 00 40 01 00 05 00 00"
    " 00 00 00 08 00 00 00 00 00 00 00 00 00 15 00 00")


def test_alloc_store_example_builds_byte_for_byte():
    pkt = KBTP(opcode="ALLOC_STORE", request_id=7, handle=0x4001) / KBTPAllocStore(inline_data=b"KVBLOCK!")
    assert bytes(pkt) == ALLOC_STORE
    assert codec.encode({"opcode": 0x12, "request_id": 7, "handle": 0x4001,
                         "inline_data": b"KVBLOCK!"}) == ALLOC_STORE


def test_alloc_store_example_dissects():
    pkt = KBTP(ALLOC_STORE)
    assert pkt.opcode == 0x12 and pkt.request_id == 7 and pkt.handle == 0x4001
    assert pkt.flags == 0x0001 and "INLINE" in str(pkt.flags)
    assert pkt[KBTPAllocStore].dd.length == 8
    assert pkt[KBTPAllocStore].inline_data == b"KVBLOCK!"
    assert packet_fields(pkt) == codec.decode(ALLOC_STORE)


def test_completion_example_round_trips_and_answers_the_request():
    pkt = KBTP(opcode="COMPLETION", request_id=7, handle=0x4001, generation=5) / KBTPCompletion(
        data_length=8, block_offset=42 * 32 * 1024)
    assert bytes(pkt) == COMPLETION
    got = KBTP(COMPLETION)
    assert got.status == 0 and got.generation == 5
    assert got[KBTPCompletion].block_offset == 0x150000
    assert got.answers(KBTP(ALLOC_STORE)) and not KBTP(ALLOC_STORE).answers(got)
    assert got.hashret() == KBTP(ALLOC_STORE).hashret()
    fields = codec.decode(COMPLETION)
    assert fields["completion.data_length"] == 8 and fields["generation"] == 5
    assert codec.encode(fields) == COMPLETION


def test_ring_counter_example_n4():
    assert ring.add_mask(2) == 0x8000000080000020
    expected = [(0, 0, 0x0000000100000010), (1, 16, 0x0000000200000020),
                (2, 32, 0x0000000300000030), (3, 48, 0x0000000400000000),
                (4, 0, 0x0000000500000010)]
    counter = 0
    for ticket, offset, new in expected:
        assert ring.fetch_add(counter, 2) == (ticket, offset, new)
        counter = new


@pytest.mark.parametrize("addr_le", [False, True])
def test_deferred_free_example_ring_contents(addr_le):
    """Replay the text's scenario on real ring bytes and check every slot it names."""
    n, block = 2, 32 * 1024
    slots = bytearray()
    for s in range(4):  # N = F = 4: slot s holds block 100 + s with Sequence s
        slots += codec.encode_struct(RING_SLOT, {"slot.sequence": s, "slot.block_offset": (100 + s) * block}, addr_le)

    def slot(offset):
        return codec.decode_struct(RING_SLOT, bytes(slots[offset:offset + 16]), addr_le)

    def write(offset, values):
        slots[offset:offset + 16] = codec.encode_struct(RING_SLOT, values, addr_le)

    head, tail = 0, ring.join(4, 16 * (4 % 4))
    x_ticket, x_offset, head = ring.fetch_add(head, n)            # X takes ticket 0, delayed
    got = {}
    for _ in range(3):                                             # Y takes tickets 1, 2, 3
        t, o, head = ring.fetch_add(head, n)
        entry = slot(o)
        assert entry["slot.sequence"] == t and entry["slot.block_offset"] != SLOT_CONSUMED
        got[t] = entry["slot.block_offset"] // block
        write(o, {**entry, "slot.block_offset": SLOT_CONSUMED})
    assert got == {1: 101, 2: 102, 3: 103}
    u, o, tail = ring.fetch_add(tail, n)                           # Y frees block 101
    assert (u, o) == (4, 0)
    assert slot(0)["slot.block_offset"] != SLOT_CONSUMED                # not consumed yet: defer
    entry = slot(x_offset)                                         # X reads slot 0 now
    assert (x_ticket, entry["slot.sequence"], entry["slot.block_offset"] // block) == (0, 0, 100)
    write(x_offset, {**entry, "slot.block_offset": SLOT_CONSUMED})
    write(o, {"slot.sequence": u, "slot.block_offset": 101 * block})         # the deferred free lands
    t, o4, head = ring.fetch_add(head, n)                          # the next allocation
    assert (t, o4) == (4, 0)
    assert slot(o4) == {"slot.sequence": 4, "slot.reserved": 0, "slot.block_offset": 101 * block}
    assert KBTPRingSlot(bytes(slots[0:16]), addr_le=addr_le).block_offset == 101 * block
    order = "little" if addr_le else "big"
    assert bytes(slots[8:16]) == (101 * block).to_bytes(8, order)
    assert bytes(slots[0:4]) == (4).to_bytes(4, "big")
