#!/usr/bin/env python3
"""Capture KBTP sessions of the kernel's RDMA stacks with tcpdump in the lab's guest.

These are real kernel frames, not the soft RNIC's ``--pcap``:

- RoCEv2: ``kbtp target --io verbs`` on Linux rxe (rxe0) in the guest, the soft-RNIC
  initiator on the host, tcpdump on the guest's eth0 (path MTU 1024): every frame of the
  target's side (RDMA Writes of LOADs, Read Requests of stores, Write with Immediate of a
  completion record, Fetch and Add and Read responses, CM MADs) is built by rxe.
- iWARP: target and initiator both on the verbs backend on Linux siw, siw1 and siw2 on a
  veth pair inside the guest, tcpdump on it: every octet is siw's and the kernel TCP's.

    tools/lab_captures.py              write pcaps/rxe_kernel_session.pcap, pcaps/siw_kernel_session.pcap
    tools/lab_captures.py --out DIR    elsewhere

Each session does HELLO, inline and RDMA Read ALLOC_STOREs, a STORE, LOADs (RDMA Write), a
status error, DIRECT_LOAD, FREEs and GOODBYE; the RoCEv2 one also RECORD and DIRECT_ALLOC.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kbtp_scapy.initiator import Initiator, KbtpError  # noqa: E402

if "rdma_lab" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("rdma_lab", ROOT / "tools" / "rdma_lab.py")
    sys.modules["rdma_lab"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["rdma_lab"])
rdma_lab = sys.modules["rdma_lab"]

TARGET = ["--blocks", "64", "-S", "4096", "--max-inline", "512", "--ticket-timeout", "2000"]
NAMES = {"roce": "rxe_kernel_session.pcap", "iwarp": "siw_kernel_session.pcap"}


async def session(url: str, *, roce: bool, **options) -> None:
    """The captured session: one of each kind of message, as the module docstring says."""
    ini = await Initiator.connect(url, **options)
    h = ini.target.handle_base
    await ini.alloc_store(h, b"KV cache block, inline", seal=True)
    await ini.alloc_store(h + 1, bytes(range(256)) * 12, seal=True)        # RDMA Read
    await ini.load(h)
    await ini.load(h + 1)                                                 # RDMA Write
    try:
        await ini.load(h + 2)
    except KbtpError:
        pass                                                              # NOT_VALID
    if roce:
        await ini.load(h + 1, record=True)                                # Write with Immediate
        await ini.direct_alloc(h + 3, b"direct block")                    # Fetch and Add, BIND
    await ini.direct_load(h + 1)
    await ini.alloc_store(h + 4, b"draft")                                # unsealed
    await ini.store(h + 4, bytes(range(200)) * 10, seal=True, inline=False)  # STORE, RDMA Read
    await ini.load(h + 4)
    await ini.free(h)
    await ini.free(h + 4)
    await ini.goodbye(release=True)


def capture(lab, transport: str, out: Path) -> Path:
    """One session of ``transport`` captured into ``out`` (a file of the host's)."""
    from tests.netns import enter  # the lab's host side is a namespace
    pcap = lab.dir / f"{transport}.pcap"
    if transport == "roce":
        iface, listen, device, ns = "eth0", rdma_lab.GUEST_IP, "rxe0", []
    else:
        iface, listen, device, ns = "vsiw", rdma_lab.SIW_INNER_IP, "siw1", ["ip", "netns", "exec", "peer"]
    lab.run(["ip", "link", "set", "eth0", "mtu", "1500"])               # path MTU 1024
    target = lab.spawn(lab.kbtp("target", "--transport", transport, "--io", "verbs", "--device",
                                device, "--listen", listen, *TARGET, *rdma_lab.TRUST_ARGS),
                       name=f"capture-{transport}")
    tcpdump = lab.spawn(["tcpdump", "-Z", "root", "-i", iface, "-s", "0", "-U", "-w", str(pcap),
                         "udp port 4791" if transport == "roce" else "tcp port 5420"],
                        name=f"tcpdump-{transport}")
    try:
        target.wait_for("listening on", 120)
        tcpdump.wait_for("listening on", 60)
        url = f"{transport}://{listen}"
        if transport == "roce":
            with enter(lab.netns):
                asyncio.run(asyncio.wait_for(session(url, roce=True, mtu=1024), 120))
        else:
            lab.run(ns + lab.python(str(Path(__file__)), "--guest-session", url, "siw2"), timeout=300)
        time.sleep(1)
    finally:
        tcpdump.stop()
        target.stop()
        lab.run(["ip", "link", "set", "eth0", "mtu", str(rdma_lab.MTU)])
    out.write_bytes(pcap.read_bytes())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "pcaps", help="where to write (pcaps/)")
    ap.add_argument("--guest-session", nargs=2, metavar=("URL", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.guest_session:                         # in the guest: the iWARP session on siw2
        url, device = args.guest_session
        asyncio.run(asyncio.wait_for(session(url, roce=False, io="verbs", device=device), 240))
        return 0
    with rdma_lab.Lab() as lab:
        for transport, name in NAMES.items():
            print(f"wrote {capture(lab, transport, args.out / name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
