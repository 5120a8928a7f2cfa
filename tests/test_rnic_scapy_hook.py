"""The frame hook shows every frame of a live session as a Scapy packet, KBTP included."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

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
                                                              lambda d, f, ns: raw.append(f)],
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


SESSION_WITHOUT_HOOK = """
import asyncio, sys
from kbtp_scapy.initiator import Initiator
from kbtp_scapy.target import TargetConfig
from tests.kbtp_harness import TargetThread

for transport in ("iwarp", "roce"):
    t = TargetThread(transport, TargetConfig(blocks=16, max_initiators=2),
                     hosts=["127.56.0.1", "127.56.0.2"])

    async def main():
        ini = await Initiator.connect(t.url, **t.connect_options(0))
        h = ini.target.handle_base
        await ini.alloc_store(h, bytes(3000), seal=True, inline=False)
        assert (await ini.load(h)).data == bytes(3000)
        await ini.goodbye(release=True)
    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        t.stop()
print(sorted(m for m in sys.modules if m.split(".")[0] == "scapy"))
"""


def test_a_session_without_a_hook_never_imports_scapy():
    """Scapy is for those who ask for it: target, initiator and both soft-RNIC bindings
    run a whole session (inline-less store, LOAD, GOODBYE) without importing it."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", SESSION_WITHOUT_HOOK], cwd=root, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "[]"
