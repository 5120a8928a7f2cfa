"""``kbtp conform``: the whole suite passes against the reference target on both bindings,
and every case fails against a reference target with the matching bug planted.

Bugs are planted from the test, never in the target's source: executor handlers and
hooks are replaced in the target's own thread, class methods with ``monkeypatch``. Each
planted run selects its one case with ``--only``.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import xml.etree.ElementTree as ET

import pytest

from kbtp_scapy import codec
from kbtp_scapy.cli import main
from kbtp_scapy.conform.registry import all_cases
from kbtp_scapy.rnic import Access
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.target import connection as conn_mod
from kbtp_scapy.target import direct as direct_mod
from kbtp_scapy.target import table as table_mod
from kbtp_scapy.target.connection import Connection
from kbtp_scapy.target.operations import Executor, Outcome
from kbtp_scapy.target.server import Target
from kbtp_scapy.target.sessions import Initiator, Sessions
from kbtp_scapy.target.table import SEALED, BlockTable, Entry
from kbtp_scapy.tables.enums import OPCODES, REQUEST_FLAGS

from .kbtp_harness import TargetThread

OP = OPCODES.by_name()
F = {f.name: f.value for f in REQUEST_FLAGS.flags}
_net = itertools.count(1)


def make(transport: str, **config) -> TargetThread:
    n = next(_net)
    base = dict(blocks=128, block_size=4096, max_initiators=8, ticket_timeout_ms=300, retention_s=30)
    return TargetThread(transport, TargetConfig(**{**base, **config}),
                        hosts=[f"127.51.{n}.1", f"127.51.{n}.2"])


def conform(t: TargetThread, tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    local = ["--local", t.initiator_hosts[0]] if t.transport == "roce" else []
    code = main(["conform", "--target", t.url, *local, "--timeout", "5", "-q", "--json", str(out), *args])
    return code, json.loads(out.read_text())


# -- the whole suite against the reference target -------------------------------------------

@pytest.fixture(scope="module", params=["iwarp", "roce"])
def suite(request, tmp_path_factory):
    t = make(request.param)
    tmp = tmp_path_factory.mktemp(f"conform-{request.param}")
    try:
        code, doc = conform(t, tmp, "--junit", str(tmp / "junit.xml"), "--pcap-dir", str(tmp / "pcaps"))
    finally:
        t.stop()
    return request.param, code, doc, tmp


def test_suite_passes_against_the_reference(suite):
    transport, code, doc, tmp = suite
    bad = {c["id"]: (c["verdict"], c["expected"], c["seen"], c["detail"])
           for c in doc["cases"] if c["verdict"] not in ("PASS", "SKIP")}
    assert code == 0 and not bad, bad
    skipped = {c["id"] for c in doc["cases"] if c["verdict"] == "SKIP"}
    other = "completion.record.write_imm" if transport == "iwarp" else "completion.record.rdmap"
    assert skipped == {other}
    assert {c["id"] for c in doc["cases"]} == {c.id for c in all_cases()}
    assert not (tmp / "pcaps").exists()          # pcaps only for cases that did not pass


def test_reports_are_well_formed(suite):
    _, _, doc, tmp = suite
    suite_xml = ET.parse(tmp / "junit.xml").getroot()
    assert suite_xml.tag == "testsuite" and int(suite_xml.get("tests")) == len(doc["cases"])
    assert int(suite_xml.get("failures")) == 0 and int(suite_xml.get("errors")) == 0
    assert len(suite_xml.findall("testcase")) == len(doc["cases"])
    assert doc["exit_code"] == 0 and doc["summary"]["FAIL"] == 0
    assert doc["coverage"]["cases"] == len(doc["cases"]) and doc["coverage"]["not_checkable"]
    for c in doc["cases"]:
        assert c["requirement"] and c["level"] in ("MUST", "MUST NOT", "SHOULD", "RULE")


def test_every_case_has_a_planted_bug():
    assert {c.id for c in all_cases()} == set(PLANTS)


# -- planted bugs ----------------------------------------------------------------------------

def set_handler(t: TargetThread, opcode: str, wrap) -> None:
    """Replace one opcode's handler of the target's executor (in the target's thread)."""
    ex = t.target.executor
    original = Executor._handlers[OP[opcode]]
    t.run(lambda: setattr(ex, "_handlers", {**ex._handlers, OP[opcode]: wrap(original)}))


def wrap_method(monkeypatch, cls, name: str, make_wrapper) -> None:
    monkeypatch.setattr(cls, name, make_wrapper(getattr(cls, name)))


def hello_ack_body(change):
    def wrapper(original):
        async def hello_ack(self, status, body):
            if body:
                change(self, body)
            await original(self, status, body)
        return hello_ack
    return wrapper


def complete_with(change):
    def wrapper(original):
        def complete(self, req, outcome, why=""):
            original(self, change(dict(req)), outcome, why)
        return complete
    return wrapper


class CodecShim:
    """The connection module's codec with ``decode`` replaced."""

    def __init__(self, decode):
        self.decode = decode

    def __getattr__(self, name):
        return getattr(codec, name)


def shim_decode(monkeypatch, fix):
    monkeypatch.setattr(conn_mod, "codec", CodecShim(lambda buf, le=False: fix(bytes(buf), le)))


def grant(monkeypatch, name: str, change):
    original = getattr(conn_mod, name)

    def granted(*args):
        fields, windows = original(*args)
        change(args, fields, windows)
        return fields, windows
    monkeypatch.setattr(conn_mod, name, granted)


def if_entry(predicate, then):
    """A handler wrapper: ``then`` when ``predicate(entry, req)``, else the real handler."""
    def wrapper(original):
        async def handler(self, conn, req, fetch=None):
            entry = self.table.read(req["handle"])
            if predicate(entry, req):
                return await then(self, conn, req, entry, original, fetch)
            return await original(self, conn, req, fetch)
        return handler
    return wrapper


async def _ok(self, conn, req, entry, original, fetch):
    return Outcome(0, entry.generation, 0, entry.block_offset)


def _flags(mask_off=0, mask_on=0):
    def wrapper(original):
        async def handler(self, conn, req, fetch=None):
            req["flags"] = (req["flags"] & ~mask_off) | mask_on
            return await original(self, conn, req, fetch)
        return handler
    return wrapper


def plant_order(t, mp):
    held = []

    def wrapper(original):
        def complete(self, req, outcome, why=""):
            if req["opcode"] == OP["LOAD"] and not held:
                held.append((req, outcome, why))
                return
            original(self, req, outcome, why)
            while held:
                original(self, *held.pop())
        return complete
    wrap_method(mp, Connection, "_complete", wrapper)


def plant_valid_before_data(t, mp):
    """ALLOC_STORE that writes the entry first and the data a little later."""
    def wrapper(original):
        async def alloc_store(self, conn, req, fetch=None):
            data = await self._data(conn, req, req["dd.length"], fetch)
            _, block = await conn.ring.allocate()
            bound = self.table.bind(req["handle"], block, len(data), bool(req["flags"] & F["SEAL"]))
            conn.state.bound.add(req["handle"])
            await asyncio.sleep(0.05)
            self.memory.block(block, len(data))[:] = data
            return Outcome(0, bound.generation, len(data), block)
        return alloc_store
    set_handler(t, "ALLOC_STORE", wrapper)


def plant_late_data(t, mp):
    def wrapper(original):
        async def load(self, conn, req, fetch=None):
            e = self.table.read(req["handle"])
            data = bytes(self.memory.block(e.block_offset, e.data_length))
            asyncio.get_running_loop().call_later(
                0.3, lambda: conn.qp.write(req["dd.stag"], req["dd.offset"], data, signaled=False))
            return Outcome(0, e.generation, e.data_length, e.block_offset)
        return load
    set_handler(t, "LOAD", wrapper)


async def _truncating_load(self, conn, req, entry, original, fetch):
    n = req["dd.length"]
    conn.qp.write(req["dd.stag"], req["dd.offset"], bytes(self.memory.block(entry.block_offset, n)),
                  signaled=False)
    return Outcome(0, entry.generation, n, entry.block_offset)


async def _overwrite_bound(self, conn, req, entry, original, fetch):
    self.table.unbind(req["handle"])
    conn.state.bound.discard(req["handle"])
    self.release_block(entry.block_offset)
    return await original(self, conn, req, fetch)


async def _unseal_first(self, conn, req, entry, original, fetch):
    self.table.write(req["handle"], Entry(entry.flags & ~SEALED, entry.generation, entry.data_length,
                                          entry.block_offset))
    return await original(self, conn, req, fetch)


async def _write_then_check(self, conn, req, entry, original, fetch):
    data = req.get("inline_data", b"")
    self.memory.block(entry.block_offset, len(data))[:] = data
    return await original(self, conn, req, fetch)


def plant_no_generation_check(t, mp):
    ex = t.target.executor

    def entry(req, own):
        h = req["handle"]
        if h not in ex.table or (own is not None and not own.owns(h)):
            from kbtp_scapy.target.operations import Failed
            raise Failed("INVALID_HANDLE")
        return ex.table.read(h)
    t.run(lambda: setattr(ex, "_entry", entry))


def plant_corrupt_data(t, mp):
    ex = t.target.executor
    original = ex._data

    async def data(conn, req, length, fetch):
        d = await original(conn, req, length, fetch)
        return d[:-1] + bytes([d[-1] ^ 1]) if d else d
    t.run(lambda: setattr(ex, "_data", data))


def plant_bind_any_offset(t, mp):
    def wrapper(original):
        async def bind(self, conn, req, fetch=None):
            ring = conn.state.partition.ring
            block = ring.ready(req["bind.ticket"], ring.offset_of(req["bind.ticket"]))
            if block is not None:
                req["bind.block_offset"] = block
            return await original(self, conn, req, fetch)
        return bind
    set_handler(t, "BIND", wrapper)


def plant_bind_length(t, mp):
    def wrapper(original):
        async def bind(self, conn, req, fetch=None):
            req["bind.data_length"] = 0
            return await original(self, conn, req, fetch)
        return bind
    set_handler(t, "BIND", wrapper)


def plant_wider_partition(t, mp):
    def change(args, fields, windows):
        memory, _, qp = args
        w = windows[0]
        memory.memory.deregister(w.stag)
        wide = memory.memory.register(memory.pool, Access.REMOTE_WRITE, start=w.start,
                                      length=w.length + memory.block_size, base=w.base, connection=qp)
        fields["hello_ack.partition.stag"], windows[0] = wide.stag, wide
    grant(mp, "grant_partition", change)


def plant_load_offset(t, mp):
    def wrapper(original):
        async def load(self, conn, req, fetch=None):
            out = await original(self, conn, req, fetch)
            out.block_offset += self.block_size
            return out
        return load
    set_handler(t, "LOAD", wrapper)


def plant_credits(t, mp):
    def change(self, body):
        body["hello_ack.request_credits"] = 64
    wrap_method(mp, Connection, "_hello_ack", hello_ack_body(change))


def plant_abandon_keeps_window(t, mp):
    def wrapper(original):
        def abandon(self, ticket):
            self.windows = []
            original(self, ticket)
        return abandon
    wrap_method(mp, direct_mod.TicketWatch, "_abandon", wrapper)


def plant_hello_ack_request_id(t, mp):
    async def hello_ack(self, status, body):
        await self.qp.send(codec.encode({"opcode": OP["HELLO_ACK"], "status": status, "request_id": 1,
                                         "hello_ack.features": 0, **body}))
    mp.setattr(Connection, "_hello_ack", hello_ack)


def plant_admit_active(t, mp):
    def wrapper(original):
        def admit(self, ident, want):
            known = self.by_id.get(ident)
            if known is not None:
                known.active = False
            return original(self, ident, want)
        return admit
    wrap_method(mp, Sessions, "admit", wrapper)


def _not_valid(entry, req):
    return not entry.valid


PLANTS = {
    "session.hello_ack.header": plant_hello_ack_request_id,
    "session.initiator_id.active_rejected": plant_admit_active,
    "session.retention.goodbye": lambda t, mp: wrap_method(
        mp, Sessions, "detach", lambda o: lambda self, state, release: o(self, state, True)),
    "session.retention.connection_lost": lambda t, mp: wrap_method(
        mp, Sessions, "detach", lambda o: lambda self, state, release: o(self, state, True)),
    "session.goodbye.release": lambda t, mp: t.run(lambda: setattr(t.target.sessions, "_release", lambda s: None)),
    "session.hello_ack.disjoint_ranges": lambda t, mp: wrap_method(mp, Connection, "_hello_ack", hello_ack_body(
        lambda self, body: body.update({"hello_ack.handle_base": self.target.config.base_handle}))),
    "session.credits.request": plant_credits,
    "ops.header.version": lambda t, mp: shim_decode(mp, lambda b, le: codec.decode(b[:1] and b"\x01" + b[1:], le)),
    "ops.header.opcode": lambda t, mp: shim_decode(
        mp, lambda b, le: codec.decode(b[:1] + b"\x12" + b[2:] if b[1:2] == b"\x7e" else b, le)),
    "ops.header.length": lambda t, mp: shim_decode(
        mp, lambda b, le: codec.decode(b + bytes(7) if b[1:2] == b"\x12" and len(b) == 45 else b, le)),
    "ops.handle.own_range": lambda t, mp: mp.setattr(Initiator, "owns", lambda self, h: True),
    "ops.handle.outside_table": lambda t, mp: mp.setattr(BlockTable, "__contains__", lambda self, h: True),
    "ops.generation.stale": plant_no_generation_check,
    "ops.load.not_valid": lambda t, mp: set_handler(t, "LOAD", if_entry(_not_valid, _ok)),
    "ops.load.not_sealed": lambda t, mp: set_handler(t, "LOAD", _flags(mask_on=F["ALLOW_UNSEALED"])),
    "ops.load.too_large": lambda t, mp: set_handler(t, "LOAD", if_entry(
        lambda e, req: e.valid and e.data_length > req["dd.length"], _truncating_load)),
    "ops.store.too_large": lambda t, mp: t.run(
        lambda: setattr(t.target.executor, "_store_length", lambda req: req["dd.length"])),
    "ops.store.not_valid": lambda t, mp: set_handler(t, "STORE", if_entry(_not_valid, _ok)),
    "ops.store.sealed": lambda t, mp: set_handler(t, "STORE", if_entry(lambda e, r: e.sealed, _unseal_first)),
    "ops.store.seal_flag": lambda t, mp: set_handler(t, "STORE", _flags(mask_off=F["SEAL"])),
    "ops.store.data": plant_corrupt_data,
    "ops.unmapped_store.already_bound": lambda t, mp: set_handler(
        t, "ALLOC_STORE", if_entry(lambda e, r: e.valid, _overwrite_bound)),
    "ops.unmapped_store.completion": plant_load_offset,
    "ops.free.not_valid": lambda t, mp: set_handler(t, "FREE", if_entry(_not_valid, _ok)),
    "ops.free.unbinds": lambda t, mp: set_handler(t, "FREE", if_entry(lambda e, r: True, _ok)),
    "ops.no_side_effect": lambda t, mp: set_handler(t, "STORE", if_entry(
        lambda e, r: e.sealed and r["flags"] & F["INLINE"], _write_then_check)),
    "ops.quota.no_space": lambda t, mp: mp.setattr(Initiator, "usage", property(lambda s: 0)),
    "generation.never_zero": lambda t, mp: mp.setattr(table_mod, "next_generation", lambda g: (g + 1) % 2),
    "generation.next": lambda t, mp: mp.setattr(table_mod, "next_generation", lambda g: g % 0xFFFF + 2),
    "completion.request_id": lambda t, mp: wrap_method(mp, Connection, "_complete", complete_with(
        lambda req: {**req, "request_id": req["request_id"] ^ 1})),
    "completion.order": plant_order,
    "completion.invalidate": lambda t, mp: wrap_method(mp, Connection, "_complete", complete_with(
        lambda req: {**req, "flags": req["flags"] & ~F["INVALIDATE"]})),
    "completion.load_data": plant_late_data,
    "direct.load.data_before_valid": plant_valid_before_data,
    "completion.record.rdmap": lambda t, mp: mp.setattr(Target, "offered_features",
                                                        lambda self, qp: self.config.features),
    "completion.record.write_imm": lambda t, mp: wrap_method(mp, Connection, "_complete", complete_with(
        lambda req: {**req, "flags": req["flags"] & ~F["RECORD"]})),
    "direct.load.entry_and_block": lambda t, mp: grant(mp, "grant_direct_load", lambda a, f, w: f.update(
        {"hello_ack.table_base_handle": f["hello_ack.table_base_handle"] + 1})),
    "direct.load.read_only": lambda t, mp: grant(mp, "grant_direct_load", lambda a, f, w: setattr(
        w[1], "access", w[1].access | Access.REMOTE_WRITE)),
    "direct.alloc.atomics": lambda t, mp: grant(mp, "grant_partition", lambda a, f, w: setattr(
        w[2], "access", Access.REMOTE_READ)),
    "direct.alloc.bind": plant_bind_length,
    "direct.bind.verify": plant_bind_any_offset,
    "direct.ticket.abandoned": lambda t, mp: mp.setattr(direct_mod.TicketWatch, "abandoned", lambda s, k: False),
    "direct.ticket.partition_revoked": plant_abandon_keeps_window,
    "direct.head.aligned": lambda t, mp: grant(mp, "grant_partition", lambda a, f, w: f.update(
        {"hello_ack.head.offset": f["hello_ack.head.offset"] + 4})),
    "direct.partition.bounds": plant_wider_partition,
    "direct.partition.connection": lambda t, mp: grant(mp, "grant_partition", lambda a, f, w: setattr(
        w[0], "connection", None)),
    "security.default_mode.no_stag": lambda t, mp: grant(mp, "grant_direct_load", lambda a, f, w: [
        setattr(x, "connection", None) for x in w]),
    "security.clear_freed": lambda t, mp: t.run(lambda: setattr(t.target.executor, "clear_freed", False)),
}
TRANSPORT = {"completion.record.write_imm": "roce"}
CONFIG = {"session.credits.request": {"request_credits": 2}}


@pytest.mark.parametrize("case_id", sorted(PLANTS))
def test_planted_bug_fails_its_case(case_id, monkeypatch, tmp_path):
    t = make(TRANSPORT.get(case_id, "iwarp"), **CONFIG.get(case_id, {}))
    try:
        PLANTS[case_id](t, monkeypatch)
        code, doc = conform(t, tmp_path, "--only", case_id, "--pcap-dir", str(tmp_path / "pcaps"))
    finally:
        t.stop()
    [got] = [c for c in doc["cases"] if c["id"] == case_id]
    should = got["level"] == "SHOULD"
    assert got["verdict"] == ("WARN" if should else "FAIL"), got
    assert code == (0 if should else 1)
    assert got["pcap"] and (tmp_path / "pcaps").is_dir()


# -- the command line ------------------------------------------------------------------------

def test_exit_codes_for_usage_and_harness_errors(tmp_path, capsys):
    assert main(["conform"]) == 2                                   # no --target
    assert main(["conform", "--list", "--only", "nothing."]) == 2   # nothing selected
    assert "ops.unmapped_store.already_bound" in (main(["conform", "--list"]), capsys.readouterr().out)[1]
    out = tmp_path / "r.json"
    junit = tmp_path / "r.xml"
    code = main(["conform", "--target", "iwarp://127.51.250.1:9", "--timeout", "1",
                 "--json", str(out), "--junit", str(junit)])
    assert code == 2
    assert json.loads(out.read_text())["exit_code"] == 2
    assert ET.parse(junit).getroot().get("errors") == "1"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "harness error" in err[0]
