"""``kbtp bench``: a benchmark client for any KBTP target, in perftest's manner."""
