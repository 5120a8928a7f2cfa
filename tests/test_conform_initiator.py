"""``kbtp conform --role initiator`` and ``kbtp fuzz --role initiator``: real runs against
``kbtp initiator`` and the Python driver on both bindings, planted bugs caught by their
own case, and programs that cannot be judged (missing, exiting at once, hanging)
reported as ERROR with no process left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kbtp_scapy.conform.initiator.runner import all_cases
from kbtp_scapy.initiator.script import ScriptError, parse, parse_results

from .initiator_bugs import BY_NAME, CORPUS, program
from .kbtp_harness import fresh_hosts
from .stops import STOPS, stop

ROOT = Path(__file__).resolve().parent.parent
KBTP = [sys.executable, "-m", "kbtp_scapy"]
TRANSPORTS = ["iwarp", "roce"]
_ports = iter(range(5600, 5700))


def listen(transport: str) -> tuple[str, str]:
    """A listen URL of the test's own and the address the initiator sends from."""
    host, local = fresh_hosts(2)
    if transport == "iwarp":
        return f"iwarp://{host}:{next(_ports)}", local
    return f"roce://{host}", local


def conform(transport: str, cmd: list[str], *args: str, timeout: float = 240) -> tuple[int, str, str]:
    url, local = listen(transport)
    proc = subprocess.run([*KBTP, "conform", "--role", "initiator", "--listen", url, "--local", local,
                           *args, "--", *cmd], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


def verdicts(doc: dict) -> dict[str, str]:
    return {c["id"]: c["verdict"] for c in doc["cases"]}


# -- the script language --------------------------------------------------------------------

def test_script_parses_statements_and_concurrent_operations():
    script = parse("alloc_store 7 @in seal; load 7 @out & load 0x8 @o2 unsealed\nfree 7; goodbye release")
    assert [[str(op) for op in st] for st in script] == [
        ["alloc_store 7 @in seal"], ["load 7 @out", "load 8 @o2 unsealed"], ["free 7"],
        ["goodbye release"]]
    assert parse_results("load 7 OK\nfree - NOT_VALID\n") == [("load", "7", "OK"), ("free", "-", "NOT_VALID")]


@pytest.mark.parametrize("text,why", [
    ("explode 1", "unknown operation"), ("load @x", "handle"), ("load 1", "@FILE"),
    ("free 1 @x", "takes no @FILE"), ("store 1 @x inline noinline", "together"),
    ("load 1 @x sideways", "unknown word"), ("load 1 @a/b", "plain file name")])
def test_script_errors_name_what_is_wrong(text, why):
    with pytest.raises(ScriptError, match=why):
        parse(text)


# -- the reference initiator passes -------------------------------------------------------------

QUICK = ("--only", "hello.header", "--only", "completion.", "--only", "direct_load.order",
         "--only", "direct_alloc.slot", "--only", "load.")


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kbtp_initiator_passes_with_json_and_junit(tmp_path, transport):
    cmd = [*KBTP, "initiator", "{url}", "--local", "{local}", "--id-file", "{state}/id", "script",
           "--ops", "{ops}", "--in", "{in}", "--out", "{out}"]
    junit = tmp_path / "i.xml"
    code, out, err = conform(transport, cmd, *QUICK, "--json", "--junit", str(junit))
    doc = json.loads(out)
    assert code == 0, (doc["summary"], err)
    assert doc["role"] == "initiator" and doc["exit_code"] == 0
    got = verdicts(doc)
    assert set(got.values()) == {"PASS"}, got
    assert {"hello.header", "completion.out_of_order", "direct_load.order", "direct_alloc.slot",
            "load.data_after_completion"} <= set(got)
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    assert int(suite.get("tests")) == len(got)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_python_driver_passes_through_the_environment_alone(transport):
    """No placeholders: the adapter reads KBTP_TARGET_URL, KBTP_OPS, ... (and KBTP_LOCAL)."""
    code, out, err = conform(transport, [sys.executable, "-m", "kbtp_scapy.initiator.driver"],
                             "--only", "hello.", "--only", "status.", "--only", "quota.", "--json")
    doc = json.loads(out)
    assert code == 0, (verdicts(doc), err)
    assert set(verdicts(doc).values()) == {"PASS"}


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reference_initiator_passes_every_case(transport):
    code, out, err = conform(transport, program(None), "--json", timeout=600)
    doc = json.loads(out)
    got = verdicts(doc)
    assert code == 0, ({k: v for k, v in got.items() if v != "PASS"}, err)
    skipped = {k for k, v in got.items() if v == "SKIP"}
    assert skipped == ({"record.descriptor", "record.buffer", "record.slots", "flags.record_as_asked",
                        "addr_le.record"} if transport == "iwarp" else {"binding.mpa.enhanced"})
    assert len(got) >= 30


# -- planted bugs are caught by their own case ---------------------------------------------------

def test_every_case_has_a_planted_bug_meant_for_it():
    assert {c.id for c in all_cases()} <= {b.case for b in CORPUS}
    assert len(BY_NAME) == len(CORPUS)


#: a few of the corpus, each on one binding (tools/initiator_catch_rate.py runs them all)
PLANTED = [("fifo_matching", "iwarp"), ("load_data_early", "roce"), ("slot_no_confirm", "roce"),
           ("credits_completion_only", "iwarp"), ("direct_load_generation_only", "iwarp"),
           ("record_stag_zero", "roce"), ("fetch_add_mask_wide", "iwarp"), ("quota_ignored", "roce")]


@pytest.mark.slow
@pytest.mark.parametrize("name,transport", PLANTED, ids=[f"{b}-{t}" for b, t in PLANTED])
def test_planted_bug_fails_its_own_case(tmp_path, name, transport):
    bug = BY_NAME[name]
    assert transport in bug.transports
    code, out, err = conform(transport, program(name), "--only", bug.case, "--json",
                             "--pcap-dir", str(tmp_path))
    doc = json.loads(out)
    case = next(c for c in doc["cases"] if c["id"] == bug.case)
    assert case["verdict"] == "FAIL", case
    assert code == 1
    assert case["expected"] and case["seen"]
    assert case["pcap"] and Path(case["pcap"]).stat().st_size > 24      # frames of the case


# -- programs that cannot be judged ---------------------------------------------------------------

def _no_process(marker: str) -> bool:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return marker not in ps


@pytest.mark.slow
def test_missing_program_is_error_with_the_reason():
    code, out, err = conform("iwarp", ["/nonexistent/kbtp-initiator"], "--only", "hello.header", "--json")
    doc = json.loads(out)
    case = doc["cases"][0]
    assert (code, case["verdict"]) == (2, "ERROR")
    assert "no such program" in case["detail"]


@pytest.mark.slow
def test_program_exiting_at_once_is_error_with_its_words():
    code, out, err = conform("iwarp", ["sh", "-c", "echo cannot start the engine >&2; exit 3"],
                             "--only", "hello.header", "--json")
    case = json.loads(out)["cases"][0]
    assert (code, case["verdict"]) == (2, "ERROR")
    assert "status 3" in case["detail"] and "cannot start the engine" in case["detail"]


@pytest.mark.slow
def test_hanging_program_is_killed_with_its_children(tmp_path):
    marker = f"hang-{uuid.uuid4().hex}"
    script = tmp_path / "hang.sh"
    script.write_text(f"(exec -a {marker} sleep 300) &\nexec -a {marker} sleep 300\n")
    code, out, err = conform("iwarp", ["bash", str(script)], "--only", "hello.header", "--timeout", "1",
                             "--json", timeout=60)
    case = json.loads(out)["cases"][0]
    assert (code, case["verdict"]) == (2, "ERROR")
    assert "did not exit within 1 s" in case["detail"]
    assert _no_process(marker), "a process of the hanging program outlived the check"


def without_direct_alloc(tmp_path: Path) -> list[str]:
    """The reference initiator behind a wrapper that reports any script with direct_alloc
    UNSUPPORTED and sends nothing for it, as a small initiator does."""
    wrapper = tmp_path / "no-direct-alloc.sh"
    wrapper.write_text('case "$KBTP_OPS" in *direct_alloc*) echo "direct_alloc 0 UNSUPPORTED" '
                       '> "$KBTP_OUT/results"; exit 0;; esac\n'
                       f'exec {sys.executable} -m kbtp_scapy initiator "$KBTP_TARGET_URL" --local "$KBTP_LOCAL" '
                       '--timeout "$KBTP_TIMEOUT" --id-file "$KBTP_STATE/id" script\n')
    return ["sh", str(wrapper)]


@pytest.mark.slow
def test_unsupported_operation_skips_the_case_naming_it(tmp_path):
    """A program without DIRECT_ALLOC reports it UNSUPPORTED: those cases are SKIP, not FAIL,
    and the rest is judged as before (the reference initiator does the other scripts)."""
    code, out, err = conform("roce", without_direct_alloc(tmp_path), "--only", "direct_alloc.bind",
                             "--only", "direct_alloc.slot", "--only", "hello.header", "--json")
    doc = json.loads(out)
    assert verdicts(doc) == {"hello.header": "PASS", "direct_alloc.bind": "SKIP",
                             "direct_alloc.slot": "SKIP"}, out + err
    assert code == 0, err
    skipped = [c["detail"] for c in doc["cases"] if c["verdict"] == "SKIP"]
    assert all("does not implement direct_alloc (reported UNSUPPORTED)" in d for d in skipped), skipped


@pytest.mark.slow
def test_role_initiator_usage_errors():
    proc = subprocess.run([*KBTP, "conform", "--role", "initiator", "--", "true"], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ})
    assert proc.returncode == 2 and "--listen" in proc.stderr
    proc = subprocess.run([*KBTP, "conform", "--role", "initiator", "--listen", "iwarp://127.0.0.1:9"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "after '--'" in proc.stderr
    for args, why in ((["--role", "target", "--target", "iwarp://127.0.0.1:9", "--io", "verbs"],
                       "are for --role initiator"),
                      (["--role", "initiator", "--listen", "iwarp://127.0.0.1:9", "--device", "rxe0"],
                       "--device needs --io verbs")):
        proc = subprocess.run([*KBTP, "conform", *args, "--", "true"], capture_output=True, text=True, cwd=ROOT)
        assert (proc.returncode, proc.stderr.count("\n")) == (2, 1) and why in proc.stderr, proc.stderr


@pytest.mark.slow
def test_checking_target_on_a_missing_device_names_what_to_check(tmp_path):
    """``--io verbs`` on a machine without the device (this one, outside the lab): an
    ERROR that says what could not be opened and what to check, no traceback."""
    code, out, err = conform("iwarp", ["true"], "--io", "verbs", "--device", "nosuch0", "--only",
                             "hello.header", "--json")
    case = json.loads(out)["cases"][0]
    assert (code, case["verdict"]) == (2, "ERROR"), (code, out, err)
    assert "--device" in case["detail"] and "Traceback" not in err, case


# -- the hostile target ------------------------------------------------------------------------

def fuzz(transport: str, cmd: list[str], *args: str, timeout: float = 240) -> tuple[int, str, str]:
    url, local = listen(transport)
    proc = subprocess.run([*KBTP, "fuzz", "--role", "initiator", "--listen", url, "--local", local,
                           "--timeout", "8", *args, "--", *cmd], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_fuzz_finds_nothing_in_the_reference_initiator(tmp_path):
    code, out, err = fuzz("iwarp", program(None), "--cases", "8", "--seed", "3", "--json",
                          "--out", str(tmp_path))
    doc = json.loads(out)
    assert (code, doc["cases"], doc["findings"]) == (0, 8, []), err
    assert sum(doc["kinds"].values()) == 8


@pytest.mark.slow
def test_fuzz_judges_a_program_that_lacks_an_operation(tmp_path):
    """UNSUPPORTED is an answer the oracles judge like any other, not a harness error: the
    hostile target's cases run to the end (seed 1's fourth case scripts direct_alloc)."""
    code, out, err = fuzz("roce", without_direct_alloc(tmp_path), "--cases", "6", "--seed", "1",
                          "--json", "--out", str(tmp_path / "found"))
    doc = json.loads(out)
    assert (code, doc["cases"], doc["findings"]) == (0, 6, []), out + err
    assert "Traceback" not in err


@pytest.mark.slow
def test_fuzz_catches_a_crash_minimises_and_saves_it(tmp_path):
    bug = BY_NAME["hello_ack_unchecked"]
    index = bug.case.split("-")[1]
    code, out, err = fuzz("roce", program(bug.name), "--seed", "1", "--start", str(int(index)),
                          "--cases", "1", "--json", "--out", str(tmp_path))
    doc = json.loads(out)
    assert code == 1, err
    [finding] = doc["findings"]
    assert finding["case"] == f"roce-1-{index}" and finding["kind"] == "hello_ack.truncate"
    assert finding["findings"][0]["oracle"] == "crash"
    assert len(finding["script"]) <= len(finding["original_script"])
    assert json.loads((tmp_path / f"roce-1-{index}.json").read_text())["script"] == finding["script"]
    assert (tmp_path / f"roce-1-{index}.pcap").stat().st_size > 24


@pytest.mark.slow
@STOPS
def test_ctrl_c_keeps_the_cases_judged(tmp_path, sigs, code, name):
    """A SIGINT after two cases: the JUnit and JSON reports hold them, marked interrupted,
    and the run exits 130 (as the target's checker does, and as the JSON says), not a bare
    'aborted'; JUnit's counts are those of its testcases; the result line says how far it got."""
    cmd = [*KBTP, "initiator", "{url}", "--id-file", "{state}/id", "script", "--ops", "{ops}",
           "--in", "{in}", "--out", "{out}"]
    url, _ = listen("iwarp")
    junit, doc = tmp_path / "i.xml", tmp_path / "i.json"
    proc = subprocess.Popen([*KBTP, "conform", "--role", "initiator", "--listen", url, "--junit",
                             str(junit), "--json-file", str(doc), "--", *cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    judged: list[str] = []
    for line in iter(proc.stdout.readline, ""):
        judged += [line] if line.startswith("PASS") else []
        if len(judged) == 2:
            break
    stop(proc, sigs)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.splitlines()[-1].startswith(f"kbtp: conform: interrupted ({name}) after ")
    report = json.loads(doc.read_text())
    cases = report["cases"]
    assert len(cases) >= 2 and {c["verdict"] for c in cases} == {"PASS"} and report["exit_code"] == code
    assert f"result: interrupted ({name}) after {len(cases)} of {len(all_cases())} cases: " in out, out
    suite = ET.parse(junit).getroot()
    assert int(suite.get("tests")) == len(suite.findall("testcase")) == len(cases) + 1
