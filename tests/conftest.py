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


@pytest.hookimpl(tryfirst=True)   # before xdist reads the groups it adds
def pytest_collection_modifyitems(session, config, items) -> None:
    """Which tests share a worker, and in what order they start.

    Under pytest-xdist (``-n``, pyproject's addopts) each module runs whole on one worker, as
    its addresses come from module counters and its costly fixtures are the module's, and the
    lab's modules share one worker, as they share one guest. The lab goes first there, so
    its guest's minutes overlap the other workers' tests; in one process it goes last, as
    its emulated guest keeps a core busy from the first lab test to the end of the session."""
    for item in items:
        lab = item.get_closest_marker("lab") is not None
        item.add_marker(pytest.mark.xdist_group("lab" if lab else item.module.__name__))
    parallel = bool(getattr(config.option, "numprocesses", None)) or hasattr(config, "workerinput")
    items.sort(key=lambda item: (item.get_closest_marker("lab") is not None) != parallel)
