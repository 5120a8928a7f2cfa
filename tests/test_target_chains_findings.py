"""``--execution chains``: the findings of docs/CHAINS.md that the target now meets as the
software target does, each with a real chains target on loopback and the real initiator.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from kbtp_scapy import codec
from kbtp_scapy.initiator import Initiator, KbtpError, SessionEnded
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.target.ring import FreeRing
from kbtp_scapy.vocab import Opcode, RequestFlag

from .kbtp_harness import TargetThread
from .test_target_chains import ended, run


def leak(ring: FreeRing) -> list[int]:
    """A target bug: every free block taken out of ``ring`` behind the target's back."""
    blocks = []
    for _ in range(ring.occupancy()):
        ticket, offset = ring.take_ticket()
        block = ring.ready(ticket, offset)
        assert block is not None
        blocks.append(block)
        ring.consume(offset)
    return blocks


@pytest.fixture(params=["iwarp", "roce"])
def transport(request) -> str:
    return request.param


def test_a_block_whose_alloc_store_chain_failed_its_read_goes_back_to_the_ring(transport):
    """Finding 12: an ALLOC_STORE chain consumes its ring slot before it RDMA-Reads the data;
    an invalid STag ends the connection there. At teardown the target gives the block of
    the chain caught between its ticket and its Send back to the ring, so the initiator,
    reconnected, allocates its whole quota of a pool that holds exactly that quota."""
    config = TargetConfig(blocks=4, block_size=4096, max_initiators=1, request_credits=4,
                          features=0, execution="chains")
    t = TargetThread(transport, config)
    ident = os.urandom(16)

    async def cut_short() -> int:
        ini = await Initiator.connect(t.url, initiator_id=ident, credits=4, features=0,
                                      **t.connect_options(0))
        h = ini.target.handle_base
        await ini.alloc_store(h, b"kept", seal=True)
        request = codec.encode({"opcode": Opcode.ALLOC_STORE, "request_id": 9, "handle": h + 1,
                                "flags": RequestFlag.INVALIDATE, "dd.stag": 0x7777,
                                "dd.offset": 0, "dd.length": 100})
        with pytest.raises(SessionEnded):
            await ini.raw(request)
        return h

    async def the_rest(h: int) -> list[bytes]:
        ini = await Initiator.connect(t.url, initiator_id=ident, credits=4, features=0,
                                      **t.connect_options(0))
        for i in range(1, 4):
            await asyncio.wait_for(ini.alloc_store(h + i, b"block %d" % i, seal=True), 3)
        data = [(await ini.load(h + i)).data for i in range(4)]
        await ini.goodbye(release=True)
        return data
    try:
        h = run(cut_short())
        ended(t)
        ring = t.target.memory.shared_ring
        assert t.run(ring.occupancy) == 3          # all but the one bound
        assert run(the_rest(h)) == [b"kept"] + [b"block %d" % i for i in range(1, 4)]
        m = t.target.metrics
        assert m.python[Opcode.ALLOC_STORE] == 0 and m.chain[Opcode.ALLOC_STORE] == 4
    finally:
        t.stop()


def test_the_ticket_of_a_chain_waiting_for_its_slot_when_the_connection_ends_is_given_up(transport):
    """Finding 12's other case: the connection ends while an ALLOC_STORE chain waits for its
    ring slot (the ring emptied behind the target's back). At teardown the chain's ticket is
    given up, so a block that fills its slot later goes back to the ring, rather than
    waiting there for a chain that is gone."""
    config = TargetConfig(blocks=4, block_size=4096, max_initiators=1, request_credits=4,
                          features=0, execution="chains")
    t = TargetThread(transport, config)
    ring = t.target.memory.shared_ring

    async def main() -> list[int]:
        ini = await Initiator.connect(t.url, credits=4, features=0, **t.connect_options(0))
        h = ini.target.handle_base
        await ini.alloc_store(h, b"kept", seal=True)
        leaked = t.run(lambda: leak(ring))
        with pytest.raises(TimeoutError):          # the chain waits for its slot
            await asyncio.wait_for(ini.alloc_store(h + 1, b"waits"), 0.3)
        await ini.close()
        return leaked
    try:
        leaked = run(main())
        ended(t)
        t.run(lambda: ring.free(leaked[0]))
        assert t.run(ring.occupancy) == 1
        assert t.run(lambda: ring.deferred) == 0
    finally:
        t.stop()


def direct_alloc_target(transport: str) -> TargetThread:
    """A chains target whose sessions get DIRECT_ALLOC partitions; Ticket Timeout 4 s (the
    ticket watch looks every 0.5 s)."""
    return TargetThread(transport, TargetConfig(blocks=16, block_size=4096, max_initiators=2,
                                                request_credits=4, ticket_timeout_ms=4000,
                                                execution="chains"))


def head(t: TargetThread, ini: Initiator) -> int:
    """Tickets taken from the initiator's partition ring (its Head's ticket count)."""
    def count() -> int:
        part = t.target.sessions.by_id[ini.initiator_id].partition
        assert part is not None
        return part.ring.counter("head") >> 32
    return t.run(count)


@pytest.mark.slow
def test_the_alloc_store_chains_quota_counts_a_direct_alloc_initiators_own_tickets(transport):
    """Finding 14: a DIRECT_ALLOC initiator takes all but one of its quota's tickets by its
    own FetchAdds on Head. After the ticket watch's next look the chains' usage counter
    holds them: one ALLOC_STORE runs in its chain, the next is refused NO_SPACE by the
    chain's quota guard, before it takes a ticket (Head counts the initiator's tickets and
    the one chain's), where the chain used to pass the guard and wait for a slot."""
    t = direct_alloc_target(transport)

    async def main() -> str:
        ini = await Initiator.connect(t.url, credits=4, **t.connect_options(0))
        h, quota = ini.target.handle_base, ini.target.quota
        for _ in range(quota - 1):
            await ini.take_ticket()
        await asyncio.sleep(0.8)                     # a look of the ticket watch
        await ini.alloc_store(h, b"the last block", seal=True)
        try:
            await asyncio.wait_for(ini.alloc_store(h + 1, b"over the quota"), 2)
        except KbtpError as refused:
            assert head(t, ini) == quota
            return refused.name
        return "OK"
    try:
        assert run(main()) == "NO_SPACE"
        m = t.target.metrics
        assert (m.chain[Opcode.ALLOC_STORE], m.python[Opcode.ALLOC_STORE]) == (1, 1)
    finally:
        t.stop()


@pytest.mark.slow
def test_an_alloc_store_chain_past_tickets_the_watch_has_not_seen_yet_is_refused_no_space(transport):
    """Finding 14's remaining window (conform's ``direct.quota.tickets``): the initiator takes
    its whole quota's tickets and sends an ALLOC_STORE at once, before a look of the ticket
    watch. The chain passes the quota guard and waits for a slot; the connection's watchdog
    sees the session at its quota without it and answers NO_SPACE within a look, giving the
    chain's ticket up, as the software target answers it."""
    t = direct_alloc_target(transport)

    async def main() -> tuple[str, float]:
        ini = await Initiator.connect(t.url, credits=4, **t.connect_options(0))
        h, quota = ini.target.handle_base, ini.target.quota
        for _ in range(quota):
            await ini.take_ticket()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(KbtpError) as refused:
            await ini.alloc_store(h, b"past the quota")
        took = loop.time() - start
        assert head(t, ini) == quota + 1             # the chain took one, and gave it up
        return refused.value.name, took
    try:
        status, took = run(main())
        assert status == "NO_SPACE" and took < 0.5, took
        assert t.target.metrics.python[Opcode.ALLOC_STORE] == 1
    finally:
        t.stop()


@pytest.mark.slow
def test_the_watchdog_counts_the_handles_chains_bound_before_it_answers(transport):
    """conform's ``direct.quota.tickets`` on a busy host, where it takes few tickets: the
    quota's other handles are bound by ALLOC_STORE chains, one ticket is taken, and an
    ALLOC_STORE sent at once passes the chain's quota guard and waits for a slot. The
    watchdog must count the handles the chains bound, which the runner books only when it
    refills: no request comes to make it, so the watchdog used to see the session below
    its quota and leave the chain waiting until the ticket was abandoned (then OK)."""
    t = direct_alloc_target(transport)

    async def main() -> str:
        ini = await Initiator.connect(t.url, credits=4, **t.connect_options(0))
        h, quota = ini.target.handle_base, ini.target.quota
        await asyncio.gather(*(ini.alloc_store(h + i, b"bound by a chain") for i in range(quota - 1)))
        await ini.take_ticket()
        try:
            await asyncio.wait_for(ini.alloc_store(h + quota, b"over the quota"), 1.5)
        except KbtpError as refused:
            return refused.name
        except TimeoutError:
            return "no answer"
        return "OK"
    try:
        assert run(main()) == "NO_SPACE"
        assert t.target.metrics.chain[Opcode.ALLOC_STORE] >= 1
    finally:
        t.stop()


@pytest.mark.slow
@pytest.mark.parametrize("execution, transport", [("software", "iwarp"), ("chains", "iwarp"),
                                                  ("chains", "roce")])
def test_an_alloc_store_whose_slot_never_fills_is_answered_internal(execution, transport):
    """Finding 11: only a target bug leaves a ring slot empty; here the target's own thread
    takes the ring's free blocks out behind its back. The software target gives up after
    its allocation timeout (0.5 s here) with INTERNAL; the chains target's watchdog, a timer
    per connection, does the same for the chain caught in its wait-on-data, and the requests
    behind it run again. The ticket is given up in both: a block freed later goes back to
    the ring, not to the ticket, and the next ALLOC_STORE gets it."""
    config = TargetConfig(blocks=4, block_size=4096, max_initiators=1, request_credits=4,
                          features=0, execution=execution)
    t = TargetThread(transport, config)
    ring = t.target.memory.shared_ring

    async def main() -> None:
        ini = await Initiator.connect(t.url, credits=4, features=0, **t.connect_options(0))
        h = ini.target.handle_base
        await ini.alloc_store(h, b"kept", seal=True)
        leaked = t.run(lambda: leak(ring))
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(KbtpError) as failed:
            await ini.alloc_store(h + 1, b"no block for this")
        assert failed.value.name == "INTERNAL" and 0.5 <= loop.time() - start < 2
        assert (await ini.load(h)).data == b"kept"
        t.run(lambda: ring.free(leaked[0]))
        assert t.run(ring.occupancy) == 1
        assert (await ini.alloc_store(h + 1, b"now there is", seal=True)).status == 0
        assert (await ini.load(h + 1)).data == b"now there is"
        await ini.close()
    try:
        t.run(lambda: setattr(t.target.executor, "allocate_timeout", 0.5))
        run(main())
        ended(t)
        m = t.target.metrics
        if execution == "chains":       # the INTERNAL is the watchdog's, from Python
            assert (m.chain[Opcode.ALLOC_STORE], m.python[Opcode.ALLOC_STORE]) == (2, 1)
            assert m.chain[Opcode.LOAD] == 2
    finally:
        t.stop()
