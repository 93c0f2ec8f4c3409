"""One error hierarchy; the CLI turns any of these into a one-line message and exit code 2."""

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # as a shell reports a process ended by Ctrl-C


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
