"""Small helpers shared by the case modules."""
from __future__ import annotations

import os

from ...initiator import Initiator, Result
from ...rnic import Access
from ...rnic.memory import MemoryRegion
from ...tables.memory import ENTRY_SIZE
from ...vocab import AnyStruct, Opcode
from ..context import Ctx

SENTINEL = 0xA5


def data(n: int = 64) -> bytes:
    return os.urandom(n)


def other_generation(g: int) -> int:
    """A non-zero Generation different from ``g``."""
    return (g + 0x1234) % 0xFFFF + 1


def next_generation(g: int) -> int:
    return g % 0xFFFF + 1


async def bind(ctx: Ctx, ini: Initiator, handle: int, payload: bytes, *, seal: bool = True,
               inline: bool | None = None) -> Result:
    """ALLOC_STORE that must succeed (it is set-up, not the requirement under test)."""
    return await ctx.setup(ini.alloc_store(handle, payload, seal=seal, inline=inline),
                           f"ALLOC_STORE to 0x{handle:x}", ini)


def buffer(ini: Initiator, length: int) -> MemoryRegion:
    """A writable buffer filled with a sentinel, to see whether the target wrote it."""
    return ini.memory.register(bytearray([SENTINEL]) * length, Access.REMOTE_WRITE)


def untouched(region: MemoryRegion) -> bool:
    return bytes(region.view) == bytes([SENTINEL]) * region.length


def load_request(ctx: Ctx, ini: Initiator, handle: int, region: MemoryRegion, flags: int = 0,
                 generation: int = 0) -> bytes:
    return ctx.encode(ini, {"opcode": Opcode.LOAD, "handle": handle, "flags": flags,
                            "generation": generation, "dd.stag": region.stag, "dd.offset": 0,
                            "dd.length": region.length})


async def unbound(ctx: Ctx, ini: Initiator, handle: int, what: str) -> None:
    """The handle is not bound: a LOAD (unsealed allowed) completes NOT_VALID."""
    await ctx.expect(ini.load(handle, allow_unsealed=True), "NOT_VALID",
                     f"LOAD of 0x{handle:x} {what}")


async def holds(ctx: Ctx, ini: Initiator, handle: int, payload: bytes, what: str,
                generation: int | None = None) -> Result:
    """The handle is bound and holds ``payload`` (and ``generation`` when given)."""
    got = await ctx.ok(ini.load(handle, allow_unsealed=True), f"LOAD of 0x{handle:x} {what}")
    ctx.check(got.data == payload, f"the data of 0x{handle:x} {what} unchanged",
              f"{len(got.data)} octets that differ")
    if generation is not None:
        ctx.check(got.generation == generation, f"Generation {generation} {what}",
                  f"Generation {got.generation}")
    return got


def entry_at(ini: Initiator, handle: int) -> tuple[int, int]:
    """(Table STag, Tagged Offset) of ``handle``'s entry, from the DIRECT_LOAD grant."""
    f = ini.target.fields
    return f["table.stag"], f["table.offset"] + (handle - f["table_base_handle"]) * ENTRY_SIZE


async def entry_of(ini: Initiator, handle: int) -> AnyStruct:
    """The table entry of ``handle`` as an RDMA Read through the Table STag shows it."""
    return await ini._entry(*entry_at(ini, handle))
