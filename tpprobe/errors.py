"""The tool's own errors: each carries one line a person can act on.

`UsageError` and `CaptureError` end the CLI with exit code 2 and that one line (no traceback
unless --debug). Anything else escaping is a bug in tpprobe.
"""


class TPProbeError(Exception):
    """Base of tpprobe's own errors; str(e) is the one line shown to the user."""

    exit_code = 2


class UsageError(TPProbeError):
    """Bad arguments or environment: what is wrong and what to do."""


class CaptureError(TPProbeError):
    """A capture folder or file that cannot be read safely (names the file and what was expected)."""


class RankFailure(TPProbeError):
    """A peer rank died, hung or disagreed while the probe waited on it."""

    exit_code = 1
