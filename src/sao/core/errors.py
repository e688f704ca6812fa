"""Errors a user can fix: each carries one line that says what is wrong and how to fix it.

The CLI prints ``str(error)`` alone (no traceback) and exits non-zero for these; any other exception is a
bug in sao and keeps its traceback.
"""


class SaoError(Exception):
    """Base class: a problem with the user's input, configuration or environment, not a bug."""


class ConfigError(SaoError, ValueError):
    """An option or configuration value outside its allowed range."""


class DataError(SaoError, ValueError):
    """A data file or data set that is missing, empty or malformed."""


class NothingTrained(SaoError):
    """A run that ended having trained on nothing: no policy update, every trajectory cut at a limit, or its
    environment failing beyond the fault budget. The run folder keeps what was done (``--resume`` continues it)."""
