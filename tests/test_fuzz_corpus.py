"""``kbtp fuzz --seed-corpus``: the KBTP requests of a capture (pcaps/roce_session.pcap, read
with the streaming decoder) become seeds that mutated cases start from; the run against the
reference target on loopback finds nothing, its case names and replay line carry the
corpus, a name replays only against the same corpus, and an unreadable capture is a
one-line error, exit 2."""
from __future__ import annotations

import json
from pathlib import Path

from kbtp_scapy.cli import main
from kbtp_scapy.fuzz.cases import corpus_digest, make_case
from kbtp_scapy.fuzz.corpus import load
from kbtp_scapy.target import TargetConfig

from .kbtp_harness import TargetThread, fresh_hosts

SESSION = str(Path(__file__).parent.parent / "pcaps" / "roce_session.pcap")
IWARP = str(Path(__file__).parent.parent / "pcaps" / "iwarp_session.pcap")


def test_captured_requests_become_seeds():
    corpus = load([SESSION])
    # the capture's ALLOC_STORE of handle base + 1 with 8 octets inline (flags INLINE|SEAL)
    assert {"op": "ALLOC_STORE", "flags": 3, "offset": 1, "size": 8} in corpus.seeds
    assert {s["op"] for s in corpus.seeds} >= {"LOAD", "STORE", "ALLOC_STORE", "FREE", "BIND"}
    assert load([SESSION]).digest == corpus.digest != load([SESSION, IWARP]).digest
    cases = [make_case("iwarp", 5, i, corpus) for i in range(40)]
    started = [s["start"] for c in cases for s in c.steps if "start" in s]
    assert started and all(s in corpus.seeds for s in started)
    assert cases[3].name == f"iwarp-5-000003-c{corpus.digest}"
    # the digest as the summary prints it names the same case
    assert corpus_digest(f"iwarp-5-000003-{corpus.digest}") == corpus.digest
    # the built-in steps keep their values: only the seeded ones differ
    plain = make_case("iwarp", 5, 3)
    assert [s["kind"] for s in plain.steps] == [s["kind"] for s in cases[3].steps]


def test_a_run_from_a_seed_corpus_and_its_replay(tmp_path, capsys):
    t = TargetThread("iwarp", TargetConfig(blocks=256, max_initiators=8, ticket_timeout_ms=200),
                     hosts=fresh_hosts(2))
    summary = tmp_path / "s.json"
    try:
        assert main(["fuzz", "--target", t.url, "-q", "--cases", "30", "--seed", "5", "--out",
                     str(tmp_path / "f"), "--seed-corpus", SESSION, "--json-file", str(summary)]) == 0
        doc = json.loads(summary.read_text())
        digest = load([SESSION]).digest
        assert doc["seed_corpus"] == {"digest": digest, "requests": len(load([SESSION]).seeds)}
        assert doc["cases"] == 30 and doc["findings"] == [] and doc["exit_code"] == 0
        assert f"seed corpus {digest}" in capsys.readouterr().out
        name = f"iwarp-5-000003-c{digest}"
        assert main(["fuzz", "--target", t.url, "-q", "--seed-corpus", SESSION, "--replay", name]) == 0
        capsys.readouterr()
        # the same name against another corpus, or none: refused in one line
        for other in (["--seed-corpus", IWARP], []):
            assert main(["fuzz", "--target", t.url, "-q", *other, "--replay", name]) == 2
            err = capsys.readouterr().err
            assert f"seed corpus {digest}" in err and len(err.strip().splitlines()) == 1, err
        assert main(["fuzz", "--target", t.url, "-q", "--seed-corpus", SESSION, "--replay", "iwarp-5-000003"]) == 2
        assert "without a seed corpus" in capsys.readouterr().err
    finally:
        t.stop()


def test_an_unreadable_capture_is_exit_2(tmp_path, capsys):
    junk = tmp_path / "junk.pcap"
    junk.write_bytes(b"not a capture at all, not even close")
    for bad in (str(junk), str(tmp_path / "absent.pcap"), str(tmp_path)):
        assert main(["fuzz", "--target", "iwarp://127.53.9.1:9", "--cases", "1", "--seed-corpus", bad]) == 2
        err = capsys.readouterr().err
        assert f"--seed-corpus {bad}" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
