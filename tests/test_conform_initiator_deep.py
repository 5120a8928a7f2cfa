"""The deeper initiator cases (issue 31): the reference initiator passes each on both
bindings, and each catches the planted bug written for it, a bug every case before it
let through (``docs/INITIATOR_CONFORMANCE.md``, "Measuring the checker"); one of them,
ticket_per_try, is caught by a check added to direct_alloc.slot."""
from __future__ import annotations

import json

import pytest

from kbtp_scapy.conform.initiator.cases import _repeats

from .initiator_bugs import BY_NAME, program
from .test_conform_initiator import conform, verdicts

DEEP = ["hello.id_bits", "credits.strays", "credits.completion_buffers", "quota.concurrent",
        "quota.failed_free", "addr_le.direct_load", "flags.as_asked", "flags.record_as_asked",
        "record.slots", "status.every_opcode", "direct_load.every_window", "direct_alloc.write_order",
        "goodbye.after_completions", "request.ids", "addr_le.record", "descriptor.read_only",
        "credits.every_opcode", "completion.same_handle", "generation.rebound"]
ROCE_ONLY = {"flags.record_as_asked", "record.slots", "addr_le.record"}


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_reference_initiator_passes_the_deeper_cases(transport):
    args = [a for case in DEEP for a in ("--only", case)]
    code, out, err = conform(transport, program(None), *args, "--json", timeout=300)
    got = verdicts(json.loads(out))
    assert set(got) == set(DEEP), got
    want = {c: "SKIP" if transport == "iwarp" and c in ROCE_ONLY else "PASS" for c in DEEP}
    assert got == want, err
    assert code == 0


#: each new bug on the binding it is judged on here (tools/initiator_catch_rate.py runs both)
PLANTED = [("id_uuid4", "iwarp"), ("id_half_repeated", "roce"), ("id_fixed_prefix", "iwarp"),
           ("stray_returns_credit", "roce"), ("recv_not_reposted", "roce"),
           ("recv_not_reposted", "iwarp"), ("credits_request_only", "iwarp"),
           ("credits_request_only_slow", "roce"), ("mpa_revision_1", "iwarp"),
           ("quota_tickets_uncounted", "roce"), ("quota_failed_free_counted", "iwarp"),
           ("addr_le_entries_ignored", "roce"), ("allow_unsealed_always", "iwarp"),
           ("unsealed_retry", "roce"), ("invalidate_on_free", "iwarp"),
           ("record_dropped_on_free", "roce"), ("record_slot_shared", "roce"),
           ("load_status_collapsed", "iwarp"), ("direct_load_cached", "roce"),
           ("bind_before_write", "iwarp"), ("goodbye_early", "roce"), ("request_ids_cycle", "iwarp"),
           ("record_descriptor_big_endian", "roce"), ("source_writable", "roce"),
           ("bind_without_credit", "roce"), ("free_without_credit", "iwarp"),
           ("matched_by_handle", "iwarp"), ("generation_cached", "roce"), ("ticket_per_try", "iwarp")]


@pytest.mark.slow
@pytest.mark.parametrize("name,transport", PLANTED, ids=[f"{b}-{t}" for b, t in PLANTED])
def test_planted_bug_fails_its_deeper_case(name, transport):
    bug = BY_NAME[name]
    assert transport in bug.transports
    code, out, err = conform(transport, program(name), "--only", bug.case, "--json")
    [case] = json.loads(out)["cases"]
    want = "WARN" if case["level"] == "SHOULD" else "FAIL"
    assert case["verdict"] == want, case
    assert code == (0 if want == "WARN" else 1) and case["expected"] and case["seen"]


def test_an_id_made_of_a_shorter_value_repeated_is_named_by_its_period():
    assert _repeats(bytes(range(16))) is None
    assert _repeats(bytes(range(8)) * 2) == 8
    assert _repeats(b"\x5a" * 16) == 1
    assert _repeats(b"KBTP" * 4) == 4
