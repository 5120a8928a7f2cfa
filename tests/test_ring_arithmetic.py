"""RFC 7306 masked FetchAdd against its definition, field by field."""
from __future__ import annotations

from hypothesis import given, strategies as st

from kbtp_scapy.ring import add_mask, masked_add

U64 = st.integers(0, (1 << 64) - 1)


def by_fields(value: int, add: int, mask: int) -> int:
    """RFC 7306 s5.2: each run of bits ending at a mask bit (or bit 63) is added on its own."""
    result, low = 0, 0
    tops = [b for b in range(64) if mask >> b & 1]
    if not tops or tops[-1] != 63:
        tops.append(63)
    for high in tops:
        field = (1 << (high - low + 1)) - 1
        result |= (((value >> low) & field) + ((add >> low) & field) & field) << low
        low = high + 1
    return result


@given(U64, U64, U64)
def test_masked_add_matches_the_definition(value, add, mask):
    assert masked_add(value, add, mask) == by_fields(value, add, mask)


@given(U64, st.integers(0, 27))
def test_ring_counter_fields_wrap_on_their_own(value, n):
    assert masked_add(value, 0x0000000100000010, add_mask(n)) == \
        by_fields(value, 0x0000000100000010, add_mask(n))
