"""``kbtp decode --stats``: a request answered by the completion record it asked for (an
RDMA Write into its Completion Descriptor) is answered, with its latency and the record's
status, as ``kbtp analyze`` pairs it."""
from __future__ import annotations

import json
from pathlib import Path

from kbtp_scapy.analyze.rows import capture_rows
from kbtp_scapy.vocab import Opcode
from tests.test_decode import kbtp, records

PCAP = Path(__file__).resolve().parent.parent / "pcaps" / "roce_session.pcap"


def _recorded() -> dict:
    """The one request of the sample session that asks for a completion record."""
    listed = [json.loads(line) for line in kbtp("decode", "--json", str(PCAP)).stdout.splitlines()]
    [request] = [o for o in listed if o.get("kbtp.flags.record") and o["kbtp.opcode"] != Opcode.BIND]
    return request


def test_a_request_answered_by_its_completion_record_is_answered():
    """FREE rid=5 RECORD is answered by the record Written into its Completion Descriptor
    (frame 29, an RDMA Write with Immediate): counted with the frames' time apart and the
    record's status OK; nothing is left unanswered. ``kbtp analyze`` pairs the same."""
    request = _recorded()
    assert request["kbtp.opcode"] == Opcode.FREE and request["kbtp.request_id"] == 5
    times = [t for t, _ in records(PCAP)]
    latency = times[29 - 1] - times[request["frame"] - 1]
    doc = json.loads(kbtp("decode", "--stats", "--json", str(PCAP)).stdout)
    assert doc["unanswered"] == 0
    ok = doc["by_opcode_status"]["FREE"]["OK"]
    assert ok["calls"] == 1 and abs(ok["min"] - latency) < 2e-6
    text = kbtp("decode", "--stats", str(PCAP)).stdout.decode().splitlines()
    assert text[-1] == "18 requests answered, 0 unanswered"
    [row] = [r for r in capture_rows(PCAP) if r.get("frame") == request["frame"] and r.get("opcode_name") == "FREE"]
    assert row["answer_frame"] == 29 and row["answer_status_name"] == "OK"
    assert abs(row["latency_s"] - ok["min"]) < 1e-9


def test_a_record_outside_the_time_window_answers_nothing():
    """--to before the record was written: the request waits, unanswered, as one whose
    COMPLETION falls outside the window."""
    request = _recorded()
    times = [t for t, _ in records(PCAP)]
    cut = (times[request["frame"] - 1] + times[29 - 1]) / 2 - times[0]
    doc = json.loads(kbtp("decode", "--stats", "--json", "--to", f"{cut:.7f}", str(PCAP)).stdout)
    assert "OK" not in doc["by_opcode_status"].get("FREE", {})
    assert doc["unanswered"] >= 1
