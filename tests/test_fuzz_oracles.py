"""The fuzzer's model-based oracles, each shown by a bug planted in a reference target.

Every bug breaks one sentence of the specification and is planted from the test
(monkeypatching the target running in its thread): the fuzzer must find it on both
bindings within a bounded number of cases, naming the oracle's kind. The bounds come
from the case generator itself (``first_case``), never from a run of the code under test.
The unmodified reference target gives no finding (``test_fuzz.py`` runs 10,000 cases per
binding; here the cases each test runs are also run once against a clean target).
"""
from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from kbtp_scapy.cli import main
from kbtp_scapy.fuzz.cases import make_case
from kbtp_scapy.target import TargetConfig, table
from kbtp_scapy.target.connection import Connection
from kbtp_scapy.target.direct import TicketWatch
from kbtp_scapy.target.operations import Executor, Failed, Outcome
from kbtp_scapy.target.sessions import InitiatorState
from kbtp_scapy.vocab import RequestFlag

from .kbtp_harness import TargetThread

LOAD, ALLOC_STORE, FREE = 0x10, 0x12, 0x13
_pairs = iter(range(1, 250))


def hosts() -> list[str]:
    n = next(_pairs)
    return [f"127.57.{n // 120}.{2 * (n % 120) + 1}", f"127.57.{n // 120}.{2 * (n % 120) + 2}"]


def config(**kw) -> TargetConfig:
    return TargetConfig(**{"blocks": 256, "max_initiators": 8, "ticket_timeout_ms": 100, **kw})


def first_case(kind: str, seed: int = 1, op: str | None = None, **match) -> int:
    """Index of the first case of ``seed`` with a step of ``kind`` (and ``op``, key values)."""
    for index in range(20000):
        for step in make_case("roce", seed, index).steps:
            if step["kind"] == kind and (op is None or step.get("op") == op) \
                    and all(step.get(k) == v for k, v in match.items()):
                return index
    raise AssertionError(f"no {kind} step in 20,000 cases")


def handler(ex: Executor, opcode: int, wrap: Callable) -> None:
    """Replace the target's handler of ``opcode`` (run in the target's thread)."""
    original = Executor._handlers[opcode]

    async def planted(self, conn, req, fetch=None):
        return await wrap(original, self, conn, req, fetch)
    ex._handlers = {**ex._handlers, opcode: planted}


# -- the bugs: each takes the running target and a monkeypatch ------------------------------

def load_unbound_invalid(t, mp):
    """LOAD of an unbound entry completes INVALID_HANDLE (the text: NOT_VALID)."""
    async def wrap(original, self, conn, req, fetch):
        try:
            return await original(self, conn, req, fetch)
        except Failed as failure:
            if failure.status == Failed("NOT_VALID").status:
                raise Failed("INVALID_HANDLE") from None
            raise
    t.run(lambda: handler(t.target.executor, LOAD, wrap))


def load_ignores_sealed(t, mp):
    """LOAD returns unsealed blocks without ALLOW_UNSEALED (the text: NOT_SEALED)."""
    async def wrap(original, self, conn, req, fetch):
        return await original(self, conn, {**req, "flags": req["flags"] | RequestFlag.ALLOW_UNSEALED}, fetch)
    t.run(lambda: handler(t.target.executor, LOAD, wrap))


def load_truncates(t, mp):
    """LOAD into a short buffer writes what fits and reports that length, OK (the text: TOO_LARGE)."""
    async def wrap(original, self, conn, req, fetch):
        try:
            return await original(self, conn, req, fetch)
        except Failed as failure:
            if failure.status != Failed("TOO_LARGE").status:
                raise
        entry, n = self.table.read(req["handle"]), req["dd.length"]
        conn.qp.write(req["dd.stag"], req["dd.offset"], bytes(self.memory.block(entry.block_offset, n)))
        return Outcome(0, entry.generation, n, entry.block_offset)
    t.run(lambda: handler(t.target.executor, LOAD, wrap))


def no_invalidate(t, mp):
    """Completions of requests with INVALIDATE come as plain Sends."""
    original = Connection._complete
    mp.setattr(Connection, "_complete", lambda self, req, outcome, why="": original(
        self, {**req, "flags": req.get("flags", 0) & ~RequestFlag.INVALIDATE}, outcome, why))


def no_record(t, mp):
    """RECORD on a session granted RECORD_COMPLETION is answered by a COMPLETION Send."""
    original = Connection._complete
    mp.setattr(Connection, "_complete", lambda self, req, outcome, why="": original(
        self, {**req, "flags": req.get("flags", 0) & ~RequestFlag.RECORD}, outcome, why))


def generation_wraps_to_zero(t, mp):
    """The Generation wraps from 0xFFFF to 0 (the text: skipping zero); entries start near the top."""
    mp.setattr(table, "next_generation", lambda g: (g + 1) & 0xFFFF)

    def near_the_top():
        tb = t.target.memory.table
        for h in range(tb.base_handle, tb.base_handle + tb.count):
            tb.write(h, table.Entry(0, 0xFFFD, 0, table.UNBOUND_OFFSET))
    t.run(near_the_top)


def alloc_reports_wrong_block(t, mp):
    """ALLOC_STORE completes with the Block Offset of the next block, not the one it bound."""
    async def wrap(original, self, conn, req, fetch):
        out = await original(self, conn, req, fetch)
        if out.status == 0:
            out.block_offset = (out.block_offset + self.block_size) % (self.block_size * self.memory.config.blocks)
        return out
    t.run(lambda: handler(t.target.executor, ALLOC_STORE, wrap))


def quota_off_by_one(t, mp):
    """The quota check lets one allocation past the quota."""
    mp.setattr(InitiatorState, "usage", property(lambda self: len(self.bound) + self.tickets - 1))


def failed_alloc_uses_quota(t, mp):
    """An ALLOC_STORE that fails a check still counts against the quota (the text: no other effect)."""
    async def wrap(original, self, conn, req, fetch):
        try:
            return await original(self, conn, req, fetch)
        except Failed:
            conn.state.tickets += 1
            raise
    t.run(lambda: handler(t.target.executor, ALLOC_STORE, wrap))


def hello_ack_handle(t, mp):
    """HELLO_ACK carries the Handle Base in its header's Block Handle (the text: zero)."""
    original = Connection._hello_ack

    async def hello_ack(self, status, body):
        await original(self, status, {**body, "handle": body.get("hello_ack.handle_base", 0)})
    mp.setattr(Connection, "_hello_ack", hello_ack)


def tickets_never_abandoned(t, mp):
    """A ticket left unbound past the Ticket Timeout is never reclaimed; a late BIND succeeds."""
    mp.setattr(TicketWatch, "_abandon", lambda self, ticket: None)


def abandoned_stag_stays_valid(t, mp):
    """Abandonment reclaims the block without invalidating the Partition STag first."""
    def abandon(self, ticket):
        del self._pending[ticket]
        self._abandoned.add(ticket)
        self.state.tickets -= 1
        self.part.ring.reclaim(ticket)
    mp.setattr(TicketWatch, "_abandon", abandon)


# bug, TargetConfig overrides, the kinds that name it, first case that can show it, cases to run
BUGS = [
    (load_unbound_invalid, {}, {"status"}, 0, 60),
    (load_ignores_sealed, {}, {"ok-not-sealed"}, 0, 60),
    (load_truncates, {}, {"ok-too-large"}, 0, 20),
    (no_invalidate, {}, {"invalidate"}, 0, 5),
    (generation_wraps_to_zero, {}, {"generation"}, 0, 40),
    (alloc_reports_wrong_block, {}, {"block-offset"}, 0, 40),
    (quota_off_by_one, {"direct_partitions": 0}, {"ok-quota"}, first_case("quota"), 3),
    (failed_alloc_uses_quota, {}, {"quota"}, first_case("quota"), 3),
    (hello_ack_handle, {}, {"hello-ack"}, 0, 2),
    (tickets_never_abandoned, {}, {"ok-abandoned-ticket"}, first_case("abandon"), 2),
    (abandoned_stag_stays_valid, {}, {"ticket"}, first_case("abandon"), 2),
]


def fuzz(t: TargetThread, tmp_path, *args: str) -> tuple[int, dict]:
    local = ["--local", t.initiator_hosts[0]] if t.transport == "roce" else []
    summary = tmp_path / "summary.json"
    code = main(["fuzz", "--target", t.url, *local, "-q", "--out", str(tmp_path / "findings"),
                 "--json-file", str(summary), "--timeout", "6", *args])
    return code, json.loads(summary.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
@pytest.mark.parametrize("bug,overrides,kinds,start,cases", BUGS, ids=[b[0].__name__ for b in BUGS])
def test_planted_bug_is_found(bug, overrides, kinds, start, cases, transport, tmp_path, monkeypatch):
    t = TargetThread(transport, config(**overrides), hosts=hosts())
    try:
        bug(t, monkeypatch)
        code, doc = fuzz(t, tmp_path, "--start", str(start), "--cases", str(cases), "--max-findings", "1",
                         "--minimize-budget", "0")
    finally:
        t.stop()
    found = set(doc["finding_kinds"])
    assert code == 1 and found & kinds, (found, [f["detail"] for d in doc["findings"] for f in d["findings"]])


def test_record_sent_as_send_is_found(tmp_path, monkeypatch):
    """RoCEv2 only: RECORD_COMPLETION is never granted over iWARP."""
    t = TargetThread("roce", config(), hosts=hosts())
    try:
        no_record(t, monkeypatch)
        code, doc = fuzz(t, tmp_path, "--start", str(first_case("valid", record=True)), "--cases", "40",
                         "--max-findings", "1", "--minimize-budget", "0")
    finally:
        t.stop()
    assert code == 1 and "record" in doc["finding_kinds"], doc["finding_kinds"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_the_same_cases_pass_on_a_clean_target(transport, tmp_path):
    """Every window of cases the planted bugs ran, against the unmodified target: no finding."""
    t = TargetThread(transport, config(), hosts=hosts())
    try:
        for bug, _, _, start, cases in BUGS:
            code, doc = fuzz(t, tmp_path, "--start", str(start), "--cases", str(cases))
            assert code == 0 and not doc["findings"], (bug.__name__, doc["finding_kinds"])
    finally:
        t.stop()


@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_target_that_refuses_sessions_stops_with_exit_2(transport, tmp_path, monkeypatch, capsys):
    """A target whose GOODBYE RELEASE keeps the session fills its initiator slots; the
    fuzzer cannot open its sessions then, and must say so (exit 2), not pass."""
    t = TargetThread(transport, config(max_initiators=4), hosts=hosts())
    sessions = t.target.sessions
    original = sessions.detach
    t.run(lambda: setattr(sessions, "detach", lambda state, release: original(state, False)))
    try:
        code, doc = fuzz(t, tmp_path, "--cases", "200")
    finally:
        t.stop()
    err = capsys.readouterr().err
    assert code == 2 and doc["exit_code"] == 2 and doc["cases"] < 20
    assert "NO_SPACE" in err and "RELEASE" in err and "--max-initiators" in err
