"""The reference target against the third round of hostile peers (issue 32): each test an
attack on real sockets against a ``kbtp target`` process, in software and ``--execution
chains``, asserting numbers. The attackers are ``tests/attack.py``'s.
"""
from __future__ import annotations

import asyncio
import secrets

import pytest

from kbtp_scapy.initiator import Initiator, KbtpError

from . import attack as a
from .hostile import TargetProc
from .kbtp_harness import fresh_hosts

POOL = ["-F", "64", "-S", "4096"]
BLOCK = 4096


async def _load_after(url: str, ident: bytes, handle: int) -> tuple[str, bytes]:
    """The same initiator back, LOADing the handle of the refused store: (status, data)."""
    ini = await Initiator.connect(url, initiator_id=ident, features=0)
    try:
        result = await asyncio.wait_for(ini.load(handle, allow_unsealed=True), 10)
        return "OK", result.data
    except KbtpError as exc:
        return exc.name, b""
    finally:
        await ini.goodbye(release=True)


@pytest.mark.slow
@pytest.mark.parametrize("execution", ["software", "chains"])
@pytest.mark.parametrize("answer", [BLOCK // 2, BLOCK + 1024], ids=["short", "long"])
def test_iwarp_read_response_not_of_the_requested_length_fails_the_store(execution, answer):
    """T5: the RDMA Read of a non-inline ALLOC_STORE answered with 2,048 (or 5,120) of 4,096
    octets, Last set: a protocol error (RFC 5040 s4.4; siw: DDP base-or-bounds Terminate).
    The store never completes OK, the target Terminates the stream, and the handle holds
    nothing afterwards."""
    host, = fresh_hosts(1)
    t = TargetProc("iwarp", host, *POOL, "--execution", execution)
    port = int(t.url.rsplit(":", 1)[1])
    ident = secrets.token_bytes(16)

    async def attack():
        s = await a.MpaStream.open(host, port)
        ack = await s.session(ident)
        got = await a.iwarp_store_answered(s, 1, ack["handle_base"], BLOCK, answer)
        await s.end()
        return got, await _load_after(t.url, ident, ack["handle_base"])
    try:
        got, (status, data) = asyncio.run(asyncio.wait_for(attack(), 60))
    finally:
        t.stop()
    assert got["read"], got
    assert got["completion"] is None or got["completion"]["status"] != "OK", got
    assert got["terminate"] and got["ended"], got
    assert status == "NOT_VALID" and data == b"", (status, len(data))


@pytest.mark.slow
@pytest.mark.parametrize("execution", ["software", "chains"])
@pytest.mark.parametrize("answer", [BLOCK // 2, BLOCK + 1024], ids=["short", "long"])
def test_roce_read_response_not_of_the_requested_length_fails_the_store(execution, answer):
    """T5 on RoCEv2: a Read Response of the wrong length (IB 9.9.2.3 table: a bad
    response, the requester's QP to the error state): the store never completes OK, the
    target ends the connection (DREQ), and the handle holds nothing afterwards."""
    host, local = fresh_hosts(2)
    t = TargetProc("roce", host, *POOL, "--execution", execution)
    ident = secrets.token_bytes(16)

    async def attack():
        s = await a.LyingRcSession.open(local, host)
        s.answer = lambda size: answer if size == BLOCK else size
        ack = await s.session(ident)
        got = await a.roce_store_answered(s, 1, ack["handle_base"], BLOCK)
        await s.end()
        return got, await _load_after(t.url, ident, ack["handle_base"])
    try:
        got, (status, data) = asyncio.run(asyncio.wait_for(attack(), 60))
    finally:
        t.stop()
    assert got["read"], got
    assert got["completion"] is None or got["completion"]["status"] != "OK", got
    assert got["ended"], got
    assert status == "NOT_VALID" and data == b"", (status, len(data))
