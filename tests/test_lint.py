"""ruff and mypy over the project with its pyproject.toml settings, as CI runs them: a
lint or type error fails the suite here, before it reaches CI.

Both run from the environment the suite runs in (``python -m``), so the versions are the
ones the ``[test]`` extra pins. mypy keeps its cache in the checkout's ``.mypy_cache``
(ignored by git): about 15 s cold on two busy cores, under a second warm.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed: ./tools/install.sh installs the [test] extra")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    proc = _run("ruff", "check", "--no-fix", "--output-format", "concise", ".")
    if proc.returncode != 0:
        pytest.fail(f"ruff check:\n{proc.stdout}{proc.stderr}", pytrace=False)


def test_mypy_finds_nothing_in_the_whole_package() -> None:
    proc = _run("mypy")                      # files and strictness from pyproject.toml
    if proc.returncode != 0:
        pytest.fail(f"mypy:\n{proc.stdout}{proc.stderr}", pytrace=False)
    checked = re.search(r"no issues found in (\d+) source files", proc.stdout)
    modules = sum(1 for _ in (ROOT / "kbtp_scapy").rglob("*.py"))
    assert checked is not None and int(checked[1]) == modules, \
        f"mypy checked {checked[1] if checked else 'no'} files of the package's {modules}:\n{proc.stdout}"
