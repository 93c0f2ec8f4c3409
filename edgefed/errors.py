"""One error hierarchy; the CLI turns any of these into a one-line message and exit code 2. Anything else is a
bug: one line too (internal_error), with its traceback only when debugging (--debug or EDGEFED_DEBUG=1)."""

import contextlib
import os
import traceback

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1  # an exception edgefed did not expect: a bug to report
EXIT_INTERRUPTED = 130  # as a shell reports a process ended by Ctrl-C
EXIT_REJOIN = 4  # the coordinator ended the world at a round boundary: a board edgefed launch left out is back
EXIT_RANK_LOST = 3  # the coordinator ended the world because a rank stopped answering (edgefed launch goes on)


class EdgefedError(Exception):
    """Base of every error edgefed reports to a user (bad input, not a bug)."""


class ConfigError(EdgefedError):
    """A config key is unknown, missing, of the wrong type or out of range."""


class ProblemFileError(EdgefedError):
    """A problem or data file is missing, unreadable or has the wrong arrays."""


class RunLogError(EdgefedError):
    """A run log cannot be written, read or resumed."""


class ResourceError(EdgefedError):
    """The machine cannot hold what the run asks for."""


class Interrupted(Exception):
    """Ctrl-C during a run in this process; the log at `path` holds every completed round."""

    def __init__(self, path):
        super().__init__(f"interrupted; continue with: edgefed run --resume {path}")
        self.path = path


class RankLost(Exception):
    """A device rank sent nothing, not even a heartbeat, for longer than [mpi] rank_timeout_s: it is hung
    or its board is gone. Not a user's mistake: `edgefed launch` restarts the world without it."""

    def __init__(self, rank: int, silent_s: float, host: str | None = None):
        where = f" on {host}" if host else ""
        super().__init__(f"rank {rank}{where} stopped answering: nothing heard for {silent_s:.1f} s "
                         "([mpi] rank_timeout_s)")
        self.rank, self.silent_s, self.host = rank, silent_s, host


class SecAggError(EdgefedError):
    """Secure aggregation found a message it cannot trust: a share, key or mask seed that was changed on its way."""


class Unrecoverable(SecAggError):
    """Too few devices survived a round for secure aggregation to remove the masks ([secagg] threshold): the
    round is aborted, nothing is applied."""


DEBUG_ENV = "EDGEFED_DEBUG"  # set (to anything but "" or "0") by --debug, inherited by mpiexec's ranks and sweeps'


def debugging() -> bool:
    """Whether an unexpected exception shows its traceback (--debug, or EDGEFED_DEBUG=1 in the environment)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


@contextlib.contextmanager
def reading(path):
    """Around the reading of a file: an exception edgefed did not expect (a bug, or a file damaged in a way no
    check foresaw) leaves it named the file, which internal_error says."""
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, EdgefedError) and not hasattr(exc, "edgefed_file"):
            exc.edgefed_file = str(path)
        raise


def internal_error(exc: BaseException, command: str = "") -> str:
    """What a user sees of an exception edgefed did not expect: one line naming it, the file it was reading
    (when known) and the command, and how to get the traceback to report; under debugging, the traceback
    follows."""
    text = str(exc).strip().splitlines()
    what = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    file = getattr(exc, "edgefed_file", None)
    where = (f" reading {file}" if file else "") + (f" in `{command}`" if command else "")
    if debugging():
        return f"internal error{where}: {what}\n" + "".join(traceback.format_exception(exc)).rstrip()
    return (f"internal error{where}: {what}; this is a bug in edgefed, not in your input: run the command again with "
            f"--debug (or {DEBUG_ENV}=1) and report it with the traceback")
