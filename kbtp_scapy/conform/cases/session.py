"""Session Establishment: HELLO and HELLO_ACK, Initiator IDs, retention, RELEASE, credits."""
from __future__ import annotations

import asyncio

from ... import codec
from ...initiator import Initiator
from ...rnic import Access
from ...rnic.qp import ConnectionLost, RemoteError
from ...vocab import Feature, GoodbyeFlag, Opcode, RequestFlag, Status
from ..context import Ctx, status_name
from ..hold import SETTLE
from ..registry import MUST, RULE, case, untestable
from .common import bind, buffer, data, holds, load_request
from .ops import quota_of

SECTION = "Session Establishment"


@case("session.hello_ack.header", SECTION, RULE, """the initiator sends HELLO and the target
      answers with HELLO_ACK, both as Send messages and both starting with the common header ()
      in which Request ID, Block Handle, Generation, and Status are zero""")
async def hello_ack_header(ctx: Ctx) -> None:
    qp = await ctx.raw_qp()
    await ctx.wait(qp.send(codec.encode({"opcode": Opcode.HELLO, "hello.completion_credits": 4,
                                         "hello.initiator_id": ctx.new_id()})), "the HELLO sent")
    msg = await ctx.wait(qp.recv(), "a HELLO_ACK")
    try:
        ack = codec.decode(msg.payload)
    except codec.Malformed as exc:
        ctx.check(False, "a well-formed HELLO_ACK", f"{exc}: {msg.payload.hex()}")
    ctx.check(ack["opcode"] == Opcode.HELLO_ACK, "opcode HELLO_ACK (0x02)", hex(ack["opcode"]))
    ctx.check(ack["version"] == 1, "Version 1", ack["version"])
    if ack["status"]:                # "Status reports an error in HELLO_ACK": a refusal is allowed
        ctx.note(f"the HELLO was refused ({status_name(ack['status'])}), so only Request ID, Block "
                 "Handle and Generation were checked")
    header = {k: ack[k] for k in ("request_id", "handle", "generation")}
    ctx.check(not any(header.values()), "Request ID, Block Handle and Generation zero", header)
    if not ack["status"]:
        ctx.check(not ack["status"], "Status zero", ack["status"])
        await ctx.wait(qp.send(codec.encode({"opcode": Opcode.GOODBYE, "flags": GoodbyeFlag.RELEASE})), "GOODBYE sent")


@case("session.hello.version", SECTION, RULE, """Version is 1. (Session Establishment: the initiator
      sends HELLO and the target answers with HELLO_ACK ... (Status reports an error in HELLO_ACK))""")
async def hello_version(ctx: Ctx) -> None:
    """HELLOs that are well formed but for their Version (0, 2, 255): each is refused, by a
    HELLO_ACK with a non-zero Status or by closing the connection; none is granted a session."""
    for version in (0, 2, 0xFF):
        qp = await ctx.raw_qp()
        hello = codec.encode({"opcode": Opcode.HELLO, "hello.completion_credits": 4,
                              "hello.initiator_id": ctx.new_id()})
        await ctx.wait(qp.send(bytes([version]) + hello[1:]), "the HELLO sent")
        try:
            msg = await asyncio.wait_for(qp.recv(), ctx.timeout)
        except TimeoutError:
            ctx.check(False, f"a HELLO with Version {version} refused (a HELLO_ACK with an error Status, "
                      "or the connection closed)", f"nothing within {ctx.timeout:g} s")
        except (ConnectionLost, RemoteError):    # the connection closed: refused
            continue
        try:
            ack = codec.decode(msg.payload)
        except codec.Malformed:
            continue                  # not a HELLO_ACK granting anything
        ctx.check(ack["opcode"] != Opcode.HELLO_ACK or ack["status"] != Status.OK,
                  f"a HELLO with Version {version} refused (a HELLO_ACK with an error Status, or the "
                  "connection closed)", "HELLO_ACK Status OK: a session granted")
        await qp.close()


@case("session.initiator_id.active_rejected", SECTION, MUST, """a target MUST reject a HELLO whose
      Initiator ID belongs to a session that is still active.""")
async def active_rejected(ctx: Ctx) -> None:
    first = await ctx.connect(features=0)
    h = await ctx.handle(first)
    status, second = await ctx.hello_status(first.initiator_id)
    ctx.check(second is None, "the second HELLO refused (non-zero HELLO_ACK Status)",
              "HELLO_ACK Status OK: a second session with the same Initiator ID")
    if status != "ALREADY_BOUND":
        ctx.note(f"refused with {status}; the reference target uses ALREADY_BOUND (NOTES decision 6)")
    await ctx.expect(first.load(h), "NOT_VALID", "the first session still served after the refused HELLO")


RETENTION = """GOODBYE ends the session. With flag 0x0001 RELEASE, the target frees all handles
    bound by the initiator. Otherwise, and when a connection fails, the target keeps the
    initiator's bindings for a retention time of its choosing; an initiator that reconnects with
    the same Initiator ID within that time receives the same handle range and finds its bindings
    intact."""


async def _retained(ctx: Ctx, graceful: bool) -> None:
    a = await ctx.connect(features=0)
    h, payload = await ctx.handle(a), data(200)
    r = await bind(ctx, a, h, payload)
    if graceful:
        await ctx.goodbye(a, release=False)
    else:
        await a.close()                  # the connection ends without GOODBYE
    b = await ctx.reconnect(a)
    seen = (hex(b.target.handle_base), b.target.handle_count)
    ctx.check((b.target.handle_base, b.target.handle_count) == (a.target.handle_base, a.target.handle_count),
              f"the same handle range ({a.target.handle_base:#x}, {a.target.handle_count})", seen)
    await holds(ctx, b, h, payload, "after reconnecting", r.generation)


@case("session.retention.goodbye", SECTION, RULE, RETENTION)
async def retained_after_goodbye(ctx: Ctx) -> None:
    await _retained(ctx, graceful=True)


@case("session.retention.connection_lost", SECTION, RULE, RETENTION)
async def retained_after_loss(ctx: Ctx) -> None:
    await _retained(ctx, graceful=False)


async def _allocated(ctx: Ctx, ini: Initiator, hs: list[int], what: str) -> list[int]:
    """The Block Offsets of ALLOC_STOREs of ``ini`` to ``hs`` that must complete OK."""
    results = await ctx.wait(asyncio.gather(*(ctx.ok(ini.alloc_store(h, data(16)), f"ALLOC_STORE {what}")
                                              for h in hs)), f"{len(hs)} ALLOC_STOREs")
    return [r.block_offset for r in results]


@case("session.retention.partition", SECTION, RULE, f"""{RETENTION} (For DIRECT_ALLOC, the target
      instead gives each initiator its own ring and Head counter over a partition of the pool whose
      size equals the initiator's quota, so that every ticket on that ring belongs to that
      initiator. With these rules no block is ever lost or handed out twice.)""",
      features=Feature.DIRECT_ALLOC)
async def retained_partition(ctx: Ctx) -> None:
    """One block bound from a DIRECT_ALLOC session's partition (exactly one: the smallest
    usage that must keep the partition), GOODBYE without RELEASE, and a reconnect that asks
    for DIRECT_ALLOC again: the block is still bound, and neither the rest of the quota nor
    the whole quota of a second session is allocated from it."""
    a = await ctx.connect(features=Feature.DIRECT_ALLOC, need=Feature.DIRECT_ALLOC)
    q = quota_of(ctx, a, 0)
    (h, *rest), payload = await ctx.handles(a, q), data(200)   # all at once: none is freed for another
    r = await bind(ctx, a, h, payload)
    await ctx.goodbye(a, release=False)
    b = await ctx.reconnect(a, features=Feature.DIRECT_ALLOC)
    await holds(ctx, b, h, payload, "after reconnecting", r.generation)
    c = await ctx.connect(features=Feature.DIRECT_ALLOC)
    others = await ctx.handles(c, quota_of(ctx, c, 0))
    for ini, hs, who in ((b, rest, "the reconnected session's other quota"),
                         (c, others, "a second session's quota")):
        offsets = await _allocated(ctx, ini, hs, f"of {who}")
        ctx.check(r.block_offset not in offsets, f"{who} allocated without the block "
                  f"{r.block_offset:#x} still bound to 0x{h:x}", "that block allocated again")
        await holds(ctx, b, h, payload, f"after {who} was allocated", r.generation)


@case("session.goodbye.release", SECTION, RULE, """With flag 0x0001 RELEASE, the target frees all
      handles bound by the initiator.""")
async def release(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    hs = await ctx.handles(a, 3)
    for h in hs:
        await bind(ctx, a, h, data(16))
    await ctx.goodbye(a, release=True)
    b = await ctx.reconnect(a)
    for h in hs:
        got, _ = await ctx.outcome(b.load(h, allow_unsealed=True))
        ctx.check(got != "OK", f"0x{h:x} no longer bound after GOODBYE with RELEASE",
                  "LOAD completed OK: the handle is still bound")
    if b.target.handle_base <= hs[0] < b.target.handle_base + b.target.handle_count:
        await ctx.ok(b.alloc_store(hs[0], b"again"), "ALLOC_STORE to a released handle")


@case("session.hello_ack.disjoint_ranges", SECTION, RULE, """Handles of different initiators never
      overlap, so each initiator can choose handles for Unmapped Store without coordination.""")
async def disjoint_ranges(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    b = await ctx.connect(features=0)
    ra = range(a.target.handle_base, a.target.handle_base + a.target.handle_count)
    rb = range(b.target.handle_base, b.target.handle_base + b.target.handle_count)
    ctx.check(ra.stop <= rb.start or rb.stop <= ra.start, "two disjoint handle ranges",
              f"[{ra.start:#x}, {ra.stop:#x}) and [{rb.start:#x}, {rb.stop:#x})")
    await bind(ctx, a, await ctx.handle(a), b"a")
    await bind(ctx, b, await ctx.handle(b), b"b")


@case("session.credits.request", SECTION, RULE, """A target pre-posts, for each request credit, a
      receive buffer (Request Credits of HELLO_ACK: requests an initiator may have outstanding)""")
async def request_credits(ctx: Ctx) -> None:
    """Every credit in use at once: the first request, an ALLOC_STORE, waits for data the
    checker does not send yet, so no buffer can come back before the last request arrives;
    a missing buffer shows as an RNR NAK (RoCEv2, which the RNIC would retry silently) or
    a Terminate (iWARP)."""
    a = await ctx.connect(features=0, credits=min(ctx.info.request_credits, 256))
    await all_credits_outstanding(ctx, a)


@case("session.credits.completion", "HELLO", RULE, """Completion Credits is the number of receive
      buffers the initiator has posted for COMPLETION messages.""")
async def completion_credits(ctx: Ctx) -> None:
    """HELLOs announcing 1 and 3 Completion Credits, with exactly that many receive buffers
    posted: the HELLO_ACK grants no more Request Credits than that, and with every Request
    Credit granted in use at once and no buffer posted again meanwhile, each request gets
    exactly one COMPLETION and nothing arrives without a buffer (which would be an RNR NAK
    on RoCEv2, a Terminate on iWARP)."""
    for credits in (1, 3):
        a = await ctx.connect(features=0, credits=credits)
        granted = a.target.request_credits
        ctx.check(granted <= credits, f"HELLO_ACK Request Credits at most the HELLO's {credits} Completion "
                  "Credits", granted)
        got: list = []
        a.qp.on_receive(got.append)             # the buffers stay used: none is posted again
        naks = a.qp.stats.get("rnr_naks_sent", 0)
        ctx.send(a, [load_request(ctx, a, a.target.handle_base, buffer(a, 64), RequestFlag.ALLOW_UNSEALED)
                     for _ in range(granted)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ctx.timeout
        while len(got) < granted and loop.time() < deadline and not a.qp.closed:
            await asyncio.sleep(0.01)
        await asyncio.sleep(SETTLE)             # anything more would find no buffer
        refused = a.qp.stats.get("rnr_naks_sent", 0) - naks
        when = f"with {credits} Completion Credits and {granted} requests (the Request Credits) outstanding"
        ctx.check(not a.qp.closed and not refused, f"no message without a receive buffer {when}",
                  "the connection terminated" if a.qp.closed else f"{refused} RNR NAK(s) sent")
        ctx.check(len(got) == granted, f"exactly one COMPLETION per request {when}", f"{len(got)} messages")
        a.qp.post_recv(granted)
        await ctx.goodbye(a, release=True)


async def all_credits_outstanding(ctx: Ctx, a: Initiator, when: str = "") -> None:
    """Every credit of ``a`` in use at once, the first request held on its RDMA Read."""
    credits = min(a.target.request_credits, a.completion_credits)
    h, loaded = await ctx.handles(a, 2)
    payload = data(min(a.target.block_size, 256))
    await bind(ctx, a, loaded, payload)
    source = a.memory.register(bytearray(payload), Access.REMOTE_READ)
    first = ctx.encode(a, {"opcode": Opcode.ALLOC_STORE, "handle": h, "dd.stag": source.stag,
                           "dd.offset": 0, "dd.length": len(payload)})
    loads = [load_request(ctx, a, loaded, buffer(a, len(payload))) for _ in range(credits - 1)]
    hold = ctx.hold_reads(a)
    naks = a.qp.stats.get("rnr_naks", 0)
    hold.hold()
    try:
        ctx.send(a, [first])
        if not await hold.wait_requested(ctx.timeout):
            ctx.check(False, "an RDMA Read of the data of a non-inline ALLOC_STORE",
                      f"none within {ctx.timeout:g} s")
        ctx.send(a, loads)
        await asyncio.sleep(SETTLE)
        refused = a.qp.stats.get("rnr_naks", 0) - naks
    finally:
        hold.release()
    ctx.check(not a.qp.closed, f"{credits} requests (the Request Credits) outstanding at once{when}, "
              "each in a receive buffer", "the connection terminated (no receive buffer for a request)")
    ctx.check(not refused, f"{credits} requests (the Request Credits) outstanding at once{when}, each "
              "in a receive buffer", f"{refused} RNR NAK(s): a request found no receive buffer")
    got = await ctx.collect(a, credits)
    statuses = [status_name(c["status"]) if c else "no COMPLETION" for c in got]
    ctx.check(statuses == ["OK"] * credits, f"{credits} completions OK{when}", statuses)
    for handle in (h, loaded):
        await ctx.ok(a.free(handle), f"FREE of 0x{handle:x}{when}")


untestable(SECTION, MUST, """the Initiator ID MUST be generated with at least 128 bits of entropy
           and kept secret, MUST be sent only on connections authenticated as described in""",
           "a requirement on initiators and deployments; the target cannot show it on the wire")
untestable("Allocation Quotas", MUST, "An initiator MUST NOT exceed its quota",
           "a requirement on initiators; the target's side is ops.quota.no_space")
untestable("HELLO_ACK", MUST, """If ADDR_LE is set, the initiator MUST encode the Block Handle and
           the STag, Tagged Offset, and Length fields of the Data and Completion Descriptors in
           little-endian byte order""",
           "a requirement on initiators; every case follows it when the target sets ADDR_LE")
