"""Outputs of a run: text and an HTML page for people, JSON and JUnit XML for machines, and
the exit code."""
from __future__ import annotations

import html as _html
import json
import os
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ..initiator.results import TargetInfo
from ..words import count
from .registry import ERROR, FAIL, PASS, SKIP, UNTESTABLE, VERDICTS, WARN, Case, checked_by
from .runner import Outcome

EXIT_OK, EXIT_DIFFERS, EXIT_HARNESS = 0, 1, 2


def exit_code(outcomes: Iterable[Outcome], strict: bool = False) -> int:
    """1 when any case failed (with ``strict``, or WARNed), else 2 when any could not be
    judged, else 0: a target that fails a requirement is told so even when other cases
    could not be judged because of it."""
    verdicts = {o.verdict for o in outcomes}
    if FAIL in verdicts or strict and WARN in verdicts:
        return EXIT_DIFFERS
    return EXIT_HARNESS if ERROR in verdicts else EXIT_OK


def listing(cases: list[Case]) -> str:
    lines = []
    for c in cases:
        needs = []
        if c.transport:
            needs.append(c.transport)
        if c.features:
            needs.append(f"features {c.features:#06x}")
        lines.append(f"{c.id:40} {c.level:8} {c.section}{' [' + ', '.join(needs) + ']' if needs else ''}")
        lines.append(f"    \u201c{c.shown}\u201d")
    return "\n".join(lines)


def requirements(outcomes: list[Outcome]) -> dict[str, Any] | None:
    """The normative sentences of the text (``kbtp conform --coverage``) and how many of
    them a case of this run judged; None without the text beside the checker."""
    from . import matrix
    if not matrix.SPEC.exists():
        return None
    rows = matrix.matrix()
    judged = {o.case.id for o in outcomes if o.verdict in (PASS, FAIL, WARN)}
    return {"sentences": len(rows), "judged_in_this_run": sum(any(c in judged for c in r.cases) for r in rows),
            "checked_by_some_case": sum(bool(r.cases) for r in rows),
            "not_checkable": sum(bool(r.reason) and not r.cases for r in rows), "gaps": len(matrix.gaps(rows))}


def coverage(outcomes: list[Outcome]) -> dict[str, Any]:
    """Per section: cases run and judged (PASS/FAIL/WARN), plus the untestable requirements."""
    sections: dict[str, Counter] = {}
    for o in outcomes:
        s = sections.setdefault(o.case.group, Counter())
        s["cases"] += 1
        s["judged"] += o.verdict in (PASS, FAIL, WARN)
    return {"sections": {k: dict(v) for k, v in sorted(sections.items())},
            "judged": sum(v["judged"] for v in sections.values()),
            "cases": len(outcomes),
            "not_checkable": [{"section": u.section, "level": u.level, "requirement": u.shown,
                               "reason": u.reason} for u in UNTESTABLE]}


def header(url: str, info: TargetInfo) -> str:
    return (f"kbtp conform {url}: Features {info.features:#06x}, Block Size {info.block_size}, "
            f"quota {info.quota}, Ticket Timeout {info.ticket_timeout_ms} ms\n")


def case_lines(o: Outcome, quiet: bool = False) -> list[str]:
    """The lines of one case: its verdict, and for one that did not pass, why."""
    if quiet and o.verdict == PASS and not o.notes:
        return []
    out = [f"{o.verdict:5}  {o.case.id}{'  (' + o.detail + ')' if o.detail and o.verdict == SKIP else ''}"]
    if o.verdict in (FAIL, WARN, ERROR):
        if o.broke is None:
            out.append(f"       requirement ({o.case.level}, {o.case.section}): \u201c{o.case.shown}\u201d")
        else:
            rule = checked_by(o.broke)
            out.append(f"       broke ({rule.level}, {rule.section}; {rule.id}): \u201c{rule.shown}\u201d")
        if o.expected or o.seen:
            out.append(f"       expected: {o.expected}")
            out.append(f"       seen:     {o.seen}")
        if o.detail:
            out.append(f"       {'during:' if o.broke else 'error: '}   {o.detail}")
        if o.pcap:
            out.append(f"       pcap:     {o.pcap}")
    out += [f"       info: {note}" for note in o.notes]
    return out


def went_away(left: int, case_id: str) -> str:
    return f"{count(left, 'case')} could not run: the target went away at case {case_id}"


def not_run(outcomes: list[Outcome]) -> str:
    """``N cases could not run: the target went away at case X``, or "" when all ran."""
    left = [o for o in outcomes if o.not_run]
    return went_away(len(left), left[0].gone_at) if left else ""


def interrupted(judged: int, total: int, by: str = "Ctrl-C") -> str:
    """What a run stopped by Ctrl-C (or SIGTERM) says of itself (its reports' error, its result line)."""
    return f"interrupted ({by}) after {judged} of {count(total, 'case')}"


def footer(outcomes: list[Outcome], stopped: str = "") -> str:
    """The coverage and result lines; ``stopped`` says why the run ended early."""
    counts = Counter(o.verdict for o in outcomes)
    cov = coverage(outcomes)
    return "\n".join([
        "", "coverage: " + ", ".join(f"{k} {v['judged']}/{v['cases']}" for k, v in cov["sections"].items())
        + f"; {cov['judged']} of {cov['cases']} cases judged; {len(cov['not_checkable'])} requirements "
        "cannot be judged from the wire (see --json)",
        "result: " + (f"{stopped}: " if stopped else "") + ", ".join(f"{counts[v]} {v}" for v in VERDICTS)])


def text(url: str, info: TargetInfo, outcomes: list[Outcome], quiet: bool = False) -> str:
    """Every case, or with ``quiet`` only those that did not pass; the counts cover all."""
    lines = [header(url, info)]
    for o in outcomes:
        lines += case_lines(o, quiet)
    return "\n".join(lines) + "\n" + footer(outcomes)


def as_json(url: str, info: TargetInfo | None, outcomes: list[Outcome], error: str | None = None,
            strict: bool = False, quick: bool = False, selected: Iterable[Case] = (),
            code: int | None = None) -> str:
    """The report; ``selected`` the cases the run was to judge (``--rerun-failed`` runs those
    it did not judge again), ``code`` the exit status when the run ended early (Ctrl-C)."""
    doc = {
        "target": url,
        "error": error,
        "exit_code": code if code is not None else EXIT_HARNESS if error else exit_code(outcomes, strict),
        "strict": strict,
        "quick": quick,
        "selected": [c.id for c in selected],
        "target_info": None if info is None else {
            "features": info.features, "request_credits": info.request_credits,
            "block_size": info.block_size, "max_inline": info.max_inline, "quota": info.quota,
            "handle_base": info.handle_base, "handle_count": info.handle_count,
            "ticket_timeout_ms": info.ticket_timeout_ms},
        "summary": {v: sum(o.verdict == v for o in outcomes) for v in VERDICTS},
        "gone_at": next((o.gone_at for o in outcomes if o.gone_at), None),
        "cases": [{"id": o.case.id, "section": o.case.section, "level": o.case.level,
                   "requirement": o.case.shown, "verdict": o.verdict, "expected": o.expected,
                   "seen": o.seen, "detail": o.detail, "not_run": o.not_run, "notes": o.notes, "pcap": o.pcap,
                   "broke": None if o.broke is None else o.broke.value,
                   "seconds": round(o.duration, 3)} for o in outcomes],
        "coverage": {**coverage(outcomes), "requirements": requirements(outcomes)},
    }
    return json.dumps(doc, indent=2)


def junit(url: str, outcomes: list[Outcome], error: str | None = None) -> bytes:
    """JUnit XML; a WARN is a failure of type "warning", so that CI shows it. A run that did
    not finish has one more testcase, "harness", in error: every count covers it."""
    suite = ET.Element("testsuite", name="kbtp-conform", tests=str(len(outcomes) + bool(error)),
                       failures=str(sum(o.verdict in (FAIL, WARN) for o in outcomes)),
                       errors=str(sum(o.verdict == ERROR for o in outcomes) + bool(error)),
                       skipped=str(sum(o.verdict == SKIP for o in outcomes)),
                       time=f"{sum(o.duration for o in outcomes):.3f}")
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="target", value=url)
    for o in outcomes:
        tc = ET.SubElement(suite, "testcase", classname=f"kbtp.{o.case.group}", name=o.case.id,
                           time=f"{o.duration:.3f}")
        message = f"expected {o.expected}; seen {o.seen}" if o.expected or o.seen else o.detail
        rule = o.case if o.broke is None else checked_by(o.broke)
        body = (f"{'' if o.broke is None else 'broke ' + rule.id + ', '}{rule.level}: {rule.shown}"
                + (f"\npcap: {o.pcap}" if o.pcap else ""))
        if o.verdict == FAIL:
            ET.SubElement(tc, "failure", message=message, type=o.case.level).text = body
        elif o.verdict == WARN:
            ET.SubElement(tc, "failure", message=f"WARN (SHOULD not met): {message}",
                          type="warning").text = body
        elif o.verdict == ERROR:
            ET.SubElement(tc, "error", message=f"{o.detail}: {message}" if o.expected else message).text = body
        elif o.verdict == SKIP:
            ET.SubElement(tc, "skipped", message=o.detail)
        if o.notes:
            ET.SubElement(tc, "system-out").text = "\n".join(o.notes)
    if error:
        tc = ET.SubElement(suite, "testcase", classname="kbtp.harness", name="harness", time="0")
        ET.SubElement(tc, "error", message=error)
    return ET.tostring(suite, encoding="utf-8", xml_declaration=True)


_STYLE = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;width:100%}
td,th{border:1px solid #ccc;padding:.3em .5em;vertical-align:top;text-align:left}
tr.PASS td.verdict{background:#d8f5d8}tr.FAIL td.verdict{background:#f7c4c4}
tr.WARN td.verdict{background:#fde7b5}tr.ERROR td.verdict{background:#f3c6f3}
tr.SKIP td.verdict{background:#e4e4e4}code{white-space:pre-wrap}
nav.not-passed li{margin:.15em 0}nav.not-passed b{display:inline-block;width:4em}"""
#: The order of the summary's links: what needs a look first.
_FIRST = (FAIL, WARN, ERROR, SKIP)


def _not_passed(outcomes: list[Outcome]) -> str:
    """The summary at the top of the page: a link to each case's row that did not PASS."""
    e = _html.escape
    items = [f'<li><b>{e(v)}</b> <a href="#{e(o.case.id)}">{e(o.case.id)}</a></li>'
             for v in _FIRST for o in outcomes if o.verdict == v]
    if not items:
        return ""
    return (f'<nav class="not-passed"><h2>{count(len(items), "case")} did not pass</h2><ul>'
            + "".join(items) + "</ul></nav>")


def html(url: str, outcomes: list[Outcome], error: str | None, where: str) -> str:
    """One page for people: the counts and a link to each case that did not pass, then
    every case (its row's id is the case's) with its requirement, what was expected and
    seen, and a link to its capture (relative to ``where``, the page's folder, so the page
    and --pcap-dir move together)."""
    e = _html.escape
    counts = ", ".join(f"{sum(o.verdict == v for o in outcomes)} {v}" for v in VERDICTS)
    rows = []
    for o in outcomes:
        pcap = "" if not o.pcap else \
            f'<a href="{e(os.path.relpath(o.pcap, where))}">{e(os.path.basename(o.pcap))}</a>'
        rows.append(f'<tr class="{e(o.verdict)}" id="{e(o.case.id)}"><td class="verdict">{e(o.verdict)}</td>'
                    f"<td><code>{e(o.case.id)}</code><br>{e(o.case.section)}</td><td>{e(o.case.level)}: "
                    f"{e(o.case.shown)}</td><td>{e(o.expected or '')}</td><td>{e(o.seen or '')}</td>"
                    f"<td>{e(o.detail or '')}</td><td>{pcap}</td></tr>")
    problem = f'<p class="error">The run did not finish: {e(error)}</p>' if error else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>kbtp conform: {e(url)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>kbtp conform: {e(url)}</h1>{problem}<p class=\"summary\">{e(counts)}</p>{_not_passed(outcomes)}"
            "<table><thead><tr><th>verdict</th><th>case</th><th>requirement</th><th>expected</th>"
            "<th>seen</th><th>detail</th><th>capture</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></body></html>\n")
