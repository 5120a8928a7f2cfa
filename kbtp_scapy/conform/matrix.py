"""The requirement-to-case matrix: every normative sentence of the text, and what checks it.

A sentence is checked by a case when the case quotes it (a fragment of the case's quoted
requirement of at least four words appears in the sentence, or the sentence in it), or
when ``CHECKED_BY`` names the case for it (cases that test a sentence without quoting
it, such as the boundary and full-width cases). Every other sentence needs a reason in
``NOT_CHECKED`` why no peer can judge it from the wire. ``matrix`` pairs each sentence
with its cases and the observable effect each relies on; a sentence with neither a case
nor a reason is a gap (``gaps``), which the test suite refuses.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .cases import all_cases
from .coverage_map import CHECKED_BY, EFFECTS, NOT_CHECKED
from .registry import Case
from .spec_text import Sentence, sentences

#: The text this checkout carries (a copy of the specification as received).
SPEC = Path(__file__).resolve().parents[2] / "docs" / "kbtp-draft.txt"
MIN_WORDS = 4


@dataclass
class Row:
    sentence: Sentence
    cases: list[str] = field(default_factory=list)
    how: dict[str, str] = field(default_factory=dict)   # case id -> "quoted" or "mapped"
    reason: str = ""

    @property
    def covered(self) -> bool:
        return bool(self.cases or self.reason)


def normal(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9_]+", text.lower()))


def fragments(requirement: str) -> list[str]:
    """The quoted requirement cut at ellipses, brackets and sentence ends, normalized."""
    parts = re.split(r"\.\.\.|[()\[\]]|(?<=[.;:])\s", requirement)
    return [n for p in parts if (n := normal(p))]


def quotes(case: Case, sentence: Sentence) -> bool:
    """The case quotes the sentence: a fragment of its requirement is the whole sentence,
    or a fragment of at least MIN_WORDS words is part of it, or (for a long sentence) the
    requirement quotes all of it."""
    said = normal(sentence.text)
    parts = fragments(case.requirement)
    return bool(said) and (said in parts or any(len(f.split()) >= MIN_WORDS and f in said for f in parts)
                           or len(said.split()) >= 2 * MIN_WORDS and said in normal(case.requirement))


def _match(table: Mapping[str, object], sentence: Sentence) -> str | None:
    """The key of ``table`` that names ``sentence`` (its section and first words)."""
    for key in table:
        section, _, start = key.partition(": ")
        if section == sentence.section and sentence.text.startswith(start):
            return key
    return None


def matrix(text: str | None = None, cases: list[Case] | None = None) -> list[Row]:
    text = SPEC.read_text() if text is None else text
    cases = all_cases() if cases is None else cases
    rows = []
    for s in sentences(text):
        row = Row(s)
        for c in cases:
            if quotes(c, s):
                row.cases.append(c.id)
                row.how[c.id] = "quoted"
        key = _match(CHECKED_BY, s)
        for cid in CHECKED_BY.get(key, ()) if key else ():
            if cid not in row.cases:
                row.cases.append(cid)
                row.how[cid] = "mapped"
        key = _match(NOT_CHECKED, s)
        if key:
            row.reason = NOT_CHECKED[key]
        rows.append(row)
    return rows


def stale_keys(text: str | None = None) -> list[str]:
    """Keys of the mapping tables that name no sentence of the text (it changed)."""
    text = SPEC.read_text() if text is None else text
    ss = sentences(text)
    return [k for table in (CHECKED_BY, NOT_CHECKED) for k in table
            if not any(_match({k: None}, s) for s in ss)]


def gaps(rows: list[Row]) -> list[Row]:
    return [r for r in rows if not r.covered]


def effect(case: Case) -> str:
    """What the case observes: its docstring's first sentence, else its entry in EFFECTS."""
    if case.id in EFFECTS:
        return EFFECTS[case.id]
    doc = " ".join((case.fn.__doc__ or "").split())
    return re.split(r"(?<=\.)\s", doc, maxsplit=1)[0] if doc else ""


def as_dict(rows: list[Row]) -> dict:
    by_id = {c.id: c for c in all_cases()}
    out = []
    for r in rows:
        out.append({"section": r.sentence.section, "kind": r.sentence.kind, "keyword": r.sentence.keyword,
                     "sentence": r.sentence.text,
                     "cases": [{"id": cid, "how": r.how[cid], "effect": effect(by_id[cid])} for cid in r.cases],
                     "not_checkable": r.reason or None})
    kinds: dict[str, dict[str, int]] = {}
    for r in rows:
        k = kinds.setdefault(r.sentence.kind, {"sentences": 0, "checked": 0, "not_checkable": 0, "gaps": 0})
        k["sentences"] += 1
        k["checked" if r.cases else "not_checkable" if r.reason else "gaps"] += 1
    return {"sentences": len(rows), "checked": sum(bool(r.cases) for r in rows),
            "not_checkable": sum(bool(r.reason) and not r.cases for r in rows),
            "gaps": len(gaps(rows)), "by_kind": kinds, "rows": out}


def text_report(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        s = r.sentence
        mark = "GAP " if not r.covered else "    "
        lines.append(f"{mark}[{s.section}; {s.kind}{' ' + s.keyword if s.keyword else ''}] \u201c{s.text}\u201d")
        for cid in r.cases:
            lines.append(f"        {cid}{' (mapped)' if r.how[cid] == 'mapped' else ''}")
        if r.reason:
            lines.append(f"        {'in part ' if r.cases else ''}not checkable: {r.reason}")
    d = as_dict(rows)
    lines.append(f"\n{d['sentences']} normative sentences: {d['checked']} checked by cases, "
                 f"{d['not_checkable']} not checkable from the wire (with the reason), {d['gaps']} gaps")
    return "\n".join(lines) + "\n"


def markdown(rows: list[Row]) -> str:
    """docs/COVERAGE.md: the matrix as a page (generated; ``tools/coverage_page.py``)."""
    by_id = {c.id: c for c in all_cases()}
    d = as_dict(rows)
    out = ["# Requirement-to-case matrix", "",
           "Generated from the specification's text by `tools/coverage_page.py` (do not edit; "
           "`kbtp conform --coverage` prints the same, `--json` as JSON). Each normative sentence, "
           "found in the text, with the conformance cases that check it and the observable effect "
           "each relies on, or why no peer can check it from the wire.", "",
           f"{d['sentences']} sentences: {d['checked']} checked, {d['not_checkable']} not checkable, "
           f"{d['gaps']} gaps.", "",
           "| kind | sentences | checked | not checkable | gaps |", "| --- | --- | --- | --- | --- |"]
    for kind, k in sorted(d["by_kind"].items()):
        out.append(f"| {kind} | {k['sentences']} | {k['checked']} | {k['not_checkable']} | {k['gaps']} |")
    section = None
    for r in rows:
        s = r.sentence
        if s.section != section:
            section = s.section
            out += ["", f"## {section}", ""]
        out.append(f"- **{s.kind}{' ' + s.keyword if s.keyword else ''}**: {s.text}")
        for cid in r.cases:
            eff = effect(by_id[cid])
            out.append(f"  - `{cid}`{' (mapped)' if r.how[cid] == 'mapped' else ''}: {eff}")
        if r.reason:
            out.append(f"  - {'in part ' if r.cases else ''}not checkable: {r.reason}")
        if not r.covered:
            out.append("  - **gap**: no case and no reason")
    return "\n".join(out) + "\n"
