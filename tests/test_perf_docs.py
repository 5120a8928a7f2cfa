"""docs/PERFORMANCE.md and the benchmarks that write it: every table is written by the
command its section names, and ``--write-docs`` replaces that table and nothing else."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy import tables as T

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "PERFORMANCE.md"
SECTION = re.compile(r"<!-- (\w+):begin -->\n(.*?)<!-- \1:end -->", re.S)


def test_every_table_is_written_by_the_command_its_section_names():
    text = PAGE.read_text()
    names = [m[1] for m in SECTION.finditer(text)]
    assert len(names) == text.count(":begin -->") == len(set(names)) >= 6
    for name in names:
        script = ROOT / "tools" / f"{name}.py"
        assert f'write_section(args.write_docs, "{name}"' in script.read_text(), script
        heading = text.rfind("\n## ", 0, text.index(f"<!-- {name}:begin -->"))
        assert f"`tools/{name}.py --write-docs" in text[heading:text.index(f"<!-- {name}:begin -->")]


def _outside(text: str) -> str:
    return SECTION.sub(lambda m: m[1], text)


@pytest.mark.slow
def test_bench_codec_rewrites_its_table_and_nothing_else(tmp_path):
    page = tmp_path / "PERFORMANCE.md"
    shutil.copy(PAGE, page)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_codec.py"), "--seconds", "0.02",
                           "--write-docs", str(page)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    written = {m[1]: m[2] for m in SECTION.finditer(page.read_text())}
    before = {m[1]: m[2] for m in SECTION.finditer(PAGE.read_text())}
    assert _outside(page.read_text()) == _outside(PAGE.read_text())
    assert {k: v for k, v in written.items() if k != "bench_codec"} == \
        {k: v for k, v in before.items() if k != "bench_codec"}
    table = written["bench_codec"]
    assert set(table.splitlines()) <= {line.rstrip() for line in proc.stdout.splitlines()}  # as printed
    for message in T.MESSAGES:
        assert len(re.findall(rf"^\| {message.name} \| [\d.]+ \| [\d.]+ \| \d+× \|$", table, re.M)) == 2


def test_a_page_without_the_markers_is_refused_in_one_line_before_the_run(tmp_path):
    page = tmp_path / "elsewhere.md"
    page.write_text("# no tables here\n")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_codec.py"), "--seconds", "5",
                           "--write-docs", str(page)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"{page}: no <!-- bench_codec:begin --> ... <!-- bench_codec:end --> markers; "
        "the table has nowhere to go"]
    assert page.read_text() == "# no tables here\n"
