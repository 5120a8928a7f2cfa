"""What the requirement-to-case matrix cannot find by quotation alone.

``CHECKED_BY``: sentences that cases check without quoting them (keyed by section and
the sentence's first words). ``NOT_CHECKED``: sentences no peer can judge from the
wire, and why (a requirement on initiators or deployments, a definition with nothing of
its own to observe, a lead-in to the list that follows, informative reasoning). ``EFFECTS``:
what each case observes, for the cases whose docstring does not say it. A key that
names no sentence of the text, or a sentence with neither, fails the test suite.
"""
from __future__ import annotations

INITIATOR = "a requirement on initiators; the target's side is not observable from it"
LEAD_IN = "a lead-in to the list that follows; its items are the requirements"
REASONING = "the text's reasoning for the rules around it; the rules themselves are checked"
TERM = "a definition: the sentences that use the term carry the requirements"

CHECKED_BY: dict[str, tuple[str, ...]] = {
    "Conventions and Definitions: Block: A fixed-size region of the target's block pool, identified":
        ("direct.load.entry_and_block", "ops.store.neighbours"),
    "Conventions and Definitions: Generation: A 16-bit counter of a table entry":
        ("generation.next", "generation.never_zero", "ops.generation.stale"),
    "Conventions and Definitions: Sealed block: A block whose contents":
        ("ops.store.sealed", "ops.no_side_effect"),
    "Conventions and Definitions: All fields in messages and in memory structures":
        ("completion.request_id.full_width", "ops.descriptor.offset_full_width", "direct.load.entry_and_block",
         "direct.ring.laps"),
    "Block Pool: The target allocates F blocks of Block Size octets":
        ("ops.limits.lengths", "direct.load.entry_and_block"),
    "Block Pool: Each block is identified by its Block Offset.": ("ops.unmapped_store.completion",),
    "Block Pool: Tables and ring slots store Block Offsets": ("direct.load.entry_and_block", "direct.ring.laps"),
    "Block Table: The block table has one 16-octet entry per handle": ("direct.load.entry_and_block",
                                                                       "ops.limits.range_edges"),
    "Block Table: Flags: 0x0001 VALID": ("ops.free.unbinds", "direct.load.entry_and_block"),
    "Block Table: Data Length is the number of valid octets": ("direct.load.entry_and_block",
                                                               "ops.store.seal_flag"),
    "Block Table: An entry is written only by the target": ("direct.load.read_only",
                                                            "direct.load.data_before_valid"),
    "Free-Block Ring: The free-block ring has N slots": ("direct.ring.laps",),
    "Free-Block Ring: Each slot is 16 octets:": ("direct.ring.laps",),
    "Free-Block Ring: A slot whose Block Offset is all ones": ("direct.ring.laps", "direct.ring.deferred_free"),
    "Free-Block Ring: Bits 31 to n+4 are zero.": ("direct.alloc.atomics", "direct.ring.laps"),
    "Free-Block Ring: It sets Head to Ticket 0 and Slot Offset 0": ("direct.ring.laps", "direct.alloc.atomics"),
    "Free-Block Ring: Allocation: FetchAdd on Head returns ticket t": ("direct.alloc.atomics", "direct.ring.laps"),
    "Free-Block Ring: Free: the target first updates the table entry": ("direct.ring.laps",
                                                                        "direct.ring.deferred_free"),
    "Allocation Quotas: The target assigns each initiator an Allocation Quota": ("ops.quota.no_space",
                                                                                 "direct.partition.bounds"),
    "Allocation Quotas: For DIRECT_ALLOC (), the target instead gives each initiator its own ring":
        ("direct.partition.bounds", "direct.ring.laps", "ops.no_side_effect.quota"),
    "Allocation Quotas: Target-executed allocations take blocks from a ring shared":
        ("ops.no_side_effect.quota",),
    "Session Establishment: Completion Credits is the number of receive buffers": ("session.credits.request",),
    "HELLO_ACK: Features: 0x0001 DIRECT_LOAD": ("session.features.not_granted", "security.default_mode.no_stag",
                                               "session.features.requested_not_granted"),
    "HELLO_ACK: Each direct-mode descriptor is 16 octets": ("direct.load.entry_and_block", "direct.head.aligned",
                                                           "direct.partition.bounds"),
    "HELLO_ACK: Any initiator MAY load any handle the target authorizes": ("ops.limits.range_edges",),
    "Common Header: Generation in a request is the generation the initiator expects":
        ("ops.generation.stale", "ops.unmapped_store.completion", "ops.status.precedence"),
    "Common Header: Request ID is chosen by the initiator": ("ops.header.version", "ops.header.opcode",
                                                             "ops.header.length"),
    "Common Header: Status is zero in requests.": ("session.hello_ack.header",),
    "Common Header: 0x0001 INLINE": ("ops.store.data", "ops.limits.lengths"),
    "Common Header: 0x0002 SEAL": ("ops.store.seal_flag", "ops.unmapped_store.already_bound"),
    "Common Header: 0x0004 RECORD": ("completion.record.write_imm", "completion.record.canaries",
                                     "session.features.not_granted"),
    "Common Header: 0x0010 ALLOW_UNSEALED": ("ops.load.not_sealed",),
    "Common Header: 0x10 LOAD": ("ops.load.canaries", "completion.record.write_imm"),
    "Common Header: 0x11 STORE": ("ops.store.data", "completion.invalidate"),
    "Common Header: 0x12 ALLOC_STORE": ("ops.store.data", "ops.header.length"),
    "Common Header: 0x13 FREE": ("ops.free.unbinds", "completion.record.canaries"),
    "Common Header: 0x14 BIND": ("direct.alloc.bind", "direct.bind.verify"),
    "Common Header: 0x20 COMPLETION": ("ops.unmapped_store.completion", "completion.request_id"),
    "Common Header: 0x30 GOODBYE": ("session.goodbye.release", "session.retention.goodbye"),
    "Descriptors: For LOAD it is the destination": ("ops.store.data", "ops.load.canaries",
                                                    "ops.descriptor.offset_full_width", "ops.flags.stores"),
    "Descriptors: A Completion Descriptor is 16 octets": ("completion.record.canaries",
                                                          "completion.invalidate.two_descriptors"),
    "Block Load: 1. The target reads the table entry of the handle.": ("ops.load.not_valid",
                                                                    "ops.unmapped_store.completion"),
    "Block Unmapped Store: 2. The target allocates a block from the ring": ("direct.ring.laps",
                                                                         "ops.no_side_effect.quota"),
    "Block Free: If the block may next be allocated to an initiator of a different trust domain":
        ("security.clear_freed",),
    "Completion: By default the target completes a request with a COMPLETION": ("completion.invalidate",
                                                                               "session.features.not_granted",
                                                                               "completion.invalidate.two_descriptors"),
    "Completion: A target MUST use completion records only on bindings": ("completion.record.rdmap",),
    "Direct Modes: The initiator never writes ring slots.": ("direct.load.read_only",),
    "Direct Modes: Frees always use FREE.": ("direct.ring.laps",),
    "Status Codes: 1 INVALID_HANDLE": ("ops.handle.outside_table", "ops.handle.upper_half"),
    "Status Codes: 2 STALE_GENERATION": ("ops.generation.stale",),
    "Status Codes: 3 NOT_VALID": ("ops.load.not_valid", "ops.free.not_valid"),
    "Status Codes: 4 ALREADY_BOUND": ("ops.unmapped_store.already_bound",),
    "Status Codes: 5 NO_SPACE": ("ops.quota.no_space", "ops.quota.carried"),
    "Status Codes: 6 SEALED": ("ops.store.sealed",),
    "Status Codes: 7 NOT_SEALED": ("ops.load.not_sealed",),
    "Status Codes: 8 TOO_LARGE": ("ops.load.too_large", "ops.store.too_large", "ops.limits.lengths"),
    "Status Codes: 11 TICKET_ABANDONED": ("direct.ticket.abandoned",),
    "Status Codes: 0 OK Success": ("ops.store.data",),
    "RDMAP Binding: Requests, HELLO, HELLO_ACK, and COMPLETION are carried in Send":
        ("session.hello_ack.header", "completion.order"),
    "RDMAP Binding: INVALIDATE uses Send with Invalidate.": ("completion.invalidate",),
    "RDMAP Binding: Loads use RDMA Write; stores without INLINE use RDMA Read": ("ops.store.data",
                                                                                "completion.load_data"),
    "RDMAP Binding: Ring counters use FetchAdd with the Add Mask": ("direct.alloc.atomics",),
    "RDMAP Binding: Completions are always COMPLETION messages;": ("completion.record.rdmap",),
    "RDMAP Binding: RECORD_COMPLETION is not offered": ("completion.record.rdmap",),
    "InfiniBand and RoCEv2: Over an InfiniBand reliable connection or RoCEv2": ("ops.store.data",
                                                                                "completion.load_data"),
    "InfiniBand and RoCEv2: With unmasked Fetch and Add, the Head and Tail counters":
        ("direct.alloc.atomics", "direct.ring.laps"),
    "Security Considerations: Handle ranges prevent an initiator from overwriting":
        ("ops.handle.own_range", "ops.limits.range_edges"),
    "Security Considerations: Generations prevent use of stale handles.": ("ops.generation.stale",),
    "Security Considerations: Quotas bound memory consumption per initiator.": ("ops.quota.no_space",
                                                                                "ops.quota.carried"),
    "Security Considerations: Direct modes expose the table and pool for reading":
        ("direct.load.read_only", "security.default_mode.no_stag"),
    "Security Considerations: A misbehaving initiator with DIRECT_ALLOC can take tickets":
        ("direct.ticket.abandoned", "direct.ticket.reclaimed_unit"),
    "Security Considerations: Targets offer direct modes only to initiators within the same trust domain":
        ("direct.bind.verify",),
}

NOT_CHECKED: dict[str, str] = {
    "Conventions and Definitions: In addition:": LEAD_IN,
    "Conventions and Definitions: Initiator: The endpoint that issues KBTP requests.": TERM,
    "Conventions and Definitions: Target: The endpoint that owns the block pool.": TERM,
    "Free-Block Ring: The returned Slot Offset can be used as an address offset": REASONING,
    "Free-Block Ring: Counters are in the target's memory byte order":
        "the counters are never read (the text forbids RDMA Read of them); only what FetchAdd returns "
        "shows, which direct.alloc.atomics checks",
    "Free-Block Ring: The rules are:": LEAD_IN,
    "Free-Block Ring: With these rules no block is ever lost": REASONING,
    "Free-Block Ring: Writing the Block Offset before the Sequence":
        "the order of two writes into the target's own memory: a remote reader cannot read both "
        "halves of a slot at one instant to tell which came first",
    "Allocation Quotas: When all initiators respect their quotas": REASONING,
    "HELLO_ACK: If ADDR_LE is set, the initiator MUST encode": INITIATOR + " (every case encodes so)",
    "HELLO_ACK: A target sets ADDR_LE when its RDMA interface":
        "the target's reason for choosing ADDR_LE, a choice the text leaves to it",
    "Common Header: Flags are interpreted per opcode": LEAD_IN,
    "Common Header: 0x01 HELLO": "the opcode's layout; session.hello_ack.header sends one",
    "Common Header: 0x02 HELLO_ACK": "the opcode's layout; session.hello_ack.header decodes one",
    "Direct Modes: Direct modes expose target structures to the initiator and are OPTIONAL.":
        "a permission: offering no direct mode is as conformant as offering them (cases needing them SKIP)",
    "Direct Modes: A target MUST offer them only to initiators it trusts": "trust is the target's configuration",
    "Direct Modes: This costs two round trips but no target processing.": REASONING,
    "Status Codes: 10 INTERNAL Target failure": "a target failure cannot be provoked from outside on purpose",
    "RDMAP Binding: KBTP runs over an RDMAP Stream on DDP and MPA": "below KBTP: every case runs over it",
    "RDMAP Binding: The security of the binding is that of": "a deployment requirement below the RDMA layer",
    "InfiniBand and RoCEv2: The InfiniBand specification defines an unmasked Fetch and Add":
        "a statement about InfiniBand, not about KBTP targets",
    "Operational Considerations: Block size follows the KV cache block":
        "a deployment choice of Block Size; any Block Size is conformant",
    "Operational Considerations: Implementations SHOULD expose counters":
        "counters are exposed out of band, not over KBTP",
    "Security Considerations: The security considerations of apply.":
        "a reference to another document's considerations",
    "Security Considerations: The initiator exposes only the buffers named":
        "a recommendation for initiators; the checker's own initiator follows it",
    "Security Considerations: KV cache blocks contain information derived": REASONING,
    "Block Free: Initiators that may still be loading the block detect": INITIATOR,
    "Session Establishment: Because it gives access to those bindings":
        "the part on initiators (entropy, secrecy, authenticated connections) is for initiators and "
        "deployments; the target's part is checked",
    "Allocation Quotas: An initiator MUST NOT exceed its quota": "the first clause is on initiators; the "
        "target's part (releasing units) is checked",
}

#: What each case observes, where its docstring does not say it.
EFFECTS: dict[str, str] = {
    "completion.request_id": "the COMPLETION's Request ID and Version, for an OK and a failing request",
    "completion.invalidate": "a Send with Invalidate naming the Data Descriptor's STag, for a LOAD and a STORE",
    "completion.load_data": "the whole block in the initiator's buffer when the COMPLETION arrives",
    "completion.record.rdmap": "HELLO_ACK Features over iWARP, requested with every feature",
    "completion.record.write_imm": "an RDMA Write with Immediate, and the record's fields",
    "direct.load.entry_and_block": "the entry and block read through the Table and Pool STags",
    "direct.load.read_only": "RDMA Writes through the Pool and Table STags refused; the data unchanged",
    "direct.alloc.atomics": "FetchAdd results on Head: consecutive tickets, Slot Offsets 16 * (ticket mod N)",
    "direct.alloc.bind": "BIND's completion and the data loaded back",
    "direct.bind.verify": "BINDs naming another block or an untaken ticket refused, the handle unbound",
    "direct.ticket.abandoned": "BIND after two Ticket Timeouts answered TICKET_ABANDONED",
    "direct.ticket.partition_revoked": "an RDMA Write through the Partition STag refused after the abandonment",
    "direct.head.aligned": "the Head descriptor's Tagged Offset and Count",
    "direct.partition.bounds": "Partition Count, and RDMA Writes just outside the partition refused",
    "direct.partition.connection": "a Write through another connection's Partition STag refused",
    "generation.next": "the Generations of bind, free and bind completions",
    "ops.header.version": "the answer to a request with Version 2 (its Status and Request ID), and the "
                          "handle left unbound",
    "ops.header.opcode": "the answer to unassigned and non-request opcodes (its Status and Request ID), and "
                         "the handle left unbound",
    "ops.header.length": "the answer to requests shorter than their fields say (its Status, and its Request "
                         "ID when the octets hold one), and the handle left unbound",
    "ops.handle.outside_table": "INVALID_HANDLE for LOAD, ALLOC_STORE and FREE far outside every range",
    "ops.generation.stale": "STALE_GENERATION for LOAD, STORE and FREE; the data unchanged",
    "ops.load.not_valid": "NOT_VALID, and the initiator's buffer untouched",
    "ops.load.not_sealed": "NOT_SEALED, and the initiator's buffer untouched",
    "ops.load.too_large": "TOO_LARGE, and the initiator's buffer untouched",
    "ops.store.too_large": "TOO_LARGE for stores over Block Size; the entry unchanged",
    "ops.store.not_valid": "NOT_VALID for a STORE to an unbound handle; still unbound",
    "ops.store.sealed": "SEALED for a STORE to a sealed block; the data unchanged",
    "ops.store.seal_flag": "Data Length in the STORE's completion; a LOAD without ALLOW_UNSEALED succeeds",
    "ops.store.data": "the data loaded back after inline and RDMA Read stores",
    "ops.unmapped_store.completion": "the LOAD completion's Block Offset, Generation and Data Length",
    "ops.free.not_valid": "NOT_VALID for a FREE of an unbound handle, and for a second FREE",
    "ops.no_side_effect": "each failing request's status; the data and Generations unchanged afterwards",
    "ops.quota.no_space": "NO_SPACE for the allocation past the quota; OK again after a FREE",
    "session.hello_ack.header": "the HELLO_ACK's header fields",
    "session.initiator_id.active_rejected": "a non-OK HELLO_ACK for the second HELLO; the first session served",
    "session.retention.goodbye": "the same handle range and bindings after GOODBYE without RELEASE",
    "session.retention.connection_lost": "the same handle range and bindings after a lost connection",
    "session.goodbye.release": "LOADs of the released handles not OK after reconnecting",
    "session.hello_ack.disjoint_ranges": "two sessions' Handle Base and Count",
    "ops.status.precedence": "the status of requests failing two checks at once",
    "security.default_mode.no_stag": "a HELLO_ACK without descriptors; other sessions' STags refused",
    "security.clear_freed": "a freed block read through the Pool STag",
}
