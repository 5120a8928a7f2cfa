"""Session Establishment: HELLO and HELLO_ACK, Initiator IDs, retention, RELEASE, credits."""
from __future__ import annotations

import asyncio

from ... import codec
from ...rnic.qp import ConnectionLost
from ...tables.enums import GOODBYE_FLAGS, flag
from ..context import Ctx
from ..registry import MUST, RULE, case, untestable
from .common import OP, bind, data, holds

SECTION = "Session Establishment"
RELEASE = flag(GOODBYE_FLAGS, "RELEASE")


@case("session.hello_ack.header", SECTION, RULE, """the initiator sends HELLO and the target
      answers with HELLO_ACK, both as Send messages and both starting with the common header ()
      in which Request ID, Block Handle, Generation, and Status are zero""")
async def hello_ack_header(ctx: Ctx) -> None:
    qp = await ctx.raw_qp()
    await ctx.wait(qp.send(codec.encode({"opcode": OP["HELLO"], "hello.completion_credits": 4,
                                         "hello.initiator_id": ctx.new_id()})), "the HELLO sent")
    msg = await ctx.wait(qp.recv(), "a HELLO_ACK")
    try:
        ack = codec.decode(msg.payload)
    except codec.Malformed as exc:
        ctx.check(False, "a well-formed HELLO_ACK", f"{exc}: {msg.payload.hex()}")
    ctx.check(ack["opcode"] == OP["HELLO_ACK"], "opcode HELLO_ACK (0x02)", hex(ack["opcode"]))
    ctx.check(ack["version"] == 1, "Version 1", ack["version"])
    header = {k: ack[k] for k in ("request_id", "handle", "generation", "status")}
    ctx.check(not any(header.values()), "Request ID, Block Handle, Generation and Status zero", header)
    await ctx.wait(qp.send(codec.encode({"opcode": OP["GOODBYE"], "flags": RELEASE})), "GOODBYE sent")


@case("session.initiator_id.active_rejected", SECTION, MUST, """a target MUST reject a HELLO whose
      Initiator ID belongs to a session that is still active.""")
async def active_rejected(ctx: Ctx) -> None:
    first = await ctx.connect(features=0)
    status, second = await ctx.hello_status(first.initiator_id)
    ctx.check(second is None, "the second HELLO refused (non-zero HELLO_ACK Status)",
              "HELLO_ACK Status OK: a second session with the same Initiator ID")
    if status != "ALREADY_BOUND":
        ctx.note(f"refused with {status}; the reference target uses ALREADY_BOUND (NOTES decision 6)")
    await ctx.expect(first.load(first.target.handle_base), "NOT_VALID",
                     "the first session still served after the refused HELLO")


RETENTION = """GOODBYE ends the session. With flag 0x0001 RELEASE, the target frees all handles
    bound by the initiator. Otherwise, and when a connection fails, the target keeps the
    initiator's bindings for a retention time of its choosing; an initiator that reconnects with
    the same Initiator ID within that time receives the same handle range and finds its bindings
    intact."""


async def _retained(ctx: Ctx, graceful: bool) -> None:
    a = await ctx.connect(features=0)
    h, payload = a.target.handle_base, data(200)
    r = await bind(ctx, a, h, payload)
    if graceful:
        await ctx.goodbye(a, release=False)
    else:
        await a.close()                  # the connection ends without GOODBYE
    b = await ctx.reconnect(a)
    seen = (hex(b.target.handle_base), b.target.handle_count)
    ctx.check((b.target.handle_base, b.target.handle_count) == (h, a.target.handle_count),
              f"the same handle range ({hex(h)}, {a.target.handle_count})", seen)
    await holds(ctx, b, h, payload, "after reconnecting", r.generation)


@case("session.retention.goodbye", SECTION, RULE, RETENTION)
async def retained_after_goodbye(ctx: Ctx) -> None:
    await _retained(ctx, graceful=True)


@case("session.retention.connection_lost", SECTION, RULE, RETENTION)
async def retained_after_loss(ctx: Ctx) -> None:
    await _retained(ctx, graceful=False)


@case("session.goodbye.release", SECTION, RULE, """With flag 0x0001 RELEASE, the target frees all
      handles bound by the initiator.""")
async def release(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    h = a.target.handle_base
    for k in range(3):
        await bind(ctx, a, h + k, data(16))
    await ctx.goodbye(a, release=True)
    b = await ctx.reconnect(a)
    for k in range(3):
        got, _ = await ctx.outcome(b.load(h + k, allow_unsealed=True))
        ctx.check(got != "OK", f"0x{h + k:x} no longer bound after GOODBYE with RELEASE",
                  "LOAD completed OK: the handle is still bound")
    if b.target.handle_base <= h < b.target.handle_base + b.target.handle_count:
        await ctx.ok(b.alloc_store(h, b"again"), "ALLOC_STORE to a released handle")


@case("session.hello_ack.disjoint_ranges", SECTION, RULE, """Handles of different initiators never
      overlap, so each initiator can choose handles for Unmapped Store without coordination.""")
async def disjoint_ranges(ctx: Ctx) -> None:
    a = await ctx.connect(features=0)
    b = await ctx.connect(features=0)
    ra = range(a.target.handle_base, a.target.handle_base + a.target.handle_count)
    rb = range(b.target.handle_base, b.target.handle_base + b.target.handle_count)
    ctx.check(ra.stop <= rb.start or rb.stop <= ra.start, "two disjoint handle ranges",
              f"[{ra.start:#x}, {ra.stop:#x}) and [{rb.start:#x}, {rb.stop:#x})")
    await bind(ctx, a, ra.start, b"a")
    await bind(ctx, b, rb.start, b"b")


@case("session.credits.request", SECTION, RULE, """A target pre-posts, for each request credit, a
      receive buffer (Request Credits of HELLO_ACK: requests an initiator may have outstanding)""")
async def request_credits(ctx: Ctx) -> None:
    credits = min(ctx.info.request_credits, 256)
    a = await ctx.connect(features=0, credits=credits)
    h = a.target.handle_base
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(ctx.outcome(a.load(h, allow_unsealed=True)) for _ in range(credits))), ctx.timeout)
    except (ConnectionLost, asyncio.TimeoutError) as exc:
        ctx.check(False, f"{credits} pipelined requests (the Request Credits) all completed",
                  f"{type(exc).__name__} {exc}")
    statuses = {status for status, _ in results}
    ctx.check(statuses == {"NOT_VALID"}, f"{credits} completions NOT_VALID", statuses)


untestable(SECTION, MUST, """the Initiator ID MUST be generated with at least 128 bits of entropy
           and kept secret, MUST be sent only on connections authenticated as described in""",
           "a requirement on initiators and deployments; the target cannot show it on the wire")
untestable("Allocation Quotas", MUST, "An initiator MUST NOT exceed its quota",
           "a requirement on initiators; the target's side is ops.quota.no_space")
untestable("HELLO_ACK", MUST, """If ADDR_LE is set, the initiator MUST encode the Block Handle and
           the STag, Tagged Offset, and Length fields of the Data and Completion Descriptors in
           little-endian byte order""",
           "a requirement on initiators; every case follows it when the target sets ADDR_LE")
