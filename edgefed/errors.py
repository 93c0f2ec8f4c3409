"""One error hierarchy; the CLI turns any of these into a one-line message and exit code 2."""

EXIT_BAD_INPUT = 2


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
