"""An explicit-state model check of the free-block ring (spec "Free-Block Ring", "Allocation
Quotas"), run on the target's own ``FreeRing``.

Every step an actor takes is one call into ``ring.py`` on the ring's real bytes (slots and
counters in the target's memory order, FetchAdd through ``MemoryTable``), so what is
checked is the code that serves requests, not a restatement of it. A breadth-first search
restores the ring to each reached state (``FreeRing.snapshot``/``restore``), applies every
enabled step, and checks in every new state that

- every block is in exactly one place: an unconsumed slot, a deferred free, or an actor's
  hands (nothing lost, nothing handed out twice);
- a block an allocator has read but not consumed is still in its ticket's slot;
- every initiator's usage (blocks bound plus tickets taken and not bound) is within its
  quota, and Head passes Tail only by as many tickets as were reclaimed before their
  slots were filled (their blocks come back under new tickets as soon as they are);
- a state with no step left has every actor done and every block back in the ring (an
  allocation never waits for a block that cannot come).

Actors (one connection each; the software target serves one request at a time per
connection, and so does a chain on one send queue):

- ``alloc``: a target-executed ALLOC_STORE in software: FetchAdd on Head, then read the
  slot until it holds the ticket's block and consume it in the same step, as
  ``FreeRing.allocate`` does (``FreeRing.consume`` writes a deferred free at once), later
  FREE it.
- ``chain``: the same allocation run by a work-request chain, its steps the chain engine's
  own loopback work requests on the ring's bytes (``ChainSteps``): FetchAdd on Head, a
  Read of the slot, and a Write of all ones to its Block Offset that consumes it behind
  ``FreeRing``'s back; the target's software writes deferred frees at its next refill
  (``FreeRing.settle``, a step of its own).
- ``direct``: a DIRECT_ALLOC initiator on its partition ring: FetchAdd on Head, read the
  slot (and read it again) until it holds the ticket's block, BIND (the target checks the
  ticket, the slot and the quota as ``Executor.bind`` does, then consumes the slot), later
  FREE. While a ticket is outstanding the Ticket Timeout may expire: the target
  invalidates the initiator's STags (no more direct steps) and reclaims the ticket
  (``FreeRing.reclaim``); a later BIND of it gets TICKET_ABANDONED.

A shared ring serves ``alloc``/``chain`` actors of separate initiators, each with its own
quota (their sum within F), or of one initiator whose requests run in several request
credits' chains at once (one quota); a partition ring serves one initiator, whose
``direct`` and target-executed actors share one quota equal to the partition size.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from .. import codec, ring as counters
from ..rnic.chains import Engine, Flag, Op, Sge, Wqe
from ..rnic.chains.engine import LOOPBACK_ACCESS
from ..rnic.chains.wqe import byteorder
from ..rnic.memory import MemoryTable
from ..rnic.qp import WorkRequest
from ..tables import memory as M
from .ring import CONSUMED, FreeRing

KINDS = ("alloc", "chain", "direct")
IDLE, WAIT, GOT, SEEN = "idle", "wait", "got", "seen"
_BLOCK_AT = M.RING_SLOT.offset("block_offset")


@dataclass(frozen=True)
class Config:
    """A ring of 2**n slots holding ``blocks`` blocks (Block Offsets ``first``, ``first``+1,
    ...), and its actors with their quotas and number of allocations each."""

    n: int
    blocks: int
    actors: tuple[str, ...]
    quotas: tuple[int, ...]          # per actor on a shared ring; one value on a partition
    rounds: int | tuple[int, ...] = 1   # allocations per actor (one value for all)
    masked: bool = True
    abandon: bool = True             # may the Ticket Timeout expire (direct actors)
    strict: bool = False             # Head may never pass Tail, not even behind a reclaim
    give_up: bool = False            # may a software allocation time out (INTERNAL)
    first: int = 100

    @property
    def one_initiator(self) -> bool:
        """All actors are one initiator's (its partition ring, or several request credits'
        chains of one session): one quota for all."""
        return len(self.quotas) == 1

    def validate(self) -> None:
        if not 0 < self.blocks <= 1 << self.n:
            raise ValueError(f"F = {self.blocks} must be 1 to N = {1 << self.n}")
        if any(kind not in KINDS for kind in self.actors):
            raise ValueError(f"actors are {', '.join(KINDS)}")
        if "direct" in self.actors and not self.one_initiator:
            raise ValueError("a DIRECT_ALLOC ring is one initiator's: give one quota")
        if len(self.quotas) not in (1, len(self.actors)) or sum(self.quotas) > self.blocks \
                or min(self.quotas) < 1:
            raise ValueError(f"one quota, or one per actor, at least 1 and summing to at most "
                             f"F = {self.blocks}")

    def label(self) -> str:
        kinds = "+".join(self.actors)
        rounds = self.rounds if isinstance(self.rounds, int) else "/".join(map(str, self.rounds))
        return (f"N={1 << self.n} F={self.blocks} {kinds} quota={'/'.join(map(str, self.quotas))} "
                f"rounds={rounds} {'masked' if self.masked else 'unmasked'}")


@dataclass(frozen=True)
class Actor:
    """One actor's program counter and what it holds."""

    phase: str = IDLE
    ticket: int = -1
    offset: int = -1
    block: int = -1
    held: tuple[int, ...] = ()
    left: int = 0
    disabled: bool = False           # its STags were invalidated (an abandoned ticket)


class _NoPeer:
    """The chain steps are loopback work requests only."""

    def transmit(self, wr: WorkRequest, done: object) -> None:
        raise AssertionError(f"a ring step put a {wr.verb.value} on the wire")


class ChainSteps:
    """A chain actor's steps as the chain engine's own work requests on the ring's bytes:
    masked (or unmasked) FetchAdd on Head, a Read of the slot, the Write of all ones that
    consumes it, each a loopback WQE run to completion (``rnic/chains``)."""

    def __init__(self, ring: FreeRing, memory: MemoryTable, slots: bytearray, heads: bytearray) -> None:
        self.ring, self.memory = ring, memory
        self.engine = Engine(memory, _NoPeer(), little=False)
        self.sq = self.engine.create_queue(8, self.engine.create_cq())
        loopback = self.engine.loopback
        self.slots = memory.register(slots, LOOPBACK_ACCESS, connection=loopback)
        self.heads = memory.register(heads, LOOPBACK_ACCESS, connection=loopback)
        self.scratch = memory.register(bytearray(M.SLOT_SIZE), LOOPBACK_ACCESS, connection=loopback)
        self.ones = memory.register(bytearray(CONSUMED.to_bytes(8, "big")), LOOPBACK_ACCESS,
                                    connection=loopback)

    def _run(self, wqe: Wqe) -> bytes:
        self.engine.post(self.sq, wqe)
        self.engine.run()
        if self.sq.error is not None:
            raise AssertionError(f"chain step failed: {self.sq.error}")
        return bytes(self.scratch.local(0, M.SLOT_SIZE))

    def take(self) -> tuple[int, int]:
        ring = self.ring
        raw = self._run(Wqe(Op.FETCH_ADD, Flag.LOOPBACK, remote_stag=self.heads.stag, operand=ring.add,
                            operand2=ring.mask or 0, sges=[Sge(self.scratch.stag, 0, 8)]))
        ticket, low = counters.split(int.from_bytes(raw[:8], byteorder(self.memory.order == "little")),
                                     ring.n if ring.masked else None)
        return ticket, low if ring.masked else ring.offset_of(ticket)

    def read(self, offset: int) -> tuple[int, int]:
        raw = self._run(Wqe(Op.READ, Flag.LOOPBACK, remote_stag=self.slots.stag, remote_offset=offset,
                            length=M.SLOT_SIZE, sges=[Sge(self.scratch.stag, 0, M.SLOT_SIZE)]))
        d = codec.decode_struct(M.RING_SLOT, raw, self.ring.addr_le)
        return d["slot.sequence"], d["slot.block_offset"]

    def consume(self, offset: int) -> None:
        self._run(Wqe(Op.WRITE, Flag.LOOPBACK, remote_stag=self.slots.stag,
                      remote_offset=offset + _BLOCK_AT, sges=[Sge(self.ones.stag, 0, 8)]))


State = tuple[tuple, tuple[Actor, ...], tuple[int, ...]]
"""(ring snapshot, actors, tickets the target abandoned)."""
Step = tuple[tuple[Actor, ...], tuple[int, ...]]
"""What a step leaves: the actors and the abandoned tickets."""


@dataclass
class Result:
    config: Config
    states: int = 0
    transitions: int = 0
    terminal: int = 0
    max_deferred: int = 0
    behind_reclaim: int = 0          # states in which Head has passed Tail (see ``lag``)
    seconds: float = 0.0
    violation: str | None = None
    trace: list[str] = field(default_factory=list)


class Model:
    """The actors' steps on one ``FreeRing``; ``successors`` is the transition relation."""

    def __init__(self, config: Config) -> None:
        config.validate()
        self.config = config
        size = 1 << config.n
        self.blocks = tuple(range(config.first, config.first + config.blocks))
        memory = MemoryTable("little")
        slots, heads = bytearray(M.SLOT_SIZE * size), bytearray(16)
        self.ring = FreeRing(memory, memoryview(slots), memoryview(heads), config.n, self.blocks,
                             masked=config.masked, addr_le=False)
        self.chain = ChainSteps(self.ring, memory, slots, heads)

    def initial(self) -> State:
        self.ring.reset(self.blocks)
        rounds = self.config.rounds
        each = rounds if isinstance(rounds, tuple) else (rounds,) * len(self.config.actors)
        actors = tuple(Actor(left=r) for r in each)
        return self.ring.snapshot(), actors, ()

    # -- quotas --------------------------------------------------------------------------

    def _initiator(self, i: int) -> int:
        return 0 if self.config.one_initiator else i

    def usage(self, actors: tuple[Actor, ...], who: int) -> int:
        return sum(len(a.held) + (a.phase != IDLE) for i, a in enumerate(actors)
                   if self._initiator(i) == who)

    # -- transitions ---------------------------------------------------------------------

    def successors(self, state: State) -> Iterator[tuple[str, State]]:
        snap, actors, abandoned = state
        for i, kind in enumerate(self.config.actors):
            self.ring.restore(snap)             # every guard sees this state's ring
            for label, step in list(self._steps(kind, i, actors, abandoned)):
                self.ring.restore(snap)
                out, new_abandoned = step()
                yield f"{kind}{i} {label}", (self.ring.snapshot(), out, new_abandoned)
        if snap[2]:                                    # deferred frees: the target's refill
            self.ring.restore(snap)
            if self.ring.settle():
                yield "target settle", (self.ring.snapshot(), actors, abandoned)

    def _steps(self, kind: str, i: int, actors: tuple[Actor, ...],
               abandoned: tuple[int, ...]) -> Iterator[tuple[str, Callable[[], Step]]]:
        ring, a = self.ring, actors[i]
        quota = self.config.quotas[self._initiator(i)]

        def becomes(new: Actor, gone: tuple[int, ...] = abandoned) -> Step:
            return actors[:i] + (new,) + actors[i + 1:], gone

        if a.phase == IDLE and a.left and not a.disabled \
                and self.usage(actors, self._initiator(i)) < quota:
            def take() -> Step:
                ticket, offset = self.chain.take() if kind == "chain" else ring.take_ticket()
                return becomes(replace(a, phase=WAIT, ticket=ticket, offset=offset, left=a.left - 1))
            yield "FetchAdd Head", take
        ready = ring.ready(a.ticket, a.offset) if a.phase == WAIT else None
        if ready is not None and not a.disabled:
            def read(block: int = ready) -> Step:
                if kind == "chain":        # the chain's Read of the slot, by the engine
                    sequence, block = self.chain.read(a.offset)
                    assert sequence == a.ticket & 0xFFFFFFFF and block != CONSUMED
                if kind == "alloc":        # FreeRing.allocate: the read and consume at once
                    ring.consume(a.offset)
                    return becomes(self._holding(a, block))
                return becomes(replace(a, phase=SEEN if kind == "direct" else GOT, block=block))
            yield f"read slot {a.offset // M.SLOT_SIZE} (ticket {a.ticket})", read
        if kind == "alloc" and a.phase == WAIT and self.config.give_up \
                and ring.ready(a.ticket, a.offset) is None:
            def give_up() -> Step:
                ring.give_up(a.ticket)     # FreeRing.allocate's timeout: INTERNAL
                return becomes(replace(a, phase=IDLE, ticket=-1, offset=-1))
            yield f"allocation of ticket {a.ticket} times out", give_up
        if a.phase == GOT:
            def consume() -> Step:
                self.chain.consume(a.offset)
                return becomes(self._holding(a, a.block))
            yield f"consume slot {a.offset // M.SLOT_SIZE} (block {a.block})", consume
        if a.phase == SEEN:
            def bind() -> Step:
                if a.ticket in abandoned:  # Executor.bind: TICKET_ABANDONED
                    return becomes(replace(a, phase=IDLE, ticket=-1, offset=-1, block=-1))
                offset = ring.offset_of(a.ticket)
                if ring.ready(a.ticket, offset) != a.block:
                    raise AssertionError(f"BIND of ticket {a.ticket}: slot no longer holds {a.block}")
                ring.consume(offset)
                return becomes(self._holding(a, a.block))
            yield f"BIND ticket {a.ticket} (block {a.block})", bind
        if kind == "direct" and a.phase in (WAIT, SEEN) and self.config.abandon \
                and a.ticket not in abandoned:
            def expire() -> Step:
                ring.reclaim(a.ticket)
                # the initiator's STags are invalidated: none of its direct actors can
                # take, read or write any more
                out = tuple(replace(b, disabled=True) if k == "direct" else b
                            for k, b in zip(self.config.actors, actors))
                if a.phase == WAIT:        # it never sees the block: nothing to bind
                    out = out[:i] + (replace(out[i], phase=IDLE, ticket=-1, offset=-1),) + out[i + 1:]
                return out, tuple(sorted(abandoned + (a.ticket,)))
            yield f"Ticket Timeout: reclaim ticket {a.ticket}", expire
        for block in a.held:
            def free(block: int = block) -> Step:
                ring.free(block)
                return becomes(replace(a, held=tuple(b for b in a.held if b != block)))
            yield f"FREE block {block}", free

    @staticmethod
    def _holding(a: Actor, block: int) -> Actor:
        return replace(a, phase=IDLE, ticket=-1, offset=-1, block=-1,
                       held=tuple(sorted(a.held + (block,))))

    # -- invariants ----------------------------------------------------------------------

    def violation(self, state: State) -> str | None:
        snap, actors, abandoned = state
        self.ring.restore(snap)
        ring, size = self.ring, 1 << self.config.n
        places: Counter[int] = Counter()
        for s in range(size):
            block = ring.slot(s * M.SLOT_SIZE)[1]
            if block != CONSUMED:
                places[block] += 1
        places.update(ring.deferred_blocks())
        for a in actors:
            places.update(a.held)
        lost = [b for b in self.blocks if places[b] == 0]
        twice = sorted(b for b, n in places.items() if n > 1)
        strange = sorted(b for b in places if b not in self.blocks)
        if lost or twice or strange:
            return f"blocks lost {lost}, in two places {twice}, unknown {strange}"
        for i, a in enumerate(actors):
            if a.phase in (GOT, SEEN) and not (a.disabled and a.ticket in abandoned):
                if ring.ready(a.ticket, a.offset) != a.block:
                    return f"actor {i} read block {a.block} for ticket {a.ticket}, slot changed"
        for who, quota in enumerate(self.config.quotas):
            if self.usage(actors, who) > quota:
                return f"initiator {who} uses {self.usage(actors, who)} of quota {quota}"
        if self.lag(state) > (0 if self.config.strict else len(snap[3])):
            return "Head passed Tail: a ticket was taken with no block issued or coming for it"
        return None

    def lag(self, state: State) -> int:
        """Tickets taken beyond the last one issued by Tail: allowed only while as many
        reclaimed tickets wait for their slot, whose blocks then come back under new tickets."""
        self.ring.restore(state[0])
        return (self.ring.counter("head") >> 32) - (self.ring.counter("tail") >> 32)

    def stuck(self, state: State) -> str | None:
        """What is wrong with a state that has no successor, if anything."""
        snap, actors, _ = state
        self.ring.restore(snap)
        waiting = [i for i, a in enumerate(actors) if a.phase != IDLE]
        if waiting:
            return f"deadlock: actors {waiting} wait and nothing can move"
        if self.ring.occupancy() != self.config.blocks or self.ring.deferred:
            return "at the end not every block is back in the ring"
        return None


def check(config: Config, limit: int = 2_000_000) -> Result:
    """Breadth-first over every interleaving; the first violation comes with a shortest
    trace to it."""
    model = Model(config)
    start = time.perf_counter()
    result = Result(config)
    first = model.initial()
    parents: dict[State, tuple[State | None, str]] = {first: (None, "initial")}
    queue = deque([first])
    bad: tuple[State, str] | None = None
    if (why := model.violation(first)) is not None:
        bad = first, why
    while queue and bad is None:
        state = queue.popleft()
        moved = False
        for label, nxt in list(model.successors(state)):
            moved = True
            result.transitions += 1
            if nxt in parents:
                continue
            parents[nxt] = (state, label)
            result.max_deferred = max(result.max_deferred, len(nxt[0][2]))
            if (why := model.violation(nxt)) is not None:
                bad = nxt, why
                break
            result.behind_reclaim += model.lag(nxt) > 0
            queue.append(nxt)
            if len(parents) > limit:
                raise RuntimeError(f"{config.label()}: more than {limit} states")
        if not moved:
            result.terminal += 1
            if (why := model.stuck(state)) is not None:
                bad = state, why
    result.states = len(parents)
    result.seconds = time.perf_counter() - start
    if bad is not None:
        result.violation = bad[1]
        result.trace = trace(parents, bad[0])
    return result


def trace(parents: dict[State, tuple[State | None, str]], state: State) -> list[str]:
    steps = []
    at: State | None = state
    while at is not None:
        at, label = parents[at]
        steps.append(label)
    return steps[::-1]


def run(model: Model, labels: list[str]) -> list[State]:
    """Follow a trace of step labels from the initial state (each must be enabled), checking
    the invariants in every state; the states visited."""
    state = model.initial()
    states = [state]
    for label in labels:
        moves = dict(model.successors(state))
        if label not in moves:
            raise ValueError(f"step {label!r} is not enabled; enabled: {sorted(moves)}")
        state = moves[label]
        if (why := model.violation(state)) is not None:
            raise AssertionError(f"after {label!r}: {why}")
        states.append(state)
    return states
