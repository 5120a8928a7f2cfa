"""``kbtp replay``: rebuild the KBTP sessions of a capture and replay them against a live target."""
