"""The RDMA lab in the suite: one QEMU guest with the kernel's rxe and siw per test session.

``lab`` (a session fixture, tests/conftest.py) boots ``tools/rdma_lab.py``'s guest once; tests skip, with the
reason, where it cannot start (no root, no /dev/net/tun). The project's code runs at full
speed on the host, in the lab's network namespace (``in_lab``, ``HostTarget``), and only
the peer runs in the guest: ``GuestTarget`` is ``kbtp target --io verbs`` on a device there.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kbtp_scapy.target import Target, TargetConfig

from .kbtp_harness import TargetThread
from .lab_walk import LAB_TARGET, TARGET_ARGS
from .netns import enter, move
from .sandbox import ROOT


def _tool(name: str):
    """A maintainers' script of tools/ as a module (tools/ is no package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


rdma_lab = _tool("rdma_lab")
lab_captures = _tool("lab_captures")


@dataclass(frozen=True)
class Binding:
    """One binding of the lab: its guest device, the guest's and the host's addresses."""

    transport: str
    device: str
    guest: str
    host: str

    def url(self, host: str, port: int | None = None) -> str:
        return f"{self.transport}://{host}" + (f":{port}" if port else "")


# the walk's target trusts what the lab's own tools trust (tests/lab_walk.py cannot import tools/)
assert set(rdma_lab.NETWORKS) <= set(LAB_TARGET["trust"]), (rdma_lab.NETWORKS, LAB_TARGET["trust"])

BINDINGS = {"roce": Binding("roce", "rxe0", rdma_lab.GUEST_IP, rdma_lab.HOST_IP),
            "iwarp": Binding("iwarp", "siw0", rdma_lab.SIW_GUEST_IP, rdma_lab.SIW_HOST_IP)}


def session_guest() -> Iterator:
    """The guest of the ``lab`` fixture (tests/conftest.py: one for every module); with
    KBTP_LAB=attach, the one ``tools/rdma_lab.py up`` keeps (for maintainers iterating on
    lab tests: no boot per run)."""
    why = rdma_lab.unavailable()
    if why:
        pytest.skip(f"the RDMA lab cannot start here: {why}")
    if os.environ.get("KBTP_LAB") == "attach" and (running := rdma_lab.Lab.running()):
        yield running
        running.close()
        return
    guest = rdma_lab.Lab()
    try:
        guest.boot()
    except rdma_lab.LabError as exc:
        guest.close()
        pytest.fail(f"the RDMA lab did not start: {exc}")
    try:
        yield guest
    finally:
        guest.close()


@contextlib.contextmanager
def in_lab(lab) -> Iterator[None]:
    """Run the block (its sockets and subprocesses) in the lab's host-side namespace."""
    with enter(lab.netns):
        yield


class GuestTarget:
    """``kbtp target --io verbs`` on the binding's device in the guest, LAB_TARGET's geometry."""

    def __init__(self, lab, binding: Binding, *extra: str, port: int | None = None,
                 verbose: bool = True) -> None:
        self.lab, self.binding = lab, binding
        listen = binding.guest + (f":{port}" if port else "")
        self.proc = lab.spawn(lab.kbtp("target", "--transport", binding.transport, "--io", "verbs",
                                       "--device", binding.device, "--listen", listen,
                                       *TARGET_ARGS, *extra, *["-v"] * verbose), name=f"target-{binding.device}")
        self.url = binding.url(binding.guest, port or _default(binding))
        self.proc.wait_for(f"listening on {self.url}", 120)

    def output(self) -> str:
        return self.proc.output()

    def stop(self) -> str:
        """Ctrl-C, as a user stops it; returns everything it printed."""
        rc = self.proc.stop()
        out = self.proc.output()
        assert rc == 0, f"target exited {rc}: {out[-3000:]}"
        assert "Traceback" not in out, out[-3000:]
        return out

    def __enter__(self) -> GuestTarget:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()


def _default(binding: Binding) -> int:
    return 4791 if binding.transport == "roce" else 5420


class HostTarget(TargetThread):
    """The reference target on the soft RNIC, its loop thread in the lab's namespace."""

    def __init__(self, lab, binding: Binding, **options) -> None:
        self.netns = lab.netns
        super().__init__(binding.transport, TargetConfig(**LAB_TARGET), hosts=[binding.host],
                         port=_default(binding), **options)

    async def _make(self, config: TargetConfig) -> Target:
        move(self.netns)                 # the loop's thread, for good
        return Target(config, self.transport)
