#!/usr/bin/env python3
"""Regenerate the sample captures in pcaps/ from kbtp_scapy.samples, with realistic times.

The session builders space frames evenly; here each frame gets the time it would have on a
25 Gb/s link: its predecessor's serialisation time, a fraction of a microsecond between
frames of one burst, a few microseconds before an acknowledgement, the target's
processing time (5 to 25 µs) before it answers and the initiator's (20 to 150 µs) before
its next request, drawn from a generator seeded with the file's name, so the files are
the same on every run. Wireshark's Time column and ``kbtp.time`` then show what a real
capture would.

``--check`` writes them to a temporary folder and exits 1 if any committed capture
differs, so CI notices when the tables or the framing changed without a regeneration.
"""
from __future__ import annotations

import argparse
import filecmp
import random
import struct
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kbtp_scapy.builders.recorder import INITIATOR_V4, INITIATOR_V6  # noqa: E402
from kbtp_scapy.decode.frames import ROCE, TCP, address, locate  # noqa: E402
from kbtp_scapy.decode.pcapfile import Reader  # noqa: E402
from kbtp_scapy.samples import write_samples  # noqa: E402
from kbtp_scapy.wire.roce import ACKNOWLEDGE  # noqa: E402

PCAPS = ROOT / "pcaps"
START = 1_709_283_600.0            # 2024-03-01 09:00:00 UTC
LINK = 25e9                        # bits per second
OVERHEAD = 24                      # preamble, start delimiter, FCS and gap, in octets


def _kind(linktype: int, data: bytes) -> tuple[bool, bool]:
    """(sent by the initiator, a bare acknowledgement) of one frame."""
    where = locate(linktype, data)
    if where is None or where[0] not in (ROCE, TCP):
        return False, False
    ini = address(where[1]) in (INITIATOR_V4, INITIATOR_V6)
    if where[0] == ROCE:
        return ini, data[where[3]] == ACKNOWLEDGE
    return ini, where[-1] == where[-2]


def retime(path: Path) -> None:
    """Give the frames of ``path`` the times a 25 Gb/s capture would show."""
    with open(path, "rb") as f:
        reader = Reader(f, str(path))
        linktype = reader.linktype
        frames = [data for _, _, _, data in reader]
    rng = random.Random(path.name)
    t, previous = START, None
    out = [struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, linktype)]
    for i, data in enumerate(frames):
        ini, ack = _kind(linktype, data)
        if i:
            t += (len(frames[i - 1]) + OVERHEAD) * 8 / LINK
            if ini == previous:
                t += rng.uniform(0.1e-6, 0.5e-6)
            elif ack:
                t += rng.uniform(2e-6, 6e-6)
            else:
                t += rng.uniform(20e-6, 150e-6) if ini else rng.uniform(5e-6, 25e-6)
        previous = ini
        sec, usec = divmod(round(t * 1e6), 1_000_000)
        out.append(struct.pack("<IIII", sec, usec, len(data), len(data)) + data)
    path.write_bytes(b"".join(out))


def write(outdir: Path) -> list[Path]:
    paths = write_samples(outdir)
    for path in paths:
        retime(path)
    return paths


def stale(outdir: Path = PCAPS) -> list[str]:
    """Names of committed captures that differ from what the code generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = write(Path(tmp))
        return [p.name for p in fresh
                if not (outdir / p.name).exists() or not filecmp.cmp(p, outdir / p.name, shallow=False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if pcaps/ is stale")
    args = ap.parse_args()
    if args.check:
        names = stale()
        for name in names:
            print(f"pcaps/{name} is stale: run tools/make_pcaps.py", file=sys.stderr)
        return 1 if names else 0
    for path in write(PCAPS):
        print(f"wrote {path.relative_to(PCAPS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
