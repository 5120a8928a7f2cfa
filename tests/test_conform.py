"""``kbtp conform``: the whole suite passes against the reference target on both bindings,
and every case fails, every time, against a reference target with its bug planted.

The bugs are those of ``tests/planted_bugs.py``, each meant for one case; each runs five
times against its planted target on each binding it applies to. The checker's own
behaviour follows: cases independent of one another when RELEASE is broken, a refused
HELLO that is no header error, and the command line (a target's fault in a set-up step:
``test_verdicts_peer_fault.py``).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import pty
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kbtp_scapy.cli import main
from kbtp_scapy.conform import report
from kbtp_scapy.conform.cases import all_cases
from kbtp_scapy.conform.initiator.runner import all_cases as initiator_cases
from kbtp_scapy.conform.registry import SHOULD
from kbtp_scapy.conform.runner import Outcome, probe, run, run_case
from kbtp_scapy.initiator import Initiator, KbtpError

from .kbtp_harness import deaf_roce
from .planted_bugs import BY_NAME, CORPUS, Bug, start

#: Runs of each planted bug's case: the suite checks the bug is caught every time it looks;
#: five of five per binding is tools/conform_catch_rate.py's measure, not the suite's.
RUNS = 2
_net = itertools.count(1)


def hosts() -> list[str]:
    n = next(_net)
    return [f"127.51.{n // 250}.{n % 250 + 1}", f"127.52.{n // 250}.{n % 250 + 1}"]


def local(t) -> list[str]:
    return ["--local", t.initiator_hosts[0]] if t.transport == "roce" else []


def conform(t, tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    code = main(["conform", "--target", t.url, *local(t), "--timeout", "5", "-q",
                 "--json-file", str(out), *args])
    return code, json.loads(out.read_text())


def case(case_id: str):
    [c] = [c for c in all_cases() if c.id == case_id]
    return c


# -- the whole suite against the reference target -------------------------------------------

@pytest.fixture(scope="module", params=["iwarp", "roce"])
def suite(request, tmp_path_factory):
    t = start(request.param, hosts())
    tmp = tmp_path_factory.mktemp(f"conform-{request.param}")
    try:
        code, doc = conform(t, tmp, "--junit", str(tmp / "junit.xml"), "--pcap-dir", str(tmp / "pcaps"))
    finally:
        t.stop()
    return request.param, code, doc, tmp


@pytest.mark.slow
def test_suite_passes_against_the_reference(suite):
    transport, code, doc, tmp = suite
    bad = {c["id"]: (c["verdict"], c["expected"], c["seen"], c["detail"])
           for c in doc["cases"] if c["verdict"] not in ("PASS", "SKIP")}
    assert code == 0 and not bad, bad
    skipped = {c["id"] for c in doc["cases"] if c["verdict"] == "SKIP"}
    assert skipped == {c.id for c in all_cases() if c.transport not in (None, transport)}
    assert "completion.record.write_imm" in skipped or "completion.record.rdmap" in skipped
    assert {c["id"] for c in doc["cases"]} == {c.id for c in all_cases()}
    assert not (tmp / "pcaps").exists()          # pcaps only for cases that did not pass
    assert not any(c["notes"] for c in doc["cases"]), [c["notes"] for c in doc["cases"] if c["notes"]]


@pytest.mark.slow
def test_reports_are_well_formed(suite):
    _, _, doc, tmp = suite
    suite_xml = ET.parse(tmp / "junit.xml").getroot()
    assert suite_xml.tag == "testsuite" and int(suite_xml.get("tests")) == len(doc["cases"])
    assert int(suite_xml.get("failures")) == 0 and int(suite_xml.get("errors")) == 0
    assert len(suite_xml.findall("testcase")) == len(doc["cases"])
    assert doc["exit_code"] == 0 and doc["summary"]["FAIL"] == 0
    assert doc["coverage"]["cases"] == len(doc["cases"]) and doc["coverage"]["not_checkable"]
    req = doc["coverage"]["requirements"]
    assert req["gaps"] == 0 and 100 < req["judged_in_this_run"] <= req["checked_by_some_case"] < req["sentences"]
    for c in doc["cases"]:
        assert c["requirement"] and c["level"] in ("MUST", "MUST NOT", "SHOULD", "RULE")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_generation_goes_round_on_a_fresh_reference(transport):
    """No seeding: from Generation 0, the 32,768 bind/free cycles of a real wrap."""
    t = start(transport, hosts(), seed=None)
    try:
        _, [out] = asyncio.run(run(t.url, [case("generation.never_zero")], timeout=10,
                                   local=t.initiator_hosts[0] if transport == "roce" else None))
    finally:
        t.stop()
    assert out.verdict == "PASS" and not out.notes, (out.expected, out.seen, out.detail, out.notes)


# -- planted bugs: each fails its case, on each binding, every run ----------------------------

def test_every_case_has_a_planted_bug():
    assert {c.id for c in all_cases()} == {b.case for b in CORPUS}


def _planted(bug: Bug, transport: str, monkeypatch, tmp_path, runs: int = RUNS):
    t = start(transport, hosts(), bug)
    try:
        bug.plant(t, monkeypatch)
        return asyncio.run(run(t.url, [case(bug.case)] * runs, timeout=3, pcap_dir=tmp_path / "pcaps",
                               local=t.initiator_hosts[0] if transport == "roce" else None))[1]
    finally:
        t.stop()


#: The fast subset (-m 'not slow') runs one bug in SAMPLE of the corpus; the suite runs all.
SAMPLE = 12


@pytest.mark.parametrize("bug,transport", [
    pytest.param(b, tr, marks=() if i % SAMPLE == 0 else pytest.mark.slow)
    for i, (b, tr) in enumerate((b, tr) for b in CORPUS for tr in b.transports)],
    ids=lambda v: v.name if isinstance(v, Bug) else v)
def test_planted_bug_fails_its_case_every_run(bug, transport, monkeypatch, tmp_path):
    outcomes = _planted(bug, transport, monkeypatch, tmp_path)
    want = "WARN" if case(bug.case).level == SHOULD else "FAIL"
    assert [o.verdict for o in outcomes] == [want] * RUNS, \
        [(o.verdict, o.expected, o.seen, o.detail) for o in outcomes]
    assert all(o.expected and o.seen and o.pcap for o in outcomes)
    assert (tmp_path / "pcaps").is_dir()


# -- the checker's own behaviour ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["release_frees_nothing", "release_ignored"])
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_broken_release_fails_only_its_own_case(name, transport, monkeypatch, tmp_path):
    """Every case cleans up after itself without relying on RELEASE, and reconnects with an
    earlier case's Initiator ID when the target, still keeping old sessions, refuses new ones."""
    bug = BY_NAME[name]
    t = start(transport, hosts(), bug)
    try:
        bug.plant(t, monkeypatch)
        code, doc = conform(t, tmp_path, "--quick")
    finally:
        t.stop()
    verdicts = {c["id"]: c["verdict"] for c in doc["cases"] if c["verdict"] not in ("PASS", "SKIP")}
    assert verdicts == {"session.goodbye.release": "FAIL"} and code == 1, verdicts
    skipped = {c["id"] for c in doc["cases"] if c["verdict"] == "SKIP"}
    assert skipped == {c.id for c in all_cases() if c.slow or c.transport not in (None, transport)}


@pytest.mark.slow
def test_a_refused_hello_is_no_header_error(tmp_path):
    """A target with every initiator slot taken refuses the case's HELLO with NO_SPACE: the
    header is judged without Status (PASS, with a note); Request ID 1 in it still fails."""
    for bug in (None, BY_NAME["hello_ack_request_id"]):
        t = start("iwarp", hosts())
        with pytest.MonkeyPatch.context() as mp:
            if bug:
                bug.plant(t, mp)

            async def full():
                info = await probe(t.url, None, 5)
                held = []
                while True:                       # until the target has no room left
                    try:
                        held.append(await Initiator.connect(t.url, features=0))
                    except KbtpError:
                        break
                out = await run_case(case("session.hello_ack.header"), t.url, "iwarp", info, timeout=5,
                                     local=None, pcap_dir=None)
                for ini in held:
                    await ini.goodbye(release=True)
                return out
            try:
                out = asyncio.run(full())
            finally:
                t.stop()
        if bug is None:
            assert out.verdict == "PASS" and "refused (NO_SPACE)" in out.notes[0], out
        else:
            assert out.verdict == "FAIL" and "Request ID" in out.expected, out


@pytest.mark.slow
def test_strict_and_junit_show_a_warn(monkeypatch, tmp_path):
    bug = BY_NAME["no_clear_on_free"]
    t = start("roce", hosts(), bug)
    try:
        bug.plant(t, monkeypatch)
        lax, doc = conform(t, tmp_path, "--only", "security.clear_freed", "--junit", str(tmp_path / "j.xml"))
        strict, strict_doc = conform(t, tmp_path, "--only", "security.clear_freed", "--strict")
    finally:
        t.stop()
    assert doc["cases"][0]["verdict"] == "WARN" and lax == 0 and doc["exit_code"] == 0
    assert strict == 1 and strict_doc["exit_code"] == 1 and strict_doc["strict"]
    root = ET.parse(tmp_path / "j.xml").getroot()
    [failure] = root.iter("failure")
    assert failure.get("type") == "warning" and failure.get("message").startswith("WARN") and \
        root.get("failures") == "1"


# -- the command line ------------------------------------------------------------------------

def _kbtp(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kbtp_scapy", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.fixture(scope="module")
def reference():
    t = start("iwarp", hosts())
    yield t
    t.stop()


@pytest.mark.slow
def test_json_alone_on_stdout(reference, tmp_path):
    only = ["--only", "ops.store.", "--only", "generation.", "--quick"]
    flag = _kbtp("conform", "--target", reference.url, "--json", *only)
    dash = _kbtp("conform", "--target", reference.url, "--json-file", "-", *only)
    text = _kbtp("conform", "--target", reference.url, "--json-file", str(tmp_path / "r.json"), *only)
    for proc in (flag, dash, text):
        assert proc.returncode == 0, proc.stderr
    for doc in (json.loads(flag.stdout), json.loads(dash.stdout), json.loads((tmp_path / "r.json").read_text())):
        verdicts = {c["id"]: c["verdict"] for c in doc["cases"]}
        assert verdicts.pop("generation.never_zero") == "SKIP" and set(verdicts.values()) == {"PASS"}
        assert doc["quick"] and doc["exit_code"] == 0
    [slow] = [c for c in json.loads(flag.stdout)["cases"] if c["id"] == "generation.never_zero"]
    assert "--quick" in slow["detail"] and "slow" in slow["detail"]
    assert text.stdout.startswith("kbtp conform ") and "PASS   ops.store.data" in text.stdout
    assert "result: " in text.stdout and not flag.stderr and not dash.stderr


@pytest.mark.slow
def test_each_case_once_on_a_terminal(reference):
    """Progress on stderr (a terminal) is one line rewritten in place, cleared before each
    result; the result is printed once. On a pipe there is no progress at all."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kbtp_scapy", "conform", "--target", reference.url,
                             "--only", "ops.store.", "--quick"], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    out, _ = proc.communicate(timeout=60)
    os.close(master)
    assert proc.returncode == 0
    lines = out.decode().splitlines()
    for case_id in ("ops.store.too_large", "ops.store.data", "ops.store.sealed"):
        assert sum(case_id in line for line in lines) == 1, lines
        assert f"] {case_id} ...".encode() in err
    assert b"\n" not in err.replace(b"\r\n", b"") and err.count(b"\r") >= 10
    piped = _kbtp("conform", "--target", reference.url, "--only", "ops.store.data")
    assert piped.returncode == 0 and piped.stderr == ""


def test_exit_codes_for_usage_and_harness_errors(tmp_path, capsys):
    assert main(["conform"]) == 2                                   # no --target
    assert main(["conform", "--list", "--only", "nothing."]) == 2   # nothing selected
    assert "ops.unmapped_store.already_bound" in (main(["conform", "--list"]), capsys.readouterr().out)[1]
    out, junit = tmp_path / "r.json", tmp_path / "r.xml"
    code = main(["conform", "--target", "iwarp://127.51.250.1:9", "--timeout", "1",
                 "--json-file", str(out), "--junit", str(junit)])
    assert code == 2
    assert json.loads(out.read_text())["exit_code"] == 2
    assert ET.parse(junit).getroot().get("errors") == "1"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kbtp: conform: iwarp://127.51.250.1:9: cannot reach")
    assert "connection refused" in err[0] and "; check" in err[0]


@pytest.mark.slow
def test_a_timeout_is_said_in_words(capsys):
    """Nothing answers on RoCEv2: the reason says how long it waited, never "(TimeoutError: )"."""
    with deaf_roce("127.51.251.1") as url:
        code = main(["conform", "--target", url, "--local", "127.51.251.2", "--timeout", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no CM REP" in err and "within 1 s" in err and "TimeoutError" not in err \
        and "raise --timeout" in err


@pytest.mark.slow
def test_the_wait_it_names_is_the_wait_it_made(capsys):
    """Nothing answers on RoCEv2 with --timeout 9: the probe waits the 9 s it says, not the
    RNIC's own 5 s set-up wait (it said "no answer within 10 s" after 7.2 s)."""
    with deaf_roce("127.51.251.3") as url:
        began = time.monotonic()
        code = main(["conform", "--target", url, "--local", "127.51.251.4", "--timeout", "9"])
        waited = time.monotonic() - began
    err = capsys.readouterr().err.strip()
    assert code == 2 and "within 9 s" in err, err
    assert waited >= 8.9, waited


@pytest.mark.slow
def test_rerun_only_what_failed_last_time(reference, tmp_path):
    """--rerun-failed REPORT runs every case of that run's selection that it did not judge
    for good: FAIL, WARN, ERROR, a SKIP the run could not reach (the target went away) and a
    case missing from the report (the run stopped); a PASS and a SKIP of the target's own
    stand. A report of another target's run is noted on stderr. A report where nothing is left
    runs nothing (exit 0, said on stderr); a file that is not such a report, or a report that
    does not list its run's cases, is one line, exit 2."""
    ids = [c.id for c in all_cases()[:7]]
    verdicts = ["FAIL", "PASS", "ERROR", "WARN", "SKIP", "SKIP"]        # the 7th: not reached
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"selected": ids, "cases": [
        {"id": i, "verdict": v, "not_run": n == 5} for n, (i, v) in enumerate(zip(ids, verdicts))]}))
    proc = _kbtp("conform", "--target", reference.url, "--rerun-failed", str(earlier), "--json")
    assert proc.returncode == 0, proc.stderr
    assert [c["id"] for c in json.loads(proc.stdout)["cases"]] == [ids[0], ids[2], ids[3], ids[5], ids[6]]
    assert "note" not in proc.stderr, proc.stderr
    for checked, noted in (("iwarp://127.51.249.1:9", True), (reference.url, False)):
        doc = json.loads(earlier.read_text()) | {"target": checked}
        earlier.write_text(json.dumps(doc))
        proc = _kbtp("conform", "--target", reference.url, "--rerun-failed", str(earlier), "--only", ids[0])
        assert proc.returncode == 0, proc.stderr
        assert (f"note: {earlier} judged {checked}; its cases not judged for good run against "
                f"{reference.url}" in proc.stderr) is noted, proc.stderr
    earlier.write_text(json.dumps({"selected": ids[:2], "cases": [{"id": ids[0], "verdict": "PASS"},
                                                                  {"id": ids[1], "verdict": "SKIP"}]}))
    proc = _kbtp("conform", "--target", reference.url, "--rerun-failed", str(earlier))
    assert proc.returncode == 0 and proc.stdout == "" and "no case to run again" in proc.stderr
    for bad, why in (("not json", "is not the JSON report"), ('{"cases": []}', "does not list the cases"),
                     ('{"role": "initiator", "selected": [], "cases": []}', "--role initiator run")):
        earlier.write_text(bad)
        proc = _kbtp("conform", "--target", reference.url, "--rerun-failed", str(earlier))
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and why in proc.stderr, proc.stderr


@pytest.mark.slow
def test_rerun_after_a_run_that_never_reached_the_target(tmp_path):
    """A run that could not reach the target judged nothing: its rerun is its whole
    selection (it said "none failed" and exited 0, so CI went green on nothing)."""
    first = tmp_path / "first.json"
    only = ["--only", "ops.store.", "--only", "completion.order"]
    proc = _kbtp("conform", "--target", "iwarp://127.51.250.2:9", "--timeout", "1", *only,
                 "--json-file", str(first))
    assert proc.returncode == 2 and json.loads(first.read_text())["cases"] == []
    t = start("iwarp", hosts())
    try:
        proc = _kbtp("conform", "--target", t.url, "--rerun-failed", str(first), "--json")
    finally:
        t.stop()
    assert proc.returncode == 0, proc.stderr
    ran = [c["id"] for c in json.loads(proc.stdout)["cases"]]
    assert ran == [c.id for c in all_cases() if c.id.startswith("ops.store.") or c.id == "completion.order"]


def test_help_names_every_exit_status():
    """The README's table gives conform's exit status 130 (Ctrl-C); --help says it too."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    [row] = [line for line in readme.splitlines() if line.startswith("| `conform` |")]
    codes = [code for code, said in zip((0, 1, 2, 130), row.split("|")[2:-1]) if said.strip()]
    helped = " ".join(_kbtp("conform", "--help").stdout.split())
    said = helped[helped.index("Exit status:"):]
    assert codes == [0, 1, 2, 130] and all(f" {code} " in said for code in codes), said


#: what a cross-reference the draft lost leaves in a sentence: "rules 3 and 5 of ),",
#: "Send with Invalidate ,", "Partition STag ()", "operations of ." (not an ellipsis)
BLANK = re.compile(r"\(\s*\)|\s[,;)]|\s\.(?!\.)")


@pytest.mark.parametrize("role", ["target", "initiator"])
def test_requirements_read_without_blank_references(role, tmp_path):
    """Every case's requirement as --list and the HTML report show it: each reference the
    draft left blank is filled with the document NOTES.md names for it, or marked."""
    listed = _kbtp("conform", "--role", role, "--list").stdout
    quotes = [line.strip()[1:-1] for line in listed.splitlines() if line.startswith("    \u201c")]
    page = tmp_path / "r.html"
    cases = all_cases() if role == "target" else initiator_cases()
    page.write_text(report.html("iwarp://127.0.0.1:1", [Outcome(c, "SKIP") for c in cases], None, str(tmp_path)))
    parser = _Page()
    parser.feed(page.read_text())
    shown = [r["cells"][2].split(": ", 1)[1] for r in parser.rows]
    assert len(quotes) == len(shown) == len(cases)
    assert [q for q in quotes + shown if BLANK.search(q)] == []
    notes = (Path(__file__).resolve().parent.parent / "docs" / "NOTES.md").read_text()
    cross_references = notes[notes.index("## 1."):notes.index("## 2.")]
    filled = set(re.findall(r"\[(RFC [^]]+)\]", " ".join(quotes)))
    assert filled and all(ref in cross_references for ref in filled), filled
    if role == "target":
        assert "Send with Invalidate [RFC 5040], invalidating" in listed
        assert "(rules 3 and 5 of [RFC 5040, section 5.5]), so" in listed


class _Page(HTMLParser):
    """The rows of the HTML report (class, cell texts, link targets) and the links of the
    summary above them."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []
        self.cell: list[str] | None = None
        self.summary: list[str] = []
        self.nav = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.nav = self.nav or tag == "nav"
        if tag == "a" and self.nav:
            self.summary.append(a["href"])
        elif tag == "tr" and a.get("class"):
            self.rows.append({"verdict": a["class"], "id": a.get("id"), "cells": [], "links": []})
        elif tag == "td" and self.rows:
            self.cell = []
        elif tag == "a" and self.rows:
            self.rows[-1]["links"].append(a["href"])

    def handle_endtag(self, tag):
        self.nav = self.nav and tag != "nav"
        if tag == "td" and self.cell is not None:
            self.rows[-1]["cells"].append("".join(self.cell))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def html_report(monkeypatch, tmp_path) -> tuple[Path, dict]:
    """``--html`` of two cases against a target that does not clear freed blocks (one WARN
    with a capture, one PASS): the page and the JSON report."""
    bug = BY_NAME["no_clear_on_free"]
    t = start("roce", hosts(), bug)
    page = tmp_path / "report" / "conform.html"
    page.parent.mkdir()
    try:
        bug.plant(t, monkeypatch)
        _, doc = conform(t, tmp_path, "--only", "security.clear_freed", "--only", "completion.order",
                         "--html", str(page), "--pcap-dir", str(tmp_path / "failed"))
    finally:
        t.stop()
    return page, doc


@pytest.mark.slow
def test_html_report_has_each_case_and_links_its_capture(monkeypatch, tmp_path):
    """--html FILE: a page with one row per case (verdict, requirement as quoted, expected,
    seen) and, for a case that did not pass, a link to its capture that leads to it from
    the page's folder."""
    page, doc = html_report(monkeypatch, tmp_path)
    parser = _Page()
    parser.feed(page.read_text())
    rows = {r["id"]: r for r in parser.rows}
    assert set(rows) == {c["id"] for c in doc["cases"]} == {"security.clear_freed", "completion.order"}
    for c in doc["cases"]:
        row = rows[c["id"]]
        assert row["verdict"] == c["verdict"] and row["cells"][0] == c["verdict"]
        assert row["cells"][2] == f"{c['level']}: {c['requirement']}"
        assert row["cells"][3] == (c["expected"] or "") and row["cells"][4] == (c["seen"] or "")
    warn = rows["security.clear_freed"]
    assert warn["verdict"] == "WARN" and len(warn["links"]) == 1
    pcaps = {c["id"]: c["pcap"] for c in doc["cases"]}
    assert (page.parent / warn["links"][0]).resolve() == Path(pcaps["security.clear_freed"]).resolve()
    assert rows["completion.order"]["links"] == []
    assert parser.summary == ["#security.clear_freed"]       # the one case that did not pass

