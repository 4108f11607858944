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


# A bug in tpprobe's own code (not the model's, not the user's input): its own exit code, one line.
INTERNAL_EXIT = 3
REPORT_HOW = ("a bug in tpprobe, not in your model: please report it with the command line, "
              "`tpprobe --version` and the traceback --debug prints")


class InternalError(Exception):
    """tpprobe's own code failed on a rank at a step of the pipeline; `cause` is what it raised."""

    def __init__(self, step: str, cause: BaseException, rank=None):
        self.step, self.cause, self.rank = step, cause, rank
        super().__init__(internal_line(cause, rank, step))


def exception_text(exc: BaseException) -> str:
    """`Type: first line of the message`."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__


def internal_line(exc: BaseException, rank=None, step=None) -> str:
    """`internal error on rank 1 in write: ZeroDivisionError: boom` (rank and step when known)."""
    where = (f" on rank {rank}" if rank is not None else "") + (f" in {step}" if step else "")
    return f"internal error{where}: {exception_text(exc)}"


def internal_message(line: str, debug: bool = False) -> str:
    """The whole line a person reads: `tpprobe: <line> (run with --debug ...; how to report)`."""
    hint = "" if debug else "run with --debug for the traceback; "
    return f"tpprobe: {line} ({hint}{REPORT_HOW})"


def say_internal(exc: BaseException, rank=None, step=None, debug: bool = False) -> None:
    """The one line (and, with --debug, the traceback above it) on stderr."""
    import sys
    import traceback
    if debug:
        traceback.print_exception(exc)
    print(internal_message(internal_line(exc, rank, step), debug), file=sys.stderr, flush=True)


# tpprobe's models and injections: their raises are the model's
_OWN_MODELS = ("model.py", "faults.py", "tiny.py", "tiny_archs.py", "tiny_weights.py")


def raised_in_tpprobe(exc: BaseException) -> bool:
    """Whether the innermost frame of `exc`'s traceback outside torch is tpprobe's own machinery
    (capture, exchange, checks, report), not a model it runs (the built-in or tiny SGLang models, an
    injected fault, the user's model)."""
    import os
    import torch
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(os.path.abspath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep     # tpprobe/
    for path in reversed(frames):
        if path.startswith(torch_dir):
            continue
        return path.startswith(root) and os.path.basename(path) not in _OWN_MODELS
    return False
