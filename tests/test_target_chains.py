"""``--execution chains``: LOAD run by the chain engine, everything else in software.

The real initiator talks to the real target over loopback sockets on both bindings; the
target's counters say which requests ran KBTP Python code.
"""
from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Callable, Coroutine

import pytest

from kbtp_scapy import codec
from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.rnic.memory import Access
from kbtp_scapy.rnic.qp import ConnectionLost, RemoteError
from kbtp_scapy.target import Target, TargetConfig
from kbtp_scapy.target.table import UNBOUND_OFFSET, Entry
from kbtp_scapy.vocab import Opcode, RequestFlag, Status

from .kbtp_harness import TargetThread


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(params=[("iwarp", False), ("roce", False), ("roce", True), ("iwarp", True)],
                ids=["iwarp", "roce", "roce-addr_le", "iwarp-addr_le"])
def chains(request):
    transport, addr_le = request.param
    config = TargetConfig(blocks=64, block_size=4096, max_initiators=4, ticket_timeout_ms=300,
                          request_credits=4, addr_le=addr_le, execution="chains")
    t = TargetThread(transport, config)
    yield t
    t.stop()


async def connect(t: TargetThread, index: int = 0, **kw) -> Initiator:
    return await Initiator.connect(t.url, **t.connect_options(index), **kw)


async def refused(*expected: tuple[str, Coroutine]) -> None:
    """Each request refused with its status, in order; those a failure leaves unsent are
    closed (no "never awaited")."""
    try:
        for name, coro in expected:
            with pytest.raises(KbtpError) as failed:
                await coro
            assert failed.value.name == name
    finally:
        for _, coro in expected:
            coro.close()


def ended(t: TargetThread) -> None:
    """Wait until the target has served the GOODBYE (its last batch is counted then)."""
    for _ in range(500):
        if not t.run(lambda: any(s.active for s in t.target.sessions.by_id.values())):
            return
        asyncio.run(asyncio.sleep(0.01))
    raise AssertionError("the session did not end")


def test_loads_run_without_kbtp_python(chains):
    """Stores in software, then 20 LOADs (5 batches of refills) all by chains, right data."""
    async def main():
        ini = await connect(chains, 0, credits=4)
        h = ini.target.handle_base
        blocks = [os.urandom(100 + 37 * i) for i in range(4)]
        for i, data in enumerate(blocks):
            await ini.alloc_store(h + i, data, seal=True, inline=i % 2 == 0)
        results = []
        for _ in range(5):
            results += await asyncio.gather(*(ini.load(h + i) for i in range(4)))
        for i, r in enumerate(results):
            assert r.data == blocks[i % 4] and r.generation == 1 and r.status == 0
        stored = await ini.load(h + 1, generation=1)          # the Generation checked
        assert stored.data == blocks[1]
        await ini.close()
    run(main())
    ended(chains)
    m = chains.target.metrics
    assert m.python[Opcode.LOAD] == 0 and m.chain[Opcode.LOAD] == 21
    assert m.python[Opcode.ALLOC_STORE] + m.chain[Opcode.ALLOC_STORE] == 4
    assert m.operations[Opcode.LOAD, 0] == 21
    # what --metrics serves
    samples = {(s.name, s.labels.get("opcode")): s.value for family in m.collect()
               for s in family.samples}
    assert samples["kbtp_python_requests_total", "LOAD"] == 0
    assert samples["kbtp_chain_requests_total", "LOAD"] == 21
    assert "LOAD: KBTP Python per request 0, run by chains 21" in m.table()


def test_inline_stores_run_without_kbtp_python(chains):
    """Mapped STOREs with inline data (with and without SEAL) by chains; the table entry, the
    block and the completion as the software target leaves them."""
    async def main():
        ini = await connect(chains, 0, credits=4)
        h = ini.target.handle_base
        await ini.alloc_store(h, b"first version")                     # unsealed, software
        for i in range(6):
            data = os.urandom(50 + 100 * i)
            r = await ini.store(h, data, inline=True)
            assert (r.status, r.generation, r.data_length) == (0, 1, len(data))
            assert (await ini.load(h, allow_unsealed=True)).data == data   # software LOAD
        r = await ini.store(h, b"sealed now", inline=True, seal=True, generation=1)
        assert r.data_length == 10
        assert (await ini.load(h)).data == b"sealed now"               # sealed: by chains
        await refused(("SEALED", ini.store(h, b"x", inline=True)),
                      ("NOT_VALID", ini.store(h + 1, b"x", inline=True)),
                      ("INVALID_HANDLE", ini.store(h + ini.target.handle_count, b"x", inline=True)))
        await ini.close()
        return h
    h = run(main())
    ended(chains)
    m = chains.target.metrics
    entry = chains.run(lambda: chains.target.memory.table.read(h))
    assert (entry.flags, entry.generation, entry.data_length) == (3, 1, 10)
    assert m.chain[Opcode.STORE] == 7 and m.python[Opcode.STORE] == 3 and m.chain[Opcode.LOAD] == 1


def test_stores_that_read_their_data_run_without_kbtp_python(chains):
    """Mapped STOREs without INLINE by chains: the chain RDMA-Reads the initiator's buffer
    into the block; the entry, the block and the completion as the software target leaves
    them, and the guards are the inline STORE's."""
    async def main():
        ini = await connect(chains, 0, credits=4)
        h = ini.target.handle_base
        await ini.alloc_store(h, b"first version")                     # unsealed, software
        for i in range(6):
            data = os.urandom(300 + 600 * i)
            r = await ini.store(h, data, inline=False)
            assert (r.status, r.generation, r.data_length) == (0, 1, len(data))
            assert (await ini.load(h, allow_unsealed=True)).data == data   # software LOAD
        data = os.urandom(4096)
        r = await ini.store(h, data, inline=False, seal=True, generation=1)
        assert (r.status, r.data_length) == (0, 4096)
        assert (await ini.load(h)).data == data                        # sealed: by chains
        await refused(("SEALED", ini.store(h, b"x" * 500, inline=False)),
                      ("NOT_VALID", ini.store(h + 1, b"x" * 500, inline=False)),
                      ("STALE_GENERATION", ini.store(h, b"x" * 500, inline=False, generation=7)),
                      ("INVALID_HANDLE", ini.store(h + ini.target.handle_count, b"x" * 500,
                                                   inline=False)))
        await ini.close()
        return h
    h = run(main())
    ended(chains)
    m = chains.target.metrics
    entry = chains.run(lambda: chains.target.memory.table.read(h))
    assert (entry.flags, entry.generation, entry.data_length) == (3, 1, 4096)
    assert m.chain[Opcode.STORE] == 7 and m.python[Opcode.STORE] == 4 and m.chain[Opcode.LOAD] == 1


def test_alloc_stores_run_without_kbtp_python(chains):
    """ALLOC_STOREs, inline and by RDMA Read, sealed and not, by chains on both bindings, with
    and without ADDR_LE (whose Generation comes from the successor table; docs/CHAINS.md):
    entries, blocks and completions as the software target leaves them, blocks from the
    ring, the quota and the guards held, and the FREEs (software) give the blocks back to
    chains that allocate them again."""
    async def main():
        ini = await connect(chains, 0, credits=4)
        h, quota = ini.target.handle_base, ini.target.quota
        for handle in (h + ini.target.handle_count, h - 1):     # unbound entries of others
            with pytest.raises(KbtpError) as failed:
                await ini.alloc_store(handle, b"not mine")
            assert failed.value.name == "INVALID_HANDLE"
        stored = {}
        for i in range(quota):
            data = os.urandom(20 + 250 * i % 4000)
            r = await ini.alloc_store(h + i, data, seal=i % 2 == 0)
            assert (r.status, r.generation, r.data_length) == (0, 1, len(data))
            stored[h + i] = (data, r.block_offset)
        assert len({block for _, block in stored.values()}) == quota          # distinct blocks
        # past the Ticket Timeout (300 ms): the watch knew the chains' tickets for the target's,
        # so none is pending or abandoned, and the initiator's direct modes stand
        await asyncio.sleep(0.6)
        state = chains.run(lambda: chains.target.sessions.by_id[ini.initiator_id])
        assert state.watch is not None          # a DIRECT_ALLOC session: its partition's ring
        assert (state.tickets, state.direct_disabled) == (0, False)
        for handle, (data, _) in stored.items():
            assert (await ini.load(handle, allow_unsealed=True)).data == data
        await refused(("NO_SPACE", ini.alloc_store(h + quota, b"over")),
                      ("ALREADY_BOUND", ini.alloc_store(h, b"again")))
        for handle in stored:
            await ini.free(handle)
        for i in range(quota):                          # the freed blocks come back, Generation 3
            r = await ini.alloc_store(h + i, b"second %d" % i, seal=True)
            assert (r.status, r.generation) == (0, 3)
            assert (await ini.load(h + i, generation=3)).data == b"second %d" % i
        await ini.close()
        return h, quota
    h, quota = run(main())
    ended(chains)
    m = chains.target.metrics
    entry = chains.run(lambda: chains.target.memory.table.read(h))
    assert (entry.flags, entry.generation, entry.data_length) == (3, 3, 8)
    assert m.python[Opcode.ALLOC_STORE] == 4 and m.chain[Opcode.ALLOC_STORE] == 2 * quota


def test_failed_checks_go_to_software(chains):
    async def main():
        ini = await connect(chains, 0, credits=4)
        h = ini.target.handle_base
        await ini.alloc_store(h, b"sealed", seal=True)
        await ini.alloc_store(h + 1, b"open")
        await refused(("NOT_SEALED", ini.load(h + 1)), ("NOT_VALID", ini.load(h + 2)),
                      ("STALE_GENERATION", ini.load(h, generation=9)),
                      ("INVALID_HANDLE", ini.load(1)), ("INVALID_HANDLE", ini.load(h + (1 << 56))))
        assert (await ini.load(h + 1, allow_unsealed=True)).data == b"open"
        assert (await ini.load(h)).data == b"sealed"
        await ini.close()
    run(main())
    ended(chains)
    m = chains.target.metrics
    assert m.chain[Opcode.LOAD] == 1 and m.python[Opcode.LOAD] == 6


# -- findings: where a chain's LOAD cannot make the software target's checks ------------------

@pytest.fixture(params=[(execution, transport, order) for execution in ("software", "chains")
                        for transport in ("iwarp", "roce") for order in ("", "addr_le")],
                ids=lambda p: "-".join(filter(None, p)))
def either(request):
    execution, transport, order = request.param
    config = TargetConfig(blocks=16, block_size=4096, max_initiators=2, request_credits=4,
                          execution=execution, addr_le=bool(order))
    t = TargetThread(transport, config)
    yield execution, t
    t.stop()


def test_finding_a_load_longer_than_the_buffer(either):
    """"Data Length MUST NOT exceed the descriptor Length": no primitive compares two
    numbers for order, so the chain writes anyway and the initiator's RNIC refuses the
    Write (a bounds violation ends the connection) instead of a TOO_LARGE completion."""
    mode, t = either

    async def main() -> str:
        ini = await connect(t, 0, credits=4)
        h = ini.target.handle_base
        await ini.alloc_store(h, os.urandom(3000), seal=True)
        try:
            await ini.load(h, length=100)
        except KbtpError as exc:
            return exc.name
        except (ConnectionLost, RemoteError):
            return "connection lost"
        return "OK"
    assert run(main()) == ("TOO_LARGE" if mode == "software" else "connection lost")


def test_finding_a_load_with_trailing_octets(either):
    """Finding 2, fixed: docs/NOTES.md decision 4 (a length that does not match the flags
    is MALFORMED). The chain compares the receive's byte count, read from its CQE, with
    the header's 40 octets, so the LOAD with 8 octets more goes to software; the LOAD
    without them, which follows, runs in the chain."""
    mode, t = either

    async def main() -> tuple[int, bytes]:
        ini = await connect(t, 0, credits=4)
        h = ini.target.handle_base
        await ini.alloc_store(h, b"sealed block", seal=True)
        buf = ini.memory.register(bytearray(4096), Access.REMOTE_WRITE)
        request = codec.encode({"opcode": Opcode.LOAD, "request_id": 99, "handle": h,
                                "flags": RequestFlag.INVALIDATE, "dd.stag": buf.stag,
                                "dd.offset": buf.base, "dd.length": 4096}, ini.addr_le)
        (answer,) = await ini.raw(request + bytes(8))
        data = (await ini.load(h)).data
        await ini.close()
        return codec.decode(answer.payload)["status"], data
    assert run(main()) == (Status.MALFORMED, b"sealed block")
    ended(t)
    m = t.target.metrics
    assert (m.python[Opcode.LOAD], m.chain[Opcode.LOAD]) == ((1, 1) if mode == "chains" else (2, 0))


def test_finding_requests_whose_length_differs_from_their_header_are_malformed(either):
    """Finding 13, fixed: an inline STORE or ALLOC_STORE with fewer or more octets than its
    Length, and a STORE or ALLOC_STORE without INLINE with octets after its descriptor, are
    MALFORMED (docs/NOTES.md decision 4) and change nothing: the chains' byte-count check
    (the receive's CQE against 40 + Length, or 40) sends them to software. The well-formed
    requests around them still run in chains."""
    mode, t = either

    async def main() -> tuple[list[int], bytes, tuple[int, int]]:
        ini = await connect(t, 0, credits=4)
        h = ini.target.handle_base
        await ini.alloc_store(h, b"kept")
        buf = ini.memory.register(bytearray(100), Access.REMOTE_READ)
        bad = []
        for opcode, handle in ((Opcode.STORE, h), (Opcode.ALLOC_STORE, h + 1)):
            for flags, length, extra in ((RequestFlag.INLINE, 30, 20), (RequestFlag.INLINE, 10, 20),
                                         (RequestFlag.INVALIDATE, 100, 8)):
                request = codec.encode({"opcode": opcode, "request_id": len(bad), "handle": handle,
                                        "flags": flags, "dd.stag": buf.stag, "dd.offset": buf.base,
                                        "dd.length": length}, ini.addr_le)
                (answer,) = await ini.raw(request + os.urandom(extra))
                bad.append(codec.decode(answer.payload)["status"])
        data = (await ini.load(h, allow_unsealed=True)).data
        stored = await ini.store(h, b"replaced", inline=True)
        bound = await ini.alloc_store(h + 1, b"bound now", inline=True)
        await ini.close()
        return bad, data, (stored.data_length, bound.data_length)
    statuses, data, lengths = run(main())
    assert statuses == [Status.MALFORMED] * 6 and data == b"kept" and lengths == (8, 9)
    ended(t)
    m = t.target.metrics
    if mode == "chains":
        assert m.python[Opcode.STORE] == 3 and m.chain[Opcode.STORE] == 1
        assert m.python[Opcode.ALLOC_STORE] == 3 and m.chain[Opcode.ALLOC_STORE] == 2



def test_stores_longer_than_a_block_are_refused_as_in_software(either):
    """docs/NOTES.md decision 5 (Length above Max Inline or Block Size: TOO_LARGE): the
    chains compare the Length with the limit through a limit key (PASS up to the limit, the
    null key beyond), so a STORE or ALLOC_STORE one octet too long takes the software branch,
    one of exactly Block Size runs in the chain, and the neighbouring block is untouched."""
    mode, t = either

    async def main() -> list[int]:
        ini = await connect(t, 0, credits=4)
        h = ini.target.handle_base
        await ini.alloc_store(h, b"mine")
        neighbour = os.urandom(4096)
        await ini.alloc_store(h + 1, neighbour, seal=True, inline=False)
        request = codec.encode({"opcode": Opcode.STORE, "request_id": 77, "handle": h,
                                "flags": RequestFlag.INLINE, "dd.stag": 0,
                                "dd.offset": 0, "dd.length": 5000}, ini.addr_le)
        (answer,) = await ini.raw(request + b"ten octets")
        statuses = [codec.decode(answer.payload)["status"]]
        for coro in (ini.store(h, os.urandom(4097), inline=False),
                     ini.alloc_store(h + 2, os.urandom(4097), inline=False),
                     ini.store(h, os.urandom(4096), inline=False)):
            try:
                statuses.append((await coro).status)
            except KbtpError as failed:
                statuses.append(failed.status)
        assert (await ini.load(h + 1)).data == neighbour
        await ini.close()
        return statuses
    statuses = run(main())
    ended(t)
    assert statuses == [Status.TOO_LARGE] * 3 + [0]
    if mode == "chains":
        assert t.target.metrics.chain[Opcode.STORE] == 1


def test_the_cli_says_chains_need_the_soft_rnic() -> None:
    from click.testing import CliRunner

    from kbtp_scapy.cli import cli
    result = CliRunner().invoke(cli, ["target", "--execution", "chains", "--io", "verbs"])
    assert result.exit_code == 2 and "--execution chains runs the soft RNIC's chain engine" in result.output


@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_a_session_recorded_against_software_replays_to_a_match_against_chains(
        transport: str, tmp_path, capsys) -> None:
    """``kbtp replay`` of a session the software target served (LOADs and inline STOREs the
    chains take, and requests they give to software), against a fresh chains target."""
    from kbtp_scapy.cli import main
    from kbtp_scapy.rnic.pcap import PcapSink

    capture = tmp_path / "session.pcap"
    sink = PcapSink(capture)
    software = TargetThread(transport, TargetConfig(blocks=64, max_initiators=4))

    async def session() -> None:
        ini = await Initiator.connect(software.url, frame_listeners=[sink],
                                      **software.connect_options(0))
        h = ini.target.handle_base
        await ini.alloc_store(h, b"inline block", seal=True)
        await ini.alloc_store(h + 1, bytes(range(200)) * 20, seal=True, inline=False)
        await ini.alloc_store(h + 2, b"open")
        await ini.store(h + 2, b"stored inline", inline=True)
        await asyncio.gather(ini.load(h), ini.load(h + 1), ini.load(h + 2, allow_unsealed=True))
        with pytest.raises(KbtpError):
            await ini.load(h + 3)
        await ini.goodbye()
    try:
        run(session(), 30)
    finally:
        software.stop()
        sink.close()
    chains = TargetThread(transport, TargetConfig(blocks=64, max_initiators=4, execution="chains"))
    local = ["--local", chains.initiator_hosts[0]] if transport == "roce" else []
    try:
        rc = main(["replay", str(capture), "--target", chains.url, *local, "--timeout", "3", "--json"])
        ended(chains)
        m = chains.target.metrics
    finally:
        chains.stop()
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 0 and doc["result"] == "match", out + err
    assert m.chain[Opcode.LOAD] == 2 and m.chain[Opcode.STORE] == 1


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_chain_executed_requests_count_for_the_idle_rule(transport):
    """--idle-timeout with chains: a session whose only recent request was a LOAD a chain ran
    (no KBTP Python, no batch wake-up) is not taken for silent by a newcomer who finds no
    room; silent past the timeout, it gives way (docs/CHAINS.md, "The idle rule and the
    other hostile-peer limits")."""
    config = TargetConfig(blocks=16, block_size=4096, max_initiators=1, request_credits=4,
                          idle_timeout_s=1.0, features=0, execution="chains")
    t = TargetThread(transport, config)

    async def main():
        ini = await connect(t, 0, credits=4, features=0)
        h = ini.target.handle_base
        await ini.alloc_store(h, b"held", seal=True)     # software: its wake-up sets heard_at
        await asyncio.sleep(1.5)
        assert (await ini.load(h)).data == b"held"       # a chain: 2 of 4 completions, no wake-up
        with pytest.raises(KbtpError) as refused:
            await connect(t, 1, features=0)
        assert refused.value.name == "NO_SPACE"
        assert t.run(lambda: t.target.sessions.ended_idle) == 0
        await asyncio.sleep(1.5)                         # no request since that look
        with pytest.raises(KbtpError) as refused:        # it holds a block: ended, retained
            await connect(t, 1, features=0)
        assert refused.value.name == "NO_SPACE"
        assert t.run(lambda: t.target.sessions.ended_idle) == 1
        try:
            await ini.qp.close()
        except (ConnectionLost, RemoteError):
            pass
    try:
        run(main())
        m = t.target.metrics
        assert m.chain[Opcode.LOAD] == 1 and m.python[Opcode.LOAD] == 0
    finally:
        t.stop()


@pytest.mark.slow
@pytest.mark.parametrize("options", ["", " --addr-le"], ids=["big-endian", "addr_le"])
def test_a_whole_bench_run_of_alloc_store_runs_no_kbtp_python_per_request(tmp_path, options):
    """The issue's proof: over a whole tools/bench_target.py ALLOC_STORE run against
    ``--execution chains`` (both bindings, with and without ADDR_LE; 4096-octet blocks:
    inline, and 8192: by RDMA Read), the target's closing counters say no ALLOC_STORE ran
    KBTP Python, and every one the bench timed ran by chains."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(root / "tools" / "bench_target.py"), "--transports", "iwarp,roce",
                    "--ops", "ALLOC_STORE", "--sizes", "4096,8192", "--seconds", "1", "--warmup", "0.2",
                    "--pool-mib", "64", "--round", "256", "--target-args", "--execution chains" + options,
                    "--json", str(out)], check=True, stdout=subprocess.DEVNULL, timeout=240)
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 4
    for case in cases:
        counters = re.search(r"ALLOC_STORE: KBTP Python per request (\d+), run by chains (\d+)",
                             case["target_output"])
        assert counters is not None, case
        # and every ALLOC_STORE the bench timed (its warm-up's too) ran by chains, however
        # few a loaded machine managed in the second
        assert int(counters.group(1)) == 0 and int(counters.group(2)) >= case["kbtp"]["ops"] > 0


def alloc_store_answers(transport: str, config: TargetConfig,
                        prepare: Callable[[Target], object]) -> tuple[list[tuple], Counter, Counter]:
    """The answers of one ALLOC_STORE script (inline, sealed, by RDMA Read, a FREE and a
    second ALLOC_STORE of the freed handle, each block loaded back) against a target
    ``prepare`` set up first, with its ALLOC_STOREs run by chains and by KBTP Python."""
    t = TargetThread(transport, config)

    async def main() -> list[tuple]:
        ini = await connect(t, 0, credits=4, features=config.features)
        h = ini.target.handle_base
        answers = []
        for handle, data, kw in ((h, b"wraps", {"seal": True}), (h + 1, bytes(range(60)), {"inline": False}),
                                 (h + 2, b"third", {}), (h, b"again", {"seal": True, "inline": False})):
            if handle == h and answers:
                await ini.free(h)
            r = await ini.alloc_store(handle, data, **kw)
            loaded = await ini.load(handle, allow_unsealed=True)
            answers.append((r.status, r.generation, r.data_length, r.block_offset, loaded.data == data))
        await ini.close()
        return answers
    try:
        t.run(lambda: prepare(t.target))
        answers = run(main())
        ended(t)
        m = t.target.metrics
        return answers, m.chain, m.python
    finally:
        t.stop()


@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_alloc_stores_with_addr_le_answer_as_the_software_target(transport):
    """ADDR_LE: the Generation's successor comes from the successor table (little-endian
    memory cannot carry a network-order add), so the wrap from 65,535 to 1 and every other
    answer are the software target's, with no ALLOC_STORE run by KBTP Python."""
    def near_the_wrap(target: Target) -> None:
        h = target.config.base_handle           # the first session's range
        for handle, generation in ((h, 0xFFFF), (h + 1, 0xFFFE)):
            target.memory.table.write(handle, Entry(0, generation, 0, UNBOUND_OFFSET))
    answers = {}
    for execution in ("software", "chains"):
        config = TargetConfig(blocks=64, block_size=4096, max_initiators=2, request_credits=4,
                              addr_le=True, execution=execution)
        answers[execution] = alloc_store_answers(transport, config, near_the_wrap)
    (soft, _, soft_python), (chained, chain, python) = answers["software"], answers["chains"]
    assert chained == soft and [a[1] for a in soft] == [1, 0xFFFF, 1, 3]
    assert (chain[Opcode.ALLOC_STORE], python[Opcode.ALLOC_STORE]) == (4, 0)
    assert soft_python[Opcode.ALLOC_STORE] == 4


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_a_ring_of_more_than_65536_slots_runs_alloc_store_in_chains(transport):
    """A shared ring of 2^17 slots, its tickets past 65,536 (the ring's own allocations and
    frees, 65,536 of them): RoCEv2's unmasked Head gives the ticket only, and the slot alias
    key reaches slot ``t mod N`` from the ticket's three low octets (two would reach slot
    ``t mod 65,536``, a slot that never holds the ticket: the chain would wait for good);
    iWARP's masked Head gives the Slot Offset. Both answer as the software target."""
    def past_ticket_65536(target: Target) -> None:
        ring = target.memory.shared_ring
        assert ring.size == 1 << 17
        for _ in range(1 << 16):
            ticket, offset = ring.take_ticket()
            block = ring.ready(ticket, offset)
            assert block is not None
            ring.consume(offset)
            ring.free(block)
    answers = {}
    for execution in ("software", "chains"):
        config = TargetConfig(blocks=65537, block_size=64, max_initiators=2, request_credits=4,
                              features=0, execution=execution)
        answers[execution] = alloc_store_answers(transport, config, past_ticket_65536)
    (soft, _, _), (chained, chain, python) = answers["software"], answers["chains"]
    assert chained == soft and all(a[0] == Status.OK and a[4] for a in soft)
    assert (chain[Opcode.ALLOC_STORE], python[Opcode.ALLOC_STORE]) == (4, 0)
