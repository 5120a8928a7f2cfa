"""A seed corpus from the user's own captures (``--seed-corpus``), as AFL and boofuzz take one.

The KBTP requests in the captures (streaming decoder, no Scapy) become seeds: opcode, flags,
the handle relative to its session's Handle Base (from the HELLO_ACK), and the data size
(inline or by descriptor). Mutated cases start from them; the corpus's digest goes into
the case names, so a name replays only against the corpus it came from.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..capture import kbtp_messages
from ..decode import CaptureError, Reader, capture_files, rdma_messages
from ..vocab import Opcode, RequestFlag
from .cases import REQUEST_OPS


class CorpusError(Exception):
    """A capture of the corpus that cannot be read: the message is one line."""


@dataclass(frozen=True)
class Corpus:
    seeds: tuple[dict, ...]     # {"op", "flags", "offset" (None: no HELLO_ACK seen), "size"}
    digest: str                 # 8 hex digits of the seeds: the same requests, the same cases


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = capture_files(path)
        if not found:
            raise CorpusError(f"--seed-corpus {path}: no .pcap or .pcapng file in the folder")
        return found
    return [path]


def _requests(path: Path) -> list[dict]:
    ops = {Opcode[name].value: name for name in REQUEST_OPS}
    bases: dict[int | None, int] = {}
    seeds = []
    try:
        with path.open("rb") as stream:
            reader = Reader(stream, str(path))
            for found in kbtp_messages(rdma_messages(reader)):
                f = found.fields
                if f.get("opcode") == Opcode.HELLO_ACK and "hello_ack.handle_base" in f:
                    bases[found.connection] = f["hello_ack.handle_base"]
                if found.error or f.get("opcode") not in ops:
                    continue
                base = bases.get(found.connection)
                inline = bool(f.get("flags", 0) & RequestFlag.INLINE)
                size = len(f.get("inline_data", b"")) if inline else f.get("dd.length", f.get("bind.data_length", 0))
                seeds.append({"op": ops[f["opcode"]], "flags": f.get("flags", 0),
                              "offset": None if base is None else f["handle"] - base, "size": size})
            if reader.problem:
                raise CorpusError(f"--seed-corpus {path}: {reader.problem}")
    except CaptureError as exc:             # it names the capture
        raise CorpusError(f"--seed-corpus {exc}") from None
    except OSError as exc:
        raise CorpusError(f"--seed-corpus {path}: {exc.strerror or exc}") from None
    return seeds


def load(paths: list[str]) -> Corpus:
    """The requests of every capture named (a folder: its captures), in order."""
    seeds = [s for p in paths for f in _files(Path(p)) for s in _requests(f)]
    if not seeds:
        raise CorpusError(f"--seed-corpus {' '.join(paths)}: no KBTP request (LOAD, STORE, ALLOC_STORE, "
                          "FREE, BIND) in the captures")
    text = json.dumps(seeds, sort_keys=True).encode()
    return Corpus(tuple(seeds), hashlib.sha256(text).hexdigest()[:8])
