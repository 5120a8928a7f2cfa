"""The statistics and the hazard checkers, as SQL on DuckDB over a Parquet dataset.

Every checker is one query that returns its findings with the frames that prove them.
Messages of several captures are put in one order by their capture times, so a store in
one host's capture and a load in another's are compared: the hosts' clocks must agree to
better than the gaps between the operations judged (PTP or NTP on the capturing hosts).

Bounds are derived from the dataset itself, never fixed: an answer is slow when its
latency is above both ``Q3 + 3 IQR`` and ten times the median of the latencies of its
opcode at its target (with at least ``MIN_SAMPLES`` of them); a request is unanswered when its capture went on
for longer than that bound after it (one second where too few answers give no bound).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import tables as T
from ..vocab import REQUESTS, EntryFlag

NEAR_TIMEOUT = 0.75         # of the Ticket Timeout: a BIND later than this after its FetchAdd is near it
MIN_SAMPLES = 20            # answers of an opcode below which no slow bound is derived
NO_BOUND_S = 1.0            # how long an unanswered request must wait without a bound
LISTED = 20                 # findings listed per checker; the rest are counted

#: the SQL list of the request opcodes, from the tables
REQUEST_NAMES = "(" + ", ".join(f"'{T.BY_OPCODE[o].name}'" for o in sorted(REQUESTS)) + ")"

QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99, "p999": 0.999}


@dataclass
class Finding:
    """One hazard, with the frames that prove it (``(capture, frame)``)."""

    kind: str
    severity: str           # "target": the target broke a rule; "initiator": the client did
    message: str
    evidence: list[tuple[str, int]] = field(default_factory=list)
    times: int = 1          # the same finding again later: counted, the first one's frames kept


@dataclass
class Analysis:
    messages: int
    captures: int
    sessions: int
    targets: int
    stats: list[dict[str, Any]]
    bounds: dict[tuple[str, str], float]
    findings: list[Finding]
    counts: dict[str, int]          # findings per kind, listed or not
    sessions_table: list[dict[str, Any]] = field(default_factory=list)
    interval_s: float = 0.0
    timeline: list[dict[str, Any]] = field(default_factory=list)


_EVENTS = """
CREATE TEMP TABLE ev AS
SELECT target, handle, answer_time AS t, opcode_name AS op, answer_generation AS gen,
       capture, answer_frame AS frame
FROM m WHERE opcode_name IN ('ALLOC_STORE', 'STORE', 'BIND', 'FREE') AND answer_status = 0
"""

_LOADS = """
CREATE TEMP TABLE loads AS
SELECT l.capture, l.frame, l.answer_frame, l.time, l.answer_time, l.target, l.handle,
       l.generation AS asked, l.answer_generation AS served, l.session, l.initiator,
       e.op AS last_op, e.gen AS last_gen, e.capture AS e_capture, e.frame AS e_frame,
       EXISTS (SELECT 1 FROM ev c WHERE c.target = l.target AND c.handle = l.handle
               AND c.t > l.time AND c.t < l.answer_time) AS concurrent,
       (SELECT count(*) FROM ev r WHERE r.target = l.target AND r.handle = l.handle
        AND r.t <= l.time AND r.op IN ('ALLOC_STORE', 'BIND')) AS bindings,
       (SELECT arg_max(struct_pack(capture := r.capture, frame := r.frame, op := r.op), r.t)
        FROM ev r WHERE r.target = l.target AND r.handle = l.handle AND r.t <= l.time
        AND r.op IN ('FREE', 'ALLOC_STORE', 'BIND')) AS last_change
FROM (SELECT * FROM m WHERE opcode_name = 'LOAD' AND answer_status = 0) l
ASOF LEFT JOIN ev e ON l.target = e.target AND l.handle = e.handle AND l.time >= e.t
"""


def _hex(value: int | None) -> str:
    return "?" if value is None else f"0x{value:x}"


def connect(dataset: Path, column: str | None = None, value: str | None = None) -> Any:
    """A DuckDB connection with the dataset as view ``m``: all of it, or the rows whose
    ``column`` holds ``value`` (one slice of a distributed run)."""
    import duckdb
    con = duckdb.connect()
    pattern = str(dataset / "*" / "*.parquet").replace("'", "''")
    where = ""
    if column is not None:
        assert column in ("target", "opcode_name"), column
        where = (f" WHERE {column} IS NULL" if value is None else
                 f" WHERE {column} = '{value.replace(chr(39), chr(39) * 2)}'")
    con.execute(f"CREATE VIEW m AS SELECT * FROM read_parquet('{pattern}', union_by_name = true){where}")
    return con


def _all(con: Any, sql: str, *params: Any) -> list[dict[str, Any]]:
    cur = con.execute(sql, list(params))
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def statistics(con: Any) -> list[dict[str, Any]]:
    """Count and latency percentiles per opcode and answer status."""
    cols = ", ".join(f"quantile_cont(latency_s, {q}) AS {name}" for name, q in QUANTILES.items())
    return _all(con, f"""
        SELECT opcode_name AS opcode,
               coalesce(answer_status_name, CASE WHEN recorded THEN 'RECORD' ELSE 'UNANSWERED' END) AS status,
               count(*) AS count, {cols}, max(latency_s) AS max
        FROM m WHERE opcode_name IN {REQUEST_NAMES}
        GROUP BY ALL ORDER BY opcode, status""")


def span(con: Any) -> tuple[float, float]:
    """(first time, the timeline's interval): about 100 intervals over the dataset, each a
    round 1, 2 or 5 times a power of ten seconds."""
    first, last = con.execute("SELECT min(time), max(time) FROM m").fetchone()
    if first is None:
        return 0.0, 1.0
    step = max((last - first) / 100, 1e-6)
    scale = 10 ** math.floor(math.log10(step))
    return first, next(m * scale for m in (1, 2, 5, 10) if m * scale >= step)


def timeline(con: Any, first: float, interval: float) -> list[dict[str, Any]]:
    """Requests per interval, opcode and answer status, and the octets they moved."""
    return _all(con, f"""
        SELECT CAST(floor((time - {first!r}) / {interval!r}) AS BIGINT) AS bin, opcode_name AS opcode,
               coalesce(answer_status_name, CASE WHEN recorded THEN 'RECORD' ELSE 'UNANSWERED' END) AS status,
               count(*) AS requests,
               sum(CASE WHEN opcode_name = 'LOAD' THEN coalesce(answer_data_length, 0)
                        ELSE coalesce(dd_length, bind_data_length, 0) END) AS octets
        FROM m WHERE opcode_name IN {REQUEST_NAMES}
        GROUP BY ALL ORDER BY bin, opcode, status""")


def sessions(con: Any) -> list[dict[str, Any]]:
    """Per session: who, to which target, its requests, failures and latency."""
    return _all(con, f"""
        SELECT session, any_value(initiator) AS initiator, any_value(target) AS target,
               count(*) AS requests, count(*) FILTER (WHERE answer_status = 0) AS ok,
               count(*) FILTER (WHERE answer_status != 0) AS refused,
               count(*) FILTER (WHERE answer_frame IS NULL) AS unanswered,
               quantile_cont(latency_s, 0.5) AS p50, quantile_cont(latency_s, 0.99) AS p99
        FROM m WHERE opcode_name IN {REQUEST_NAMES}
        GROUP BY session ORDER BY session""")


def bounds(con: Any) -> dict[tuple[str, str], float]:
    """The slow bound of each target's opcode with enough answers (module docstring)."""
    rows = _all(con, """
        SELECT target, opcode_name AS opcode, count(*) AS n,
               quantile_cont(latency_s, 0.25) AS q1, quantile_cont(latency_s, 0.5) AS q2,
               quantile_cont(latency_s, 0.75) AS q3
        FROM m WHERE latency_s IS NOT NULL AND opcode_name != 'COMPLETION' GROUP BY ALL""")
    return {(r["target"], r["opcode"]): max(r["q3"] + 3 * (r["q3"] - r["q1"]), 10 * r["q2"])
            for r in rows if r["n"] >= MIN_SAMPLES}


def _stale(con: Any) -> list[Finding]:
    con.execute(_LOADS)
    out = []
    for r in _all(con, "SELECT * FROM loads WHERE NOT concurrent ORDER BY answer_time"):
        where = f"LOAD of handle {_hex(r['handle'])} on {r['target']} by {r['initiator']}"
        proof = [(r["capture"], r["frame"]), (r["capture"], r["answer_frame"])]
        if r["asked"] and r["served"] != r["asked"]:
            out.append(Finding("wrong-generation", "target",
                               f"{where} asked for Generation {r['asked']} and was answered OK with "
                               f"{r['served']} (the text requires STALE_GENERATION)", proof))
        elif r["last_op"] == "FREE":
            out.append(Finding("freed-block-served", "target",
                               f"{where} was answered OK (Generation {r['served']}) after the handle "
                               "was freed and before it was bound again",
                               proof + [(r["e_capture"], r["e_frame"])]))
        elif r["last_op"] is not None and r["served"] != r["last_gen"]:
            out.append(Finding("stale-generation", "target",
                               f"{where} returned Generation {r['served']} where the last store under "
                               f"that handle completed with {r['last_gen']}",
                               proof + [(r["e_capture"], r["e_frame"])]))
        elif not r["asked"] and r["last_change"] is not None and (
                r["bindings"] > 1 or r["last_change"]["op"] == "FREE"):
            change = r["last_change"]
            out.append(Finding("unpinned-reused-load", "initiator",
                               f"{where} asked for any Generation (0) of a handle freed or bound again "
                               f"earlier (Generation {r['served']} served): the loader cannot tell whose "
                               "data it got; pass the Generation it expects",
                               proof + [(change["capture"], change["frame"])]))
    return out


_DIRECT_LOADS = """
WITH reads AS (
    SELECT capture, conn, frame, answer_frame, time, answer_time, target, initiator, rdma_region,
           rdma_offset, handle, entry_flags, entry_generation, entry_block_offset,
           lead(rdma_region) OVER w AS next_region, lead(handle) OVER w AS next_handle,
           lead(entry_generation) OVER w AS next_generation, lead(answer_frame) OVER w AS next_frame,
           lead(answer_time) OVER w AS next_time, lead(rdma_region, 2) OVER w AS then_region
    FROM m WHERE rdma_op = 'READ' AND rdma_region IN ('table', 'pool') AND answer_frame IS NOT NULL
    WINDOW w AS (PARTITION BY capture, conn ORDER BY time, frame)),
entries AS (SELECT * FROM reads WHERE rdma_region = 'table' AND entry_generation IS NOT NULL
            AND entry_flags & $valid != 0),
blocks AS (SELECT * FROM reads WHERE rdma_region = 'pool')
SELECT b.capture, b.frame AS block_frame, b.time AS block_time, b.answer_time AS block_answer_time,
       b.target, b.initiator, e.handle, e.entry_generation AS used, e.answer_frame AS entry_frame,
       e.time AS entry_sent, e.answer_time AS entry_time,
       CASE WHEN b.confirms AND b.next_handle = e.handle THEN b.next_generation END AS confirmed,
       CASE WHEN b.confirms AND b.next_handle = e.handle THEN b.next_frame END AS confirm_frame,
       CASE WHEN b.confirms AND b.next_handle = e.handle THEN b.next_time END AS confirm_time
FROM (SELECT *, next_region = 'table' AND then_region IS DISTINCT FROM 'pool' AS confirms FROM blocks) b
ASOF JOIN entries e
  ON b.capture = e.capture AND b.conn = e.conn AND b.rdma_offset = e.entry_block_offset
  AND b.time >= e.answer_time
"""


def direct_loads(con: Any) -> list[dict[str, Any]]:
    """The Direct Loads of the dataset (also kept as table ``dl``): each block read with
    the entry read it relied on (``used``: its Generation) and the one that confirmed it
    (``confirmed``), with their frames."""
    con.execute("CREATE OR REPLACE TEMP TABLE dl AS "
                + _DIRECT_LOADS.replace("$valid", str(int(EntryFlag.VALID))))
    return _all(con, "SELECT * FROM dl ORDER BY capture, block_time")


def _direct_loads(con: Any) -> list[Finding]:
    """Direct Loads (an entry read, the block read at its Block Offset, the entry read
    again) judged against the handle's history: a block read after the handle changed, on
    the word of an entry read before the change and never confirmed by a second one, is
    the initiator's stale read; an entry that both reads show with another Generation than
    the last store's, with nothing changing meanwhile, is the target's. The read of the
    session after the block read confirms it when it reads that handle's entry and is not
    itself followed by a block read (then it began the next Direct Load)."""
    out = []
    direct_loads(con)
    for r in _all(con, """
            SELECT d.*, e.op AS last_op, e.gen AS last_gen, e.capture AS e_capture, e.frame AS e_frame,
                   e.t AS e_t,
                   EXISTS (SELECT 1 FROM ev c WHERE c.target = d.target AND c.handle = d.handle
                           AND c.t > d.entry_time AND c.t < coalesce(d.confirm_time, d.block_answer_time))
                     AS concurrent
            FROM dl d ASOF LEFT JOIN ev e ON d.target = e.target AND d.handle = e.handle
                                         AND d.block_time >= e.t
            WHERE e.op IS NOT NULL ORDER BY d.block_time"""):
        where = f"Direct Load of handle {_hex(r['handle'])} on {r['target']} by {r['initiator']}"
        change = (r["e_capture"], r["e_frame"])
        used = (r["capture"], r["entry_frame"])
        block = (r["capture"], r["block_frame"])
        if r["confirmed"] is None and r["e_t"] > r["entry_time"]:
            if r["last_op"] == "FREE":
                out.append(Finding("freed-block-served", "initiator",
                                   f"{where} read the block after the handle was freed, on the word of an "
                                   f"entry read before the free (Generation {r['used']}), and never read the "
                                   "entry again to confirm it", [used, change, block]))
            elif r["last_gen"] != r["used"]:
                out.append(Finding("stale-generation", "initiator",
                                   f"{where} read the block of Generation {r['used']} after the handle was "
                                   f"bound again with {r['last_gen']}, on the word of an entry read before, "
                                   "and never read the entry again to confirm it", [used, change, block]))
        elif r["confirmed"] == r["used"] and not r["concurrent"] and r["e_t"] <= r["entry_sent"]:
            confirm = (r["capture"], r["confirm_frame"])
            if r["last_op"] == "FREE":
                out.append(Finding("freed-block-served", "target",
                                   f"{where}: the table showed the entry VALID (Generation {r['used']}) "
                                   "after the handle was freed and before it was bound again",
                                   [used, block, confirm, change]))
            elif r["last_gen"] != r["used"]:
                out.append(Finding("stale-generation", "target",
                                   f"{where}: the table showed Generation {r['used']} where the last store "
                                   f"under that handle completed with {r['last_gen']}",
                                   [used, block, confirm, change]))
    return out


def _unanswered(con: Any, limits: dict[tuple[str, str], float]) -> list[Finding]:
    out = []
    for r in _all(con, """
            SELECT capture, frame, target, opcode_name, request_id, session, time, capture_end
            FROM m WHERE answer_frame IS NULL AND capture_end IS NOT NULL AND NOT recorded
            ORDER BY time"""):
        bound = limits.get((r["target"], r["opcode_name"]), NO_BOUND_S)
        if r["capture_end"] - r["time"] > bound:
            out.append(Finding("unanswered", "target",
                               f"{r['opcode_name']} rid={r['request_id']} of session {r['session'][:16]} "
                               f"never answered, though the capture went on {r['capture_end'] - r['time']:.3g} s "
                               f"(bound {bound:.3g} s)", [(r["capture"], r["frame"])]))
    return out


def _slow(con: Any, limits: dict[tuple[str, str], float]) -> list[Finding]:
    out = []
    for (target, opcode), bound in limits.items():
        for r in _all(con, """
                SELECT capture, frame, answer_frame, request_id, latency_s FROM m
                WHERE target = ? AND opcode_name = ? AND latency_s > ? ORDER BY latency_s DESC""",
                      target, opcode, bound):
            out.append(Finding("slow", "target",
                               f"{opcode} rid={r['request_id']} to {target} answered after "
                               f"{r['latency_s'] * 1e6:.0f} µs (bound {bound * 1e6:.0f} µs from this "
                               "target's answers in the dataset)",
                               [(r["capture"], r["frame"]), (r["capture"], r["answer_frame"])]))
    return out


def _credits(con: Any) -> list[Finding]:
    return [Finding("over-credits", "initiator",
                    f"{r['opcode_name']} rid={r['request_id']} sent with {r['in_flight']} requests in "
                    f"flight where the session was granted {r['credits']} Request Credits",
                    [(r["capture"], r["frame"])])
            for r in _all(con, """SELECT capture, frame, opcode_name, request_id, in_flight, credits
                                  FROM m WHERE in_flight > credits ORDER BY time""")]


def _tickets(con: Any) -> list[Finding]:
    """BINDs answered TICKET_ABANDONED, and BINDs sent later than ``NEAR_TIMEOUT`` of the
    Ticket Timeout (or later than all of it) after the answer of the FetchAdd on the
    session's Head that took their ticket."""
    out = []
    for r in _all(con, """
            WITH fa AS (SELECT capture, conn, ticket, answer_frame, answer_time FROM m
                        WHERE rdma_op = 'FETCH_ADD' AND rdma_region = 'head' AND ticket IS NOT NULL
                        AND answer_time IS NOT NULL),
                 b AS (SELECT * FROM m WHERE opcode_name = 'BIND')
            SELECT b.capture, b.frame, b.answer_frame, b.bind_ticket, b.handle, b.time,
                   b.ticket_timeout_s, b.answer_status_name, fa.answer_frame AS fa_frame,
                   fa.answer_time AS fa_time
            FROM b ASOF LEFT JOIN fa ON b.capture = fa.capture AND b.conn = fa.conn
                                    AND b.bind_ticket = fa.ticket AND b.time >= fa.answer_time
            ORDER BY b.time"""):
        timeout = r["ticket_timeout_s"] or 0.0
        taken = [(r["capture"], r["fa_frame"])] if r["fa_frame"] is not None else []
        proof = taken + [(r["capture"], r["frame"])]
        what = f"BIND of ticket {r['bind_ticket']} to handle {_hex(r['handle'])}"
        late = None if r["fa_time"] is None else r["time"] - r["fa_time"]
        after = "" if late is None else f" {late:.3g} s after the FetchAdd that took it,"
        if r["answer_status_name"] == "TICKET_ABANDONED":
            out.append(Finding("ticket-timeout", "initiator",
                               f"{what} came{after} after the ticket was abandoned (Ticket Timeout {timeout:g} s)",
                               proof + [(r["capture"], r["answer_frame"])]))
        elif late is not None and timeout and late > timeout:
            out.append(Finding("ticket-timeout", "initiator",
                               f"{what} came{after} past the Ticket Timeout of {timeout:g} s (answered "
                               f"{r['answer_status_name'] or 'never'}: the target may reclaim such a ticket)",
                               proof))
        elif late is not None and timeout and late > NEAR_TIMEOUT * timeout:
            out.append(Finding("ticket-near-timeout", "initiator",
                               f"{what} came{after} more than {NEAR_TIMEOUT:g} of the Ticket Timeout of "
                               f"{timeout:g} s: a little slower and the ticket is abandoned", proof))
    return out


def _quota(con: Any) -> list[Finding]:
    return [Finding("at-quota", "initiator",
                    f"session {r['session'][:16]} of {r['initiator']} was refused NO_SPACE {r['n']} times "
                    "(at its Allocation Quota, or the ring was empty)",
                    [(r["capture"], r["frame"])])
            for r in _all(con, """SELECT session, any_value(initiator) AS initiator, count(*) AS n,
                                         arg_min(capture, time) AS capture, arg_min(frame, time) AS frame
                                  FROM m WHERE opcode_name IN ('ALLOC_STORE', 'BIND')
                                  AND answer_status_name = 'NO_SPACE' GROUP BY session ORDER BY frame""")]


def _unsolicited(con: Any) -> list[Finding]:
    return [Finding("unsolicited-completion", "target",
                    f"COMPLETION rid={r['request_id']} answers no request of its session",
                    [(r["capture"], r["frame"])])
            for r in _all(con, """SELECT capture, frame, request_id FROM m
                                  WHERE unsolicited ORDER BY time""")]


KINDS = ("wrong-generation", "freed-block-served", "stale-generation", "unpinned-reused-load",
         "unanswered", "slow", "over-credits", "ticket-timeout", "ticket-near-timeout", "at-quota",
         "unsolicited-completion")


def totals(con: Any) -> dict[str, int]:
    return _all(con, """SELECT count(*) AS messages, count(DISTINCT capture) AS captures,
                               count(DISTINCT session) AS sessions,
                               count(DISTINCT target) AS targets FROM m WHERE rdma_op IS NULL""")[0]


def findings(con: Any) -> tuple[list[Finding], dict[tuple[str, str], float]]:
    """Every checker's findings, and the slow bounds they used. Each checker looks only at
    the rows of one target at a time, so a dataset cut by target gives the same findings."""
    limits = bounds(con)
    con.execute(_EVENTS)
    return (_stale(con) + _direct_loads(con) + _unanswered(con, limits) + _slow(con, limits) + _credits(con)
            + _tickets(con) + _quota(con) + _unsolicited(con)), limits


def summarize(found: list[Finding]) -> tuple[list[Finding], dict[str, int]]:
    """The findings in one order (by kind, then by their first frame), the same one
    repeated counted on its first, at most ``LISTED`` of a kind; and the count per kind."""
    found = sorted(found, key=lambda f: (KINDS.index(f.kind), f.evidence))
    counts: dict[str, int] = {}
    same: dict[tuple[str, str], Finding] = {}
    listed: list[Finding] = []
    for f in found:
        counts[f.kind] = counts.get(f.kind, 0) + 1
        first = same.setdefault((f.kind, f.message), f)
        if first is not f:
            first.times += 1
        elif sum(g.kind == f.kind for g in listed) < LISTED:
            listed.append(f)
    return listed, counts


def analyze(dataset: Path) -> Analysis:
    """The whole analysis on DuckDB, in this process."""
    con = connect(dataset)
    found, limits = findings(con)
    listed, counts = summarize(found)
    t = totals(con)
    first, interval = span(con)
    return Analysis(t["messages"], t["captures"], t["sessions"], t["targets"], statistics(con), limits,
                    listed, counts, sessions(con), interval, timeline(con, first, interval))
