"""Write a benchmark's table into its section of docs/PERFORMANCE.md (or of its own page).

Each table sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``, NAME being the
script's (``bench_codec``); the text around the markers, which says what was measured and by
which command, is written by hand and kept. Every ``tools/bench_*.py`` takes
``--write-docs [FILE]`` (FILE: another copy of the page, as the tests use).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PERFORMANCE = Path(__file__).resolve().parent.parent / "docs" / "PERFORMANCE.md"


class MissingSection(Exception):
    """The page has no begin and end markers of that name, in that order."""


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with what lies between NAME's markers replaced by ``body``."""
    begin, end = markers(name)
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start >= 0 else -1
    if start < 0 or stop < 0:
        raise MissingSection(f"no {begin} ... {end} markers")
    return f"{text[:start + len(begin)]}\n{body.strip(chr(10))}\n{text[stop:]}"


def _replaced(path: Path, name: str, body: str) -> str:
    try:
        return replace_section(path.read_text(), name, body)
    except (OSError, MissingSection) as exc:
        raise SystemExit(f"{path}: {getattr(exc, 'strerror', None) or exc}; "
                         "the table has nowhere to go") from None


def check_section(path: Path, name: str) -> None:
    """Exit with one line before a long run, not after it, when its table has nowhere to go."""
    _replaced(path, name, "")


def write_section(path: Path, name: str, body: str) -> None:
    path.write_text(_replaced(path, name, body))
    print(f"wrote the {name} table into {path}", file=sys.stderr)


def add_write_docs(parser: argparse.ArgumentParser, page: Path = PERFORMANCE) -> None:
    """The ``--write-docs [FILE]`` option every benchmark script shares; ``page``: where its
    table lives (docs/PERFORMANCE.md, or the page of its own subject: docs/CHAINS.md)."""
    parser.add_argument("--write-docs", nargs="?", type=Path, const=page, default=None,
                        metavar="FILE", help=f"write the table into its section of "
                        f"docs/{page.name} (or of FILE)")
