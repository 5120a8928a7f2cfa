"""Negotiation: a feature the HELLO_ACK did not grant is not honoured in that session.

Features are what the HELLO requested and the target offers (ADDR_LE is the target's own
choice). A session that was not granted RECORD_COMPLETION is answered with COMPLETION
messages even for requests that carry RECORD and a Completion Descriptor; one that was
not granted DIRECT_ALLOC has no ring, so a BIND in it binds nothing.
"""
from __future__ import annotations

from ...rnic import Access
from ...tables import memory as M
from ...vocab import AnyMessage, Feature, Opcode, RequestFlag, Status
from ..context import Ctx, status_name
from ..registry import RULE, case
from .common import SENTINEL, bind, data, unbound

DESCRIPTORS = {Feature.DIRECT_LOAD: ("table.stag", "pool.stag"),
               Feature.DIRECT_ALLOC: ("partition.stag", "ring.stag", "head.stag")}


@case("session.features.not_granted", "Completion", RULE, """If the target advertised
      RECORD_COMPLETION and the request has the RECORD flag, the target instead writes a 24-octet
      completion record (HELLO_ACK: Direct-mode descriptors (present per Features))""")
async def not_granted(ctx: Ctx) -> None:
    """HELLOs requesting one feature each, and none: the HELLO_ACK grants nothing more
    (bar ADDR_LE) and carries the descriptors of what it granted only. In the session
    granted nothing, a LOAD and a FREE with RECORD complete by COMPLETION message with the
    record slot untouched, and a BIND is refused and binds nothing."""
    for requested in (Feature.DIRECT_LOAD, Feature.DIRECT_ALLOC, Feature.RECORD_COMPLETION, 0):
        ini = await ctx.connect(features=requested)
        granted = ini.target.features & ~Feature.ADDR_LE
        ctx.check(not granted & ~requested, f"HELLO_ACK Features within the requested {requested:#06x} "
                  "(and ADDR_LE)", f"{ini.target.features:#06x}")
        for feature, keys in DESCRIPTORS.items():
            present = [k for k in keys if k in ini.target.fields]
            ctx.check(bool(present) == bool(granted & feature), "descriptors only for the direct modes "
                      f"granted ({granted:#06x})", f"descriptors {sorted(ini.target.fields)}")
    a = ini
    h, other = await ctx.handles(a, 2)
    payload = data(32)
    r = await bind(ctx, a, h, payload)
    dest = a.memory.register(bytearray(len(payload)), Access.REMOTE_WRITE)
    requests: tuple[tuple[str, AnyMessage], ...] = (
        ("a LOAD", {"opcode": Opcode.LOAD, "handle": h, "dd.stag": dest.stag, "dd.offset": 0,
                    "dd.length": len(payload)}),
        ("a FREE", {"opcode": Opcode.FREE, "handle": h}))
    for what, values in requests:
        slot = a.memory.register(bytearray([SENTINEL]) * M.COMPLETION_RECORD.size, Access.REMOTE_WRITE)
        got = await ctx.raw(a, ctx.encode(a, {**values, "flags": RequestFlag.RECORD, "cd.stag": slot.stag,
                                              "cd.offset": 0, "cd.reserved": 0}))
        ctx.check(bool(got) and got[0][0] is not None and not got[0][1].write_imm,
                  f"{what} with RECORD in a session not granted RECORD_COMPLETION: a COMPLETION message",
                  "none" if not got else "a completion record" if got[0][1].write_imm else "something else")
        c = got[0][0]
        assert c is not None                     # the check above ended the case otherwise
        ctx.check(c["opcode"] == Opcode.COMPLETION and c["status"] == Status.OK, f"{what}: COMPLETION OK",
                  f"opcode {c['opcode']:#x}, {status_name(c['status'])}")
        ctx.check(bytes(slot.view) == bytes([SENTINEL]) * len(slot.view),
                  f"{what}: the Completion Descriptor's slot untouched", "octets written into it")
    ctx.check(bytes(dest.view) == payload, "the LOAD's data", "other octets")
    status, _ = await ctx.outcome(a.bind(other, 0, 0, r.block_offset))
    ctx.check(status != "OK", "a BIND in a session not granted DIRECT_ALLOC refused", "completed OK")
    await unbound(ctx, a, other, "after a BIND in a session not granted DIRECT_ALLOC")
