"""The one error of the tools that drive a target (conform, fuzz, replay)."""


class HarnessError(Exception):
    """The run could not start or go on (no connection, a refused set-up, nothing to
    run): no verdict can be given. The message says what failed and what to do."""
