"""``kbtp bench``: run against a real target on loopback, and judged against an independent
measure: the request-to-completion times tshark and the Lua dissector read from the bench's
own capture (kbtp.time)."""
from __future__ import annotations

import asyncio
import csv
import json
import math
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kbtp_scapy.bench.runner import Measured, sweep
from kbtp_scapy.bench.stats import Samples, histogram, percentile
from kbtp_scapy.cli import main
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.target.operations import Executor
from kbtp_scapy.vocab import Opcode

from .kbtp_harness import TargetThread
from .stops import STOPS, stop
from .tshark import TSHARK, needs_tshark

KBTP = [sys.executable, "-m", "kbtp_scapy"]
LUA = Path(__file__).resolve().parent.parent / "dissector" / "kbtp.lua"
LOAD, COMPLETION = 0x10, 0x20


@pytest.fixture(params=["roce", "iwarp"], scope="module")
def target(request):
    net = f"127.48.{secrets.randbelow(250) + 1}"
    t = TargetThread(request.param, TargetConfig(blocks=256, block_size=4096, max_initiators=8),
                     hosts=[f"{net}.{i}" for i in range(1, 8)])
    yield t
    t.stop()


def bench(target: TargetThread, *args: str, index: int = 0) -> subprocess.CompletedProcess:
    local = ["--local", target.initiator_hosts[index]] if target.transport == "roce" else []
    return subprocess.run([*KBTP, "bench", target.url, *local, *args], capture_output=True, text=True,
                          timeout=120)


def test_percentiles_are_nearest_rank():
    samples = list(range(1, 1001))
    assert [percentile(samples, p) for p in (50, 90, 99, 99.9, 100)] == [500, 900, 990, 999, 1000]
    lines = histogram([1000] * 9 + [100_000])            # 1 us and 100 us, log buckets
    assert lines[0].split("|")[1].split()[1:] == ["9", "90.0%"] and lines[-1].endswith("10.0%")


def test_sweep_is_powers_of_two_from_8_to_the_block_size():
    """perftest's -a from 8; a Block Size that is no power of two is swept to, and one under
    8 is the only size."""
    assert sweep(64) == [8, 16, 32, 64]
    assert sweep(1000) == [8, 16, 32, 64, 128, 256, 512, 1000]
    assert sweep(4) == [4] and sweep(8) == [8]


def test_histogram_rows_name_both_edges():
    """Each row says the range it counts, lower edge inclusive: 1 us falls in the first row
    (1.0 to 1.6 us at five a decade), 100 us in the last, and each row starts where the one
    before it ended."""
    lines = histogram([1000] * 9 + [100_000])
    ranges = [line.split("|")[0].split() for line in lines]
    assert ranges[0] == ["1.0", "to", "1.6", "us"] and ranges[-1][0] == "100.0"
    assert all(a[2] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_throughput_leaves_out_a_partial_last_interval():
    """A run of 1.05 s at 1,000 ops/s: ten whole 100 ms intervals at 1,000 ops/s, and not
    the last 50 ms, which read as a collapse to 500 at the end of every run."""
    s = Samples("LOAD", 4096)
    for i in range(1050):
        s.add(1000, 1000, i * 1_000_000 + 500_000)
    points = s.throughput(0.1, 1.05)
    assert len(points) == 10 and {rate for _, rate in points} == {1000.0}
    assert points[-1][0] == pytest.approx(1.0)


@pytest.mark.slow
@needs_tshark
def test_latency_agrees_with_tshark_and_the_dissector(tmp_path, target):
    """The capture holds the soft RNIC's own stamp of each frame (a RoCEv2 packet as it
    goes or comes; on iWARP the TCP write that carries a request and the read that brings
    its answer), and tshark with the Lua dissector pairs each LOAD with its COMPLETION by
    itself: its kbtp.time must give the bench's percentiles to the capture's microsecond,
    or, where the samples thin out in the tail of a busy host, to the spread of the
    capture's own samples within one in a thousand ranks of the percentile (a sample the
    two stamp apart moves the rank by one there): a tolerance the data sets, which still
    fails a bench that times anything but the wire."""
    pcap = tmp_path / "bench.pcap"
    proc = bench(target, "--op", "load", "-s", "4096", "-t", "2", "-n", "3000", "--json",
                 "--pcap", str(pcap))
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)["results"][0]
    assert (row["op"], row["iterations"], row["errors"]) == ("LOAD", 3000, 0)
    out = subprocess.run([TSHARK, "-n", "-r", str(pcap), "-X", f"lua_script:{LUA}", "-Y",
                          f"kbtp.opcode == {LOAD} || (kbtp.opcode == {COMPLETION} && kbtp.time)",
                          "-T", "fields", "-e", "frame.number", "-e", "kbtp.opcode", "-e", "kbtp.request_in",
                          "-e", "kbtp.time"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    loads = {number for number, opcode, *_ in rows if int(opcode, 0) == LOAD}
    wire = sorted(round(float(time) * 1e9) for _, opcode, request_in, time in rows
                  if int(opcode, 0) == COMPLETION and request_in in loads)
    assert len(wire) == 3000
    for p in (50, 90, 99, 99.9):
        ours, theirs = row["latency_us"][f"p{p:g}"], percentile(wire, p) / 1000
        assert abs(ours - theirs) <= max(0.01 * theirs, 2, rank_spread(wire, p) / 1000), (p, ours, theirs)


def rank_spread(ordered: list[int], p: float) -> int:
    """The spread of the samples within one in a thousand ranks (at least one) either side
    of the nearest-rank ``p`` percentile."""
    rank, near = math.ceil(round(p * len(ordered) / 100, 9)), max(1, len(ordered) // 1000)
    return ordered[min(len(ordered), rank + near) - 1] - ordered[max(1, rank - near) - 1]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_direct_alloc_slower_than_the_ticket_timeout_goes_on_in_a_new_session(transport, monkeypatch):
    """A Ticket Timeout of 1 ms, and a target that takes 12 ms to act on every tenth BIND,
    past two looks of its ticket watch (every 5 ms): the target abandons those tickets
    (BIND refused, or the Partition revoked and the connection ended), on a quiet machine
    as on a busy one. The bench counts each as expired, takes it again in a new session,
    and ends normally."""
    bind, binds = Executor.bind, [0]

    async def slow_bind(self, conn, req, fetch=None):
        binds[0] += 1
        if binds[0] % 10 == 0:
            await asyncio.sleep(0.012)
        return await bind(self, conn, req, fetch)
    monkeypatch.setitem(Executor._handlers, Opcode.BIND, slow_bind)   # the dispatch's own table
    net = f"127.48.{secrets.randbelow(250) + 1}"
    t = TargetThread(transport, TargetConfig(blocks=256, block_size=4096, max_initiators=8,
                                             ticket_timeout_ms=1), hosts=[f"{net}.{i}" for i in range(1, 8)])
    try:
        proc = bench(t, "--op", "direct_alloc", "-n", "200", "--json")
    finally:
        t.stop()
    assert proc.returncode == 0, proc.stderr
    assert binds[0] >= 200, binds                 # the slow BIND is the one the target ran
    alloc, free = json.loads(proc.stdout)["results"]
    assert alloc["expired"] > 0 and alloc["errors"] == 0, alloc
    assert alloc["iterations"] == 200 - max(0, alloc["expired"] - 200), alloc    # each taken again once
    assert free["iterations"] + free["errors"] == alloc["iterations"], free


@pytest.mark.slow
@pytest.mark.parametrize("op", ["store", "alloc_store", "direct_load", "direct_alloc"])
def test_every_operation_in_a_table_and_json(target, op):
    proc = bench(target, "--op", op, "-s", "512,4096", "-t", "4", "-n", "200", "--json", index=1)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["results"]
    names = {"store": ["STORE"], "alloc_store": ["ALLOC_STORE", "FREE"], "direct_load": ["DIRECT_LOAD"],
             "direct_alloc": ["DIRECT_ALLOC", "FREE"]}[op]
    assert [r["op"] for r in rows] == names * 2 and [r["bytes"] for r in rows][::len(names)] == [512, 4096]
    for r in rows:
        lat = r["latency_us"]
        assert r["iterations"] == 200 and r["errors"] == 0 and r["ops_per_s"] > 0
        assert lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
        assert r["cpu_us_per_op"] > 0 and 0 < r["cpu_percent"] <= 100 * 2   # threads count too
    text = bench(target, "--op", op, "-n", "100", "-t", "2", index=1)
    assert text.returncode == 0, text.stderr
    assert "t_p99.9" in text.stdout and "CPU/op[usec]" in text.stdout and " us | #" in text.stdout


@pytest.mark.slow
def test_plot_png_and_svg(tmp_path, target):
    pytest.importorskip("matplotlib")
    for name in ("bench.png", "bench.svg"):
        out = tmp_path / name
        proc = bench(target, "-n", "300", "-t", "2", "--no-histogram", "--plot", str(out), index=2)
        assert proc.returncode == 0, proc.stderr
        head = out.read_bytes()[:200]
        assert head.startswith(b"\x89PNG") if name.endswith(".png") else b"<svg" in head, head


def test_more_in_flight_than_the_quota_is_one_line(target):
    proc = bench(target, "-t", "1000", "-n", "10", index=3)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr   # as asked: usage
    assert "--in-flight 1000 needs a block each; the target's quota is 32 blocks" in proc.stderr


def _measuring(t: TargetThread, *args: str) -> subprocess.Popen:
    """``kbtp bench -D 60 --json`` against ``t``, returned once its session has run a second."""
    local = ["--local", t.initiator_hosts[0]] if t.transport == "roce" else []
    proc = subprocess.Popen([*KBTP, "bench", t.url, *local, "-D", "60", "--json", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not t.target.sessions.by_id and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)
    return proc


def _partial(proc: subprocess.Popen, code: int) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    doc = json.loads(out)
    row = doc["results"][0]
    assert doc["partial"] and row["partial"] and row["iterations"] > 0 and row["seconds"] < 30
    return doc, err.splitlines()[-1]


@pytest.mark.slow
@STOPS
def test_ctrl_c_keeps_what_was_measured(tmp_path, sigs, code, name):
    """A SIGINT (or a CI timeout's SIGTERM, which timeout(1) sends to the command and then
    to its group) a second into a 60 s run: the requests completed until then, marked
    partial, then exit 130 (143) as conform, fuzz and decode do."""
    t = TargetThread("iwarp", TargetConfig(blocks=64, max_initiators=4))
    table = tmp_path / "bench.csv"
    try:
        proc = _measuring(t, "--csv", str(table))
        stop(proc, sigs)
        doc, why = _partial(proc, code)
    finally:
        t.stop()
    assert doc["ended"] == f"interrupted ({name})" and why.startswith(f"kbtp: bench: interrupted ({name})")
    [row] = list(csv.DictReader(table.open()))
    assert row["partial"] == "True" and int(row["iterations"]) == doc["results"][0]["iterations"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_a_target_that_dies_keeps_what_was_measured(transport):
    """The target goes away a second into the run: what it answered until then is reported,
    marked partial, with why it ended; exit 1 (the target failed)."""
    t = TargetThread(transport, TargetConfig(blocks=64, max_initiators=4))
    try:
        proc = _measuring(t)
    finally:
        t.stop()
    doc, why = _partial(proc, 1)
    assert doc["ended"].startswith("the connection ended: ") and "the connection ended" in why


def test_local_over_iwarp_is_a_usage_error():
    """--local names a RoCEv2 source address; over iWARP TCP picks it: one line, exit 2, as
    kbtp initiator says it (it was a traceback)."""
    proc = subprocess.run([*KBTP, "bench", "iwarp://127.0.0.1:9", "--local", "127.0.0.2", "-n", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "--local is for RoCEv2" in proc.stderr


def test_csv_has_a_row_per_size_with_gbit_per_s(target, tmp_path):
    """--csv FILE: a header and one row per operation and size, as the JSON has them, with
    Gbit/s beside MB/s; '-' puts it on stdout alone."""
    table = tmp_path / "bench.csv"
    proc = bench(target, "-s", "512,4096", "-n", "200", "--json", "--csv", str(table), index=4)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(table.open()))
    results = json.loads(proc.stdout)["results"]
    assert [(r["op"], int(r["bytes"]), int(r["iterations"])) for r in rows] == \
        [(r["op"], r["bytes"], r["iterations"]) for r in results] == [("LOAD", 512, 200), ("LOAD", 4096, 200)]
    for r in rows:
        assert float(r["gbit_per_s"]) == pytest.approx(float(r["mb_per_s"]) * 8 / 1000, rel=0.01, abs=1e-4)
        assert float(r["lat_p50_us"]) > 0 and r["partial"] == "False"
    proc = bench(target, "-n", "50", "--csv", "-", index=5)
    assert proc.returncode == 0 and proc.stdout.splitlines()[0].startswith("op,bytes,iterations"), proc.stderr
    assert len(proc.stdout.splitlines()) == 2


@pytest.mark.slow
def test_all_sizes_sweeps_powers_of_two_to_the_block_size(target):
    """-a (perftest's): one row per size, 8, 16, ... up to the target's Block Size (4096)."""
    proc = bench(target, "-a", "-n", "20", "--json", index=1)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["results"]
    assert [r["bytes"] for r in rows] == [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert {(r["op"], r["iterations"], r["errors"]) for r in rows} == {("LOAD", 20, 0)}
    both = bench(target, "-a", "-s", "64", "-n", "5", index=1)
    assert both.returncode == 2 and "--size or --all-sizes" in both.stderr, both.stderr


@pytest.mark.slow
@needs_tshark
def test_qp_runs_sessions_at_once_each_its_own_initiator_id(target, tmp_path):
    """-q 3 (perftest's): three sessions at once, each with -t 2 and -n 30: the row sums
    them (90 LOADs a size), and the capture shows three HELLOs with three Initiator IDs."""
    pcap = tmp_path / "qp.pcap"
    proc = bench(target, "-q", "3", "-t", "2", "-s", "512,1024", "-n", "30", "--json", "--pcap", str(pcap),
                 index=2)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["connections"] == 3
    assert [(r["op"], r["bytes"], r["iterations"], r["errors"]) for r in doc["results"]] == \
        [("LOAD", 512, 90, 0), ("LOAD", 1024, 90, 0)]
    ids = hello_initiator_ids(pcap)
    assert len(ids) == 3 and len(set(ids)) == 3, ids


def hello_initiator_ids(pcap: Path) -> list[str]:
    """The Initiator ID of every HELLO in the capture, as tshark and the Lua dissector read it."""
    out = subprocess.run([TSHARK, "-n", "-r", str(pcap), "-X", f"lua_script:{LUA}", "-Y", "kbtp.hello.initiator_id",
                          "-T", "fields", "-e", "kbtp.hello.initiator_id"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.slow
def test_bidirectional_loads_and_stores_at_once(target):
    """--bidirectional: loads and stores in the same seconds, half of -t each, both reported
    with their own rows; it needs two in flight, and is load and store only."""
    proc = bench(target, "--bidirectional", "-t", "4", "-s", "1024", "-n", "60", "--json", index=3)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["results"]
    assert [(r["op"], r["bytes"], r["iterations"], r["errors"]) for r in rows] == \
        [("LOAD", 1024, 60, 0), ("STORE", 1024, 60, 0)] and json.loads(proc.stdout)["op"] == "load+store"
    assert rows[0]["seconds"] == rows[1]["seconds"]          # one run, not one after the other
    one = bench(target, "--bidirectional", "-t", "1", "-n", "5", index=3)
    assert one.returncode == 2 and "--in-flight 2 or more" in one.stderr, one.stderr
    other = bench(target, "--bidirectional", "--op", "direct_load", "-t", "2", "-n", "5", index=3)
    assert other.returncode == 2 and len(other.stderr.splitlines()) == 1, other.stderr


@pytest.mark.slow
def test_kpi_reports_kv_block_transfer_latency_over_trials(target, tmp_path):
    """--trials 3 --kpi FILE: the KV block transfer latency, P50/P95/P99/P99.9 of each
    trial (nearest rank of its samples) and their mean, min and max over the trials, per
    size; the table has a row per trial. '-' puts the JSON on stdout."""
    out = tmp_path / "kpi.json"
    proc = bench(target, "--trials", "3", "-s", "512,4096", "-n", "40", "-t", "2", "--json", "--kpi", str(out),
                 index=4)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["results"]
    assert [(r["bytes"], r["trial"]) for r in rows] == [(512, 1), (512, 2), (512, 3), (4096, 1), (4096, 2),
                                                        (4096, 3)]
    doc = json.loads(out.read_text())
    assert doc["metric"] == "KV block transfer latency" and "IETF" in doc["source"]
    assert [(r["op"], r["bytes"]) for r in doc["results"]] == [("LOAD", 512), ("LOAD", 4096)]
    for result, table_rows in zip(doc["results"], (rows[:3], rows[3:])):
        trials = result["trials"]
        assert [(t["trial"], t["samples"]) for t in trials] == [(1, 40), (2, 40), (3, 40)]
        for t, row in zip(trials, table_rows):
            assert t["p50_us"] == row["latency_us"]["p50"] and t["p99.9_us"] == row["latency_us"]["p99.9"]
            assert t["p50_us"] <= t["p95_us"] <= t["p99_us"] <= t["p99.9_us"] <= row["latency_us"]["max"]
        for key in ("p50_us", "p95_us", "p99_us", "p99.9_us"):
            values = [t[key] for t in trials]
            spread = result["across_trials"][key]
            assert (spread["min"], spread["max"]) == (min(values), max(values))
            assert spread["mean"] == pytest.approx(sum(values) / 3, abs=0.01)
    stdout = bench(target, "-n", "30", "--kpi", "-", index=4)
    assert stdout.returncode == 0, stdout.stderr
    assert json.loads(stdout.stdout)["results"][0]["trials"][0]["samples"] == 30


@pytest.mark.slow
def test_the_table_says_which_trial_a_row_is(target):
    """--trials 2: a trial column after #bytes tells each size's rows apart (the table had
    none: two rows of one size, unnamed); a single trial has no such column."""
    two = bench(target, "--trials", "2", "-s", "512,4096", "-n", "20", "--no-histogram", index=5)
    assert two.returncode == 0, two.stderr
    header, *rows = [line.split() for line in two.stdout.splitlines() if line and not line.startswith("-")]
    assert header[:4] == ["op", "#bytes", "trial", "#iterations"]
    assert [r[:4] for r in rows] == [["LOAD", size, trial, "20"] for size in ("512", "4096") for trial in "12"]
    one = bench(target, "-n", "20", "--no-histogram", index=5)
    assert one.returncode == 0 and "trial" not in one.stdout, one.stdout


def _spread(lo_us: float, hi_us: float) -> Measured:
    """A size's run with latencies spread (log-uniformly) from ``lo_us`` to ``hi_us``."""
    s = Samples("LOAD", 4096)
    for i in range(400):
        s.add(round(lo_us * 1000 * (hi_us / lo_us) ** (i / 399)), 0, i * 1_000_000)
    return Measured(4096, {"LOAD": s}, 0.4, 0.1)


@pytest.mark.slow
@pytest.mark.parametrize(("lo", "hi"), [(150, 900), (200, 3000), (45, 460), (20, 30_000), (8, 5_000_000),
                                        (100, 101)])
def test_the_latency_axis_labels_are_plain_numbers_apart(lo, hi):
    """The plot's latency axis as it is drawn: its labels are plain numbers that do not run
    into each other. Matplotlib's own log axis labelled minor ticks too under two decades,
    in scientific notation, over each other ("2×10²3×10²")."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kbtp_scapy.bench import plot
    fig = plot.figure([_spread(lo, hi)], "bench")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    latency = fig.axes[0]
    low, high = sorted(latency.get_xlim())
    shown = sorted(((tick.label1.get_window_extent(canvas.get_renderer()), tick.label1.get_text())
                    for tick in latency.xaxis.get_major_ticks() + latency.xaxis.get_minor_ticks()
                    if low <= tick.get_loc() <= high and tick.label1.get_visible() and tick.label1.get_text()),
                   key=lambda label: label[0].x0)
    texts = [text for _, text in shown]
    assert len(texts) >= 2 and all(re.fullmatch(r"\d+(\.\d+)?(e\+\d+)?", t) for t in texts), texts
    assert [float(t) for t in texts] == sorted(float(t) for t in texts), texts
    assert all(a.x1 < b.x0 for (a, _), (b, _) in zip(shown, shown[1:])), texts


def test_bench_help_lists_the_exit_statuses_the_readme_does(capsys):
    """The README's exit table and ``kbtp bench --help`` say the same of each status."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    head = next(line for line in readme.splitlines() if line.startswith("| command |"))
    row = next(line for line in readme.splitlines() if line.startswith("| `bench` |"))
    cells = [c.strip().replace("`", "") for c in row.strip("|").split(" | ")]
    table = {code.strip(): cell for code, cell in zip(head.strip("|").split(" | ")[1:], cells[1:]) if cell}
    assert main(["bench", "--help"]) == 0
    said = " ".join(capsys.readouterr().out.split("Exit status:")[1].split("\n\n")[0].split()).rstrip(".")
    helped = dict(clause.split(" ", 1) for clause in re.split(r"; (?=\d+ )", said))
    assert helped == table and "the run could not start" in table["2"]


@pytest.mark.slow
def test_ctrl_c_keeps_what_every_session_and_direction_measured():
    """A SIGINT a second into a 60 s run of two sessions, loads and stores at once: both
    directions' requests so far, marked partial, exit 130; the target is left with no
    session (each said GOODBYE)."""
    t = TargetThread("iwarp", TargetConfig(blocks=64, max_initiators=4))
    try:
        proc = _measuring(t, "-q", "2", "-t", "2", "--bidirectional")
        proc.send_signal(signal.SIGINT)
        doc, _ = _partial(proc, 130)
        deadline = time.monotonic() + 30
        while t.target.sessions.by_id and time.monotonic() < deadline:
            time.sleep(0.05)
        left = len(t.target.sessions.by_id)
    finally:
        t.stop()
    assert [r["op"] for r in doc["results"]] == ["LOAD", "STORE"] and doc["connections"] == 2
    assert all(r["partial"] and r["iterations"] > 0 for r in doc["results"])
    assert left == 0
