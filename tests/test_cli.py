"""The kbtp command as a user runs it: real processes, real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy import codec, tables as T
from kbtp_scapy.vocab import RequestFlag

from .tshark import needs_tshark

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


@pytest.mark.slow
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
    inline = RequestFlag.INLINE
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_help_explains_with_examples():
    for cmd in (("--help",), ("decode", "--help"), ("craft", "--help"), ("demo", "--help")):
        assert "Example" in kbtp(*cmd).stdout


@pytest.mark.slow
@pytest.mark.parametrize("group", [(), ("dissector",), ("initiator",)])
def test_a_bare_group_prints_its_help_on_stdout(group):
    """As click does: the help on stdout, exit 2 (click 8.2 and later; 0 before)."""
    proc = kbtp(*group, check=False)
    assert proc.returncode in (0, 2) and proc.stderr == ""
    assert proc.stdout.startswith(f"Usage: kbtp{' ' if group else ''}{' '.join(group)}")
    assert "Commands:" in proc.stdout
    assert kbtp(*group, "--help").stdout == proc.stdout


def test_craft_help_lists_every_name_the_options_take():
    text = " ".join(kbtp("craft", "--help").stdout.split())
    names = [v.name for v in T.OPCODES.values + T.STATUS.values]
    names += [f.name for s in T.FLAG_SETS if s is not T.ENTRY_FLAGS for f in s.flags]
    for name in names:
        assert f" {name} 0x" in text or f" {name} " in text, name
    assert "--status: OK 0, INVALID_HANDLE 1," in text and "RELEASE 0x1" in text


def tshark_ends(path: Path) -> tuple[str, str, int]:
    """(source, destination, opcode) of the one KBTP message in a pcap, as tshark sees it."""
    lua = kbtp("dissector", "path").stdout.strip()
    out = subprocess.run(["tshark", "-n", "-r", str(path), "-X", f"lua_script:{lua}",
                          "-o", "tcp.try_heuristic_first:TRUE", "-Y", "kbtp", "-T", "fields",
                          "-e", "ip.src", "-e", "ip.dst", "-e", "kbtp.opcode"],
                         capture_output=True, text=True, timeout=60,
                         env={"HOME": str(path.parent), "PATH": os.environ["PATH"]}).stdout.split()
    return out[0], out[1], int(out[2], 0)


@pytest.mark.slow
@needs_tshark
@pytest.mark.parametrize("transport", ["roce", "iwarp"])
def test_craft_writes_responses_from_the_target(tmp_path, transport):
    ends = {}
    for op, extra in (("LOAD", ()), ("COMPLETION", ()), ("HELLO_ACK", ()),
                      ("COMPLETION", ("--from-initiator",))):
        path = tmp_path / f"{op}{len(extra)}.pcap"
        proc = kbtp("craft", op, "--transport", transport, *extra, "-o", str(path))
        ends[op, extra] = tshark_ends(path)
        assert ("target to initiator" in proc.stderr) == (op != "LOAD" and not extra)
    initiator, target, _ = ends["LOAD", ()]
    assert ends["COMPLETION", ()] == (target, initiator, T.BY_NAME["COMPLETION"].opcode)
    assert ends["HELLO_ACK", ()][:2] == (target, initiator)
    assert ends["COMPLETION", ("--from-initiator",)][:2] == (initiator, target)


@pytest.mark.slow
def test_craft_checks_the_length_of_fixed_octet_fields():
    short = kbtp("craft", "HELLO", "--hello-initiator-id", "0102", check=False)
    assert short.returncode == 2 and "2 octets given" in short.stderr and "16 octets" in short.stderr
    odd = kbtp("craft", "HELLO", "--hello-initiator-id", "0x" + "ab" * 15 + "a", check=False)
    assert odd.returncode == 2 and "odd number of hex digits" in odd.stderr
    wire = bytes.fromhex(kbtp("craft", "HELLO", "--hello-initiator-id", "0x" + "ab" * 16).stdout)
    assert codec.decode(wire)["hello.initiator_id"] == b"\xab" * 16


@pytest.mark.slow
def test_craft_builds_the_lies_it_is_asked_for():
    """An item given whose flag or feature bit the given word lacks is built, with a note."""
    proc = kbtp("craft", "LOAD", "--flags", "0", "--cd-stag", "0x99")
    wire = bytes.fromhex(proc.stdout)
    dd, cd = T.HEADER_SIZE, T.HEADER_SIZE + T.DATA_DESCRIPTOR.size
    assert len(wire) == cd + T.COMPLETION_DESCRIPTOR.size
    assert wire[T.HEADER.offset("flags"):][:2] == b"\0\0" and wire[cd:cd + 4] == bytes.fromhex("00000099")
    assert "Completion Descriptor" in proc.stderr and "RECORD" in proc.stderr
    proc = kbtp("craft", "STORE", "--flags", "SEAL", "--inline-data", "4142")
    wire = bytes.fromhex(proc.stdout)
    assert wire.endswith(b"AB") and len(wire) == dd + T.DATA_DESCRIPTOR.size + 2
    assert "Inline Data" in proc.stderr and "INLINE" in proc.stderr
    proc = kbtp("craft", "HELLO_ACK", "--hello-ack-features", "0", "--hello-ack-pool-stag", "7")
    body = T.BY_NAME["HELLO_ACK"].body
    gated = sum(body.item(n).size for n in body.gated(body.item("table").when))
    assert len(bytes.fromhex(proc.stdout)) == T.HEADER_SIZE + body.offset("table") + gated
    assert "DIRECT_LOAD" in proc.stderr and "DIRECT_ALLOC" not in proc.stderr
    honest = kbtp("craft", "LOAD", "--cd-stag", "0x99")          # Flags computed: no lie, no note
    assert honest.stderr == "" and bytes.fromhex(honest.stdout)[3] & RequestFlag.RECORD


@pytest.mark.slow
def test_craft_trailer_and_raw_files(tmp_path):
    plain = bytes.fromhex(kbtp("craft", "FREE", "--handle", "0x4001").stdout)
    kbtp("craft", "FREE", "--handle", "0x4001", "--trailer", "de:ad be ef", "-o", str(tmp_path / "f.raw"))
    assert (tmp_path / "f.raw").read_bytes() == plain + bytes.fromhex("deadbeef")
    kbtp("craft", "FREE", "--handle", "0x4001", "-o", str(tmp_path / "f.hex"))
    assert (tmp_path / "f.hex").read_text() == plain.hex() + "\n"
    kbtp("craft", "FREE", "--handle", "0x4001", "--format", "hex", "-o", str(tmp_path / "f.bin"))
    assert (tmp_path / "f.bin").read_text().strip() == plain.hex()


def test_help_lists_every_command_without_importing_any():
    """``kbtp --help`` names every subcommand with what it does, and imports none of their
    modules (importing them all cost 0.6 to 1.2 s of CPU for a help text)."""
    code = ("import sys; from kbtp_scapy.cli import COMMANDS, main; main(['--help']); "
            "print(sorted(m for m in sys.modules if m.startswith('kbtp_scapy.cli.') "
            "and m.rsplit('.', 1)[1] in COMMANDS.values()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    *shown, imported = proc.stdout.rstrip("\n").split("\n")
    assert imported == "[]"
    from kbtp_scapy.cli import COMMANDS
    listed = "\n".join(shown).split("Commands:", 1)[1]
    assert [line.split()[0] for line in listed.splitlines() if line[:3].strip()] == list(COMMANDS)
