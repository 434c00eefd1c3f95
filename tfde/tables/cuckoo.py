"""The in-process cuckoo hash table backend (native, CPU).

Rows live in TensorFlow's resource manager of this process; the table object
owns them and destroys them when it is garbage-collected.  See
backends/cuckoo/cuckoo_table.h for the data structure.
"""

from __future__ import annotations

import itertools
import dataclasses

import tensorflow as tf
from tensorflow.python.trackable import resource as trackable_resource

from tfde import _native
from tfde.errors import ConfigError
from tfde.initializers import InitSpec
from tfde.tables.base import Table, TableCreator, as_keys, as_rows

_uid = itertools.count()
_VALUE_DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16)
_KEY_DTYPES = (tf.int32, tf.int64, tf.string)


def check_dtypes(key_dtype, value_dtype, dim) -> tuple:
    key_dtype, value_dtype = tf.as_dtype(key_dtype), tf.as_dtype(value_dtype)
    if key_dtype not in _KEY_DTYPES:
        raise ConfigError(f"key_dtype {key_dtype.name} is not supported; use int64, int32 or string")
    if value_dtype not in _VALUE_DTYPES:
        raise ConfigError(f"value_dtype {value_dtype.name} is not supported; use float32, float64, float16 or bfloat16")
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 65536:
        raise ConfigError(f"dim must be an int between 1 and 65536, got {dim!r}")
    return key_dtype, value_dtype, dim


def native_missing_args(missing, table):
    """(defaults tensor, init attrs) of a native find/accum op: what a
    missing key of `table` reads (an InitSpec, or rows)."""
    if isinstance(missing, InitSpec):
        return tf.zeros([0, table.dim], table.value_dtype), missing.attrs()
    return as_rows(missing, table.value_dtype, table.dim, table.name, "defaults"), {"init_kind": "defaults"}


class CuckooTable(Table, trackable_resource.TrackableResource):
    """A native concurrent cuckoo hash table.

    Thread-safety: all methods may run concurrently (the table locks per
    internal shard); batch operations use TensorFlow's intra-op thread pool.
    """

    def __init__(self, name: str, key_dtype, value_dtype, dim: int, expected_rows: int = 0):
        self.key_dtype, self.value_dtype, self.dim = check_dtypes(key_dtype, value_dtype, dim)
        self.name = name
        self._expected_rows = int(expected_rows)
        self._shared_name = f"tfde:{name}:{next(_uid)}"
        self._ops = _native.load()
        super().__init__()
        _ = self.resource_handle  # create now, in the current (usually eager) context

    def _create_resource(self):
        return self._ops.tfde_cuckoo_table(
            key_dtype=self.key_dtype, value_dtype=self.value_dtype, dim=self.dim,
            expected_rows=self._expected_rows, shared_name=self._shared_name)

    def _destroy_resource(self):
        tf.raw_ops.DestroyResourceOp(resource=self.resource_handle, ignore_lookup_error=True)

    def _missing_args(self, missing, n):
        return native_missing_args(missing, self)

    def find(self, keys, missing):
        keys = as_keys(keys, self.key_dtype, self.name)
        defaults, attrs = self._missing_args(missing, tf.size(keys))
        return self._ops.tfde_table_find(self.resource_handle, keys, defaults, dim=self.dim, **attrs)

    def insert(self, keys, values):
        keys = as_keys(keys, self.key_dtype, self.name)
        values = as_rows(values, self.value_dtype, self.dim, self.name)
        return self._ops.tfde_table_insert(self.resource_handle, keys, values)

    def accum(self, keys, deltas, missing):
        keys = as_keys(keys, self.key_dtype, self.name)
        deltas = as_rows(deltas, self.value_dtype, self.dim, self.name, "deltas")
        defaults, attrs = self._missing_args(missing, tf.size(keys))
        return self._ops.tfde_table_accum(self.resource_handle, keys, deltas, defaults, **attrs)

    def remove(self, keys):
        keys = as_keys(keys, self.key_dtype, self.name)
        return self._ops.tfde_table_remove(self.resource_handle, keys)

    def clear(self):
        return self._ops.tfde_table_clear(self.resource_handle)

    def size(self):
        return self._ops.tfde_table_size(self.resource_handle)

    def memory_bytes(self):
        """Heap bytes held by the table (int64 scalar)."""
        return self._ops.tfde_table_memory_bytes(self.resource_handle)

    def export_chunk(self, cursor, max_rows):
        return self._ops.tfde_table_export(
            self.resource_handle, tf.cast(cursor, tf.int64), tf.cast(max_rows, tf.int64),
            dim=self.dim, Tkey=self.key_dtype, Tvalue=self.value_dtype)

    # Checkpoints save Variables, not tables: a Variable streams all its
    # tables (tfde/saving).  Serving exports embed whole tables
    # (tfde/saving/serving.py).

    def __repr__(self):
        return f"CuckooTable({self.name!r}, {self.key_dtype.name} -> {self.value_dtype.name}[{self.dim}])"


@dataclasses.dataclass(frozen=True)
class CuckooTableCreator(TableCreator):
    """Creates CuckooTables (the default backend).

    expected_rows: rows per table to size for up front (0: grow on demand).
      The memory for that many rows is allocated and mapped when the table
      is made (so the first inserts do not page-fault), whether or not the
      rows are ever inserted.
    """

    expected_rows: int = 0

    def __post_init__(self):
        if isinstance(self.expected_rows, bool) or not isinstance(self.expected_rows, int) or self.expected_rows < 0:
            raise ConfigError(f"expected_rows must be an int >= 0, got {self.expected_rows!r}")

    def create(self, name, key_dtype, value_dtype, dim):
        return CuckooTable(name, key_dtype, value_dtype, dim, expected_rows=self.expected_rows)

    def get_config(self):
        return {"expected_rows": self.expected_rows}
