"""The kbtp command as a user runs it: real processes, real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy import codec, tables as T

ROOT = Path(__file__).resolve().parent.parent
SPEC_ALLOC_STORE = ("0112000100000000000000070000000000004001000000000000000000000000"
                    "00000000000000084b56424c4f434b21")


def kbtp(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_craft_the_specification_example():
    out = kbtp("craft", "ALLOC_STORE", "--request-id", "7", "--handle", "0x4001",
               "--inline-data", "4b56424c4f434b21").stdout.strip()
    assert out == SPEC_ALLOC_STORE


def test_craft_keeps_lies_and_names():
    out = kbtp("craft", "STORE", "--flags", "INLINE+SEAL", "--dd-length", "4096",
               "--inline-data", "00").stdout.strip()
    with pytest.raises(codec.Malformed):
        codec.decode(bytes.fromhex(out))
    assert codec.decode(bytes.fromhex(out)[:40] + bytes(4096))["flags"] == 3
    out = kbtp("craft", "0xC3", "--request-id", "1").stdout.strip()
    assert bytes.fromhex(out)[1] == 0xC3


@pytest.mark.parametrize("transport", ["roce", "iwarp"])
def test_craft_pcap_decodes_back(tmp_path, transport):
    path = tmp_path / "load.pcap"
    kbtp("craft", "LOAD", "--handle", "7", "--dd-stag", "0x1234", "--dd-length", "32768",
         "--transport", transport, "-o", str(path))
    lines = kbtp("decode", "--json", str(path)).stdout.splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj["transport"] == transport and obj["kbtp.opcode"] == 0x10
    assert obj["kbtp.handle"] == 7 and obj["kbtp.dd.stag"] == 0x1234 and obj["kbtp.dd.length"] == 32768
    assert obj["kbtp.flags.record"] == 0 and isinstance(obj["frame"], int)


def test_decode_json_keys_are_the_filter_names_of_the_tables():
    obj = json.loads(kbtp("decode", "--json", "--hex", SPEC_ALLOC_STORE).stdout)
    expected = {f"kbtp.{f.key}" for f in T.flatten(T.HEADER)}
    inline = T.flag(T.REQUEST_FLAGS, "INLINE")
    expected |= {f"kbtp.{f.key}" for f in T.flatten(T.BY_NAME["ALLOC_STORE"].body)
                 if f.when is None or f.when.mask == inline}
    expected |= {f"kbtp.flags.{b.key}" for b in T.REQUEST_FLAGS.flags}
    assert set(obj) - {"frame", "transport"} == expected
    assert obj["kbtp.inline_data"] == "4b56424c4f434b21" and obj["kbtp.flags.inline"] == 1


def test_decode_sample_capture_text_and_addr_le():
    text = kbtp("decode", str(ROOT / "pcaps" / "roce_session.pcap")).stdout
    assert "ALLOC_STORE rid=1 handle=0x4001 len=8 INLINE SEAL" in text
    assert "COMPLETION rid=1 OK gen=5 off=0x150000" in text
    le = ROOT / "pcaps" / "roce_addr_le_ipv6_session.pcap"
    assert "handle=0x4001 " in kbtp("decode", str(le)).stdout
    forced = kbtp("decode", "--no-addr-le", str(le)).stdout
    assert "handle=0x4001 " not in forced


def test_errors_are_one_line_with_the_right_exit_code(tmp_path):
    junk = tmp_path / "junk.pcap"
    junk.write_bytes(os.urandom(300))
    for args, code in [(("decode", str(junk)), 1), (("decode", str(tmp_path / "none.pcap")), 1),
                       (("decode",), 2), (("craft", "NOPE"), 2), (("craft", "LOAD", "--bind-ticket", "1"), 2),
                       (("craft", "LOAD", "--handle", "zz"), 2), (("decode", "--hex", "xyz"), 1),
                       (("frobnicate",), 2)]:
        proc = kbtp(*args, check=False)
        assert proc.returncode == code, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_truncated_capture_is_one_line_not_a_traceback(tmp_path):
    whole = (ROOT / "pcaps" / "iwarp_session.pcap").read_bytes()
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(whole[:len(whole) // 2 + 7])
    proc = kbtp("decode", str(cut), check=False)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr


def test_help_explains_with_examples():
    for cmd in (("--help",), ("decode", "--help"), ("craft", "--help"), ("demo", "--help")):
        assert "Example" in kbtp(*cmd).stdout or cmd == ("demo", "--help")
