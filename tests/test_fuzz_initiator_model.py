"""The model behind ``kbtp fuzz --role initiator``: what a correct initiator may send.

The first tests hand the model sessions built from real encoded messages (it is sans-IO)
and check that each rule fires on the initiator that breaks it and stays quiet on one
that does not; the slow ones run the hostile target against the reference initiator,
clean and with bugs planted that only the model sees."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy import codec
from kbtp_scapy.conform.initiator.model import Model, weak_id
from kbtp_scapy.conform.initiator.observe import Session
from kbtp_scapy.conform.initiator.program import Run
from kbtp_scapy.initiator.script import parse
from kbtp_scapy.vocab import Feature, Opcode, RequestFlag

from .initiator_bugs import BY_NAME, program
from .kbtp_harness import fresh_hosts

ROOT = Path(__file__).resolve().parent.parent
BASE, BLOCK = 0x100, 4096
_ports = iter(range(5760, 5800))


class Wire:
    """A session as the checking target records it: a HELLO_ACK granted, then messages
    and answers at increasing times."""

    def __init__(self, credits: int = 8, features: int = Feature.RECORD_COMPLETION) -> None:
        self.s = Session(opened=0.0)
        self.s.granted = {"opcode": Opcode.HELLO_ACK, "hello_ack.features": features,
                          "hello_ack.request_credits": credits, "hello_ack.block_size": BLOCK,
                          "hello_ack.max_inline": 512, "hello_ack.allocation_quota": 8,
                          "hello_ack.handle_base": BASE, "hello_ack.handle_count": 16}
        self.t = 0.0
        self.rid = 0
        self.send({"opcode": Opcode.HELLO, "hello.requested_features": 7, "hello.completion_credits": 32,
                   "hello.initiator_id": secrets.token_bytes(16)})

    def send(self, values: dict) -> int:
        self.t += 1
        if values["opcode"] not in (Opcode.HELLO, Opcode.GOODBYE):
            self.rid += 1
            values = {"request_id": self.rid, **values}
        raw = codec.encode(values)
        m = self.s.taken(raw)
        m.at = self.t
        if values["opcode"] == Opcode.HELLO:
            self.s.hello_raw, self.s.hello = raw, m.decoded
        return self.rid

    def answer(self, rid: int, status: int = 0) -> None:
        self.t += 1
        self.s.completed(rid, status)
        self.s.completions[-1] = (self.t, *self.s.completions[-1][1:])

    def load(self, handle: int, flags: int = RequestFlag.INVALIDATE) -> int:
        return self.send({"opcode": Opcode.LOAD, "handle": BASE + handle, "flags": flags,
                          "dd.stag": 0x77, "dd.offset": 0x1000, "dd.length": BLOCK})

    def store(self, handle: int, data: bytes, flags: int = RequestFlag.SEAL | RequestFlag.INLINE) -> int:
        return self.send({"opcode": Opcode.ALLOC_STORE, "handle": BASE + handle, "flags": flags,
                          "dd.length": len(data), "inline_data": data})


def judge(script: str, wire: Wire, statuses: list[str], outputs: dict[str, bytes] | None = None,
          inputs: dict[str, bytes] | None = None, tmp: Path | None = None) -> list[tuple[str, str]]:
    out = tmp or Path("/nonexistent")
    for name, data in (outputs or {}).items():
        (out / name).write_bytes(data)
    ops = [op for st in parse(script) for op in st]
    run = Run([], 0, 0.1, out, "", [(op.name, str(op.handle), s) for op, s in zip(ops, statuses)])
    model = Model("roce", inputs or {}, protocol_kept=True)
    model.judge_run(parse(script), [wire.s], run, kept_state=False, malformed_ack=False)
    return [(f.oracle, f.detail) for f in model.found]


def test_a_correct_exchange_gives_no_finding_and_every_field_is_counted(tmp_path):
    data = b"kv" * 100
    w = Wire()
    w.answer(w.store(0, data))
    w.answer(w.load(0))
    w.send({"opcode": Opcode.GOODBYE, "flags": 0})
    found = judge("alloc_store 0 @a seal; load 0 @r", w, ["OK", "OK"], {"r": data}, {"a": data}, tmp_path)
    assert found == []
    model = Model("roce", {}, protocol_kept=True)
    model.judge_run(parse("alloc_store 0 @a seal"), [w.s], Run([], 0, 0.1, tmp_path, "", []),
                    kept_state=False, malformed_ack=False)
    assert model.tally.judged["ALLOC_STORE.flags"] > 0 and model.tally.judged["HELLO.initiator_id"] > 0


@pytest.mark.parametrize("flags,oracle", [
    (RequestFlag.ALLOW_UNSEALED | RequestFlag.INVALIDATE, "flags"),        # not asked
    (RequestFlag.SEAL, "flags"),                                          # meaningless on LOAD
    (RequestFlag.RECORD, "flags"),                                        # record not asked
])
def test_load_flags_the_script_did_not_ask_for(flags, oracle, tmp_path):
    w = Wire()
    w.answer(w.load(3, flags))
    assert oracle in {o for o, _ in judge("load 3 @r", w, ["NOT_VALID"], tmp=tmp_path)}


def test_record_asked_and_granted_must_be_set_and_its_slot_its_own(tmp_path):
    w = Wire()
    w.load(1)                                     # RECORD dropped
    assert any(o == "flags" and "without RECORD" in d for o, d in judge("load 1 @r record", w, ["NOT_VALID"],
                                                                        tmp=tmp_path))
    w = Wire()
    for h in (1, 2):
        w.send({"opcode": Opcode.LOAD, "handle": BASE + h, "flags": RequestFlag.RECORD, "dd.stag": 0x70 + h,
                "dd.offset": 0, "dd.length": BLOCK, "cd.stag": 0x99, "cd.offset": 0x40, "cd.reserved": 0})
    found = judge("load 1 @r record & load 2 @s record", w, [], tmp=tmp_path)
    assert any(o == "record" and "outstanding" in d for o, d in found)


def test_free_with_invalidate_and_a_retry_nobody_asked_for(tmp_path):
    w = Wire()
    w.answer(w.send({"opcode": Opcode.FREE, "handle": BASE + 2, "flags": RequestFlag.INVALIDATE}))
    assert "flags" in {o for o, _ in judge("free 2", w, ["OK"], tmp=tmp_path)}
    w = Wire()
    w.answer(w.load(4), 7)                                               # NOT_SEALED
    w.answer(w.load(4, RequestFlag.ALLOW_UNSEALED | RequestFlag.INVALIDATE))
    assert "retry" in {o for o, _ in judge("load 4 @r", w, ["OK"], tmp=tmp_path)}


def test_credits_come_back_only_with_an_answer(tmp_path):
    w = Wire(credits=1)
    first = w.load(0)
    w.load(1)                                   # the first still unanswered: past the credit
    w.answer(first)
    assert "credits" in {o for o, _ in judge("load 0 @a & load 1 @b", w, [], tmp=tmp_path)}
    w = Wire(credits=1)
    w.answer(w.load(0))
    w.answer(w.load(1))
    assert "credits" not in {o for o, _ in judge("load 0 @a; load 1 @b", w, [], tmp=tmp_path)}


def test_goodbye_after_the_answers_and_with_release_as_asked(tmp_path):
    w = Wire()
    rid = w.load(0)
    w.send({"opcode": Opcode.GOODBYE, "flags": 1})
    w.answer(rid)
    found = judge("load 0 @r; goodbye", w, ["OK", "OK"], tmp=tmp_path)
    assert {"goodbye"} == {o for o, _ in found if o == "goodbye"}
    assert any("in flight" in d for _, d in found) and any("RELEASE" in d or "flags" in d for _, d in found)


def test_a_reported_status_is_the_one_the_answer_carried(tmp_path):
    w = Wire()
    w.answer(w.load(0), 11)
    found = judge("load 0 @r", w, ["INTERNAL"], tmp=tmp_path)
    assert ("result_status", "load 0 @r reported INTERNAL, its answer carried TICKET_ABANDONED") in found


@pytest.mark.parametrize("seconds,found", [(0.5, True), (4.9, False)])
def test_an_unfinished_script_is_a_finding_unless_the_program_gave_up_on_time(seconds, found, tmp_path):
    """Against a target that kept to the protocol the script runs to its end; a run that lasted
    as long as the program was told to give up after (5 s here) is a slow host, not a finding."""
    w = Wire()
    w.answer(w.load(0), 3)
    model = Model("iwarp", {}, protocol_kept=True, give_up=5.0)
    run = Run([], 1, seconds, tmp_path, "", [("load", "0", "NOT_VALID")])
    model.judge_run(parse("load 0 @a; load 1 @b"), [w.s], run, kept_state=False, malformed_ack=False)
    assert ("completeness" in {f.oracle for f in model.found}) is found


def test_weak_initiator_ids():
    assert weak_id(bytes(16)) == "all zero"
    assert weak_id(b"\x12\x34" * 8) is not None
    assert weak_id(bytes(range(4)) * 4) == "4 octets repeated"
    assert weak_id(secrets.token_bytes(16)) is None


# -- against the reference initiator ---------------------------------------------------------------

def fuzz(transport: str, cmd: list[str], *args: str, timeout: float = 400) -> tuple[int, str, str]:
    host, local = fresh_hosts(2)
    url = f"iwarp://{host}:{next(_ports)}" if transport == "iwarp" else f"roce://{host}"
    proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "fuzz", "--role", "initiator", "--listen", url,
                           "--local", local, "--timeout", "10", *args, "--", *cmd],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_the_model_finds_nothing_in_the_reference_initiator(transport, tmp_path):
    code, out, err = fuzz(transport, program(None), "--cases", "16", "--seed", "5", "--json",
                          "--out", str(tmp_path))
    doc = json.loads(out)
    assert (code, doc["cases"], doc["findings"]) == (0, 16, []), (doc["findings"], doc["error"], err)
    judged = sum(f["judged"] for f in doc["oracle"].values())
    assert judged > 500 and doc["oracle"]["LOAD.flags"]["judged"] > 0, doc["oracle"]


#: planted bugs of issue 31's classes, each replayed on the case its corpus entry names
CAUGHT = [("retry_unsealed", "iwarp", "retry"), ("free_invalidate", "roce", "flags"),
          ("credit_from_unknown", "iwarp", "credits"), ("goodbye_early_fuzz", "iwarp", "goodbye"),
          ("entries_big_endian", "roce", "direct_load"), ("bind_before_write_fuzz", "roce", "direct_alloc")]


@pytest.mark.slow
@pytest.mark.parametrize("bug,transport,oracle", CAUGHT)
def test_planted_bugs_only_the_model_sees(bug, transport, oracle, tmp_path):
    case = BY_NAME[bug].case.split(":", 1)[1]
    code, out, err = fuzz(transport, program(bug), "--replay", f"{transport}-{case}", "--json",
                          "--out", str(tmp_path))
    doc = json.loads(out)
    assert code == 1, out + err
    assert doc["error"] is None and doc["findings"], doc
    assert oracle in {f["oracle"] for f in doc["findings"][0]["findings"]}, doc["findings"]
