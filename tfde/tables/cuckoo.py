"""The in-process cuckoo hash table backend (native, CPU).

Rows live in TensorFlow's resource manager of this process; the table object
owns them and destroys them when it is garbage-collected.  See
backends/cuckoo/cuckoo_table.h for the data structure.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os

import tensorflow as tf
from tensorflow.python.trackable import resource as trackable_resource

from tfde import _native
from tfde.errors import CapacityError, ConfigError, from_op_error
from tfde.tables.base import (
    Table,
    TableCreator,
    as_deltas,
    as_keys,
    as_rows,
    check_dtypes,
    int_arg,
    native_missing_args,
    register_creator,
)

_uid = itertools.count()
# The presized layout of backends/cuckoo/cuckoo_table.h (kNumShards shards;
# buckets of kSlotsPerBucket slots, 64 bytes, filled to kMaxLoadFactor; a
# first arena chunk of 2^k >= rows rows, k in [6, 30]; row ids are uint32),
# mirrored to size a table before it is made.
_CORE_SHARDS, _SLOTS_PER_BUCKET, _MAX_LOAD, _BUCKET_BYTES = 64, 5, 0.90, 64
_MAX_ROWS_PER_SHARD = 0xFFFFFFF0


def presized_bytes(key_dtype: tf.DType, value_dtype: tf.DType, dim: int, expected_rows: int) -> int:
    """Bytes a cuckoo table made with `expected_rows` allocates (and maps)
    up front: its buckets and its rows' first arena chunks."""
    if expected_rows <= 0:
        return 0
    rows = expected_rows // _CORE_SHARDS + 1
    buckets = 4
    while buckets * _SLOTS_PER_BUCKET * _MAX_LOAD < rows:
        buckets <<= 1
    log2 = 6
    while log2 < 30 and (1 << log2) < rows:
        log2 += 1
    stride = (dim * value_dtype.size + 7) & ~7
    key_bytes = {tf.int64: 8, tf.int32: 4}.get(key_dtype, 0)  # string keys live outside the chunks
    return _CORE_SHARDS * (buckets * _BUCKET_BYTES + (1 << log2) * (stride + key_bytes))


def machine_memory_bytes() -> int:
    """Physical memory of this machine, or the cgroup (container) limit when
    it is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:  # cgroup v2; "max" when unlimited
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_expected_rows(name, key_dtype, value_dtype, dim, expected_rows) -> None:
    """Refuses (CapacityError) an expected_rows that no table on this
    machine can hold, before any memory is asked for: more rows than the
    table's row ids can number, or more bytes up front than the machine
    has."""
    if expected_rows // _CORE_SHARDS + 1 > _MAX_ROWS_PER_SHARD:
        raise CapacityError(
            f"expected_rows={expected_rows} for table {name!r} is more than one cuckoo table can hold "
            f"({_CORE_SHARDS} internal shards of at most {_MAX_ROWS_PER_SHARD} rows); spread the Variable over "
            "more tables (num_shards=) and ask for fewer rows per table"
        )
    need, have = presized_bytes(key_dtype, value_dtype, dim, expected_rows), machine_memory_bytes()
    if need > have:
        raise CapacityError(
            f"expected_rows={expected_rows} for table {name!r} ({key_dtype.name} -> {value_dtype.name}[{dim}]) "
            f"needs {need} bytes ({_gib(need)}) allocated up front, but this machine has {have} bytes "
            f"({_gib(have)}) of memory; pass a smaller expected_rows (it is per table: every shard and optimizer "
            "slot of a Variable gets one), or 0 to grow on demand"
        )


def _capacity_errors(method):
    """Runs a CuckooTable method, raising tfde.CapacityError (a
    tf.errors.ResourceExhaustedError) for an op that ran out of memory or
    row ids, eagerly.  In a graph the op raises ResourceExhaustedError
    itself, with a message that starts with "tfde.CapacityError"."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except tf.errors.ResourceExhaustedError as e:
            if isinstance(e, CapacityError):
                raise
            found = from_op_error(e)
            text = found if found is not e else e.message
            raise CapacityError(
                f"cuckoo table {self.name!r} ({self.key_dtype.name} -> {self.value_dtype.name}"
                f"[{self.dim}]) cannot take more rows: {text}. Free memory, or spread the "
                "Variable over more tables or processes"
            ) from None

    return run


class CuckooTable(Table, trackable_resource.TrackableResource):
    """A native concurrent cuckoo hash table.

    Thread-safety: all methods may run concurrently (the table locks per
    internal shard); batch operations use TensorFlow's intra-op thread pool.
    """

    def __init__(self, name: str, key_dtype: tf.DType, value_dtype: tf.DType, dim: int, expected_rows: int = 0) -> None:
        self.key_dtype, self.value_dtype, self.dim = check_dtypes(key_dtype, value_dtype, dim)
        self.name = name
        self._expected_rows = int(expected_rows)
        check_expected_rows(name, self.key_dtype, self.value_dtype, self.dim, self._expected_rows)
        self._shared_name = f"tfde:{name}:{next(_uid)}"
        self._ops = _native.load()
        super().__init__()
        self._make_resource()  # now, in the current (usually eager) context

    @_capacity_errors
    def _make_resource(self):
        _ = self.resource_handle

    def _export_to_saved_model_graph(self, *args, **kwargs):
        # A SavedModel recreates a resource from its creator function, empty:
        # a training table in one would serve initial rows, silently.  Keras 3's
        # model.export and tf.saved_model.save reach it here; the serving
        # export holds SavedByValueCuckooTables or store views instead.
        raise ConfigError(
            f"cuckoo table {self.name!r} cannot be saved in a SavedModel: it would be recreated empty on load "
            "and serve initial rows, not the trained ones. Export a model for serving with "
            "tfde.export_for_serving(model, path) (docs/saving.md), and save training state with "
            "tf.train.Checkpoint, model.save or tfde.CheckpointManager"
        )

    def _create_resource(self):
        return self._ops.tfde_cuckoo_table(
            key_dtype=self.key_dtype,
            value_dtype=self.value_dtype,
            dim=self.dim,
            expected_rows=self._expected_rows,
            shared_name=self._shared_name,
        )

    def _destroy_resource(self):
        tf.raw_ops.DestroyResourceOp(resource=self.resource_handle, ignore_lookup_error=True)

    def _missing_args(self, missing, n):
        return native_missing_args(missing, self)

    @_capacity_errors
    def find(self, keys, missing):
        keys = as_keys(keys, self.key_dtype, self.name)
        defaults, attrs = self._missing_args(missing, tf.size(keys))
        return self._ops.tfde_table_find(self.resource_handle, keys, defaults, dim=self.dim, **attrs)

    @_capacity_errors
    def insert(self, keys, values):
        keys = as_keys(keys, self.key_dtype, self.name)
        values = as_rows(values, self.value_dtype, self.dim, self.name)
        return self._ops.tfde_table_insert(self.resource_handle, keys, values)

    @_capacity_errors
    def accum(self, keys, deltas, missing):
        keys = as_keys(keys, self.key_dtype, self.name)
        deltas = as_deltas(deltas, self.value_dtype, self.dim, self.name)
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

    @_capacity_errors
    def export_chunk(self, cursor, max_rows):
        return self._ops.tfde_table_export(
            self.resource_handle,
            tf.cast(cursor, tf.int64),
            tf.cast(max_rows, tf.int64),
            dim=self.dim,
            Tkey=self.key_dtype,
            Tvalue=self.value_dtype,
        )

    # Checkpoints save Variables, not tables: a Variable streams all its
    # tables (tfde/saving).  Serving exports embed whole tables
    # (SavedByValueCuckooTable below).

    def __repr__(self):
        return f"CuckooTable({self.name!r}, {self.key_dtype.name} -> {self.value_dtype.name}[{self.dim}])"


class SavedByValueCuckooTable(CuckooTable):
    """A cuckoo table that a SavedModel holds by value (its keys and rows as
    two tensors), restored by TensorFlow's own loader through the traced
    save/restore functions: a serving process loads it without tfde's
    Python (tfde.export_for_serving(rows="embedded")).  Training tables are
    saved by their Variables instead (tfde/saving/)."""

    def _export_to_saved_model_graph(self, *args, **kwargs):
        return trackable_resource.TrackableResource._export_to_saved_model_graph(self, *args, **kwargs)

    def _serialize_to_tensors(self):
        keys, values, _ = self._ops.tfde_table_export(
            self.resource_handle,
            tf.constant(0, tf.int64),
            tf.constant(2**62, tf.int64),
            dim=self.dim,
            Tkey=self.key_dtype,
            Tvalue=self.value_dtype,
        )
        return {"keys": keys, "values": values}

    def _restore_from_tensors(self, restored_tensors):
        cleared = self.clear()
        with tf.control_dependencies([cleared]):
            return self.insert(restored_tensors["keys"], restored_tensors["values"])


@register_creator
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
        rows = int_arg(self.expected_rows)
        if rows is None or rows < 0:
            raise ConfigError(f"expected_rows must be an int >= 0, got {self.expected_rows!r}")
        object.__setattr__(self, "expected_rows", rows)  # np.int64 -> int (frozen dataclass)

    def create(self, name: str, key_dtype: tf.DType, value_dtype: tf.DType, dim: int) -> CuckooTable:
        return CuckooTable(name, key_dtype, value_dtype, dim, expected_rows=self.expected_rows)

    def get_config(self) -> dict:
        return {"expected_rows": self.expected_rows}
