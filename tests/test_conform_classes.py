"""The classes of target bugs that got past ``kbtp conform`` (issue 31), on both executions.

``tests/test_conform.py`` plants each bug of the corpus into the software target and runs
its case on both bindings. Here the cases written for issue 31's classes also run where
that test does not: against the clean reference target with ``--execution chains`` and
with ADDR_LE set (where the requested-not-granted case sees ADDR_LE granted), all PASS;
and with each class's bug planted into the chains target, its case fails there too (each
bug lives in code the chains target runs in software: the HELLO, the completion, the
non-inline stores, ALLOC_STORE, BIND and FREE).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest

from kbtp_scapy.conform.registry import SHOULD
from kbtp_scapy.conform.runner import run

from .planted_bugs import BY_NAME, Bug, start
from .test_conform import case

#: Issue 31's classes: the bug written for each, whose case is the one that catches it.
CLASSES = ("addr_le_when_requested", "store_seal_from_inline", "load_honours_seal", "quota_checked_first",
           "bind_verifies_ticket_first",
           "bind_quota_counts_its_ticket", "invalidate_last_descriptor", "hello_version_ignored",
           "credits_from_config", "clear_data_length", "release_skips_clear")
#: The cases written or sharpened for them.
CASES = sorted({BY_NAME[b].case for b in CLASSES} | {"ops.header.version"})
CLEAN = Bug("clean", "", "", lambda t, mp: None)
_net = itertools.count(1)


def hosts() -> list[str]:
    """Loopback addresses of this module's own (127.58.x.y), apart from test_conform's."""
    n = next(_net)
    return [f"127.58.{n // 250}.{n % 250 + 1}", f"127.59.{n // 250}.{n % 250 + 1}"]


def _run(bug: Bug, transport: str, case_ids, monkeypatch, **config):
    t = start(transport, hosts(), dataclasses.replace(bug, config={**bug.config, **config}))
    try:
        bug.plant(t, monkeypatch)
        return asyncio.run(run(t.url, [case(c) for c in case_ids], timeout=5,
                               local=t.initiator_hosts[0] if transport == "roce" else None))[1]
    finally:
        t.stop()


@pytest.mark.slow
@pytest.mark.parametrize("config", [dict(execution="chains"), dict(execution="chains", addr_le=True),
                                    dict(addr_le=True)], ids=["chains", "chains-addr_le", "addr_le"])
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_the_clean_reference_passes(transport, config, monkeypatch):
    outcomes = _run(CLEAN, transport, CASES, monkeypatch, **config)
    bad = {o.case.id: (o.verdict, o.expected, o.seen, o.detail) for o in outcomes if o.verdict != "PASS"}
    assert not bad and len(outcomes) == len(CASES), bad


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
@pytest.mark.parametrize("name", CLASSES)
def test_each_class_is_caught_on_chains(name, transport, monkeypatch):
    bug = BY_NAME[name]
    [out] = _run(bug, transport, [bug.case], monkeypatch, execution="chains")
    want = "WARN" if case(bug.case).level == SHOULD else "FAIL"
    assert out.verdict == want and out.expected and out.seen, (out.verdict, out.expected, out.seen, out.detail)
