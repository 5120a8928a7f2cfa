"""DIRECT_ALLOC partitions of departed sessions (issue 21 D6), against the real target."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import subprocess
import sys

import pytest

from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.target.audit import audit

from .kbtp_harness import TargetThread


@pytest.fixture(params=["iwarp", "roce"])
def one_partition(request):
    """A target with one DIRECT_ALLOC partition for two initiators, on addresses of its own."""
    net = f"127.46.{secrets.randbelow(250) + 1}"
    t = TargetThread(request.param, TargetConfig(blocks=64, block_size=4096, max_initiators=2,
                                                 direct_partitions=1, retention_s=30),
                     hosts=[f"{net}.{i}" for i in range(1, 5)])
    yield t
    t.stop()


async def connect(t: TargetThread, index: int, initiator_id: bytes | None = None) -> Initiator:
    return await Initiator.connect(t.url, initiator_id=initiator_id, **t.connect_options(index))


async def gone(t: TargetThread, ini: Initiator) -> None:
    """The connection ends without GOODBYE; wait until the target has retained the session."""
    await ini.close()
    for _ in range(200):
        if not t.run(lambda: any(s.active for s in t.target.sessions.by_id.values())):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the target never saw the connection end")


def test_a_session_that_holds_nothing_gives_its_partition_back(one_partition):
    """Run twice, as the README's example is: the second session gets DIRECT_ALLOC although
    the first one's connection died without GOODBYE; the first, reconnecting, gets it again."""
    t = one_partition

    async def main():
        first_id = secrets.token_bytes(16)
        a = await connect(t, 0, first_id)
        assert "partition.stag" in a.target.fields
        await gone(t, a)
        b = await connect(t, 1)
        hb = b.target.handle_base
        assert (await b.direct_alloc(hb, b"second run")).data_length == 10
        await b.goodbye(release=True)
        a = await connect(t, 0, first_id)                  # restored from retention
        assert "partition.stag" in a.target.fields
        assert (await a.direct_alloc(a.target.handle_base, b"back")).data_length == 4
        await a.goodbye(release=True)
    asyncio.run(asyncio.wait_for(main(), 60))
    assert t.run(lambda: t.target.sessions.evicted) == 0     # kept its range, gave the partition
    assert t.run(lambda: audit(t.target)) == []


def test_no_partition_left_is_said_on_both_sides(one_partition, caplog):
    """A retained session with a binding from its partition keeps it (bindings survive the
    connection for the retention): the next session is told why DIRECT_ALLOC is missing."""
    t = one_partition

    async def main():
        a = await connect(t, 0)
        await a.direct_alloc(a.target.handle_base, b"kept")
        await gone(t, a)
        b = await connect(t, 1)
        assert "partition.stag" not in b.target.fields
        with pytest.raises(KbtpError) as refused:
            await b.direct_alloc(b.target.handle_base, b"none left")
        await b.goodbye(release=True)
        return refused.value
    with caplog.at_level(logging.WARNING, logger="kbtp.target"):
        refused = asyncio.run(asyncio.wait_for(main(), 60))
    assert "DIRECT_ALLOC was not granted in this session's HELLO_ACK" in refused.detail
    said = [r.getMessage() for r in caplog.records if "DIRECT_ALLOC not granted" in r.getMessage()]
    assert said and "no partition left (all 1 held: 0 by active sessions, 1 by retained ones" in said[0]


def test_the_command_line_says_why_direct_alloc_is_missing(one_partition, tmp_path):
    t = one_partition

    def initiator(name: str, index: int, *args: str) -> subprocess.CompletedProcess:
        local = ["--local", t.initiator_hosts[index]] if t.transport == "roce" else []
        return subprocess.run([sys.executable, "-m", "kbtp_scapy", "initiator", t.url, "--id-file",
                               str(tmp_path / name), *local, *args], capture_output=True, text=True,
                              timeout=60, env={"HOME": str(tmp_path)})
    base = json_of(initiator("a", 0, "--json", "hello"))["handle_base"]
    assert initiator("a", 0, "direct-alloc", hex(base), "--text", "kept").returncode == 0   # retained
    other = json_of(initiator("b", 1, "--json", "hello"))["handle_base"]
    refused = initiator("b", 1, "direct-alloc", hex(other), "--text", "none left")
    assert refused.returncode == 1, refused.stderr
    assert "did not grant DIRECT_ALLOC" in refused.stderr and "partition free" in refused.stderr


def json_of(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_a_bind_that_arrives_as_its_ticket_expires_is_ticket_abandoned(one_partition):
    """BIND looks at the Ticket Timeout itself before it asks whether its ticket was
    abandoned. With the target's periodic look held back, a ticket the watch has seen and
    whose timeout has passed meets its BIND as TICKET_ABANDONED; when BIND asked first and
    looked after, it was MALFORMED (the ticket gone from the outstanding ones by then)."""
    t = one_partition
    t.run(lambda: t.target._watcher.cancel())          # only the looks this test makes

    async def main():
        ini = await connect(t, 0)
        ticket, offset = await ini.take_ticket()
        block = await ini.wait_slot(ticket, offset, 1.0)
        state = t.run(lambda: t.target.sessions.by_id[ini.initiator_id])
        t.run(state.watch.poll)                          # the watch sees the ticket taken
        await asyncio.sleep(ini.target.ticket_timeout_ms / 1000 * 1.5)
        with pytest.raises(KbtpError) as refused:
            await ini.bind(ini.target.handle_base, ticket, 0, block)
        assert refused.value.name == "TICKET_ABANDONED", refused.value
    asyncio.run(asyncio.wait_for(main(), 60))
