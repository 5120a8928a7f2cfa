"""Declaring conformance cases: one per testable requirement of the specification.

A case has a stable id (its section first), the requirement's own sentence from the
text, its level, what it needs from the target (features, binding, time) and the
coroutine that judges it from what the target sends back. Requirements that cannot be
judged from the wire are declared too (``untestable``), so the coverage summary can say
what was not checked and why.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from .references import readable

if TYPE_CHECKING:
    from .context import Ctx

MUST, MUST_NOT, SHOULD, RULE = "MUST", "MUST NOT", "SHOULD", "RULE"
LEVELS = (MUST, MUST_NOT, SHOULD, RULE)   # RULE: normative text without a BCP 14 keyword

PASS, FAIL, WARN, SKIP, ERROR = "PASS", "FAIL", "WARN", "SKIP", "ERROR"
VERDICTS = (PASS, FAIL, WARN, SKIP, ERROR)


class Fail(Exception):
    """The target did not do what the requirement asks: what was expected, what was seen."""

    def __init__(self, expected: str, seen: str) -> None:
        super().__init__(f"expected {expected}; seen {seen}")
        self.expected, self.seen = expected, seen


class Skip(Exception):
    """The target did not offer what the case needs, or it would take too long."""


class SetupFailed(Exception):
    """A step that only prepares the case could not be taken for a reason of the checker's
    (no session to be had, too few handles or too small a quota for the case), so the
    requirement could not be judged: the case is an ERROR naming the step."""

    def __init__(self, step: str, expected: str, seen: str) -> None:
        super().__init__(f"set-up step {step}: expected {expected}; seen {seen}")
        self.step, self.expected, self.seen = step, expected, seen


class Rule(Enum):
    """What a target breaks when a step that only prepares a case fails on its account,
    each named by the id of the case that checks it."""

    CREDITS = "session.credits.request"   # the connection ended under a request within the credits
    ANSWERED = "completion.request_id"    # a request that got no COMPLETION
    STATUS = "ops.no_side_effect"         # refused with a status no check of the request gives
    QUOTA = "session.quota.sum"           # NO_SPACE to an allocation within the session's quota


class Broke(SetupFailed):
    """A step that only prepares the case failed because the target broke ``rule``: the
    case FAILs naming that rule (its own requirement could not be judged)."""

    def __init__(self, rule: Rule, step: str, expected: str, seen: str) -> None:
        super().__init__(step, expected, seen)
        self.rule = rule


CaseFn = Callable[["Ctx"], Awaitable[None]]


@dataclass(frozen=True)
class Case:
    id: str
    section: str                 # the specification's section title
    level: str
    requirement: str             # quoted from the specification
    fn: CaseFn = field(repr=False, compare=False)
    features: int = 0            # HELLO_ACK Features bits the case needs
    transport: str | None = None  # "iwarp" or "roce" when only one binding applies
    slow: str = ""               # why the case takes long (``--quick`` skips it), else ""
    budget: float | None = None  # seconds the whole case may take (default: CASE_BUDGET timeouts)

    @property
    def group(self) -> str:
        return self.id.split(".", 1)[0]

    @property
    def shown(self) -> str:
        """The requirement as reports show it: the draft's blank references filled or marked."""
        return readable(self.requirement)


@dataclass(frozen=True)
class Untestable:
    """A requirement of the text that no peer can judge from the wire, and why."""

    section: str
    level: str
    requirement: str
    reason: str

    @property
    def shown(self) -> str:
        return readable(self.requirement)


CASES: list[Case] = []
UNTESTABLE: list[Untestable] = []


def case(id: str, section: str, level: str, requirement: str, *, features: int = 0,
         transport: str | None = None, slow: str = "",
         budget: float | None = None) -> Callable[[CaseFn], CaseFn]:
    """Register the decorated coroutine as the case ``id``."""
    if level not in LEVELS:
        raise ValueError(f"{id}: unknown level {level}")

    def register(fn: CaseFn) -> CaseFn:
        if any(c.id == id for c in CASES):
            raise ValueError(f"duplicate case id {id}")
        CASES.append(Case(id, section, level, " ".join(requirement.split()), fn, features, transport,
                          slow, budget))
        return fn
    return register


def checked_by(rule: Rule) -> Case:
    """The case that checks ``rule``: its requirement is the sentence the target broke."""
    return next(c for c in CASES if c.id == rule.value)


def untestable(section: str, level: str, requirement: str, reason: str) -> None:
    UNTESTABLE.append(Untestable(section, level, " ".join(requirement.split()), reason))


def select(cases: list[Case], only: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> list[Case]:
    """Cases whose id starts with one of ``only`` (all if none) and with none of ``exclude``."""
    return [c for c in cases
            if (not only or any(c.id.startswith(p) for p in only))
            and not any(c.id.startswith(p) for p in exclude)]
