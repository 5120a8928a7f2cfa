"""kbtp_scapy: Scapy layers, a fast codec and tools for KBTP over iWARP and RoCEv2."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def scapy_ext(plg: Any) -> None:
    """Scapy 2.6+ extension hook: ``conf.exts.load("kbtp_scapy")`` makes the layers
    importable as ``scapy.contrib.kbtp`` and loads them."""
    plg.config("kbtp_scapy", __version__)
    plg.register(name="kbtp", mode=plg.MODE.CONTRIB,
                 path=Path(__file__).with_name("scapy_contrib.py"), default=True)
