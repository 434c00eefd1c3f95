"""tfde's errors: one root, a few kinds that callers may want to catch.

Every message says what was seen, what was expected and how to fix it.
"""


class TfdeError(Exception):
    """Root of every error tfde raises on purpose."""


class ConfigError(TfdeError, ValueError):
    """A configuration value (argument, config-file field) is invalid."""


class ShapeError(TfdeError, ValueError):
    """A tensor has the wrong shape or dtype for the table it is used with."""


class CapacityError(TfdeError):
    """A store cannot take more rows (memory, row-id space)."""


class BackendUnavailableError(TfdeError):
    """A store could not be reached; the only retryable kind."""


class BuildError(TfdeError):
    """The native op library could not be compiled or loaded."""


class UnsupportedOptimizerError(TfdeError, TypeError):
    """DynamicEmbeddingOptimizer was given an optimizer it cannot apply lazily."""


class CheckpointError(TfdeError):
    """A checkpoint or export file is missing, truncated, corrupted, or was
    written for another model; the message names the file."""
