"""The Table protocol: the one seam between tfde and its stores.

Everything above the store (Variable, lookups, optimizer, policies, savers,
distributed code) talks only to these methods.  A backend is one module that
implements them plus a creator; see tfde/tables/cuckoo.py.

Keys are 1-D tensors of the table's key dtype; rows are ``[n, dim]`` tensors of
its value dtype.  Every method works eagerly and inside ``tf.function``.
"""

from __future__ import annotations

import abc
from typing import Iterator, Tuple, Union

import tensorflow as tf

from tfde.initializers import InitSpec

Missing = Union[InitSpec, tf.Tensor]
"""What a missing key reads: an InitSpec (deterministic per key) or a
``[n, dim]`` / ``[1, dim]`` tensor of default rows."""

DEFAULT_EXPORT_CHUNK_ROWS = 1 << 16


class Table:
    """A key -> row store of fixed dim.

    A plain base class (not an ABC: backends also derive from TensorFlow
    classes with their own metaclass); every method below must be overridden
    except export and import_, which are defined in terms of the others.

    Thread-safety: every method may be called from several threads (or
    concurrent TF ops) at once; each call is atomic per key.
    """

    name: str
    key_dtype: tf.DType
    value_dtype: tf.DType
    dim: int
    # True when every worker of a distributed job sees the same store (Redis),
    # False when each worker's table is its own (cuckoo: sharded layout).
    shared_between_workers = False
    # Whether checkpoints hold the rows (False: the store is the source of
    # truth and a restore leaves it as it is).
    in_checkpoints = True

    def find(self, keys, missing: Missing) -> Tuple[tf.Tensor, tf.Tensor]:
        """Rows of `keys` ([n, dim]) and whether each key is stored ([n] bool).
        A missing key reads its row from `missing`; nothing is inserted."""
        raise NotImplementedError

    def insert(self, keys, values) -> tf.Operation:
        """Upserts `values` ([n, dim]) under `keys`; the last duplicate wins."""
        raise NotImplementedError

    def accum(self, keys, deltas, missing: Missing) -> tf.Operation:
        """Adds `deltas` to the rows of `keys`; a missing key is inserted as
        its `missing` row plus its delta.  Duplicates all add."""
        raise NotImplementedError

    def remove(self, keys) -> tf.Tensor:
        """Removes `keys`; returns how many were present (int64 scalar)."""
        raise NotImplementedError

    def clear(self) -> tf.Operation:
        """Removes every key."""
        raise NotImplementedError

    def size(self) -> tf.Tensor:
        """Number of stored keys (int64 scalar)."""
        raise NotImplementedError

    def export_chunk(self, cursor, max_rows) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """At most `max_rows` stored (keys, rows) from `cursor` (start at 0) and
        the cursor to continue from, or -1 when done."""
        raise NotImplementedError

    def export(self, chunk_rows: int = DEFAULT_EXPORT_CHUNK_ROWS) -> Iterator[Tuple[tf.Tensor, tf.Tensor]]:
        """Eager iterator over all (keys, rows) in chunks of <= chunk_rows, so
        a large table never has to fit in one tensor.  Equivalent to calling
        export_chunk until the cursor is -1."""
        cursor = 0
        while cursor >= 0:
            keys, values, nxt = self.export_chunk(cursor, chunk_rows)
            if int(tf.size(keys)) > 0:
                yield keys, values
            cursor = int(nxt)

    def import_(self, keys, values, replace: bool = False) -> None:
        """Inserts (keys, values); with replace=True clears the table first.
        Equivalent to clear() (if replace) followed by insert()."""
        if replace:
            self.clear()
        self.insert(keys, values)


class TableCreator(abc.ABC):
    """Makes the tables of a Variable: its rows, optimizer slots and policy state."""

    @abc.abstractmethod
    def create(self, name: str, key_dtype: tf.DType, value_dtype: tf.DType, dim: int) -> Table:
        """A new (or, for shared stores, attached) table."""

    def get_config(self) -> dict:
        return {}


def as_keys(keys, key_dtype: tf.DType, table_name: str) -> tf.Tensor:
    """`keys` as a 1-D tensor of `key_dtype`, or a ShapeError saying why not."""
    from tfde.errors import ShapeError

    if not isinstance(keys, (tf.Tensor, tf.Variable)) and not tf.is_tensor(keys):
        try:
            keys = tf.convert_to_tensor(keys, dtype=key_dtype)
        except (TypeError, ValueError) as e:
            raise ShapeError(f"keys for table {table_name!r} must be {key_dtype.name}; could not convert "
                             f"{type(keys).__name__}: {e}") from None
    if keys.dtype != key_dtype:
        hint = ("cast them with tf.cast(keys, %s)" % key_dtype.name if keys.dtype.is_integer and key_dtype.is_integer
                else "hash or map them to %s first, or create the table with key_dtype=%s"
                % (key_dtype.name, keys.dtype.name))
        raise ShapeError(f"keys for table {table_name!r} are {keys.dtype.name}, expected {key_dtype.name}; {hint}")
    if keys.shape.rank is not None and keys.shape.rank != 1:
        keys = tf.reshape(keys, [-1])
    return keys


def as_rows(values, value_dtype: tf.DType, dim: int, table_name: str, what: str = "values") -> tf.Tensor:
    """`values` as a [n, dim] tensor of `value_dtype`, or a ShapeError."""
    from tfde.errors import ShapeError

    values = tf.convert_to_tensor(values)
    if values.dtype != value_dtype:
        if values.dtype.is_floating or values.dtype.is_integer:
            values = tf.cast(values, value_dtype)
        else:
            raise ShapeError(f"{what} for table {table_name!r} are {values.dtype.name}, expected {value_dtype.name}")
    shape = values.shape
    if shape.rank is not None and (shape.rank != 2 or (shape[1] is not None and shape[1] != dim)):
        raise ShapeError(f"{what} for table {table_name!r} must have shape [n, {dim}], got {shape}; "
                         f"the table holds rows of dim {dim}")
    return values
