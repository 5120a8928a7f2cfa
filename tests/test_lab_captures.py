"""Real kernel frames (tcpdump in the lab's guest): Linux rxe and siw sessions decode in
tshark with the KBTP dissector with no malformed frame, and give the same messages as
``kbtp decode``. ``tools/lab_captures.py`` makes them (and the two committed in pcaps/)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .lab import lab, lab_captures  # noqa: F401 (fixture)
from .test_dissector import PLUGIN
from .tshark import TSHARK, needs_tshark

pytestmark = [pytest.mark.lab, needs_tshark]


@pytest.mark.parametrize("transport", ["roce", "iwarp"], ids=["rxe", "siw"])
def test_kernel_frames_decode_alike_in_tshark_and_kbtp_decode(lab, tmp_path, transport):
    pcap = lab_captures.capture(lab, transport, tmp_path / f"{transport}.pcap")
    shark = subprocess.run([TSHARK, "-n", "-r", str(pcap), *PLUGIN],
                           capture_output=True, text=True, timeout=120)
    assert shark.returncode == 0 and "Malformed" not in shark.stdout, shark.stdout + shark.stderr
    fields = subprocess.run([TSHARK, "-n", "-r", str(pcap), *PLUGIN,
                             "-Y", "kbtp.opcode", "-T", "fields", "-e", "frame.number", "-e", "kbtp.opcode",
                             "-e", "kbtp.request_id"], capture_output=True, text=True, timeout=120)
    seen = [(int(f), int(op, 0), int(rid or 0, 0)) for f, op, rid in
            (line.split("\t") for line in fields.stdout.splitlines())]
    decode = subprocess.run([sys.executable, "-m", "kbtp_scapy", "decode", "--json", str(pcap)],
                            capture_output=True, text=True, timeout=120)
    assert decode.returncode == 0, decode.stderr
    decoded = [(o["frame"], o["kbtp.opcode"], o.get("kbtp.request_id", 0))
               for o in map(json.loads, decode.stdout.splitlines())]
    assert seen == decoded
    opcodes = {op for _, op, _ in decoded}
    assert {0x01, 0x02, 0x10, 0x12, 0x13, 0x20, 0x30} <= opcodes      # every kind the session sends
    if transport == "roce":
        assert 0x14 in opcodes                                         # BIND after DIRECT_ALLOC
