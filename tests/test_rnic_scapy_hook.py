"""The frame hook shows every frame of a live session as a Scapy packet, KBTP included."""
from __future__ import annotations

import asyncio

import pytest

from kbtp_scapy.initiator import Initiator
from kbtp_scapy.layers.kbtp import KBTP
from kbtp_scapy.rnic.scapy_hook import as_scapy
from kbtp_scapy.target import TargetConfig

from .kbtp_harness import TargetThread


@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_every_frame_reaches_the_hook_as_scapy(transport):
    t = TargetThread(transport, TargetConfig(blocks=16, max_initiators=2))
    seen: list[tuple[str, object]] = []
    raw: list[bytes] = []

    async def main():
        ini = await Initiator.connect(t.url, frame_listeners=[as_scapy(lambda d, p: seen.append((d, p))),
                                                              lambda d, f: raw.append(f)],
                                      **t.connect_options(0))
        await ini.alloc_store(ini.target.handle_base, b"seen", seal=True)
        await ini.load(ini.target.handle_base)
        await ini.goodbye(release=True)
    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        t.stop()
    assert len(seen) == len(raw) and {d for d, _ in seen} == {"tx", "rx"}
    assert [bytes(p) for _, p in seen] == raw               # nothing lost in the dissection
    kbtp = [(d, p[KBTP].opcode) for d, p in seen if KBTP in p]
    assert ("tx", 0x01) in kbtp and ("rx", 0x02) in kbtp    # HELLO out, HELLO_ACK in
    assert ("tx", 0x12) in kbtp and ("tx", 0x10) in kbtp
    assert sum(1 for d, op in kbtp if (d, op) == ("rx", 0x20)) == 2
