"""``kbtp fuzz``: a stateful protocol fuzzer that judges a KBTP target by the wire alone."""
