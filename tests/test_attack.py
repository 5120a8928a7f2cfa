"""The independent attacker (tests/attack.py) is independent, and frames what the texts say.

Its encoders are checked against what others wrote, never against the project's code: the
specification's normative example, the CRC32c check value of RFC 3720, and the ICRC of
every RoCEv2 frame in the real Soft-RoCE captures of tests/data/captures.
"""
from __future__ import annotations

import ast
import re
import struct
import sys
from pathlib import Path

from . import attack as a

ROOT = Path(__file__).resolve().parent.parent
CAPTURES = ROOT / "tests" / "data" / "captures"


def test_the_attacker_imports_only_the_standard_library():
    tree = ast.parse((ROOT / "tests" / "attack.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"a relative import (line {node.lineno}) would reach the test helpers"
            imported.add((node.module or "").split(".")[0])
    foreign = {name for name in imported if name not in sys.stdlib_module_names}
    assert foreign == set(), foreign
    assert "kbtp_scapy" not in imported


def _example(text: str, start: str, end: str) -> bytes:
    """The hex octets of the specification's example between ``start`` and ``end``."""
    begin = text.index(start) + len(start)
    span = text[begin:text.index(end, begin)]
    return bytes.fromhex(" ".join(re.findall(r"\b[0-9a-f]{2}\b", span)))


def test_kbtp_framing_matches_the_specification_examples():
    text = (ROOT / "docs" / "kbtp-draft.txt").read_text()
    request = _example(text, 'flags INLINE:', 'Its COMPLETION')
    completion = _example(text, 'block 42 of a pool of 32 KiB blocks):', 'Ring counter')
    assert len(request) == 48 and len(completion) == 40
    assert a.alloc_store(7, 0x4001, b"KVBLOCK!") == request
    got = a.parse(completion)
    assert (got["opcode"], got["request_id"], got["handle"], got["generation"], got["status"],
            got["length"], got["block_offset"]) == (a.COMPLETION, 7, 0x4001, 5, "OK", 8, 0x150000)
    # the common header's fields at the offsets NOTES.md section 2 gives
    hello = a.hello(bytes(range(16)), credits=9, features=a.DIRECT_LOAD)
    assert len(hello) == 44 and hello[:2] == b"\x01\x01" and hello[24:28] == b"\x00\x01\x00\x09"


def test_status_names_are_the_specification_table():
    text = (ROOT / "docs" / "kbtp-draft.txt").read_text()
    table = text[text.index("KBTP Status Codes"):text.index("Target Execution Model")]
    assert dict((int(v), name) for v, name in re.findall(r"^(\d+)\t([A-Z_]+)\t", table, re.M)) == a.STATUS


def test_crc32c_has_the_check_values_of_rfc_3720():
    assert a.crc32c(b"123456789") == 0xE3069283          # the Castagnoli check value
    assert a.crc32c(bytes(32)) == 0x8A9136AA               # RFC 3720 B.4, 32 octets of zeros


def _roce_frames(path: Path):
    data = path.read_bytes()
    at = 24
    while at < len(data):
        _, _, length, _ = struct.unpack_from("<IIII", data, at)
        frame = data[at + 16:at + 16 + length]
        at += 16 + length
        if frame[12:14] == b"\x08\x00" and frame[23] == 17 and frame[36:38] == b"\x12\xb7":
            end = 14 + struct.unpack_from(">H", frame, 16)[0]
            yield frame[14:34], frame[34:42], frame[42:end - 4], frame[end - 4:end]


def test_icrc_matches_every_frame_of_the_real_soft_roce_captures():
    checked = 0
    for capture in sorted(CAPTURES.glob("rxe_linlin_*.pcap")):
        for ip, udp, packet, icrc in _roce_frames(capture):
            assert a.icrc_of(ip, udp, packet) == icrc, (capture.name, packet[:12].hex())
            checked += 1
    assert checked > 200, checked


def test_mpa_fpdu_is_padded_and_its_crc_covers_length_ulpdu_and_pad():
    framed = a.send(b"x" * 5, 1)
    ulpdu_len = struct.unpack(">H", framed[:2])[0]
    assert ulpdu_len == a.UNTAGGED_LEN + 5 and len(framed) % 4 == 0
    assert struct.unpack("<I", framed[-4:])[0] == a.crc32c(framed[:-4])
    assert a.Fpdu(framed[2:2 + ulpdu_len]).payload == b"x" * 5
