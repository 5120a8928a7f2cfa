"""tools/rdma_lab.py on the host, without booting its guest: which kernel the guest gets,
which checkouts it can see, and that building it installs no boot kernel (issue 21)."""
from __future__ import annotations

from pathlib import Path

from .lab import rdma_lab


def _kernel_tree(root: Path, kver: str, modules: str = "lib/modules", rxe: bool = True) -> None:
    (root / "boot").mkdir(parents=True, exist_ok=True)
    (root / "boot" / f"vmlinuz-{kver}").write_bytes(b"")
    drivers = root / modules / kver / "kernel/drivers/infiniband/sw"
    (drivers / ("rxe" if rxe else "siw")).mkdir(parents=True)


def test_kernels_with_rxe_in_an_unpacked_tree(tmp_path):
    _kernel_tree(tmp_path, "6.1.0-9-amd64")
    _kernel_tree(tmp_path, "6.1.0-10-amd64", modules="usr/lib/modules")
    _kernel_tree(tmp_path, "6.1.0-11-cloud-amd64", rxe=False)        # no rdma_rxe: not a guest's
    found = rdma_lab._kernels(tmp_path)
    assert [(k.kver, k.modules) for k in found] == [
        ("6.1.0-10-amd64", tmp_path / "usr/lib/modules"), ("6.1.0-9-amd64", tmp_path / "lib/modules")]
    assert all(k.vmlinuz == tmp_path / "boot" / f"vmlinuz-{k.kver}" for k in found)


def test_building_installs_no_boot_kernel():
    assert not [p for p in rdma_lab.PACKAGES if p.startswith("linux-image")]
    assert "linux-headers-amd64" in rdma_lab.PACKAGES      # headers boot nothing


def test_a_checkout_the_guest_cannot_see_is_refused(monkeypatch):
    monkeypatch.setattr(rdma_lab.os, "geteuid", lambda: 0)
    monkeypatch.setattr(rdma_lab, "ROOT", Path("/run/user/1000/kbtp"))
    why = rdma_lab.unavailable()
    assert why and why.startswith("the checkout /run/user/1000/kbtp is under /run") and "elsewhere" in why
    monkeypatch.setattr(rdma_lab, "ROOT", Path("/tmp/kbtp"))     # the guest's tmpfs: handled
    assert not (rdma_lab.unavailable() or "").startswith("the checkout")


def test_the_guest_sees_a_checkout_under_tmp():
    """Stage 2 takes the .venv before its tmpfs hides /tmp and makes the mount point in it."""
    lines = rdma_lab.STAGE2.splitlines()
    at = {key: next(i for i, line in enumerate(lines) if key in line)
          for key in ("mount --bind @ROOT@/.venv", "mount -t tmpfs tmp", "mkdir -p /run/netns",
                      "checkout @ROOT@", "insmod @SIW@")}
    assert at["mount --bind @ROOT@/.venv"] < at["mount -t tmpfs tmp"] < at["mkdir -p /run/netns"] \
        < at["checkout @ROOT@"] < at["insmod @SIW@"]
    assert "@ROOT@" in lines[at["mkdir -p /run/netns"]].split()
