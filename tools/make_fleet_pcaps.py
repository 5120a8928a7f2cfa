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
systems suffer from, which ``kbtp analyze`` finds. Both consumers also read every block
with DIRECT_LOAD (entry, block, entry again); the buggy one, once, reads an entry, lets
the producer free the handle and store another prompt under it, then reads the block the
old entry named and never reads the entry again (a stale Direct Load). Each producer
stores one block with DIRECT_ALLOC; the buggy fleet's first producer sends that BIND
late, past ``SLOW_BIND`` of the Ticket Timeout after its FetchAdd took the ticket.
``--clean`` makes every host careful.

    tools/make_fleet_pcaps.py --out pcaps/fleet            # the committed sample
    kbtp analyze pcaps/fleet                                # finds the buggy consumer's reads

Traffic stays on loopback addresses (``--addresses``, default 127.77.0.x).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kbtp_scapy.initiator import Initiator, KbtpError  # noqa: E402
from kbtp_scapy.rnic.pcap import PcapSink  # noqa: E402
from kbtp_scapy.tables import memory as M  # noqa: E402
from kbtp_scapy.target import Target, TargetConfig  # noqa: E402

BLOCKS_PER_PRODUCER = 12
REUSED = 4                  # blocks each producer frees and stores again for a new prompt
ROUNDS = 3                  # loads of every block by each consumer, before and after reuse
SLOW_BIND = 0.8             # of the Ticket Timeout: the buggy producer's BIND after its FetchAdd


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
                if buggy and name == "producer2" and i == REUSED - 1:
                    await _stale_direct_load(peers["consumer2"], ini, h, generations)
                    continue
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
        for name in ("producer1", "producer2"):
            await _direct_alloc(peers[name], slow=buggy and name == "producer1")
        for ini in peers.values():
            await ini.goodbye()
    finally:
        for ini in peers.values():
            await ini.close()
        await target.close()
        for sink in sinks.values():
            sink.close()


async def _consume(peers: dict[str, Initiator], generations: dict[int, int], buggy: bool) -> None:
    """Each consumer loads every block once, then reads it with DIRECT_LOAD; the buggy
    one's LOADs ask for any Generation."""
    for h, generation in generations.items():
        await peers["consumer1"].load(h, generation=generation)
        await peers["consumer2"].load(h, generation=0 if buggy else generation)
    for h in generations:
        for name in ("consumer1", "consumer2"):
            await peers[name].direct_load(h)


async def _stale_direct_load(consumer: Initiator, producer: Initiator, h: int,
                             generations: dict[int, int]) -> None:
    """The buggy consumer's Direct Load, written out: the entry is read, the producer
    frees the handle and stores another prompt under it, and then the block the old entry
    named is read, without reading the entry again to see that it changed."""
    stag, base, _ = consumer._direct("table")
    at = base + (h - consumer.target.fields["table_base_handle"]) * M.ENTRY_SIZE
    entry = await consumer._entry(stag, at)
    await producer.free(h, generation=generations[h])
    done = await producer.alloc_store(h, b"producer2 prompt B block (reused)", seal=True)
    generations[h] = done.generation
    await consumer._read(consumer._direct("pool")[0], entry["entry.block_offset"],
                         entry["entry.data_length"], "a block")


async def _direct_alloc(producer: Initiator, slow: bool) -> None:
    """One block stored with DIRECT_ALLOC; ``slow``: its BIND waits ``SLOW_BIND`` of the
    Ticket Timeout after the ticket was taken (the target still accepts it)."""
    if slow:
        bind = producer.bind

        async def late(*args: Any, **options: Any) -> Any:
            await asyncio.sleep(SLOW_BIND * producer.target.ticket_timeout_ms / 1000)
            return await bind(*args, **options)
        producer.bind = late  # type: ignore[method-assign]
    try:
        await producer.direct_alloc(producer.target.handle_base + BLOCKS_PER_PRODUCER, b"direct block")
    finally:
        producer.__dict__.pop("bind", None)


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
