"""KBTP between the project and the kernel's RDMA stacks, both directions, both bindings.

The soft-RNIC initiator on the host walks every operation and status (``lab_walk``)
against the reference target on the verbs backend in the guest, on Linux rxe (RoCEv2, at
path MTUs 1024 and 4096) and siw (iWARP, with and without MPA CRC); then the verbs-backend
initiator in the guest walks the same against the soft-RNIC target on the host. The
device does the data movement: LOAD is its RDMA Write, a store its RDMA Read, DIRECT_ALLOC
its Fetch and Add (rxe; siw has no atomics, so its target does not offer it).
"""
from __future__ import annotations

import asyncio

import pytest

from .lab import BINDINGS, GuestTarget, HostTarget, in_lab, lab  # noqa: F401 (fixture)
from .lab_walk import walk
from .sandbox import ROOT

pytestmark = pytest.mark.lab


@pytest.mark.parametrize("transport,options", [
    ("roce", {"mtu": 1024}), ("roce", {"mtu": 4096}), ("iwarp", {"crc": True}),
    ("iwarp", {"crc": False})], ids=["rxe-mtu1024", "rxe-mtu4096", "siw-crc", "siw-nocrc"])
def test_soft_initiator_walks_every_operation_on_the_verbs_target(lab, transport, options):
    binding = BINDINGS[transport]
    roce = transport == "roce"
    with GuestTarget(lab, binding) as target:
        with in_lab(lab):
            asyncio.run(asyncio.wait_for(
                walk(target.url, direct_alloc=roce, record=roce, **options), 300))
        out = target.stop()
    if not roce:
        assert "not offering DIRECT_ALLOC: siw0 has no atomic operations" in out


@pytest.mark.parametrize("transport,mtu", [("roce", 1500), ("roce", 9000), ("iwarp", 9000)],
                         ids=["rxe-mtu1024", "rxe-mtu4096", "siw"])
def test_verbs_initiator_walks_every_operation_on_the_soft_target(lab, transport, mtu):
    binding = BINDINGS[transport]
    roce = transport == "roce"
    target = HostTarget(lab, binding)
    netdev = "eth0" if roce else "eth1"
    lab.run(["ip", "link", "set", netdev, "mtu", str(mtu)])
    try:
        done = lab.run(lab.python(str(ROOT / "tests" / "lab_walk.py"), target.url, binding.device,
                                  "1" if roce else "0", "1" if roce else "0"),
                       timeout=600, check=False)
    finally:
        lab.run(["ip", "link", "set", netdev, "mtu", str(lab_mtu())])
        target.stop()
    assert "walk: OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def lab_mtu() -> int:
    from .lab import rdma_lab
    return rdma_lab.MTU
