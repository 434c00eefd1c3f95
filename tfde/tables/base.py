"""The Table protocol: the one seam between tfde and its stores.

Everything above the store (Variable, lookups, optimizer, policies, savers,
distributed code) talks only to these methods.  A backend is one module that
implements them plus a creator; see tfde/tables/cuckoo.py.

Keys are 1-D tensors of the table's key dtype; rows are ``[n, dim]`` tensors of
its value dtype.  Every method works eagerly and inside ``tf.function``.
"""

from __future__ import annotations

import abc
import math
import numbers
from typing import Dict, Iterator, Optional, Tuple, Type, Union

import numpy as np
import tensorflow as tf

from tfde._defaults import CHUNK_ROWS, MAX_DIM
from tfde.errors import ConfigError, ShapeError
from tfde.initializers import InitSpec
from tfde.optimizer_rules import compute_dtype

Missing = Union[InitSpec, tf.Tensor]
"""What a missing key reads: an InitSpec (deterministic per key) or a
``[n, dim]`` / ``[1, dim]`` tensor of default rows."""

DEFAULT_EXPORT_CHUNK_ROWS = CHUNK_ROWS  # rows per exported chunk (tfde/_defaults.py)

# ---------------------------------------------------------------- checks every backend makes

_VALUE_DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16)
_KEY_DTYPES = (tf.int32, tf.int64, tf.string)


def int_arg(value):
    """`value` as a Python int when it is an integer (a Python int or a numpy
    integer such as np.int64(64)), else None.  Bools are not integers here:
    dim=True is a mistake, not 1."""
    if isinstance(value, (bool, tf.Tensor)) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def check_dtypes(key_dtype, value_dtype, dim) -> tuple:
    """(key dtype, value dtype, dim as an int), or a ConfigError."""
    key_dtype, value_dtype = tf.as_dtype(key_dtype), tf.as_dtype(value_dtype)
    if key_dtype not in _KEY_DTYPES:
        raise ConfigError(f"key_dtype {key_dtype.name} is not supported; use int64, int32 or string")
    if value_dtype not in _VALUE_DTYPES:
        raise ConfigError(f"value_dtype {value_dtype.name} is not supported; use float32, float64, float16 or bfloat16")
    width = int_arg(dim)
    if width is None or not 1 <= width <= MAX_DIM:
        raise ConfigError(f"dim must be an int between 1 and {MAX_DIM}, got {dim!r}")
    return key_dtype, value_dtype, width


def native_missing_args(missing, table):
    """(defaults tensor, init attrs) of a native find/accum op: what a
    missing key of `table` reads (an InitSpec, or rows)."""
    if isinstance(missing, InitSpec):
        return tf.zeros([0, table.dim], table.value_dtype), missing.attrs()
    return as_rows(missing, table.value_dtype, table.dim, table.name, "defaults"), {"init_kind": "defaults"}


class Table:
    """A key -> row store of fixed dim.

    A plain base class (not an ABC: backends also derive from TensorFlow
    classes with their own metaclass); every method below must be overridden
    except export, import_ and insert_with, which are defined in terms of
    the others.

    Thread-safety: every method may be called from several threads (or
    concurrent TF ops) at once; each call is atomic per key.

    Writes of one key to several tables: ``insert_with`` upserts a key's row
    here and its rows in other tables (a training step: the row, every
    optimizer slot, the policy state) as one write, all-or-nothing per key;
    a store that can fail part-way (Redis) overrides it.
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
    # A directory where checkpoints write this table's rows as files of
    # their own instead of into the checkpoint (Redis table_store_mode 1), or
    # None: the rows go into the checkpoint (when in_checkpoints).
    files_dir: Optional[str] = None

    # ---- declared capabilities: every backend answers these (memory_bytes
    # has no default: each backend says what it holds; the others default
    # to what an in-process table answers)

    def memory_bytes(self) -> tf.Tensor:
        """Bytes of this process's memory the table holds (int64 scalar); 0
        for a store whose rows live outside the process (Redis)."""
        raise NotImplementedError

    def serving_view(self) -> Optional["Table"]:
        """A read-only table over the same rows that a SavedModel can hold
        and read with tfde's ops alone, without its Python
        (tfde.export_for_serving(rows="store")); None when the rows cannot be
        read live from a serving process (an in-process table: a serving
        export copies them)."""
        return None

    def close(self) -> None:
        """Releases what the table holds outside TensorFlow's resources
        (connections, a store's expiry); the table is not used afterwards.
        In-process tables are freed with their TF resource: nothing to do."""

    # ---- the store

    def find(self, keys: tf.Tensor, missing: Missing) -> Tuple[tf.Tensor, tf.Tensor]:
        """Rows of `keys` ([n, dim]) and whether each key is stored ([n] bool).
        A missing key reads its row from `missing`; nothing is inserted."""
        raise NotImplementedError

    def find_to_update(
        self, keys: tf.Tensor, missing: Missing, step: Optional[tf.Tensor] = None
    ) -> Tuple[tf.Tensor, tf.Tensor]:
        """find() for rows a write will be computed from (a training step's
        forward lookups and its read-modify-write of rows, optimizer slots
        and policy state): a backend that may serve find() from replicas,
        which lag, reads its primary here, so no update is computed from a
        stale row.  `step` (an int64 scalar, or None outside a training
        step) is the step's number (tfde.variable.training_step): a store
        whose writes may fail part-way (Redis) reads what a failed attempt of
        this same step wrote as it was before, so the step run again applies
        once (insert_with's `step`).  The default is find()."""
        return self.find(keys, missing)

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> Optional[tf.Operation]:
        """Upserts `values` ([n, dim]) under `keys`; the last duplicate wins."""
        raise NotImplementedError

    def insert_with(self, keys: tf.Tensor, values: tf.Tensor, others: list, step: Optional[tf.Tensor] = None) -> list:
        """Upserts `values` ([n, dim]) under `keys` here and, for each
        ``(table, table_values)`` pair of `others`, `table_values`
        ([n, table.dim] of table.value_dtype) under the same keys in `table`;
        returns the write ops.  The tables share the key dtype and this
        backend (they are one Variable's row, slot and policy tables of one
        shard); `keys` are unique.

        Contract: for every key, either all of its writes are applied or, when
        the call fails, none of them (a failure never leaves a key's row
        without its slots), and a failed call raises.  This default writes
        one table after the other (equivalent to calling insert on self, then
        on each table of `others`): it keeps the contract for failures an
        insert reports before writing (bad shapes, dtypes), as the in-process
        tables do; a store that may fail part-way through a write (a server
        lost or out of memory) must override it.  `step`: the training step
        the write belongs to (see find_to_update), or None; the in-process
        tables, whose step writes cannot fail part-way, ignore it."""
        ops = [self.insert(keys, values)]
        for table, table_values in others:
            ops.append(table.insert(keys, table_values))
        return [op for op in ops if op is not None]

    def accum(self, keys: tf.Tensor, deltas: tf.Tensor, missing: Missing) -> Optional[tf.Operation]:
        """Adds `deltas` to the rows of `keys`; a missing key is inserted as
        its `missing` row plus its delta.  Duplicates all add.  `deltas` are
        of the table's dtype, float32 or float64 (as_deltas): each sum is
        taken in the wider of the row's compute type (float32 for float16
        and bfloat16) and the deltas' and rounded to the table's dtype once
        (a float64 sum to float16 or bfloat16 through float32, as
        TensorFlow's cast goes)."""
        raise NotImplementedError

    def remove(self, keys: tf.Tensor) -> tf.Tensor:
        """Removes `keys`; returns how many were present (int64 scalar)."""
        raise NotImplementedError

    def clear(self) -> tf.Operation:
        """Removes every key."""
        raise NotImplementedError

    def size(self) -> tf.Tensor:
        """Number of stored keys (int64 scalar)."""
        raise NotImplementedError

    def export_chunk(self, cursor: tf.Tensor, max_rows: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
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

    def import_(self, keys: tf.Tensor, values: tf.Tensor, replace: bool = False) -> Optional[tf.Operation]:
        """Inserts (keys, values); with replace=True clears the table first.
        Equivalent to clear() (if replace) followed by insert(), except that
        bad input (key dtype, row dtype or dim, as many rows as keys) is
        refused before anything is cleared: a refused import changes nothing."""
        keys = as_keys(keys, self.key_dtype, self.name)
        values = as_rows(values, self.value_dtype, self.dim, self.name)
        checks = check_same_count(keys, values, f"table {self.name!r}")
        if replace:
            with tf.control_dependencies(checks):
                self.clear()
        with tf.control_dependencies(checks):
            return self.insert(keys, values)


class TableCreator(abc.ABC):
    """Makes the tables of a Variable: its rows, optimizer slots and policy state.

    A creator is saved in layer configs as {"class_name", "config"}
    (`creator_config`) and rebuilt by `creator_from_config`, the one place
    that turns a config into a backend: a creator class registers itself
    there with `register_creator`."""

    @classmethod
    def from_config(cls, config: dict) -> "TableCreator":
        """The creator that get_config() described."""
        return cls(**config)

    @abc.abstractmethod
    def create(self, name: str, key_dtype: tf.DType, value_dtype: tf.DType, dim: int) -> Table:
        """A new (or, for shared stores, attached) table."""

    def get_config(self) -> dict:
        return {}


_CREATORS: Dict[str, Type[TableCreator]] = {}


def register_creator(cls):
    """Class decorator: layer configs may name `cls` (by its class name).
    A second class of the same name is refused: a config names one class."""
    known = _CREATORS.get(cls.__name__)
    if known is not None and known is not cls:
        raise ConfigError(
            f"a table creator named {cls.__name__!r} is registered already ({known.__module__}); "
            "give yours another class name"
        )
    _CREATORS[cls.__name__] = cls
    return cls


def creator_config(creator: Optional[TableCreator]) -> Optional[dict]:
    """{"class_name", "config"} of `creator`, for a layer config."""
    if creator is None:
        return None
    return {"class_name": type(creator).__name__, "config": creator.get_config()}


def creator_from_config(config) -> Optional[TableCreator]:
    """The TableCreator a layer config holds (as creator_config wrote it); a
    class that did not register_creator is refused here, naming those that did."""
    if config is None or isinstance(config, TableCreator):
        return config
    kind = config.get("class_name", "CuckooTableCreator")
    if kind not in _CREATORS:
        raise ConfigError(
            f"unknown table creator {kind!r} in a layer config; expected one of {', '.join(sorted(_CREATORS))}"
        )
    return _CREATORS[kind].from_config(dict(config.get("config", {})))


def require(condition, message: str, details: Optional[dict] = None) -> list:
    """A check on values a graph knows only when it runs: eagerly raises
    ShapeError(message) unless `condition` holds and returns []; in a graph
    returns [an assert] (InvalidArgumentError with the message when it
    fails) for what must not run before it to depend on.  `details` (name:
    scalar tensor) follow the message."""
    details = details or {}
    if tf.executing_eagerly():
        if not bool(condition):
            shown = ", ".join(f"{name} {int(value)}" for name, value in details.items())
            raise ShapeError(f"{message} ({shown})" if shown else message)
        return []
    return [tf.debugging.Assert(condition, [message] + [x for item in details.items() for x in item])]


def check_same_count(keys: tf.Tensor, rows: tf.Tensor, what: str) -> list:
    """Raises ShapeError when 1-D `keys` and [n, dim] `rows` have statically
    different lengths; returns the run-time check for lengths a graph only
    knows when it runs ([] when both are known), for writes to depend on."""
    n_keys, n_rows = keys.shape[0] if keys.shape.rank else None, rows.shape[0] if rows.shape.rank else None
    if n_keys is not None and n_rows is not None:
        if n_keys != n_rows:
            raise ShapeError(
                f"{n_keys} keys but {n_rows} rows for {what}; give one row per key (values of shape [{n_keys}, dim])"
            )
        return []
    return [
        tf.debugging.assert_equal(
            tf.size(keys, out_type=tf.int64),
            tf.shape(rows, out_type=tf.int64)[0],
            message=f"the number of keys and rows differ for {what}; give one row per key",
        )
    ]


# Key conversion is exact.  tf.convert_to_tensor
# and tf.cast wrap integers that do not fit the key dtype and truncate
# floats (2**32 + 1 -> 1, 1.7 -> 1 as int32), which would read or overwrite
# another key's row: so ids that are not tensors are converted here, through
# numpy, and checked to be integers in the key dtype's range; tensors must
# already have the key dtype (or go through cast_keys, which checks values).
_KEY_BITS = {tf.int32: 32, tf.int64: 64}


def _key_range(key_dtype: tf.DType) -> Tuple[int, int]:
    bits = _KEY_BITS[key_dtype]
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _out_of_range(value, key_dtype: tf.DType, table_name: str):
    lo, hi = _key_range(key_dtype)
    return ShapeError(
        f"key {value!r} for table {table_name!r} is outside the range of its key dtype "
        f"{key_dtype.name}, [{lo}, {hi}]; converting it would wrap around to another key. Map or "
        f"hash the ids into that range, or create the table with key_dtype=tf.int64"
    )


def _not_whole(value, key_dtype: tf.DType, table_name: str, whole_floats: bool):
    if whole_floats:
        return ShapeError(
            f"key {value!r} for table {table_name!r} is not a whole number; its ids must be "
            f"integers ({key_dtype.name}): a float id would be truncated to another key"
        )
    return ShapeError(
        f"keys for table {table_name!r} must be integers ({key_dtype.name}), got the float "
        f"{value!r}; floats are refused even when whole (1.0) because a fraction would be truncated "
        f"to another key: cast whole-number ids yourself, e.g. "
        f"np.asarray(ids).astype(np.{key_dtype.name})"
    )


def exact_key_array(keys, key_dtype: tf.DType, table_name: str, whole_floats: bool = False) -> np.ndarray:
    """`keys` (a Python int or nested list of them, or a numpy array of any
    int dtype) as a numpy array of `key_dtype`, of the same shape; a
    ShapeError names the first id that is not an integer in the dtype's
    range.  Floats are refused unless `whole_floats` (Keras layers, fed float
    placeholders): then whole-number floats are accepted, fractions are not."""
    np_dtype = key_dtype.as_numpy_dtype
    lo, hi = _key_range(key_dtype)
    if isinstance(keys, (np.ndarray, np.generic)):
        arr = np.asarray(keys)
    else:
        # An object array keeps Python ints exact: numpy's own conversion
        # turns [-1, 2**63] into floats and [1, True] into ints.
        try:
            arr = np.array(keys, dtype=object)
        except (TypeError, ValueError) as e:
            raise ShapeError(
                f"keys for table {table_name!r} must be {key_dtype.name}; could not convert {type(keys).__name__}: {e}"
            ) from None
    if arr.size == 0:
        return np.zeros(arr.shape, np_dtype)
    kind = arr.dtype.kind
    if kind == "O":
        flat = arr.ravel()
        for k in flat:
            if isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Real):
                hint = (
                    "; for string ids create the table with key_dtype=tf.string" if isinstance(k, (str, bytes)) else ""
                )
                raise ShapeError(
                    f"keys for table {table_name!r} must be integers ({key_dtype.name}), got "
                    f"{k!r} ({type(k).__name__}){hint}"
                )
            if not isinstance(k, numbers.Integral):
                if not whole_floats or not math.isfinite(k) or not float(k).is_integer():
                    raise _not_whole(k, key_dtype, table_name, whole_floats)
            if not lo <= k <= hi:
                raise _out_of_range(k, key_dtype, table_name)
        return np.array([int(k) for k in flat], np_dtype).reshape(arr.shape)
    if kind in "iu":
        for bound in (arr.min(), arr.max()):
            if not lo <= int(bound) <= hi:
                raise _out_of_range(bound.item(), key_dtype, table_name)
        return arr.astype(np_dtype)
    if kind == "f":
        arr = arr.astype(np.float64)  # holds every float16/32 value exactly; compared without overflow
        whole = np.isfinite(arr) & (np.floor(arr) == arr)
        if not whole_floats or not whole.all():
            raise _not_whole(
                arr.ravel()[np.argmin(whole.ravel()) if not whole.all() else 0].item(),
                key_dtype,
                table_name,
                whole_floats,
            )
        # lo and hi + 1 are powers of two: exact in every float dtype.
        outside = (arr < lo) | (arr >= float(hi + 1))
        if outside.any():
            raise _out_of_range(arr.ravel()[np.argmax(outside.ravel())].item(), key_dtype, table_name)
        return arr.astype(np_dtype)
    what = "booleans" if kind == "b" else f"{arr.dtype} values"
    raise ShapeError(
        f"keys for table {table_name!r} must be integers ({key_dtype.name}), got {what}"
        + ("; for string ids create the table with key_dtype=tf.string" if kind in "US" else "")
    )


def key_tensor(keys, key_dtype: tf.DType, table_name: str) -> tf.Tensor:
    """`keys` (any shape) as a tensor of `key_dtype`, or a ShapeError saying
    why not.  A tensor must have the key dtype already (a cast of wider ids
    could wrap: see cast_keys); other ids are converted exactly
    (exact_key_array; no floats)."""
    if isinstance(keys, (tf.Tensor, tf.Variable)) or tf.is_tensor(keys):
        if keys.dtype != key_dtype:
            raise ShapeError(
                f"keys for table {table_name!r} are {keys.dtype.name}, expected {key_dtype.name}; "
                + _cast_hint(keys.dtype, key_dtype)
            )
        return keys
    if key_dtype == tf.string:
        try:
            return tf.convert_to_tensor(keys, dtype=tf.string)
        except (TypeError, ValueError) as e:
            raise ShapeError(
                f"keys for table {table_name!r} must be strings; could not convert {type(keys).__name__}: {e}"
            ) from None
    if isinstance(keys, (list, tuple)) and any(tf.is_tensor(k) for k in tf.nest.flatten(keys)):
        return key_tensor(tf.convert_to_tensor(keys), key_dtype, table_name)  # a list of tensors: stacked
    return tf.constant(exact_key_array(keys, key_dtype, table_name))


def _cast_hint(seen: tf.DType, key_dtype: tf.DType) -> str:
    if key_dtype == tf.string:
        if seen.is_integer:
            return (
                "format the ids as strings first (tf.strings.as_string), or create the table with "
                f"key_dtype=tf.{seen.name}"
            )
        return "give string ids"
    if seen == tf.string:
        return "hash the strings (tf.strings.to_hash_bucket_fast) or create the table with key_dtype=tf.string"
    if seen.is_integer:
        lo, hi = _key_range(key_dtype)
        if lo <= seen.min and seen.max <= hi:
            return f"cast them with tf.cast(keys, tf.{key_dtype.name}) (exact: every {seen.name} fits)"
        return (
            f"tf.cast(keys, {key_dtype.name}) is safe only for ids in [{lo}, {hi}] (it wraps others to "
            f"another key); or create the table with key_dtype=tf.int64"
        )
    return (
        f"ids must be integers; tf.cast would truncate fractions to another key: round or hash them "
        f"explicitly, then cast to {key_dtype.name}"
    )


def cast_keys(keys: tf.Tensor, key_dtype: tf.DType, table_name: str) -> tf.Tensor:
    """Tensor ids of another int or float dtype as `key_dtype`, exactly: every
    id must be a whole number in the key dtype's range.  Checked on the
    values: eagerly a ShapeError; in a graph a tf.debugging.Assert that fails
    the step with an InvalidArgumentError naming the table, and that the
    cast ids depend on, so nothing reads (or writes) them before it passed.
    Keras layers use it (Keras feeds float placeholders and int64 data)."""
    if keys.dtype == key_dtype:
        return keys
    if not key_dtype.is_integer or not (keys.dtype.is_integer or keys.dtype.is_floating):
        raise ShapeError(
            f"ids for table {table_name!r} are {keys.dtype.name}, expected {key_dtype.name}; "
            + _cast_hint(keys.dtype, key_dtype)
        )
    lo, hi = _key_range(key_dtype)
    if keys.dtype.is_integer and lo <= keys.dtype.min and keys.dtype.max <= hi:
        return tf.cast(keys, key_dtype)  # a narrower int dtype: always exact
    if tf.executing_eagerly() and hasattr(keys, "numpy"):
        if keys.dtype == tf.bfloat16:  # numpy has no bfloat16; float32 holds every bfloat16 exactly
            keys = tf.cast(keys, tf.float32)
        return tf.constant(exact_key_array(keys.numpy(), key_dtype, table_name, whole_floats=True))
    if keys.dtype.is_floating:
        # lo and hi + 1 are powers of two: exact in every float dtype (or
        # beyond float16's range, which is then inside).  NaN fails them all.
        ok = (tf.floor(keys) == keys) & (keys >= float(lo)) & (keys < float(hi + 1))
    else:
        src_lo, src_hi = keys.dtype.min, keys.dtype.max
        ok = tf.ones_like(keys, tf.bool)
        if src_lo < lo:
            ok &= keys >= tf.constant(lo, keys.dtype)
        if src_hi > hi:
            ok &= keys <= tf.constant(hi, keys.dtype)
    ok = tf.reshape(ok, [-1])
    bad = tf.boolean_mask(tf.reshape(keys, [-1]), tf.logical_not(ok))
    check = tf.debugging.Assert(
        tf.reduce_all(ok),
        # The table's name unquoted: the Assert message escapes quotes.
        [
            f"tfde: ids for table {table_name} ({keys.dtype.name}) must be whole numbers in the range of its key "
            f"dtype {key_dtype.name}, [{lo}, {hi}] (a cast would truncate or wrap them to another key); map or hash "
            "them into that range, or create the table with key_dtype=tf.int64. Refused ids:",
            bad,
        ],
        summarize=5,
    )
    with tf.control_dependencies([check]):
        return tf.cast(tf.identity(keys), key_dtype)


def as_keys(keys, key_dtype: tf.DType, table_name: str) -> tf.Tensor:
    """`keys` as a 1-D tensor of `key_dtype` (key_tensor, flattened), or a
    ShapeError saying why not."""
    keys = key_tensor(keys, key_dtype, table_name)
    if keys.shape.rank != 1:  # unknown ranks too (a graph's TensorSpec(None))
        keys = tf.reshape(keys, [-1])
    return keys


def widened_deltas(deltas: tf.Tensor, value_dtype: tf.DType) -> tf.Tensor:
    """The dtype accum takes `deltas` in: of the table's dtype, float32 or
    float64 as given (the sum is taken in the wider type and rounded to the
    table's dtype once: float32 deltas for a float16 table are not rounded
    to float16 first), any other number type cast to the table's compute
    type (optimizer_rules.compute_dtype); anything else as it is, for the
    caller's dtype check to refuse."""
    if deltas.dtype not in (value_dtype, tf.float32, tf.float64) and (
        deltas.dtype.is_floating or deltas.dtype.is_integer
    ):
        return tf.cast(deltas, compute_dtype(value_dtype))
    return deltas


def as_deltas(deltas, value_dtype: tf.DType, dim: int, table_name: str) -> tf.Tensor:
    """`deltas` for Table.accum as a [n, dim] tensor of the dtype
    widened_deltas gives, or a ShapeError."""
    deltas = widened_deltas(tf.convert_to_tensor(deltas), value_dtype)
    return as_rows(deltas, deltas.dtype if deltas.dtype.is_floating else value_dtype, dim, table_name, "deltas")


def as_rows(values, value_dtype: tf.DType, dim: int, table_name: str, what: str = "values") -> tf.Tensor:
    """`values` as a [n, dim] tensor of `value_dtype`, or a ShapeError."""
    values = tf.convert_to_tensor(values)
    if values.dtype != value_dtype:
        if values.dtype.is_floating or values.dtype.is_integer:
            values = tf.cast(values, value_dtype)
        else:
            raise ShapeError(f"{what} for table {table_name!r} are {values.dtype.name}, expected {value_dtype.name}")
    shape = values.shape
    if shape.rank is not None and (shape.rank != 2 or (shape[1] is not None and shape[1] != dim)):
        raise ShapeError(
            f"{what} for table {table_name!r} must have shape [n, {dim}], got {shape}; "
            f"the table holds rows of dim {dim}"
        )
    return values
