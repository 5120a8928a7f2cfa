"""The compiled core of ``kbtp decode`` (``_core*.c``, ``_core.h``), and when it is used.

A pure-Python message costs 25 to 60 µs; a disk at 100 MB/s brings one every 3 µs, so
the frame loop and the JSON line are written in C: pcap and pcapng records, ``locate``,
RoCE Sends by PSN with the ICRC check, RoCEv2 connections by their pair of QPs
(``connections.py``), iWARP TCP/MPA/DDP Sends, KBTP fields from the tables
(``_core_tables.h``, generated), each session's ADDR_LE, and the exact line
``json.dumps(capture.to_json(found))`` writes (or the text line ``kbtp decode`` shows).
The Python modules beside it stay the reference, and ``KBTP_DECODE=python`` forces them.

The core ports what the Python decoder does for ``kbtp decode``, TCP holes,
resynchronisation, MPA markers and DDP reassembly included; what it does not render
goes to the Python code, so that output is the same by construction there:

* a malformed KBTP message: its line comes from the ``malformed`` callback (the codec,
  and ``to_json`` or the text line), with the session state the core keeps;
* every option of ``kbtp decode`` but ``--json`` and ``-q`` (filters, ``-c``,
  ``--addr-le``, ``--stats``, ``--json-file``, ``--layers``): the caller runs Python
  throughout.

It reads a file or a pipe as the Python reader does, one chunk at a time (``readinto1``),
and hands its lines to ``sink`` before each read, so a pipe's reader sees them as the
capture is written.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from ..wire import iwarp as IW, iwarp_defs as D
from ..wire.address import ROCE_PORT
from ..wire.mpa_markers import MARKER_LEN
from . import Stats, connections, iwarp, pcapfile, roce
from .pcapfile import Reader

try:
    from . import _core  # type: ignore[attr-defined]
except ImportError:          # built by pip install; without a compiler the package has none
    _core = None

#: Whether the extension was built (and imported).
BUILT = _core is not None
#: ``KBTP_DECODE=python`` runs the pure-Python decoder even where the core is built.
ENV = "KBTP_DECODE"

_CONFIG = {
    "chunk": pcapfile.CHUNK, "max_record": pcapfile.MAX_RECORD, "max_message": roce.MAX_MESSAGE,
    "max_closed": iwarp.MAX_CLOSED, "max_pending": iwarp.MAX_PENDING, "roce_port": ROCE_PORT,
    "max_followed": connections.MAX_FOLLOWED,
    "ddp_untagged_len": D.DDP_UNTAGGED_LEN, "ddp_tagged_len": D.DDP_TAGGED_LEN, "marker_interval": D.MARKER_INTERVAL,
    "marker_len": MARKER_LEN, "max_out_of_order": iwarp.MAX_OUT_OF_ORDER, "max_unframed": iwarp.MAX_UNFRAMED,
    "flag_m": IW.FLAG_M, "flag_c": IW.FLAG_C, "flag_r": IW.FLAG_R, "mpa_startup_len": D.MPA_STARTUP_LEN,
    "mpa_req_key": D.MPA_REQ_KEY, "mpa_rep_key": D.MPA_REP_KEY,
    "roce_sends": {op: (pos, ext) for op, (pos, ext, _, _) in roce.SENDS.items()},
    "iwarp_sends": sorted(int(op) for op in D.SEND_OPCODES),
}


def wanted() -> bool:
    """Whether ``kbtp decode`` runs the core: built, and not turned off."""
    return BUILT and os.environ.get(ENV, "") != "python"


@dataclass
class Totals:
    """What ``kbtp decode``'s summary line counts, as far as the core got."""

    messages: int = 0
    malformed: int = 0
    conns: int = 0


#: The line of a malformed message: (payload, ADDR_LE, frame, time, transport, conn,
#: connection number, frames with a bad ICRC, time of the first frame) -> the line
#: without its newline.
MalformedLine = Callable[[bytes, bool, int, float, str, tuple, int, tuple[int, ...], float], str]


def run(reader: Reader, stream: BinaryIO, sink: Callable[[bytes], Any], progress: Callable[[int, int], Any] | None,
        malformed: MalformedLine, stats: Stats, totals: Totals, text: bool = False) -> None:
    """Decode the records of ``reader`` (its header read) into lines given to ``sink``: JSON,
    or with ``text`` the lines ``kbtp decode`` shows. ``stats``, ``totals`` and the reader's
    ``cut_short`` and ``problem`` are filled in, also when it stops on an exception
    (Ctrl-C, a closed stdout)."""
    assert _core is not None, "run() needs the built extension"
    got: dict[str, Any] = {}
    read = getattr(stream, "readinto1", None) or cast(Any, stream).readinto
    try:
        _core.run(config=_CONFIG, readinto=read, **reader.handover(), text=text, sink=sink, progress=progress,
                  malformed=malformed, stats=got)
    finally:
        if got:
            stats.frames, stats.first_time, stats.cut = got["frames"], got["first_time"], got["cut"]
            stats.unsupported = Counter(got["unsupported"])
            totals.messages, totals.malformed, totals.conns = got["messages"], got["malformed"], got["conns"]
            reader.cut_short = got["cut_short"]
            if got["damage"] is not None:
                first, last, skipped, position, places, total, lost = got["damage"]
                reader.report_damage(pcapfile.DAMAGE[first[0]].format(*first[1:]),
                                     pcapfile.DAMAGE[last[0]].format(*last[1:]), skipped, position, places,
                                     total, lost)
