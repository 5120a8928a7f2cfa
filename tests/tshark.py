"""Run the real tshark and return its field values per frame, for oracle tests.

Every tshark the suite starts, here or anywhere else (live captures, ``kbtp demo``,
pyshark), runs with a HOME and configuration of the suite's own: ``tests/conftest.py``
puts ``private_home`` into the environment before any test runs, so no personal
Wireshark plugin (an installed kbtp.lua among them), preference or profile of whoever
runs the tests can change an outcome. The tests of the C plugin as a user installs it
(pyshark, the GUI) use ``installed_c_plugin``: ``kbtp dissector install --c`` into a HOME
of their own, and Wireshark's programs run as a user whose personal plugins it reads.
"""
from __future__ import annotations

import json
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

TSHARK = shutil.which("tshark")
needs_tshark = pytest.mark.skipif(TSHARK is None, reason="tshark is not installed")


def private_home(root: Path) -> dict[str, str]:
    """Environment for programs that must not see the user's own configuration: HOME and
    the XDG folders under ``root`` (Wireshark's personal configuration and plugin folders
    follow them), and none of Wireshark's WIRESHARK_* overrides."""
    for sub in (".config", ".local/share", ".cache"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WIRESHARK_")}
    env.update(HOME=str(root), XDG_CONFIG_HOME=str(root / ".config"),
               XDG_DATA_HOME=str(root / ".local/share"), XDG_CACHE_HOME=str(root / ".cache"))
    return env


def folders(env: dict[str, str] | None = None) -> dict[str, str]:
    """What ``tshark -G folders`` reports (folder kind -> path)."""
    proc = subprocess.run([TSHARK or "tshark", "-G", "folders"], capture_output=True, text=True,
                          timeout=120, env=env)
    return {name.strip(): value.strip() for name, _, value in
            (line.partition(":") for line in proc.stdout.splitlines()) if value}


def _flatten(node, out: dict[str, list]) -> None:
    """Collect every 'proto.field': value pair of tshark's JSON tree, in order."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                _flatten(value, out)
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    out.setdefault(key, []).extend(value)
            else:
                out.setdefault(key, []).append(value)
    elif isinstance(node, list):
        for item in node:
            _flatten(item, out)


def tshark_frames(pcap: Path | str, *args: str) -> list[dict[str, list]]:
    """One dict per frame: field name -> list of string values as tshark shows them."""
    proc = subprocess.run(
        [TSHARK or "tshark", "-n", "-r", str(pcap), "-T", "json", *args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    frames = []
    for frame in json.loads(proc.stdout or "[]"):
        out: dict[str, list] = {}
        _flatten(frame["_source"]["layers"], out)
        frames.append(out)
    return frames


def tshark_text(pcap: Path | str, *args: str) -> str:
    """tshark's one-line-per-frame output plus stderr, for malformed/expert checks."""
    proc = subprocess.run(
        [TSHARK or "tshark", "-n", "-r", str(pcap), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def pyshark_packets(pcap: Path | str, count: int, params: tuple[str, ...] = (),
                    display_filter: str = "kbtp.opcode", tshark_path: str | None = None) -> list:
    """The ``count`` packets pyshark reads from ``pcap`` with ``display_filter`` (tshark,
    or ``tshark_path``, run with ``params``), and then the end of the capture: no more, no
    fewer."""
    import asyncio

    import pyshark
    loop = asyncio.new_event_loop()     # (other tests' asyncio.run() leave none behind)
    cap = pyshark.FileCapture(str(pcap), display_filter=display_filter, custom_parameters=list(params),
                              eventloop=loop, tshark_path=tshark_path)
    packets = iter(cap)

    async def tshark_ended() -> None:
        await asyncio.gather(*(p.wait() for p in cap._running_processes))
    try:
        out = [next(packets) for _ in range(count)]
        # Let the loop see tshark end before pyshark's end of file kills it: kill()
        # polls first (Popen.send_signal), a poll that reaps the ended tshark makes
        # asyncio's child watcher report exit status 255, and pyshark calls that a crash.
        loop.run_until_complete(asyncio.wait_for(tshark_ended(), 60))
        assert next(packets, None) is None, pcap
        return out
    finally:
        cap.close()
        loop.close()


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
        shutil.copytree(Path(__file__).resolve().parent.parent / "pcaps", home / "pcaps")
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
