"""How much of each answer the model judged, and what it could not predict, and why.

Every field of every COMPLETION, completion record and HELLO_ACK the fuzzer reads, and
every buffer of the initiator's the target may write, is either held to a prediction
(``judged``) or counted under the reason it cannot be (``unpredicted``), so that what
the oracle leaves alone shows in the report instead of passing silently.
"""
from __future__ import annotations

from ..tally import Tally

__all__ = ["Tally"]

# the reasons the model cannot predict a field, named once for the report
UNKNOWN_ENTRY = "the entry is unknown to the model (after a lost connection or an unanswered request)"
NEVER_SHOWN = "no answer has shown this entry's Generation yet (a handle of the range never named)"
FOREIGN = "a handle outside the fuzzer's ranges: another initiator's entry, never shown"
NOT_FIXED_OK = "the text does not fix it for this operation's OK"
NOT_FIXED_REFUSAL = "the text does not fix it in a refusal"
NO_ENTRY_LOOKED = "MALFORMED or INVALID_HANDLE: the target may not have read an entry"
NO_FLAGS = "the text defines no COMPLETION flag"
UNPARSED = "the request could not be parsed: nothing to echo"
CHOSEN = "the target chooses it (a free block of the pool)"
UNKNOWN_DATA = "the block's content is unknown to the model"
NOT_OURS = "the request names an STag that is not a writable buffer of the fuzzer's"
NO_HELLO_FLAGS = "the text defines no HELLO_ACK flag"
REFUSED_HELLO = "a refused HELLO_ACK: the text fixes no body"
NO_TICKETS = "no DIRECT_ALLOC: no ticket to time out"
