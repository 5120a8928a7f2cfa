"""The requirement-to-case matrix: every normative sentence of docs/kbtp-draft.txt has a
case that checks it or a reason no peer can, and docs/COVERAGE.md is what it generates."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy.cli import main
from kbtp_scapy.conform import matrix
from kbtp_scapy.conform.cases import all_cases
from kbtp_scapy.conform.coverage_map import CHECKED_BY, EFFECTS
from kbtp_scapy.conform.spec_text import BCP14, sentences

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "docs" / "kbtp-draft.txt").read_text()


def test_every_normative_sentence_has_a_case_or_a_reason():
    gaps = [r.sentence.key for r in matrix.gaps(matrix.matrix(TEXT))]
    assert not gaps, gaps


def test_the_mapping_tables_name_sentences_of_the_text_and_cases_of_the_checker():
    assert matrix.stale_keys(TEXT) == []
    ids = {c.id for c in all_cases()}
    assert not {cid for cases in CHECKED_BY.values() for cid in cases} - ids
    assert not set(EFFECTS) - ids


def test_every_case_checks_some_sentence_and_says_what_it_observes():
    rows = matrix.matrix(TEXT)
    used = {cid for r in rows for cid in r.cases}
    assert {c.id for c in all_cases()} - used == set()
    assert [c.id for c in all_cases() if not matrix.effect(c)] == []


def test_the_walk_finds_every_bcp14_keyword_of_the_normative_sections():
    """Each MUST, MUST NOT, SHOULD and MAY of the text's normative part is in a sentence
    of kind BCP 14: counted in the raw text between the first normative heading and IANA."""
    start, end = TEXT.index("Initiator:\n"), TEXT.index("Target Execution Model This")
    normative = TEXT[start:end] + TEXT[TEXT.index("Transport Bindings\n"):TEXT.index("IANA Considerations IANA")]
    raw = len(BCP14.findall(normative))
    walked = sum(len(BCP14.findall(s.text)) for s in sentences(TEXT) if s.kind == "BCP 14")
    assert walked == raw


def test_a_new_sentence_without_a_case_is_a_gap():
    """A normative sentence added to the text, that no case quotes and no table names,
    shows as a gap, and ``kbtp conform --coverage`` exits 1 naming it."""
    added = TEXT.replace("Generation never takes the value zero.",
                         "Generation never takes the value zero. A target MUST answer within 7 ms.")
    gaps = [r.sentence.text for r in matrix.gaps(matrix.matrix(added))]
    assert gaps == ["A target MUST answer within 7 ms."]


@pytest.mark.slow
def test_cli_coverage_text_json_and_gap(tmp_path, capsys):
    assert main(["conform", "--coverage"]) == 0
    out = capsys.readouterr().out
    assert "0 gaps" in out and "ops.handle.upper_half" in out
    assert main(["conform", "--coverage", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gaps"] == 0 and doc["sentences"] == len(doc["rows"]) > 100
    row = next(r for r in doc["rows"] if r["sentence"].startswith("Request ID is chosen"))
    assert {c["id"] for c in row["cases"]} >= {"completion.request_id", "completion.request_id.full_width"}
    spec = tmp_path / "spec.txt"
    spec.write_text(TEXT.replace("Frees always use FREE.", "Frees always use FREE. BINDs MUST be rare."))
    assert main(["conform", "--coverage", "--spec", str(spec)]) == 1
    assert "BINDs MUST be rare" in capsys.readouterr().err


@pytest.mark.slow
def test_page_is_fresh_and_check_catches_staleness(tmp_path):
    tool = [sys.executable, str(ROOT / "tools" / "coverage_page.py")]
    assert subprocess.run([*tool, "--check"], capture_output=True, timeout=120).returncode == 0
    page = tmp_path / "COVERAGE.md"
    assert subprocess.run([*tool, "--out", str(page)], capture_output=True, timeout=120).returncode == 0
    page.write_text(page.read_text().replace("ops.handle.upper_half", "ops.handle.upper"))
    proc = subprocess.run([*tool, "--check", "--out", str(page)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "stale" in proc.stderr
