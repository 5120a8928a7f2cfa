"""The C plugin for the suite: built once per session from the committed packet-kbtp.c,
and tshark runs with it loaded.

Wireshark reads no personal plugin folder when it runs as root (as the suite does in
containers), so the suite loads the plugin with LD_PRELOAD: the preload build registers
the plugin when the library loads, as Wireshark's loader would (``build(preload=True)``).
The tests of the plugin as a user installs it (pyshark, the GUI) use ``installed_c_plugin``:
``kbtp dissector install --c`` into a HOME of their own, Wireshark run as a user whose
personal plugins it reads.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from kbtp_scapy.dissector.build import build, toolchain_missing
from tests.tshark import TSHARK, private_home

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "dissector" / "kbtp.lua"
MISSING = toolchain_missing()
needs_toolchain = pytest.mark.skipif(MISSING is not None, reason=f"the C plugin cannot be built: {MISSING}")
TCP_FIRST = ("-o", "tcp.try_heuristic_first:TRUE")


@pytest.fixture(scope="session")
def c_plugin(tmp_path_factory) -> Path:
    """kbtp-preload.so, built with -Wall -Wextra -Werror: the build fails on any warning."""
    return build(tmp_path_factory.mktemp("cplugin"), preload=True)


def run_form(form: str, plugin: Path, pcap: Path, *args: str, env: dict | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """tshark over ``pcap`` with the ``c`` or the ``lua`` form of the dissector."""
    env = dict(env or os.environ)
    cmd = [TSHARK or "tshark", "-n", "-r", str(pcap), *TCP_FIRST, *args]
    if form == "c":
        env["LD_PRELOAD"] = str(plugin)
    else:
        cmd += ["-X", f"lua_script:{LUA}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (form, proc.stderr)
    return proc


#: Wireshark reads no personal plugin folder when it runs as root: then the tests that use
#: the installed plugin run Wireshark's programs as this user (nobody), as a user who
#: installed the plugin runs them.
UNPRIVILEGED = "65534"
AS_USER = ("setpriv", f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}", "--clear-groups")


@dataclass
class Installed:
    """The C plugin as ``kbtp dissector install --c`` puts it into a HOME of a test's own."""
    home: Path
    env: dict[str, str]         #: that HOME and its XDG folders
    plugin: Path                #: the installed kbtp.so
    as_user: tuple[str, ...]    #: what runs a command as a user whose plugins Wireshark reads
    tshark: str                 #: a tshark that loads it (as root: a script that runs it as nobody)
    pcaps: Path                 #: pcaps/, copied where that user can read it


@contextmanager
def installed_c_plugin() -> Iterator[Installed]:
    """Install the C plugin into a fresh HOME and check that tshark lists it from there."""
    root = os.geteuid() == 0
    if root and shutil.which("setpriv") is None:
        pytest.skip("run as root without setpriv: Wireshark would read no personal plugin folder")
    home = Path(tempfile.mkdtemp(prefix="kbtp-installed-"))    # not under pytest's 0700 tmp
    try:
        env = private_home(home)
        proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "dissector", "install", "--c"],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        plugin = Path(next(line.split(" ", 1)[1] for line in proc.stdout.splitlines()
                           if line.startswith("installed ")))
        assert plugin.is_relative_to(home) and plugin.name == "kbtp.so" and plugin.parent.name == "epan"
        shutil.copytree(ROOT / "pcaps", home / "pcaps")
        tshark = TSHARK or "tshark"
        if root:
            wrapper = home / "tshark"
            wrapper.write_text(f'#!/bin/sh\nexec {" ".join(AS_USER)} {tshark} "$@"\n')
            wrapper.chmod(0o755)
            tshark = str(wrapper)
            subprocess.run(["chmod", "-R", "a+rwX", str(home)], check=True, timeout=60)
        listed = subprocess.run([tshark, "-G", "plugins"], capture_output=True, text=True, timeout=120,
                                env=env).stdout
        assert f"\t{plugin}\n" in listed, listed          # loaded from where it was installed
        yield Installed(home, env, plugin, AS_USER if root else (), tshark, home / "pcaps")
    finally:
        shutil.rmtree(home, ignore_errors=True)
