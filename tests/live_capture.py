"""Capture real traffic on the loopback interface with tshark while a test runs."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .tshark import TSHARK


class LiveCapture:
    """``with LiveCapture(path, bpf, probe):`` — tshark writes ``path`` while the block runs.

    tshark says "Capturing on" before its filter is live, so the capture counts as
    started only once ``probe()`` (which sends something the filter matches) has made
    the file grow. Skips the test where capturing on lo is not allowed.
    """

    def __init__(self, path: Path, bpf: str, probe) -> None:
        self.path, self.bpf, self.probe = path, bpf, probe
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LiveCapture:
        if os.geteuid() != 0:
            pytest.skip("capturing on lo needs root or CAP_NET_RAW")
        self.proc = subprocess.Popen([TSHARK, "-i", "lo", "-w", str(self.path), "-f", self.bpf],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        started = ""
        while "Capturing on" not in started:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._stop()
                pytest.skip(f"tshark cannot capture on lo: {started}")
            started += self.proc.stderr.readline()
        header = self.path.stat().st_size if self.path.exists() else 0
        while not self.path.exists() or self.path.stat().st_size == header:
            if time.monotonic() > deadline:
                self._stop()
                pytest.skip("tshark captured nothing on lo")
            self.probe()
            time.sleep(0.05)
        return self

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            time.sleep(0.3)                      # let the last frames reach the file
            self.proc.terminate()
            self.proc.wait(10)

    def __exit__(self, *exc) -> None:
        self._stop()


def tcp_probe(host: str, port: int):
    def probe() -> None:
        with socket.socket() as s:
            s.connect_ex((host, port))
    return probe


def udp_probe(host: str, port: int, source: str):
    """A datagram from ``source`` that the filter matches; nothing listens for it."""
    def probe() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((source, 0))
            s.sendto(b"probe", (host, port))
    return probe


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
