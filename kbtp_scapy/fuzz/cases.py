"""Cases from (seed, index): a stable name and a list of symbolic steps.

A step names what it acts on by role (``["guard", 0]``, ``["peer", 1]``, ``["edge",
"own_end"]``), never by value: values (handles, STags, generations, tickets) are learned
from the target while the case runs, so a case replays on a fresh session as it first ran.
Every random choice a step makes at run time draws from the step's own ``seed``.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..tables.enums import OPCODES
from ..vocab import Opcode, RequestFlag

if TYPE_CHECKING:
    from .corpus import Corpus

Step = dict[str, Any]

EDGES = ("own_before", "own_first", "own_last", "own_end", "peer_first", "peer_last",
         "table_end", "zero", "max", "random")
FAMILIES = ("field", "scapy_fuzz", "flags", "inline_lie", "generation", "handle_edge",
            "opcode", "bytes", "bind_forged")
REQUEST_OPS = ("LOAD", "STORE", "ALLOC_STORE", "FREE", "BIND")
VALID_OPS = ("alloc_store", "store", "load", "free", "direct_load", "direct_alloc")
RDMA_KINDS = ("random_stag", "peer_stag", "read_only_write", "out_of_bounds", "head_wrong_add")
SCRATCH = 8          # own handles the valid operations play with, after the guards
QUOTA_P, ABANDON_P = 1 / 50, 1 / 1000     # cases that end with a quota fill, an abandoned ticket
SEEDED_P = 1 / 2      # mutated requests that start from a request of the seed corpus
_NAME = re.compile(r"^(iwarp|roce)-(\d+)-(\d+)(?:-c?([0-9a-f]{8}))?$")   # the summary shows the bare digest


@dataclass
class Case:
    name: str
    seed: int
    index: int
    steps: list[Step] = field(default_factory=list)


def case_name(transport: str, seed: int, index: int, digest: str | None = None) -> str:
    """``roce-42-007315``, or ``roce-42-007315-c1a2b3c4d`` from the corpus of that digest."""
    return f"{transport}-{seed}-{index:06d}" + (f"-c{digest}" if digest else "")


def _match(name: str) -> re.Match:
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a case name like roce-42-007315")
    return m


def parse_name(name: str) -> tuple[str, int, int]:
    """``roce-42-007315`` -> ("roce", 42, 7315); ValueError for anything else."""
    m = _match(name)
    return m.group(1), int(m.group(2)), int(m.group(3))


def corpus_digest(name: str) -> str | None:
    """The digest of the seed corpus a case name was made from (None: the built-in cases)."""
    return _match(name).group(4)


def _handle(rng: random.Random) -> list:
    role = rng.choices(["scratch", "guard", "peer", "edge"], [5, 2, 3, 3])[0]
    if role == "edge":
        return ["edge", rng.choice(EDGES)]
    return [role, rng.randrange(SCRATCH if role == "scratch" else 2)]


def _valid(rng: random.Random) -> Step:
    return {"kind": "valid", "op": rng.choice(VALID_OPS), "handle": ["scratch", rng.randrange(SCRATCH)],
            "size": rng.choice([0, 1, 8, 100, 4096, rng.randrange(1, 4097)]),
            "seal": rng.random() < 0.5, "inline": rng.choice([None, True, False]),
            "fill": rng.randrange(256)}


def _mutate(rng: random.Random) -> Step:
    family = rng.choice(FAMILIES)
    op = "BIND" if family == "bind_forged" else rng.choice(REQUEST_OPS)
    handle = ["edge", rng.choice(EDGES)] if family == "handle_edge" else _handle(rng)
    return {"kind": "mutate", "op": op, "family": family, "handle": handle,
            "inline": rng.random() < 0.5, "record": rng.random() < 0.2,
            "seed": rng.getrandbits(32)}


def _rdma(rng: random.Random) -> Step:
    return {"kind": "rdma", "what": rng.choice(RDMA_KINDS),
            "verb": rng.choice(["read", "write", "fetch_add"]), "seed": rng.getrandbits(32)}


def make_case(transport: str, seed: int, index: int, corpus: Corpus | None = None) -> Case:
    """The case ``index`` of run ``seed`` (and seed corpus): the same steps every time."""
    rng = random.Random(f"kbtp-fuzz/{seed}/{index}")
    steps = []
    for _ in range(rng.choice([1, 2, 2, 3, 4])):
        kind = rng.choices(["mutate", "valid", "rdma", "burst", "reconnect"], [60, 25, 9, 3, 3])[0]
        if kind == "mutate":
            steps.append(_mutate(rng))
        elif kind == "valid":
            steps.append(_valid(rng))
        elif kind == "rdma":
            steps.append(_rdma(rng))
        elif kind == "burst":
            steps.append({"kind": "burst", "extra": rng.randrange(1, 9)})
        else:
            steps.append({"kind": "reconnect"})
    _model_steps(random.Random(f"kbtp-fuzz/{seed}/{index}/model"), steps)
    if corpus:
        _seeded(random.Random(f"kbtp-fuzz/{seed}/{index}/corpus/{corpus.digest}"), steps, corpus.seeds)
    return Case(case_name(transport, seed, index, corpus.digest if corpus else None), seed, index, steps)


def _seeded(rng: random.Random, steps: list[Step], seeds: tuple[dict, ...]) -> None:
    """Mutated requests that start from a captured request, drawn from a stream of their own
    (the built-in steps keep their values): its opcode, flags, handle (relative to the
    session's Handle Base) and data size, before the family mutates them."""
    for step in steps:
        if step["kind"] == "mutate" and step["family"] != "bind_forged" and rng.random() < SEEDED_P:
            src = rng.choice(seeds)
            step.update(op=src["op"], inline=bool(src["flags"] & RequestFlag.INLINE), start=src)
            if src["offset"] is not None and step["family"] != "handle_edge":
                step["handle"] = ["base", src["offset"]]


def _model_steps(rng: random.Random, steps: list[Step]) -> None:
    """What the model's oracles added, drawn from a second stream so that the steps a case
    had before keep their values (and saved case names their meaning): valid requests
    with RECORD, a known Generation, loads without ALLOW_UNSEALED or into a buffer
    shorter than the block; now and then a case ends by filling the quota or by leaving
    a ticket unbound past its Ticket Timeout."""
    for step in steps:
        if step["kind"] == "valid":
            step["record"] = rng.random() < 0.15
            step["known_generation"] = rng.random() < 0.3
            if step["op"] == "load":
                step["allow_unsealed"] = rng.random() < 0.6
                step["buffer"] = rng.choice(["block"] * 6 + ["exact", "short"])
    r = rng.random()
    if r < QUOTA_P:
        steps.append({"kind": "quota", "seed": rng.getrandbits(32)})
    elif r < QUOTA_P + ABANDON_P:
        steps.append({"kind": "abandon"})


def unknown_opcodes() -> list[int]:
    """Opcodes a request may not carry: unassigned, Private Use, and the answers."""
    assigned = {v.value for v in OPCODES.values}
    lo, hi = OPCODES.private_range
    return sorted(set(range(256)) - assigned) + [Opcode.HELLO, Opcode.HELLO_ACK, Opcode.COMPLETION, lo, hi]
