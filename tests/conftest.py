"""The suite's own HOME: set before any test module is imported (see ``tests.tshark``)."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from tests.tshark import private_home

_HOME: Path | None = None


def pytest_configure(config) -> None:
    global _HOME
    _HOME = Path(tempfile.mkdtemp(prefix="kbtp-tests-home-"))
    env = private_home(_HOME)
    os.environ.clear()
    os.environ.update(env)
    # A suite started in the background (``cmd &``, nohup, some CI runners) inherits SIGINT
    # ignored, and so would every program it starts: Python does not install its Ctrl-C
    # handler then, and the tests that press Ctrl-C on a tool would see it ignored. The
    # suite's programs run as from a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config) -> None:
    if _HOME is not None:
        shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def lab():
    """The RDMA lab's guest (tests/lab.py), booted once for every module that asks: a
    fixture imported into each module would be one per module, a guest each."""
    from tests.lab import session_guest
    yield from session_guest()


LAB_MODULES = "test_lab_"


def _scope(nodeid: str) -> str:
    """The work unit of a test under pytest-xdist: its module, or "lab" for the lab's modules."""
    module = nodeid.split("::", 1)[0]
    return "lab" if Path(module).name.startswith(LAB_MODULES) else module


def pytest_xdist_make_scheduler(config, log):
    """Each module runs whole on one worker (its addresses come from module counters, its
    costly fixtures are the module's) and the lab's modules together on one (they share one
    guest), in collection order. xdist's loadgroup would say so with marks, but with pytest
    9.2 its group no longer reaches the node ids; a scheduler sees node ids only, hence the
    lab's modules are known by name (checked against their mark below)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False
    return ByModule(config, log)


def pytest_collection_modifyitems(session, config, items) -> None:
    """The lab's tests first under pytest-xdist (``-n``, pyproject's addopts), so its guest's
    minutes overlap the other workers' tests; last in one process, as its emulated guest
    keeps a core busy from the first lab test to the end of the session."""
    for item in items:
        lab = item.get_closest_marker("lab") is not None
        assert lab == (_scope(item.nodeid) == "lab"), f"{item.nodeid}: a lab test's module is named {LAB_MODULES}*"
    parallel = bool(getattr(config.option, "numprocesses", None)) or hasattr(config, "workerinput")
    items.sort(key=lambda item: (item.get_closest_marker("lab") is not None) != parallel)
