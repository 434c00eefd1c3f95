"""tfde's errors: one root, a few kinds that callers may want to catch.

Every message says what was seen, what was expected and how to fix it.

Errors of a store also subclass TensorFlow's error class of the same
meaning, because inside a graph (tf.function, model.fit) TensorFlow raises
its own class for a failed op: the native ops fail with that class's code
and a message that starts with the tfde class name ("tfde.BackendError: ..."),
and eagerly tfde raises the tfde class itself (from_op_error).  So
``except tf.errors.UnavailableError`` catches a lost server in every mode,
``except tfde.BackendUnavailableError`` eagerly.
"""

import re

import tensorflow as tf


class TfdeError(Exception):
    """Root of every error tfde raises on purpose."""

    # AutoGraph (tf.function, model.fit) re-creates an error raised in
    # converted code to add its source location, and can do that only for
    # exceptions with Exception's own constructor: a ConfigError (a
    # ValueError) would reach the caller as a StagingError.  This attribute
    # makes AutoGraph let tfde errors through as they are.
    ag_pass_through = True


class _OpError:
    """Lets a tfde error that is also a tf.errors.OpError be raised with its
    message alone (OpError subclasses take (node_def, op, message)).
    OpError.__reduce__ pickles the attributes named by __init__'s arguments:
    message, node_def and op all are."""

    def __init__(self, message, node_def=None, op=None):
        # The tf.errors class (UnavailableError, ...) sets the code; called by
        # name, since a ValueError base (CredentialsError) comes before it in
        # the MRO and would swallow a plain super().__init__.
        tf_class = next(
            c
            for c in type(self).__mro__
            if issubclass(c, tf.errors.OpError) and c.__module__ == tf.errors.OpError.__module__
        )
        tf_class.__init__(self, node_def, op, message)
        self.args = (message,)


class ConfigError(TfdeError, ValueError):
    """A configuration value (argument, config-file field) is invalid."""


class ShapeError(TfdeError, ValueError):
    """A tensor has the wrong shape or dtype for the table it is used with."""


class CapacityError(_OpError, TfdeError, tf.errors.ResourceExhaustedError):
    """A store cannot take more rows (memory, row-id space); a Redis server
    out of memory (OOM) too.  Not retried: free memory, then run the step
    again."""


class BackendUnavailableError(_OpError, TfdeError, tf.errors.UnavailableError):
    """A store could not be reached, or kept answering "not now" (LOADING,
    BUSY, TRYAGAIN, ...), through every retry; the only retryable kind."""


class BackendError(_OpError, TfdeError, tf.errors.FailedPreconditionError):
    """A store refused an operation for good ("the server said no":
    WRONGTYPE, NOSCRIPT, ERR ..., or a table whose data is gone); retrying
    does not help, so it is raised at once."""


class CredentialsError(ConfigError, BackendError):
    """A store refused the configured credentials (NOAUTH, WRONGPASS,
    NOPERM): a ConfigError, and a BackendError like every refusal."""


class BuildError(TfdeError):
    """The native op library could not be compiled or loaded."""


class UnsupportedOptimizerError(TfdeError, TypeError):
    """DynamicEmbeddingOptimizer was given an optimizer it cannot apply lazily."""


class CheckpointError(TfdeError):
    """A checkpoint or export file is missing, truncated, corrupted, or was
    written for another model; the message names the file."""


# ------------------------------------------------------------ Redis error replies

# What a Redis error reply means, by its code (the reply's first word), as
# redis-py's exception classes divide them: "not now" (retried with backoff)
# apart from "no" (raised at once).  One table for both of tfde's Redis
# clients: redis-py's (RedisTable._call) and the native one, which receives
# it as the `error_kinds` attr (tfde/tables/redis_table.py native_attrs,
# backends/redis/resp_client.h ErrorKind).  Codes not listed (WRONGTYPE,
# NOSCRIPT, EXECABORT, ERR, ...) are "refused".  MOVED and ASK are not
# errors but cluster redirections, which both clients follow.
REDIS_ERROR_KINDS = {
    "LOADING": "transient",  # the server is loading its data set after a restart
    "BUSY": "transient",  # a script or module call is running too long
    "TRYAGAIN": "transient",  # a cluster slot is migrating
    "CLUSTERDOWN": "transient",  # the cluster lost quorum or a slot's node
    "MASTERDOWN": "transient",  # a replica lost its master
    "READONLY": "transient",  # the node became a replica (failover): find the master again
    "OOM": "capacity",  # used memory > maxmemory
    "NOAUTH": "credentials",
    "WRONGPASS": "credentials",
    "NOPERM": "credentials",
}
_KIND_CLASS = {
    "transient": BackendUnavailableError,
    "capacity": CapacityError,
    "credentials": CredentialsError,
    "refused": BackendError,
}


def redis_error_kind(code: str) -> str:
    """ "transient", "capacity", "credentials" or "refused" for the code of
    a Redis error reply ("WRONGTYPE", "LOADING", ...)."""
    return REDIS_ERROR_KINDS.get(code, "refused")


def redis_error_class(code: str) -> type:
    """The tfde class raised for a Redis error reply with this code."""
    return _KIND_CLASS[redis_error_kind(code)]


# ------------------------------------------------------------ crossing graphs

_PREFIX = re.compile(r"tfde\.(\w+): (.*?)(?:\s*\[Op:\w+\]|\s*\n\s*\[\[\{\{node |$)", re.S)


def tf_code(error: BaseException) -> int:
    """The TensorFlow error code a graph reports for `error` (tf.errors.*)."""
    if isinstance(error, tf.errors.OpError):
        return error.error_code
    if isinstance(error, (ValueError, TypeError)):
        return tf.errors.INVALID_ARGUMENT
    if isinstance(error, MemoryError):
        return tf.errors.RESOURCE_EXHAUSTED
    return tf.errors.UNKNOWN


def graph_message(error: TfdeError) -> str:
    """The message a graph op carries for `error`: its text after the tfde
    class name, which from_op_error reads back."""
    return f"tfde.{type(error).__name__}: {error}"


def from_op_error(error: tf.errors.OpError):
    """The tfde error named by a failed op's message (graph_message), with
    the same text; `error` itself when it names none."""
    found = _PREFIX.search(error.message)
    cls = globals().get(found.group(1)) if found else None
    if not (isinstance(cls, type) and issubclass(cls, TfdeError)):
        return error
    return cls(found.group(2).strip())
