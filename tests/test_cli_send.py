"""``kbtp initiator URL send``: crafted octets to a real target, its answers decoded, and what
became of the connection (issue 21, "send crafted bytes"); ``Initiator.raw`` and ``goodbye``
raise the connection's fate."""
from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys

import pytest

from kbtp_scapy import codec
from kbtp_scapy.initiator import Initiator, SessionEnded
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.vocab import Opcode, RequestFlag, Status

from .kbtp_harness import TargetThread

KBTP = [sys.executable, "-m", "kbtp_scapy"]
#: an inline ALLOC_STORE longer than any receive buffer the target posts (Max Inline 1024)
TOO_LONG = 3000


@pytest.fixture(params=["iwarp", "roce"], scope="module")
def target(request):
    net = f"127.47.{secrets.randbelow(250) + 1}"
    t = TargetThread(request.param, TargetConfig(blocks=64, block_size=1024, max_initiators=16,
                                                 max_inline=1024),
                     hosts=[f"{net}.{i}" for i in range(1, 12)])
    yield t
    t.stop()


_local = iter(range(1, 10**6))


def pipe(tmp_path, target, craft: list[str], *options: str) -> subprocess.CompletedProcess:
    """``kbtp craft ... | kbtp initiator URL [--local A] OPTIONS send -``, as a shell runs it."""
    local = (["--local", target.initiator_hosts[next(_local) % len(target.initiator_hosts)]]
             if target.transport == "roce" else [])
    made = subprocess.run([*KBTP, "craft", *craft], capture_output=True, timeout=60, check=True)
    return subprocess.run([*KBTP, "initiator", target.url, "--id-file", str(tmp_path / "id"), *local,
                           *options, "send", "-"],
                          input=made.stdout, capture_output=True, timeout=60, env={"HOME": str(tmp_path)})


@pytest.mark.slow
def test_crafted_lie_is_answered_malformed(tmp_path, target):
    proc = pipe(tmp_path, target, ["LOAD", "--kbtp-version", "2", "--request-id", "77", "--handle", "7"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert lines[0].startswith("sent 1: LOAD rid=77") and "[malformed: version 2 is not 1]" in lines[0]
    assert lines[1] == "  answer: COMPLETION rid=77 MALFORMED gen=0 off=0x0", lines
    assert lines[2].startswith("connection: answered:")


@pytest.mark.slow
def test_json_answers_and_fate(tmp_path, target):
    proc = pipe(tmp_path, target, ["FREE", "--request-id", "5", "--handle", "0x4000"], "--json")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert records[0]["sent"] == 1 and records[0]["message"]["kbtp.opcode"] == Opcode.FREE
    answer = records[1]
    assert answer["answer"] == 1 and answer["kbtp.request_id"] == 5
    assert answer["kbtp.opcode"] == Opcode.COMPLETION and answer["kbtp.status"] in (
        Status.NOT_VALID, Status.INVALID_HANDLE)
    assert records[2] == {"connection": "answered", "reason": records[2]["reason"], "unsent": 0}


@pytest.mark.slow
def test_goodbye_ends_the_connection_as_the_binding_does(tmp_path, target):
    proc = pipe(tmp_path, target, ["GOODBYE"])
    assert proc.returncode == 0, proc.stderr
    fate = proc.stdout.decode().splitlines()[-1]
    assert fate.startswith("connection: fin:" if target.transport == "iwarp" else "connection: dreq:"), fate


@pytest.mark.slow
def test_a_send_too_long_for_the_buffer_is_the_qps_end(tmp_path, target):
    """iWARP: the target's DDP layer answers with a Terminate; RoCEv2: a NAK, the QP's error."""
    data = tmp_path / "big.bin"
    data.write_bytes(bytes(TOO_LONG))
    proc = pipe(tmp_path, target, ["ALLOC_STORE", "--handle", "0x4000", "--inline-data-file", str(data)])
    assert proc.returncode == 0, proc.stderr
    fate = proc.stdout.decode().splitlines()[-1]
    if target.transport == "iwarp":
        assert fate.startswith("connection: terminate: Terminate from peer: DDP Untagged Buffer Error"), fate
    else:
        assert fate == "connection: qp_error: queue pair in error state after NAK: invalid request", fate


def test_raw_and_goodbye_raise_the_connections_fate(target):
    async def main():
        ini = await Initiator.connect(target.url, **({"local": target.initiator_hosts[0]}
                                                     if target.transport == "roce" else {}))
        wire = codec.encode({"opcode": Opcode.ALLOC_STORE, "request_id": 1, "handle": ini.target.handle_base,
                             "flags": RequestFlag.INLINE, "dd.length": TOO_LONG, "inline_data": bytes(TOO_LONG)})
        with pytest.raises(SessionEnded) as ended:
            await ini.raw(wire)
        with pytest.raises(SessionEnded) as after:
            await ini.goodbye(release=True)
        await ini.goodbye()                         # without RELEASE: what was asked happens
        return ended.value, after.value
    ended, after = asyncio.run(asyncio.wait_for(main(), 60))
    assert ended.how == ("terminate" if target.transport == "iwarp" else "qp_error"), ended
    assert ended.answers == []
    assert after.how == ended.how and "RELEASE not sent" in str(after)


def test_not_hex_nor_a_file(tmp_path):
    proc = subprocess.run([*KBTP, "initiator", "roce://127.0.0.1", "--id-file", str(tmp_path / "id"),
                           "send", "zz"], capture_output=True, text=True, timeout=60,
                          env={"HOME": str(tmp_path)})
    assert proc.returncode == 2 and "'zz' is neither hex nor a file" in proc.stderr, proc.stderr
