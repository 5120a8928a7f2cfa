"""One initiator process of the allocation storm (tests/test_target_storm.py).

Runs random ALLOC_STORE, STORE, LOAD and FREE on its own handles for a given time, with
several requests in flight, checks every LOAD against what it stored, and prints a JSON
summary with the digest of each block it leaves bound.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys

from kbtp_scapy.initiator import Initiator, KbtpError


async def storm(url: str, seconds: float, seed: int, local: str | None, lanes: int) -> dict:
    options = {"local": local} if local else {}
    ini = await Initiator.connect(url, features=0, **options)
    rng = random.Random(seed)
    base, quota, size = ini.target.handle_base, ini.target.quota, ini.target.block_size
    stored: dict[int, bytes] = {}
    counts = {"alloc_store": 0, "store": 0, "load": 0, "free": 0, "no_space": 0}
    errors: list[str] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    handles = list(range(base, base + min(ini.target.handle_count, 2 * quota)))

    async def lane(mine: list[int]) -> None:
        while loop.time() < end and not errors:
            h = rng.choice(mine)
            try:
                if h not in stored:
                    data = rng.randbytes(rng.choice((1, 100, size // 2, size)))
                    try:
                        await ini.alloc_store(h, data, inline=rng.random() < 0.5)
                    except KbtpError as exc:
                        if exc.name != "NO_SPACE":
                            raise
                        counts["no_space"] += 1
                        continue
                    stored[h] = data
                    counts["alloc_store"] += 1
                else:
                    choice = rng.random()
                    if choice < 0.4:
                        got = (await ini.load(h, allow_unsealed=True)).data
                        if got != stored[h]:
                            errors.append(f"load 0x{h:x}: {len(got)} octets differ from the store")
                        counts["load"] += 1
                    elif choice < 0.6:
                        data = rng.randbytes(rng.randrange(1, size))
                        await ini.store(h, data, inline=rng.random() < 0.5)
                        stored[h] = data
                        counts["store"] += 1
                    else:
                        await ini.free(h)
                        del stored[h]
                        counts["free"] += 1
            except KbtpError as exc:
                errors.append(f"0x{h:x}: {exc}")

    await asyncio.gather(*(lane(handles[i::lanes]) for i in range(lanes)))
    for h, data in sorted(stored.items()):
        got = (await ini.load(h, allow_unsealed=True)).data
        if got != data:
            errors.append(f"final load 0x{h:x} differs")
    await ini.goodbye(release=False)
    return {"counts": counts, "errors": errors,
            "bound": {str(h): hashlib.sha256(d).hexdigest() for h, d in stored.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local", default=None)
    p.add_argument("--lanes", type=int, default=8)
    a = p.parse_args()
    result = asyncio.run(storm(a.url, a.seconds, a.seed, a.local, a.lanes))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
