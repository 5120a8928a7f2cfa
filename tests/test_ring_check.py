"""The free-block ring, model-checked on the target's own ``FreeRing`` (``target/ring_check.py``).

Small configurations run here exhaustively; tools/bench_ring_check.py runs the larger ones
and writes docs/RING_CHECK.md.
"""
from __future__ import annotations

import asyncio

import pytest

from kbtp_scapy.rnic.memory import MemoryTable
from kbtp_scapy.tables import memory as M
from kbtp_scapy.target import ring_check as rc
from kbtp_scapy.target.ring import FreeRing

SMALL = [
    rc.Config(1, 2, ("alloc", "alloc"), (1, 1), rounds=2, give_up=True),
    rc.Config(1, 2, ("chain", "alloc"), (1, 1), rounds=2, masked=False),
    rc.Config(1, 2, ("direct", "direct", "alloc"), (2,), rounds=(1, 1, 2), give_up=True),
    rc.Config(1, 2, ("direct", "chain"), (2,), rounds=2),
    rc.Config(2, 3, ("chain", "chain", "alloc"), (1, 1, 1), rounds=2),
    rc.Config(2, 4, ("direct", "alloc"), (4,), rounds=(2, 3), give_up=True, masked=False),
]


@pytest.mark.slow
@pytest.mark.parametrize("config", SMALL, ids=[c.label() for c in SMALL])
def test_every_interleaving_keeps_every_block(config: rc.Config) -> None:
    result = rc.check(config)
    assert result.violation is None, "\n".join([result.violation or "", *result.trace])
    assert result.terminal > 0 and result.states > 20


def _spec_example() -> tuple[rc.Model, list[rc.State]]:
    """Spec "Examples": N = F = 4, blocks 100 to 103, a shared ring; X (actor 0) takes
    ticket 0 and is delayed, Y (actor 1) takes 1 to 3 and frees block 101."""
    model = rc.Model(rc.Config(2, 4, ("chain", "alloc"), (1, 3), rounds=(1, 4)))
    steps = ["chain0 FetchAdd Head"]
    for ticket in (1, 2, 3):
        steps += ["alloc1 FetchAdd Head", f"alloc1 read slot {ticket} (ticket {ticket})"]
    steps += ["alloc1 FREE block 101",
              "chain0 read slot 0 (ticket 0)", "chain0 consume slot 0 (block 100)",
              "target settle",
              "alloc1 FetchAdd Head", "alloc1 read slot 0 (ticket 4)"]
    return model, rc.run(model, steps)


def test_the_specifications_deferred_free_example() -> None:
    model, states = _spec_example()
    ring = model.ring

    def at(i: int) -> tuple[tuple[int, int], int, tuple[rc.Actor, ...]]:
        ring.restore(states[i][0])
        return ring.slot(0), ring.deferred, states[i][1]

    # after Y's free: Tail gave ticket 4, slot 0 is still X's, so the free waits
    slot0, deferred, actors = at(8)
    assert slot0 == (0, 100) and deferred == 1 and actors[1].held == (102, 103)
    # X reads slot 0 and obtains block 100; its Write of all ones consumes it
    slot0, deferred, actors = at(10)
    assert actors[0].held == (100,) and slot0[1] == M.SLOT_CONSUMED and deferred == 1
    # the deferred free writes slot 0 with Sequence 4 and block 101 ...
    slot0, deferred, _ = at(11)
    assert slot0 == (4, 101) and deferred == 0
    # ... which the next allocation (ticket 4) obtains
    _, _, actors = at(13)
    assert actors[1].held == (101, 102, 103)


def test_a_free_that_overwrites_an_unconsumed_slot_is_caught(monkeypatch) -> None:
    """The checker finds the bug the deferral rule prevents, with a shortest trace."""
    def overwrite(self: FreeRing, block: int) -> None:
        ticket, offset = self._fetch_add(self.tail)
        self._fill(offset, ticket, block)
    monkeypatch.setattr(FreeRing, "free", overwrite)
    result = rc.check(rc.Config(1, 2, ("chain", "alloc"), (1, 1), rounds=2))
    assert result.violation is not None and "lost" in result.violation
    assert result.trace == ["initial", "chain0 FetchAdd Head", "alloc1 FetchAdd Head",
                            "alloc1 read slot 1 (ticket 1)", "alloc1 FREE block 101"]


# -- counterexample: an allocation that timed out left its ticket taken ------------------------

LOST_TICKET = ["direct0 FetchAdd Head", "alloc1 FetchAdd Head", "alloc1 read slot 1 (ticket 1)",
               "alloc1 FREE block 101", "alloc1 FetchAdd Head",
               "alloc1 allocation of ticket 2 times out", "direct0 Ticket Timeout: reclaim ticket 0"]


def test_a_timed_out_allocation_gives_its_block_back() -> None:
    """The checker's counterexample (before ``FreeRing.give_up``): a DIRECT_ALLOC ticket
    holds slot 0, a FREE to slot 0 waits behind it, the target-executed allocation of the
    ticket that free is for times out (INTERNAL); when the direct ticket is reclaimed the
    free is written for a ticket nobody will consume, and block 101 is lost for good."""
    model = rc.Model(rc.Config(1, 2, ("direct", "alloc"), (2,), rounds=2, give_up=True))
    final = rc.run(model, LOST_TICKET)[-1]
    assert model.stuck(final) is None
    model.ring.restore(final[0])
    assert model.ring.occupancy() == 2 and sorted(
        model.ring.slot(o)[1] for o in (0, M.SLOT_SIZE)) == [100, 101]


def test_allocate_times_out_and_the_late_block_returns() -> None:
    """The same on ``FreeRing.allocate`` itself, with the event loop and its timeout."""
    async def scenario() -> None:
        slots, heads = memoryview(bytearray(2 * M.SLOT_SIZE)), memoryview(bytearray(16))
        ring = FreeRing(MemoryTable(), slots, heads, 1, [100, 101], masked=True, addr_le=False)
        direct, offset = ring.take_ticket()           # ticket 0, slot 0, never read
        _, block = await ring.allocate()              # ticket 1: block 101
        ring.free(block)                              # ticket 2 at slot 0: deferred
        with pytest.raises(TimeoutError):
            await ring.allocate(timeout=0.01)         # ticket 2 waits behind ticket 0
        ring.reclaim(direct)                          # ticket 0 abandoned: slot 0 freed
        assert ring.occupancy() == 2 and ring.deferred == 0
        assert sorted([(await ring.allocate(timeout=0.1))[1] for _ in range(2)]) == [100, 101]
    asyncio.run(scenario())


# -- counterexample: a free took over a slot a chain had consumed, ahead of its deferred free --

CHAIN_TAKEOVER = ["chain0 FetchAdd Head", "chain0 read slot 0 (ticket 0)", "alloc1 FetchAdd Head",
                  "alloc1 read slot 1 (ticket 1)", "alloc1 FREE block 101",
                  "chain0 consume slot 0 (block 100)", "chain0 FREE block 100",
                  "chain0 FetchAdd Head", "alloc1 FetchAdd Head", "alloc1 read slot 1 (ticket 3)",
                  "alloc1 FREE block 100"]


def test_a_free_after_a_chains_consume_writes_the_deferred_free_first() -> None:
    """The checker's counterexample (before ``FreeRing.free`` settled): a chain consumes
    slot 0 by a Write of all ones while a free to it is deferred; a later free to slot 0
    found it consumed and wrote it, so the deferred free (ticket 2, block 101) was never
    written and the chain waiting for ticket 2 waited for good."""
    model = rc.Model(rc.Config(1, 2, ("chain", "alloc"), (1, 1), rounds=2, masked=False))
    states = rc.run(model, CHAIN_TAKEOVER + ["chain0 read slot 0 (ticket 2)"])
    assert states[-1][1][0].block == 101


def test_head_passes_tail_only_behind_a_reclaim() -> None:
    """What the text's quota argument misses: the target releases a reclaimed ticket's
    usage at once, but its block comes back only when the ticket's slot is filled, which
    can wait behind another outstanding ticket. Head then passes Tail; the shortest way."""
    strict = rc.check(rc.Config(1, 2, ("direct", "direct", "alloc"), (2,), rounds=(1, 1, 2),
                                strict=True))
    assert strict.violation is not None and strict.violation.startswith("Head passed Tail")
    assert strict.trace == ["initial", "direct0 FetchAdd Head", "alloc2 FetchAdd Head",
                            "alloc2 read slot 1 (ticket 1)", "alloc2 FREE block 101",
                            "direct1 FetchAdd Head", "direct1 Ticket Timeout: reclaim ticket 2",
                            "alloc2 FetchAdd Head"]
