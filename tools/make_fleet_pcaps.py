#!/usr/bin/env python3
"""Record a small fleet's captures: two producers, two consumers, one reference target.

Each host records its own capture, as each NIC of a serving fleet would (``HOST.pcap``,
the frames its soft RNIC sent and received), so the captures must be read together to see
a block stored on one host and loaded on another. The producers store sealed blocks in
their handle ranges, free some and store new prompts' blocks under the same handles; the
consumers load the producers' blocks. The careful consumer passes the Generation the
producer's store returned (handed over outside the protocol, as the text says handles
are); the buggy consumer (``--buggy``, the default) loads with Generation 0, "any", and is
served another prompt's block after the handle was reused: the stale read KV-cache
systems suffer from, which ``kbtp analyze`` finds. ``--clean`` makes both consumers
careful.

    tools/make_fleet_pcaps.py --out pcaps/fleet            # the committed sample
    kbtp analyze pcaps/fleet                                # finds the buggy consumer's reads

Traffic stays on loopback addresses (``--addresses``, default 127.77.0.x).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kbtp_scapy.initiator import Initiator, KbtpError  # noqa: E402
from kbtp_scapy.rnic.pcap import PcapSink  # noqa: E402
from kbtp_scapy.target import Target, TargetConfig  # noqa: E402

BLOCKS_PER_PRODUCER = 12
REUSED = 4                  # blocks each producer frees and stores again for a new prompt
ROUNDS = 3                  # loads of every block by each consumer, before and after reuse


NAMES = ("producer1", "producer2", "consumer1", "consumer2")


async def fleet(out: Path, addresses: list[str], buggy: bool) -> None:
    """``addresses``: the target's, then the hosts' of ``NAMES``."""
    out.mkdir(parents=True, exist_ok=True)
    target = Target(TargetConfig(blocks=256, block_size=4096), "roce")
    address = await target.start(f"roce://{addresses[0]}:4791")
    hosts = dict(zip(NAMES, addresses[1:], strict=True))
    sinks = {name: PcapSink(out / f"{name}.pcap") for name in hosts}
    peers: dict[str, Initiator] = {}
    try:
        for name, host in hosts.items():
            peers[name] = await Initiator.connect(str(address), local=host, frame_listeners=[sinks[name]])
        generations: dict[int, int] = {}          # handle -> Generation of its last store
        for name in ("producer1", "producer2"):
            ini = peers[name]
            for i in range(BLOCKS_PER_PRODUCER):
                h = ini.target.handle_base + i
                done = await ini.alloc_store(h, f"{name} prompt A block {i}".encode(), seal=True)
                generations[h] = done.generation
        for _ in range(ROUNDS):
            await _consume(peers, generations, buggy)
        for name in ("producer1", "producer2"):
            ini = peers[name]
            for i in range(REUSED):
                h = ini.target.handle_base + i
                await ini.free(h, generation=generations[h])
                done = await ini.alloc_store(h, f"{name} prompt B block {i}".encode(), seal=True)
                stale = generations[h]
                generations[h] = done.generation
                # the careful consumer still holds the old Generation: refused, as it must be
                try:
                    await peers["consumer1"].load(h, generation=stale)
                except KbtpError:
                    pass
        for _ in range(ROUNDS):
            await _consume(peers, generations, buggy)
        for ini in peers.values():
            await ini.goodbye()
    finally:
        for ini in peers.values():
            await ini.close()
        await target.close()
        for sink in sinks.values():
            sink.close()


async def _consume(peers: dict[str, Initiator], generations: dict[int, int], buggy: bool) -> None:
    """Each consumer loads every block once; the buggy one asks for any Generation."""
    for h, generation in generations.items():
        await peers["consumer1"].load(h, generation=generation)
        await peers["consumer2"].load(h, generation=0 if buggy else generation)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "pcaps" / "fleet")
    parser.add_argument("--addresses", default="127.77.0.1,127.77.0.11,127.77.0.12,127.77.0.21,127.77.0.22",
                        help="loopback addresses of the target, then of " + ", ".join(NAMES))
    parser.add_argument("--clean", action="store_true", help="both consumers pass the Generation")
    args = parser.parse_args()
    addresses = args.addresses.split(",")
    if len(addresses) != 1 + len(NAMES):
        parser.error(f"--addresses: give {1 + len(NAMES)} addresses")
    asyncio.run(fleet(args.out, addresses, buggy=not args.clean))
    return 0


if __name__ == "__main__":
    sys.exit(main())
