"""The C plugin for the suite: built once per session from the committed packet-kbtp.c,
and tshark runs with it loaded.

Wireshark reads no personal plugin folder when it runs as root (as the suite does in
containers), so the suite loads the plugin with LD_PRELOAD: the preload build registers
the plugin when the library loads, as Wireshark's loader would (``build(preload=True)``).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kbtp_scapy.dissector.build import build, toolchain_missing
from tests.tshark import TSHARK

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "dissector" / "kbtp.lua"
MISSING = toolchain_missing()
needs_toolchain = pytest.mark.skipif(MISSING is not None, reason=f"the C plugin cannot be built: {MISSING}")
TCP_FIRST = ("-o", "tcp.try_heuristic_first:TRUE")


@pytest.fixture(scope="session")
def c_plugin(tmp_path_factory) -> Path:
    """kbtp-preload.so, built with -Wall -Wextra -Werror: the build fails on any warning."""
    return build(tmp_path_factory.mktemp("cplugin"), preload=True)


def run_form(form: str, plugin: Path, pcap: Path, *args: str, env: dict | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """tshark over ``pcap`` with the ``c`` or the ``lua`` form of the dissector."""
    env = dict(env or os.environ)
    cmd = [TSHARK or "tshark", "-n", "-r", str(pcap), *TCP_FIRST, *args]
    if form == "c":
        env["LD_PRELOAD"] = str(plugin)
    else:
        cmd += ["-X", f"lua_script:{LUA}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (form, proc.stderr)
    return proc
