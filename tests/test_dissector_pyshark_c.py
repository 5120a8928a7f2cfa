"""pyshark with the C plugin, as a user installs it: ``kbtp dissector install --c`` into a
HOME of the test's own, then pyshark reads every message (``display_filter="kbtp.opcode"``,
the filter for messages: ``kbtp`` also matches data frames) and finds the same kbtp fields,
values and labels, frame for frame, as through the Lua form."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cplugin import ROOT, TCP_FIRST, needs_toolchain
from tests.test_dissector import PLUGIN
from tests.tshark import TSHARK, Installed, installed_c_plugin, needs_tshark, pyshark_packets

pytestmark = [needs_tshark, needs_toolchain]

PCAPS = sorted((ROOT / "pcaps").glob("*.pcap"))


def kbtp_fields(packets: list) -> list[tuple[int, list]]:
    """Per packet: its number and, for each kbtp layer, every field's name, value and label."""
    return [(int(pkt.number), [[(name, f.show, f.showname) for name in layer.field_names
                                for f in layer.get_field(name).all_fields]
                               for layer in pkt.layers if layer.layer_name == "kbtp"])
            for pkt in packets]


def messages(pcap: Path, params: tuple[str, ...], tshark: str) -> int:
    """How many frames tshark itself shows with kbtp.opcode, under the same environment."""
    proc = subprocess.run([tshark, "-n", "-r", str(pcap), *params, "-Y", "kbtp.opcode"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return len(proc.stdout.splitlines())


@pytest.fixture
def installed_c(monkeypatch) -> Iterator[Installed]:
    """The C plugin installed into a HOME of the test's own, and that HOME in the environment
    pyshark starts tshark in."""
    with installed_c_plugin() as installed:
        for key in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"):
            monkeypatch.setenv(key, installed.env[key])
        yield installed


@pytest.mark.slow
def test_pyshark_reads_the_same_kbtp_fields_from_the_c_plugin_as_from_the_lua_form(installed_c, monkeypatch):
    tshark, folder = installed_c.tshark, installed_c.pcaps
    got = {}
    for pcap in PCAPS:
        count = messages(folder / pcap.name, TCP_FIRST, tshark)
        assert count, pcap.name
        got[pcap.name] = kbtp_fields(pyshark_packets(folder / pcap.name, count, TCP_FIRST, tshark_path=tshark))
    monkeypatch.undo()                  # the suite's own HOME, no C plugin: kbtp.lua alone
    for pcap in PCAPS:
        lua = kbtp_fields(pyshark_packets(pcap, messages(pcap, PLUGIN, TSHARK or "tshark"), PLUGIN))
        assert [n for n, _ in got[pcap.name]] == [n for n, _ in lua], pcap.name
        differ = [(a, b) for a, b in zip(got[pcap.name], lua) if a != b]
        assert not differ, (pcap.name, differ[:1])
        assert all(layers and all(layers) for _, layers in lua), pcap.name
