"""Security Considerations: no target STag in the default mode, freed blocks cleared."""
from __future__ import annotations

from ...initiator.client import ALL_FEATURES
from ...vocab import EntryFlag, Feature
from ..context import Ctx
from ..registry import MUST, RULE, SHOULD, case, untestable
from .common import bind, data, entry_of
from .direct import REFUSED, remote_access

SECTION = "Security Considerations"
CHUNK = 64           # octets compared at a time: a cleared part never equals random ones by chance
GRANTS = {"table": "read", "pool": "read", "ring": "read", "partition": "write", "head": "atomic"}


@case("security.default_mode.no_stag", SECTION, RULE, """In the default mode, the target exposes no
      STag of its own memory to initiators: all access to the block pool, the table, and the ring
      is performed by the target after validation.""")
async def no_stag(ctx: Ctx) -> None:
    b = await ctx.connect(features=0)
    ctx.check(not b.target.features & (Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC) and not b.target.fields,
              "a HELLO_ACK without direct modes or descriptors for a HELLO that requested none",
              f"Features {b.target.features:#06x}, descriptors {sorted(b.target.fields)}")
    if not ctx.info.features & (Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC):
        return
    a = await ctx.connect(features=ALL_FEATURES)
    intruder = b
    for key, right in GRANTS.items():
        if f"{key}.stag" not in a.target.fields:
            continue
        stag, offset = a.target.fields[f"{key}.stag"], a.target.fields[f"{key}.offset"]
        if intruder.qp.closed:             # one intruder, reconnecting after each refusal
            intruder = await ctx.reconnect(intruder)
        access = {"read": lambda: intruder.qp.read(stag, offset, 16),
                  "write": lambda: intruder.qp.write(stag, offset, b"intruder"),
                  "atomic": lambda: intruder.qp.fetch_add(stag, offset, 1)}[right]()
        seen = await remote_access(ctx, intruder, access)
        ctx.check(seen == REFUSED, f"a default-mode session's {right} through the {key} STag of "
                  "another session refused", seen)


@case("security.clear_freed", SECTION, SHOULD, """targets SHOULD clear blocks when they are freed if
      the blocks may be allocated to initiators of a different trust domain.""", features=Feature.DIRECT_LOAD)
async def clear_freed(ctx: Ctx) -> None:
    """Whole blocks of secret octets, then a STORE of one octet to each (its Data Length now
    1); one freed by FREE, the other by GOODBYE with RELEASE: read through the Pool STag,
    no part of either block's Block Size still holds its secret (a target that clears a
    freed block only up to its Data Length, or only on FREE, leaves the rest)."""
    a = await ctx.connect(features=0)
    size = a.target.block_size
    blocks = []
    for h in await ctx.handles(a, 2):
        secret = data(size)
        r = await bind(ctx, a, h, secret, seal=False, inline=False)
        await ctx.ok(a.store(h, b"s"), "STORE of one octet (Data Length 1)")
        blocks.append((h, r.block_offset, secret))
    await ctx.ok(a.free(h), "FREE")
    await ctx.goodbye(a, release=True)
    c = await ctx.connect(need=Feature.DIRECT_LOAD)
    pool = c.target.fields["pool.stag"]
    for (handle, offset, secret), how in zip(blocks, ("GOODBYE with RELEASE", "FREE")):
        entry = await ctx.wait(entry_of(c, handle), f"an RDMA Read of the entry of the handle freed by {how}")
        if entry["entry.flags"] & EntryFlag.VALID:
            ctx.note(f"the handle {how} should have freed is still bound: session.goodbye.release "
                     "judges that; its block's clearing is not judged")
            continue
        seen = await ctx.wait(c.qp.read(pool, offset, size), f"an RDMA Read of the block freed by {how}")
        kept = [i for i in range(1, size, CHUNK) if seen[i:i + CHUNK] == secret[i:i + CHUNK]]   # past the octet
        ctx.check(not kept, f"the whole block freed by {how} ({size} octets) cleared (read through the Pool "
                  "STag)", f"its data still there in {len(kept)} of its {CHUNK}-octet parts, from offset "
                  f"{kept[0] if kept else 0}")

untestable(SECTION, SHOULD, """it SHOULD use STags that are valid for a single request and SHOULD
           request INVALIDATE so that they are revoked by the completion.""",
           "a recommendation for initiators; the checker's own initiator follows it")
untestable(SECTION, SHOULD, "Connections SHOULD be confined to a trusted network or protected with IPsec",
           "a deployment recommendation")
untestable("RDMAP Binding", MUST, "when the network is not trusted, IPsec MUST be used as specified there.",
           "a deployment requirement below the RDMA layer")
untestable("Operational Considerations", SHOULD, """Implementations SHOULD expose counters per
           operation and status, ring occupancy, and quota use per initiator.""",
           "counters are exposed out of band, not over KBTP")


@case("binding.mpa.enhanced", "RDMAP Binding", SHOULD, "Peers SHOULD use the enhanced connection "
      "establishment of .", transport="iwarp")
async def mpa_enhanced(ctx: Ctx) -> None:
    """The checker's MPA Request is revision 2 with the IRD and ORD of RFC 6581: the
    target's Reply answers in kind."""
    a = await ctx.connect(features=0)
    reply = getattr(a.qp, "peer_startup", None)
    if reply is None:
        ctx.skip("the MPA exchange was the RDMA device's own (verbs), not seen by the checker")
        return
    ctx.check(reply.rev == 2 and reply.enhanced, "an MPA Reply of revision 2 with RFC 6581's IRD and ORD",
              f"revision {reply.rev}" + ("" if reply.enhanced else ", without IRD and ORD"))
