"""The compiled core of ``kbtp decode --json`` (``decode/_core*.c``) against the pure-Python
decoder it ports: byte-identical stdout, stderr and exit status on every capture the suite
has (pcaps/, the fleet's, the real ones, the dissector's fuzz corpus and RDMA sessions) and
on cut, corrupted and re-encoded ones; the core is what ``kbtp decode`` runs when built."""
from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from kbtp_scapy.cli import main
from kbtp_scapy.decode import core
from tests import (
    test_decode as dec,
    test_decode_connections as conns,
    test_dissector_fuzz as fuzz,
    test_dissector_rdma as rdma,
)
from tests.test_dissector_c import SANITIZER

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path("/work/shared/captures")
COMMITTED = sorted({*(ROOT / "pcaps").rglob("*.pcap"), *(ROOT / "tests" / "data" / "captures").glob("*.pcap"),
                    *SHARED.glob("*.pcap")})

needs_core = pytest.mark.skipif(not core.BUILT, reason="the extension is not built (pip install -e .)")


def kbtp_decode(path: Path, pure: bool, *options: str) -> tuple[int, bytes, bytes]:
    """(exit status, stdout, stderr) of ``kbtp decode OPTIONS -q path``, in this process,
    with the core or with KBTP_DECODE=python."""
    with CliRunner().isolation(env={core.ENV: "python" if pure else ""}) as (out, err, _):
        code = main(["decode", *options, "-q", str(path)])
        sys.stdout.flush()
        return code, out.getvalue(), err.getvalue()


def kbtp_json(path: Path, pure: bool) -> tuple[int, bytes, bytes]:
    return kbtp_decode(path, pure, "--json")


def identical(path: Path) -> tuple[int, bytes, bytes]:
    """``kbtp decode`` of ``path``, JSON and text, the same with the core and without;
    returns the JSON run's."""
    for options in ((), ("--json",)):
        fast, pure = kbtp_decode(path, False, *options), kbtp_decode(path, True, *options)
        assert fast == pure, (path, options)
    return fast


@needs_core
@pytest.mark.parametrize("pcap", COMMITTED, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_committed_captures_decode_identically(pcap):
    code, out, err = identical(pcap)
    assert code == 0 and err


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, Path]:
    """The captures other tests build: variants of test_decode (markers, multi-segment
    Sends, several QPs), the RDMA sessions, the dissector fuzz corpus, re-encoded forms."""
    tmp = tmp_path_factory.mktemp("core")
    out = {"multi": dec.multi_connection(tmp / "multi.pcap"), "interleaved": dec.interleaved(tmp / "mixed.pcap")}
    for name, with_cm, acks in (("two_roce_cm", True, False), ("two_roce_acks", False, True),
                                ("two_roce_blind", False, False)):    # RoCE connections told apart three ways
        out[name] = conns.two_connections(tmp / f"{name}.pcap", with_cm=with_cm, acks=acks, crossed=True)
    for transport, addr_le in rdma.CASES:
        path = tmp / f"rdma_{transport}{'_le' if addr_le else ''}.pcap"
        rdma.build(transport, path, addr_le)
        out[path.stem] = path
    for name in fuzz.build(tmp / "fuzz", scale=0.25):
        out[f"fuzz_{name}"] = tmp / "fuzz" / f"{name}.pcap"
    for src in ("roce_session", "iwarp_session"):
        for fmt in ("pcapng", "nsecpcap"):
            out[f"{src}_{fmt}"] = tmp / f"{src}.{fmt}"
            subprocess.run(["editcap", "-F", fmt, str(ROOT / "pcaps" / f"{src}.pcap"), str(out[f"{src}_{fmt}"])],
                           check=True, timeout=60)
    frames = dec.records(ROOT / "pcaps" / "iwarp_session.pcap")
    out["big_endian"] = tmp / "be.pcap"
    with open(out["big_endian"], "wb") as f:
        f.write(struct.pack(">IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        for ts, data in frames:
            f.write(struct.pack(">IIII", int(ts), round(ts % 1 * 1e6), len(data), len(data)) + data)
    frame = dec.records(ROOT / "pcaps" / "roce_session.pcap")[0][1]
    out["link_types"] = dec._pcapng(tmp / "mixed.pcapng", [(197, bytes(80)), (1, frame), (247, bytes(40))])
    out["erf"] = dec.write_pcap(tmp / "ib.erf.pcap", [(1.0, bytes(80))] * 3, linktype=197)
    return out


GENERATED = ["multi", "interleaved", "two_roce_cm", "two_roce_acks", "two_roce_blind",
             *(f"rdma_{t}{'_le' if le else ''}" for t, le in rdma.CASES),
             "fuzz_raw_roce", "fuzz_raw_iwarp", "fuzz_reframed_roce", "fuzz_reframed_iwarp",
             "roce_session_pcapng", "roce_session_nsecpcap", "iwarp_session_pcapng", "iwarp_session_nsecpcap",
             "big_endian", "link_types", "erf"]


@needs_core
@pytest.mark.slow
@pytest.mark.parametrize("name", GENERATED)
def test_generated_captures_decode_identically(generated, name):
    identical(generated[name])


def _damaged(whole: bytes, rng: random.Random, flips: int) -> bytes:
    """``whole`` with ``flips`` random octets after the file header changed."""
    data = bytearray(whole)
    for _ in range(flips):
        data[rng.randrange(24, len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


@needs_core
@pytest.mark.slow
@pytest.mark.parametrize("src", ["roce_session.pcap", "iwarp_session.pcap", "rxe_kernel_session.pcap",
                                 "siw_kernel_session.pcap", "fleet/consumer1.pcap"])
def test_cut_and_corrupted_captures_decode_identically(tmp_path, src):
    """Cut anywhere (in a record header, in a frame), octets flipped anywhere (frames, record
    lengths: the file is corrupt from there), a record length made huge: the same lines,
    the same summary and the same one-line error either way."""
    whole = (ROOT / "pcaps" / src).read_bytes()
    rng = random.Random(src)
    cases = {f"cut{n}": whole[:n] for n in sorted(rng.sample(range(25, len(whole)), 6))}
    cases |= {f"flip{i}": _damaged(whole, rng, 1 + i) for i in range(8)}
    huge = bytearray(whole)
    huge[24 + 16 + len(dec.records(ROOT / "pcaps" / src)[0][1]) + 8:][:4] = struct.pack("<I", 1 << 30)
    cases["huge_record"] = bytes(huge)
    starts = dec.record_starts(whole)
    middle = starts[len(starts) // 2]
    cases["garbage_inserted"] = whole[:middle] + bytes(range(200, 237)) + whole[middle:]
    twice = bytearray(whole)
    for n in (len(starts) // 3, 2 * len(starts) // 3):
        twice[starts[n] + 8:starts[n] + 12] = struct.pack("<I", 0xFFFFFFF0)
    cases["two_damaged_headers"] = bytes(twice)
    cases["garbage_at_the_end"] = whole + bytes(range(255, 215, -1))
    codes = set()
    for name, data in cases.items():
        path = tmp_path / f"{name}.pcap"
        path.write_bytes(data)
        codes.add(identical(path)[0])
    assert codes == {0, 1}                 # some read to their end, some say where they stop


@needs_core
@pytest.mark.parametrize("name", ["roce_session_pcapng", "iwarp_session_pcapng"])
def test_damaged_pcapng_blocks_decode_identically(generated, name, tmp_path):
    """Block lengths broken (not a multiple of 4, too large) in two places, and a Section
    Header's byte-order magic broken: both read past each to the next whole block alike."""
    data = bytearray(generated[name].read_bytes())
    blocks, at = [], 0
    while at + 8 <= len(data):
        blocks.append(at)
        at += struct.unpack_from("<I", data, at + 4)[0]
    for n, length in ((len(blocks) // 3, 7), (2 * len(blocks) // 3, 1 << 30)):
        data[blocks[n] + 4:blocks[n] + 8] = struct.pack("<I", length)
    path = tmp_path / "damaged.pcapng"
    path.write_bytes(bytes(data))
    code, out, err = identical(path)
    assert code == 1 and b"2 damaged places" in err and out
    section = bytearray(generated[name].read_bytes())
    section[8:12] = b"\0\0\0\0"                        # the first section's magic
    path.write_bytes(bytes(section))
    code, out, err = identical(path)
    assert code == 1 and b"has no byte-order magic: the file is corrupt" in err
    # read on in the byte order before it (a resync in the other order found a false block)
    assert out.count(b"\n") == identical(generated[name])[1].count(b"\n") and b"claims" not in err


def _shuffled(frames: list, rng: random.Random, changes: int) -> list:
    """``frames`` with some swapped with the next, dropped or repeated, as a capture that
    lost, reordered and saw retransmitted segments."""
    out = list(frames)
    for _ in range(changes):
        k = rng.randrange(len(out) - 1)
        kind = rng.randrange(3)
        if kind == 0:
            out[k], out[k + 1] = out[k + 1], out[k]
        elif kind == 1:
            del out[k]
        else:
            out.insert(k + rng.randrange(1, 4), out[k])
    return out


@needs_core
@pytest.mark.slow
def test_reordered_lost_and_repeated_segments_decode_identically(generated, tmp_path):
    """TCP segments of the iWARP captures reordered, lost and repeated: holes, waits,
    resynchronisation after a hole, in the core and as Python decodes them."""
    rng = random.Random(3)
    sources = [ROOT / "pcaps" / "iwarp_session.pcap", ROOT / "pcaps" / "siw_kernel_session.pcap",
               ROOT / "pcaps" / "fleet" / "producer1.pcap", generated["multi"], _iwarp_sessions(tmp_path / "s.pcap")]
    for n, src in enumerate(sources):
        frames = dec.records(src)
        for i in range(10):
            path = dec.write_pcap(tmp_path / f"{n}_{i}.pcap", _shuffled(frames, rng, 1 + i))
            identical(path)


_FRAMES = st.lists(st.tuples(st.sampled_from([1, 101, 113, 276, 0, 197]), dec._frames), max_size=12)


@needs_core
@settings(max_examples=150, deadline=None)
@given(frames=_FRAMES)
def test_any_frames_decode_identically(tmp_path_factory, frames):
    """Frames of any content and link type, in a pcapng file: the core reads them as the
    Python decoder does (and never crashes)."""
    path = tmp_path_factory.mktemp("any") / "any.pcapng"
    dec._pcapng(path, frames)
    identical(path)


@needs_core
def test_the_core_is_what_decode_runs(monkeypatch, tmp_path):
    """Built with the package, the core decodes --json and the text lines, of a file or
    standard input; KBTP_DECODE=python or a filter run the Python decoder, which still
    works on its own."""
    assert core.BUILT and core.wanted()
    calls = []
    real = core.run
    monkeypatch.setattr(core, "run", lambda *a: calls.append(a[0]) or real(*a))
    pcap = ROOT / "pcaps" / "roce_session.pcap"
    fast = kbtp_json(pcap, False)
    assert len(calls) == 1 and fast[0] == 0
    pure = kbtp_json(pcap, True)
    assert len(calls) == 1 and pure == fast and len(pure[1].splitlines()) == 36
    text = kbtp_decode(pcap, False)
    assert len(calls) == 2 and text == kbtp_decode(pcap, True) and b" HELLO_ACK OK " in text[1]
    with CliRunner().isolation() as (out, _, _):
        assert main(["decode", "--json", "--opcode", "LOAD", str(pcap)]) == 0
    assert len(calls) == 2
    with CliRunner().isolation(input=pcap.read_bytes()) as (out, _, _):     # standard input too
        assert main(["decode", "--json", "-q", "-"]) == 0
        sys.stdout.flush()
        assert len(calls) == 3 and out.getvalue() == fast[1]


def _reordered(path: Path) -> Path:
    """iwarp_session.pcap with two TCP segments of one direction, both carrying data,
    swapped: the second arrives before the first (a hole, then its filling)."""
    frames = dec.records(ROOT / "pcaps" / "iwarp_session.pcap")

    def direction(data: bytes) -> tuple[bytes, int]:
        ihl = (data[14] & 0x0F) * 4
        has_data = len(data) > 14 + ihl + (data[14 + ihl + 12] >> 4) * 4
        return data[26:34] + data[14 + ihl:14 + ihl + 4], has_data
    k = next(i for i in range(10, len(frames) - 1)
             if direction(frames[i][1]) == direction(frames[i + 1][1]) and direction(frames[i][1])[1])
    frames[k], frames[k + 1] = (frames[k][0], frames[k + 1][1]), (frames[k + 1][0], frames[k][1])
    return dec.write_pcap(path, frames)


def _core_lines(path: Path) -> list[bytes]:
    """The lines the core writes for ``path``."""
    from kbtp_scapy.cli.decode import _malformed_json
    from kbtp_scapy.decode import Reader, Stats
    lines: list[bytes] = []
    with open(path, "rb") as stream:
        core.run(Reader(stream), stream, lines.append, None, _malformed_json, Stats(), core.Totals())
    return b"".join(lines).splitlines()


@needs_core
def test_segments_after_a_hole_wait_for_it_in_the_core(tmp_path):
    """A TCP segment that arrives before the one it follows is held until the hole fills,
    as iwarp.py holds it, in the core."""
    path = _reordered(tmp_path / "reordered.pcap")
    assert _core_lines(path) == identical(path)[1].splitlines()


@needs_core
def test_a_lost_segment_anywhere_decodes_identically(tmp_path):
    """Each frame of two iWARP connections with Sends of several DDP segments lost in turn:
    Sends with a hole come out incomplete, DDP segments wait for their message, the
    stream resynchronises, all in the core and as Python decodes it."""
    frames = dec.records(_iwarp_sessions(tmp_path / "whole.pcap"))
    incomplete = 0
    for k in range(len(frames)):
        path = dec.write_pcap(tmp_path / f"without{k}.pcap", frames[:k] + frames[k + 1:])
        lines = _core_lines(path)
        assert lines == identical(path)[1].splitlines()
        incomplete += any(b"inline data is" in line for line in lines)
    assert incomplete >= 2


@needs_core
@pytest.mark.slow
def test_mpa_markers_are_the_cores(generated):
    """The multi variant (a connection with markers and MPA revision 2, one without CRC,
    RoCE QPs, ADDR_LE): in the core, as Python decodes it."""
    lines = _core_lines(generated["multi"])
    assert len(lines) == 35 and sum(b'"malformed"' in line for line in lines) == 5
    assert lines == identical(generated["multi"])[1].splitlines()


@needs_core
@pytest.mark.slow
def test_memory_stays_flat_in_the_core(tmp_path):
    """test_decode's 210 MB capture (RoCE and iWARP, a RoCE Send that never ends, an iWARP
    direction whose segments all wait behind a lost one) as a file: the core decodes it
    all itself, and its memory stays flat as the Python decoder's does."""
    path = tmp_path / "big.pcap"
    with open(path, "wb") as out:
        dec._generate(out, 210 << 20)
    assert len(_core_lines(path)) > 40_000           # all of it in the core
    dec.decoded_flat(["--json", "-q", str(path)])


@needs_core
def test_a_live_pipe_shows_messages_before_the_capture_ends(tmp_path):
    """`tcpdump -w - | kbtp decode --json -`: the core writes every message it has before
    it waits for more input, and Ctrl-C then ends it with the summary and status 130."""
    pcap = (ROOT / "pcaps" / "iwarp_session.pcap").read_bytes()
    proc = subprocess.Popen([sys.executable, "-m", "kbtp_scapy", "decode", "--json", "-"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdin.write(pcap)                   # and the pipe stays open: more may come
    proc.stdin.flush()
    want = kbtp_json(ROOT / "pcaps" / "iwarp_session.pcap", True)[1].splitlines()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(proc.stdout.readline().rstrip(b"\n") for _ in want))
    reader.start()
    reader.join(60)                          # lines held back would never come: no hang
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert got == want
    assert proc.returncode == 130 and b"interrupted (Ctrl-C)" in err and b"Traceback" not in err, err


def test_the_core_is_built_where_a_compiler_is():
    """The extension is optional (an install without gcc still works), so a build that
    failed would only skip the tests above: with gcc here, it must have been built."""
    import shutil
    assert core.BUILT or shutil.which("gcc") is None, "pip install -e . did not build kbtp_scapy.decode._core"


def test_committed_core_tables_are_fresh():
    """The stale-file check without the CLI (test_dissector runs ``--check`` with an edit)."""
    from kbtp_scapy.dissector.generate_core import CORE_TABLES, header_source
    assert CORE_TABLES.read_text() == header_source(), "run 'kbtp dissector generate'"


#: The sanitized core runs each capture as kbtp decode and kbtp decode --json do.
_SANITIZED_RUN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_core", sys.argv[1])
sanitized = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sanitized)
from kbtp_scapy.cli.decode import _malformed_json, _malformed_text
from kbtp_scapy.decode import CaptureError, Reader, Stats, core
core._core = sanitized
for path in sys.argv[2:]:
    for text, malformed in ((False, _malformed_json), (True, _malformed_text)):
        with open(path, "rb") as stream:
            try:
                core.run(Reader(stream), stream, len, None, malformed, Stats(), core.Totals(), text)
            except CaptureError:
                pass
print("done", len(sys.argv) - 2)
"""


def _sanitized_core(tmp: Path) -> Path:
    """The core's C built as the package builds it, with AddressSanitizer and UBSan, and each
    frame in an allocation of its own (KBTP_CORE_CHECKED)."""
    import sysconfig

    from kbtp_scapy.dissector.build import SANITIZERS
    out = tmp / f"_core{sysconfig.get_config_var('EXT_SUFFIX')}"
    sources = sorted(map(str, (ROOT / "kbtp_scapy" / "decode").glob("_core*.c")))
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
                    *SANITIZERS, "-DKBTP_CORE_CHECKED", f"-I{sysconfig.get_paths()['include']}", *sources,
                    "-o", str(out), "-lm"], check=True, capture_output=True, timeout=300)
    return out


@needs_core
@pytest.mark.slow
def test_core_under_address_and_undefined_behaviour_sanitizers(generated, tmp_path):
    """The core built with -fsanitize=address,undefined (Python's own build is not; the
    runtimes are preloaded, as for the C plugin) over the fuzz corpus, the generated
    captures and cut and corrupted ones: no report."""
    from kbtp_scapy.dissector.build import sanitizer_preload
    module = _sanitized_core(tmp_path)
    runtimes = " ".join(sanitizer_preload(module).split()[:-1])
    rng = random.Random(33)
    damaged = []
    for src in ("roce_session.pcap", "iwarp_session.pcap", "fleet/producer1.pcap"):
        whole = (ROOT / "pcaps" / src).read_bytes()
        for i in range(12):
            path = tmp_path / f"{Path(src).stem}_{i}.pcap"
            path.write_bytes(_damaged(whole, rng, 1 + 4 * i)[:rng.randrange(25, len(whole) + 1)])
            damaged.append(path)
        for i in range(8):
            damaged.append(dec.write_pcap(tmp_path / f"{Path(src).stem}_shuffled{i}.pcap",
                                          _shuffled(dec.records(ROOT / "pcaps" / src), rng, 2 + 3 * i)))
        for n, at in enumerate(rng.sample(dec.record_starts(whole), 3)):     # read past damage
            resync = bytearray(whole[:at] + bytes(rng.randrange(256) for _ in range(23 + n)) + whole[at:])
            resync[at + 8 + 23 + n:][:4] = b"\xff\xff\xff\x0f"
            damaged.append(tmp_path / f"{Path(src).stem}_resync{n}.pcap")
            damaged[-1].write_bytes(bytes(resync))
    paths = [*map(str, generated.values()), *map(str, COMMITTED), *map(str, damaged)]
    env = dict(os.environ, LD_PRELOAD=runtimes, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _SANITIZED_RUN, str(module), *paths], capture_output=True,
                          text=True, timeout=600, env=env)
    reports = [line for line in proc.stderr.splitlines() if any(s in line for s in SANITIZER)]
    assert not reports, reports[:5]
    assert proc.returncode == 0 and proc.stdout.split() == ["done", str(len(paths))], proc.stderr[-2000:]


def _iwarp_sessions(path: Path, cut_last: int = 0) -> Path:
    """Two iWARP connections without markers (CRC on, and off with MPA revision 1) whose
    STOREs carry inline data over several DDP segments, interleaved; with ``cut_last``, the
    capture stops that many frames early, inside a Send."""
    from kbtp_scapy.builders.iwarp import IwarpConversation
    frames = []
    for i, kw in enumerate([{}, {"crc": False, "revision": 1}]):
        conv = IwarpConversation(("10.0.0.1", 40001 + i), ("10.0.0.9", 5420 + i), start=1_700_000_000.0 + 3e-5 * i,
                                 gap=0.0001, **kw)

        def send(ini, payload, conv=conv):
            conv.send_message("Send", payload, from_initiator=ini)

        def write(data, stag, to, conv=conv):
            conv.send_message("RDMA Write", data, from_initiator=False, stag=stag, to=to)
        dec._session(send, write, addr_le=False, rid0=100 * (i + 1))
        conv.close()
        frames += [(float(p.time), bytes(p)) for p in conv.packets]
    frames.sort(key=lambda f: f[0])
    return dec.write_pcap(path, frames[:len(frames) - cut_last])


@needs_core
def test_sends_of_several_ddp_segments_are_put_together_by_the_core(tmp_path):
    """A Send of several DDP segments is the core's, complete or left incomplete by a
    capture that stops inside it."""
    whole = _iwarp_sessions(tmp_path / "whole.pcap")
    stores = [line for line in kbtp_json(whole, True)[1].splitlines() if b'"kbtp.opcode": 17' in line]
    assert len(stores) == 2
    cut_inside = 0
    for cut in (0, 3, 17, 20):
        path = whole if not cut else _iwarp_sessions(tmp_path / f"cut{cut}.pcap", cut)
        lines = _core_lines(path)
        assert lines == identical(path)[1].splitlines()
        cut_inside += sum(b"inline data is" in line for line in lines)     # a STORE cut short
    assert cut_inside == 3
