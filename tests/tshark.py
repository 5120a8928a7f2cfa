"""Run the real tshark and return its field values per frame, for oracle tests."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

TSHARK = shutil.which("tshark")
needs_tshark = pytest.mark.skipif(TSHARK is None, reason="tshark is not installed")


def _flatten(node, out: dict[str, list]) -> None:
    """Collect every 'proto.field': value pair of tshark's JSON tree, in order."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                _flatten(value, out)
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    out.setdefault(key, []).extend(value)
            else:
                out.setdefault(key, []).append(value)
    elif isinstance(node, list):
        for item in node:
            _flatten(item, out)


def tshark_frames(pcap: Path | str, *args: str) -> list[dict[str, list]]:
    """One dict per frame: field name -> list of string values as tshark shows them."""
    proc = subprocess.run(
        [TSHARK or "tshark", "-n", "-r", str(pcap), "-T", "json", *args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    frames = []
    for frame in json.loads(proc.stdout or "[]"):
        out: dict[str, list] = {}
        _flatten(frame["_source"]["layers"], out)
        frames.append(out)
    return frames


def tshark_text(pcap: Path | str, *args: str) -> str:
    """tshark's one-line-per-frame output plus stderr, for malformed/expert checks."""
    proc = subprocess.run(
        [TSHARK or "tshark", "-n", "-r", str(pcap), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr
