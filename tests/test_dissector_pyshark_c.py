"""pyshark with the C plugin, as a user installs it: ``kbtp dissector install --c`` into a
HOME of the test's own, then pyshark reads every message (``display_filter="kbtp.opcode"``,
the filter for messages: ``kbtp`` also matches data frames) and finds the same kbtp fields,
values and labels, frame for frame, as through the Lua form."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cplugin import ROOT, TCP_FIRST, c_plugin, needs_toolchain  # noqa: F401 (fixture)
from tests.test_dissector import PLUGIN
from tests.tshark import TSHARK, needs_tshark, private_home, pyshark_packets

pytestmark = [needs_tshark, needs_toolchain]

PCAPS = sorted((ROOT / "pcaps").glob("*.pcap"))


def kbtp_fields(packets: list) -> list[tuple[int, list]]:
    """Per packet: its number and, for each kbtp layer, every field's name, value and label."""
    return [(int(pkt.number), [[(name, f.show, f.showname) for name in layer.field_names
                                for f in layer.get_field(name).all_fields]
                               for layer in pkt.layers if layer.layer_name == "kbtp"])
            for pkt in packets]


def messages(pcap: Path, params: tuple[str, ...]) -> int:
    """How many frames tshark itself shows with kbtp.opcode, under the same environment."""
    proc = subprocess.run([TSHARK or "tshark", "-n", "-r", str(pcap), *params, "-Y", "kbtp.opcode"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return len(proc.stdout.splitlines())


@pytest.fixture
def installed_c(tmp_path, monkeypatch, c_plugin) -> Path:  # noqa: F811
    """The C plugin installed into the test's own HOME, and the environment set so that
    tshark (and so pyshark) loads it. Wireshark reads no personal plugin folder when run as
    root: then the same sources' preload build (tests/cplugin.py) stands in for it."""
    env = private_home(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "dissector", "install", "--c"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    plugin = Path(next(line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("installed ")))
    assert plugin.is_relative_to(tmp_path) and plugin.name == "kbtp.so" and plugin.parent.name == "epan"
    for key in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(key, env[key])
    if os.geteuid() == 0:
        monkeypatch.setenv("LD_PRELOAD", str(c_plugin))
    else:
        listed = subprocess.run([TSHARK or "tshark", "-G", "plugins"], capture_output=True, text=True,
                                timeout=120).stdout
        assert str(plugin) in listed, listed
    return plugin


def test_pyshark_reads_the_same_kbtp_fields_from_the_c_plugin_as_from_the_lua_form(installed_c, monkeypatch):
    got = {}
    for pcap in PCAPS:
        count = messages(pcap, TCP_FIRST)
        assert count, pcap.name
        got[pcap.name] = kbtp_fields(pyshark_packets(pcap, count, TCP_FIRST))
    monkeypatch.undo()                  # the suite's own HOME, no C plugin: kbtp.lua alone
    assert "LD_PRELOAD" not in os.environ
    for pcap in PCAPS:
        lua = kbtp_fields(pyshark_packets(pcap, messages(pcap, PLUGIN), PLUGIN))
        assert [n for n, _ in got[pcap.name]] == [n for n, _ in lua], pcap.name
        differ = [(a, b) for a, b in zip(got[pcap.name], lua) if a != b]
        assert not differ, (pcap.name, differ[:1])
        assert all(layers and all(layers) for _, layers in lua), pcap.name
