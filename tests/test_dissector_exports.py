"""The dissector as a Wireshark, tshark or pyshark user meets it: every field of every
message once in tshark's default JSON, in -T ek and through pyshark, equal to what
``kbtp decode`` reads; the installed copy and -X lua_script: together; the suite's own
HOME."""
from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kbtp_scapy import codec
from kbtp_scapy.builders.recorder import write_pcap
from kbtp_scapy.vocab import Opcode
from tests.test_decode import multi_connection, streamed
from tests.test_dissector import LUA, PLUGIN
from tests.tshark import TSHARK, folders, needs_tshark, private_home, pyshark_packets

pytestmark = needs_tshark

ROOT = Path(__file__).resolve().parent.parent
PCAPS = sorted((ROOT / "pcaps").glob("*.pcap"))


@pytest.fixture(scope="module")
def captures(tmp_path_factory) -> list[Path]:
    """The samples, the multi-connection variant, and messages with two expert infos each
    (over credits and undefined flag bits; an answer to nothing)."""
    tmp = tmp_path_factory.mktemp("exports")
    experts = []
    for transport in ("roce", "iwarp"):
        load = {"opcode": Opcode.LOAD, "dd.stag": 1, "dd.length": 8}
        path = tmp / f"experts_{transport}.pcap"
        write_pcap(path, transport, [(d, codec.encode(v)) for d, v in [
            ("request", {"opcode": Opcode.HELLO}),
            ("response", {"opcode": Opcode.HELLO_ACK, "hello_ack.request_credits": 1}),
            ("request", {**load, "request_id": 1}),
            ("request", {**load, "request_id": 2, "flags": 0x0100}),
            ("response", {"opcode": Opcode.COMPLETION, "request_id": 99, "status": 3})]])
        experts.append(path)
    return [*PCAPS, multi_connection(tmp / "multi.pcap"), *experts]


def run(pcap: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([TSHARK, "-n", "-r", str(pcap), *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and "Lua" not in proc.stderr, proc.stderr
    return proc


def by_frame(pcap: Path) -> dict[int, dict]:
    """``kbtp decode``'s fields per frame (one message per frame in these captures)."""
    out: dict[int, dict] = {}
    for obj in streamed(pcap):
        assert obj["frame"] not in out
        out[obj["frame"]] = {k: v for k, v in obj.items() if k.startswith("kbtp.")}
    return out


def same(shown, value) -> bool:
    """A value as tshark shows it (text, or JSON numbers and booleans in -T ek) equals the
    decoder's."""
    if isinstance(shown, (bool, int)):
        return int(shown) == value
    if isinstance(value, str):
        return shown.replace(":", "") == value
    if shown in ("True", "False"):
        return int(shown == "True") == value
    return int(shown, 0) == value


def leaves(node, out: Counter, values: dict) -> None:
    for key, value in node.items():
        if isinstance(value, dict):
            leaves(value, out, values)
        elif key.startswith("kbtp."):
            out[key] += 1
            values[key] = value


@pytest.mark.slow
def test_every_field_once_in_the_default_json(captures):
    for pcap in captures:
        dups: list[tuple[str, str]] = []

        def no_duplicates(pairs):
            keys = Counter(k for k, _ in pairs)
            dups.extend((pcap.name, k) for k, n in keys.items() if n > 1 and k.startswith("kbtp"))
            return dict(pairs)
        frames = json.loads(run(pcap, *PLUGIN, "-T", "json").stdout, object_pairs_hook=no_duplicates)
        assert not dups, dups
        want = by_frame(pcap)
        assert want
        for number, fields in want.items():
            layers = frames[number - 1]["_source"]["layers"]
            count, values = Counter(), {}
            leaves(layers["kbtp"], count, values)
            for key, value in fields.items():
                assert count[key] == 1, (pcap.name, number, key, count[key])
                assert same(values[key], value), (pcap.name, number, key, values[key], value)
            assert all(n == 1 for n in count.values()), (pcap.name, number, count)


def test_subtrees_are_named_fields(captures):
    frames = json.loads(run(PCAPS[0], *PLUGIN, "-T", "json", "-Y", "kbtp.hello_ack.table").stdout)
    kbtp = frames[0]["_source"]["layers"]["kbtp"]
    assert {"kbtp.hello_ack.table", "kbtp.hello_ack.head"} <= set(kbtp)
    assert "kbtp.hello_ack.table.stag" in kbtp["kbtp.hello_ack.table"]
    assert "_ws.lua.text" not in json.dumps(frames)


@pytest.mark.slow
def test_every_field_once_in_ek(captures):
    for pcap in captures:
        docs = [json.loads(line) for line in run(pcap, *PLUGIN, "-T", "ek").stdout.splitlines()
                if line.startswith('{"timestamp"')]
        for number, fields in by_frame(pcap).items():
            kbtp = docs[number - 1]["layers"]["kbtp"]
            for key, value in fields.items():
                shown = kbtp["kbtp_" + key.replace(".", "_")]
                assert not isinstance(shown, list), (pcap.name, number, key, shown)
                assert same(shown, value), (pcap.name, number, key, shown, value)


@pytest.mark.slow
def test_every_field_once_through_pyshark(captures):
    for pcap in captures[:len(PCAPS) + 1]:
        want = by_frame(pcap)
        for pkt in pyshark_packets(pcap, len(want), PLUGIN):
            fields = want[int(pkt.number)]
            for key, value in fields.items():
                field = pkt.kbtp.get_field(key[5:].replace(".", "_"))
                assert field is not None and len(field.all_fields) == 1, (pcap.name, pkt.number, key)
                assert same(field.show, value), (pcap.name, pkt.number, key, field.show, value)


@pytest.mark.slow
def test_installed_plugin_and_lua_script_together_load_once(tmp_path):
    """`kbtp dissector install`, then the README's tshark -X lua_script:$(kbtp dissector
    path): no error, and the same output as either alone; uninstall removes it."""
    env = private_home(tmp_path)
    kbtp = [sys.executable, "-m", "kbtp_scapy", "dissector"]
    pcap = ROOT / "pcaps" / "iwarp_session.pcap"
    args = ("-o", "tcp.try_heuristic_first:TRUE", "-V")
    alone = run(pcap, *PLUGIN, "-V").stdout
    proc = subprocess.run([*kbtp, "install", "--lua"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("installed "), proc.stderr
    installed = Path(proc.stdout.splitlines()[0].split(" ", 1)[1].strip())   # then which form loads
    assert installed.read_text() == LUA.read_text()
    both = run(pcap, *PLUGIN, "-V", env=env)
    assert both.stdout == alone
    assert run(pcap, *args, env=env).stdout == alone
    proc = subprocess.run([*kbtp, "uninstall"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and not installed.exists(), proc.stderr
    assert "KV Cache" not in run(pcap, *args, env=env).stdout


def test_uninstall_leaves_a_file_that_is_not_ours(tmp_path):
    other = tmp_path / "kbtp.lua"
    other.write_text("-- someone else's\n")
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "dissector", "uninstall",
                           "--folder", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and other.exists()
    assert proc.stderr == f"kbtp: {other} is not this dissector; left it alone\n"


def test_tshark_in_the_suite_uses_the_suites_own_home():
    """What the user who runs the tests has installed or configured cannot matter."""
    own = folders()
    home = os.environ["HOME"]
    real = pwd.getpwuid(os.getuid()).pw_dir
    assert home != real
    for kind in ("Personal configuration", "Personal Lua Plugins", "Personal Plugins"):
        assert own[kind].startswith(home + "/"), (kind, own[kind])
    assert not any(k.startswith("WIRESHARK_") for k in os.environ)
