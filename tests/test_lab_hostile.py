"""Issue 13's bounds on the verbs backend: the reference target on the kernel's rxe and siw.

On a device the kernel's CM sets connections up and the device answers the peer, so
what the soft RNIC does itself is the target's here: it takes the half-open slot when a
connection arrives and closes one that sends no HELLO in time; its zero-length RDMA
Write probes are answered by a live peer's RNIC and fail on a vanished one's; its
answers' work completions (signaled every few, a zero-length Write behind the rest when
it must wait) are what the backlog counts. The attackers run on the host's soft RNIC.
"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kbtp_scapy.initiator import Initiator

from . import attack as a
from .hostile import SLACK, admitted_after, samples, start_peer
from .lab import BINDINGS, GuestTarget, in_lab, rdma_lab

pytestmark = pytest.mark.lab
METRICS = 9464


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def metrics(lab) -> dict[str, float]:
    """The guest target's Prometheus samples (its --metrics is on the guest's loopback)."""
    done = lab.run(lab.python("-c", "import urllib.request, sys; sys.stdout.write(urllib.request"
                              f".urlopen('http://127.0.0.1:{METRICS}/metrics').read().decode())"))
    return samples(done.stdout)


@pytest.mark.parametrize("transport", ["roce", "iwarp"], ids=["rxe", "siw"])
def test_verbs_target_probes_idle_sessions_and_closes_silent_connections(lab, transport):
    """A connection that sends no HELLO is closed at --hello-timeout; an idle session is
    probed every --probe-interval, the soft RNIC answers, and its data is intact."""
    binding = BINDINGS[transport]
    with GuestTarget(lab, binding, "--probe-interval", "0.3", "--probe-timeout", "3",
                     "--hello-timeout", "1", "--metrics", str(METRICS)) as target:
        async def main():
            loop = asyncio.get_running_loop()
            # The RTR a moment after the MPA Reply: sent at once, on a busy machine siw (6.1)
            # can take it before its QP is in RDMA mode, never reports the connection
            # established, and drops it at its own MPA timeout (10 s), the target none the
            # wiser (README "Limits", on siw)
            silent = await a.connect(target.url, binding.host, rtr_after=0.05)
            start = loop.time()
            assert await silent.wait_closed(1 + SLACK), "the silent connection is still open"
            closed_after = loop.time() - start
            await silent.end()
            ini = await Initiator.connect(target.url, features=0)
            h = ini.target.handle_base
            await ini.alloc_store(h, b"idle but alive", seal=True)
            await asyncio.sleep(2.0)            # about six probe intervals of silence
            assert (await ini.load(h)).data == b"idle but alive"
            await ini.free(h)
            await ini.goodbye(release=True)
            return closed_after
        with in_lab(lab):
            closed_after = run(main())
        m = metrics(lab)
    assert 0.5 < closed_after < 1 + SLACK, closed_after
    assert m["kbtp_liveness_probes_total"] >= 2, m
    assert m.get('kbtp_connections_terminated_total{reason="liveness"}', 0) == 0, m
    assert m['kbtp_connections_refused_total{reason="hello_timeout"}'] == 1, m


def test_vanished_peer_of_the_rxe_target_gives_its_slot_to_a_newcomer(lab):
    """A peer SIGKILLed after HELLO, the only initiator the target admits: rxe's retries
    of the probe go unanswered, so within the probe interval and timeout the session goes
    to retention and a new initiator gets its slot."""
    binding = BINDINGS["roce"]
    with GuestTarget(lab, binding, "--max-initiators", "1", "--direct-partitions", "0",
                     "--probe-interval", "0.5", "--probe-timeout", "2",
                     "--metrics", str(METRICS)) as target:
        with in_lab(lab):
            peer = start_peer(target.url, os.urandom(16), False, rdma_lab.HOST_IP2)
            try:
                peer.send_signal(signal.SIGKILL)
                peer.wait()

                async def main():
                    after, refusals, new = await admitted_after(
                        target.url, asyncio.get_running_loop().time(), local=binding.host)
                    await new.goodbye(release=True)
                    return after, refusals
                after, refusals = run(main())
            finally:
                peer.kill()
                peer.wait()
        m = metrics(lab)
    assert refusals >= 1 and after < 0.5 + 2 + SLACK, (after, refusals)
    assert m['kbtp_connections_terminated_total{reason="liveness"}'] == 1, m


def test_rxe_target_stops_serving_a_peer_without_receive_buffers(lab):
    """Every COMPLETION meets an RNR NAK, which rxe retries for ever: the target stops at
    twice the Request Credits of answers its device has not had acknowledged and ends the
    connection at --backlog-timeout."""
    binding = BINDINGS["roce"]
    with GuestTarget(lab, binding, "--backlog-timeout", "2", "--metrics", str(METRICS)) as target:
        async def attack():
            conn = await a.connect(target.url, binding.host)
            ack = await conn.session(credits=16)
            assert ack["status"] == "OK" and ack["credits"] == 16, ack
            conn.receive_buffers = 0         # the HELLO_ACK's was the last
            handle = ack["handle_base"]
            result = await a.keep_saying(conn, lambda n: a.load(n, handle), 16, 0.01)
            seen = {hex(k): v for k, v in conn.port.seen.items()}
            await conn.end()
            return (*result, conn.rnr_naks, seen)
        with in_lab(lab):
            took, sent, closed, rnr_naks, seen = run(attack())
        m = metrics(lab)
    assert closed and took < 2 + SLACK, (took, sent, rnr_naks, seen)
    assert m['kbtp_connections_terminated_total{reason="backlog"}'] == 1, m
    served = m.get('kbtp_operations_total{opcode="LOAD",status="NOT_VALID"}', 0)
    assert served <= 16 + 2 * 16 + 16 and sent > 5 * served, (served, sent)
