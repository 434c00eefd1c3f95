"""tfde.Variable: a dynamic embedding table split over shards of a store.

A Variable maps keys (int64, int32 or string) to rows ``[dim]`` of a float
dtype.  Its rows live in one table per shard, made by a TableCreator (the
in-process cuckoo table by default); a key's shard is given by the stable
hash (tfde.hashing).  Lookups never insert (docs/design.md, decision 3): a key that was
never written reads its initial row, a deterministic function of (key, seed).

Training: a trainable Variable owns a *step buffer*, a ``tf.Variable`` of
shape ``[None, dim]`` that holds the rows looked up for training since the
optimizer's last step, with their keys beside it.  Lookups that are part of
a training step (under a recording GradientTape, outside tf.data functions:
docs/lookups.md) append to it and gather from it, so the gradient of the
loss reaches it as IndexedSlices; tfde.DynamicEmbeddingOptimizer maps those back to keys, applies
the update to the touched rows, writes them to the store and empties the
buffer.  A layer called twice in one step appends twice, so both calls'
gradients are applied.

Thread-safety: lookups and writes may run concurrently (the stores are
thread-safe); the step buffer assumes one training step at a time.  A
training step's writes of a key (row, optimizer slots, policy state, change
log) and the removal of that key (remove(), restrict(), clear()) exclude each
other: both run inside the Variable's write section (a tf.CriticalSection),
so a removal that overlaps training leaves every key either in all of the
Variable's tables or in none of them.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from typing import Any, Iterator, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tfde import _native
from tfde import exchange as _exchange
from tfde import initializers as _init
from tfde.changes import ChangeLog
from tfde.errors import ConfigError, ShapeError
from tfde.hashing import shard_index
from tfde.local import local_variable
from tfde.optimizer_rules import compute_dtype
from tfde.step_kernels import fused_lookup
from tfde.tables.base import (
    DEFAULT_EXPORT_CHUNK_ROWS,
    Table,
    TableCreator,
    as_keys,
    check_dtypes,
    check_same_count,
    int_arg,
    key_tensor,
    require,
    widened_deltas,
)
from tfde.tables.cuckoo import CuckooTableCreator
from tfde.types import DTypeLike, InitializerLike, KeysLike, RowsLike

_SECTION_IDS = itertools.count()


def _module_name(name: str) -> str:
    cleaned = re.sub(r"\W", "_", name)
    return cleaned if cleaned and not cleaned[0].isdigit() else "v_" + cleaned


_STEPS = []  # this process's training step counter, made on first use (training_step)


def training_step() -> Optional[tf.Tensor]:
    """This process's training step number: an int64 scalar that every
    training step of a DynamicEmbeddingOptimizer advances once all of its
    table writes succeeded (next_training_step), so a step that failed and
    is run again reads the same number.  Training reads and writes carry it
    to the tables (Table.find_to_update, Table.insert_with), where a store
    whose writes may fail part-way makes the step run again apply once
    (docs/redis.md, "A step run again").  None inside a TF1 graph, which
    cannot read an eager variable."""
    with tf.init_scope():
        if not tf.executing_eagerly():
            return None
        if not _STEPS:
            _STEPS.append(local_variable(tf.constant(0, tf.int64), [], False, "tfde_training_step"))
    return _STEPS[0].read_value()


def next_training_step() -> tf.Operation:
    """Advances training_step() (the optimizer, after a step's writes)."""
    training_step()
    return _STEPS[0].assign_add(1) if _STEPS else tf.no_op()


def _check_arguments(seed, trainable, restrict_policy, admission_filter) -> None:
    """ConfigError for Variable arguments of the wrong kind, before any
    table is made (int('abc'), bool('no') and a str policy failed or passed
    far from the cause)."""
    number = int_arg(seed)
    if seed is not None and (number is None or not -(2**63) <= number < 2**63):
        raise ConfigError(f"seed must be None or an int in [-2**63, 2**63), got {seed!r}")
    if not isinstance(trainable, (bool, np.bool_)):
        raise ConfigError(f"trainable must be True or False, got {trainable!r}")
    # By their methods (tfde/policy.py and tfde/admission.py import this module).
    for arg, value, methods, kind, example in (
        (
            "restrict_policy",
            restrict_policy,
            ("bind", "restrict"),
            "RestrictPolicy class or instance",
            "tfde.FrequencyRestrictPolicy",
        ),
        (
            "admission_filter",
            admission_filter,
            ("bind", "admit"),
            "AdmissionFilter instance",
            "tfde.CounterFilter(min_count=2)",
        ),
    ):
        fits = all(callable(getattr(value, m, None)) for m in methods)
        if value is not None and not (fits and (arg == "restrict_policy" or not isinstance(value, type))):
            raise ConfigError(f"{arg} must be None or a tfde {kind} (e.g. {example}), got {value!r}")


class Variable(tf.Module):
    """A dynamic embedding table.

    Args:
      name: unique name; tables are named ``{name}/shard_{i}_of_{n}``.
      key_dtype: tf.int64 (default), tf.int32 or tf.string.
      value_dtype: tf.float32 (default), tf.float64, tf.float16, tf.bfloat16.
      dim: row width, 1..65536.
      initializer: what a key reads before it is written: a number, an
        initializer object or name (see tfde.initializers.SUPPORTED).
      seed: seed of the initial rows when the initializer has none; defaults
        to a stable hash of `name`, so every worker agrees.
      num_shards: tables the keys are split over by stable hash.
      table_creator: backend; tfde.CuckooTableCreator() by default.
      restrict_policy: a tfde.RestrictPolicy (class or instance) told about
        every training update; see tfde.policy.
      admission_filter: a tfde.CounterFilter or tfde.ProbabilityFilter
        deciding which new keys get stored rows; see tfde.admission.
      trainable: whether lookups in training steps feed the optimizer
        (docs/lookups.md).
      track_changes: record which keys training writes and which are
        removed, for incremental exports (tfde.changes,
        tfde.saving.export_changes).
      placement: which worker of a distributed job owns each key
        (tfde.exchange.Placement): by default every worker owns the keys
        the stable hash routes to it (tfde.exchange.ROWS);
        tfde.exchange.OnWorker(w) keeps the whole Variable on worker w
        (docs/distributed.md, "Placement").

    Example:
      >>> v = tfde.Variable("ids", dim=4, initializer=0.0)
      >>> v.upsert([1, 2], [[1.0] * 4, [2.0] * 4])
      >>> v.lookup([2, 3]).numpy().tolist()
      [[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]]
    """

    # The keys of the step buffer are bookkeeping of this process, not model
    # state: kept out of .variables, so that Keras models do not list them
    # (a broadcast of model.variables to the workers cannot carry strings).
    _TF_MODULE_IGNORED_PROPERTIES = tf.Module._TF_MODULE_IGNORED_PROPERTIES | {
        "_keys_buffer",
        "_strategy",
        "_serving",
        "_local",
    }

    def __init__(
        self,
        name: str,
        key_dtype: DTypeLike = tf.int64,
        value_dtype: DTypeLike = tf.float32,
        dim: int = 1,
        initializer: InitializerLike = None,
        seed: Optional[int] = None,
        num_shards: int = 1,
        table_creator: Optional[TableCreator] = None,
        restrict_policy: Optional[Any] = None,
        admission_filter: Optional[Any] = None,
        trainable: bool = True,
        track_changes: bool = False,
        placement: Optional[_exchange.Placement] = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a Variable needs a non-empty string name, got {name!r}")
        super().__init__(name=_module_name(name))
        self._full_name = name
        self.key_dtype, self.value_dtype, self.dim = check_dtypes(key_dtype, value_dtype, dim)
        dim = self.dim  # a Python int from here on (dim may be given as a numpy integer)
        shards = int_arg(num_shards)  # numpy integers are ints; bools are not
        if shards is None or shards < 1:
            raise ConfigError(f"num_shards must be an int >= 1, got {num_shards!r}")
        self.num_shards = num_shards = shards
        _check_arguments(seed, trainable, restrict_policy, admission_filter)
        self.seed = _init.default_seed_for(name, seed)
        self.initializer = _init.resolve(initializer, dim, self.seed)
        self.table_creator = table_creator if table_creator is not None else CuckooTableCreator()
        if not isinstance(self.table_creator, TableCreator):
            raise ConfigError(f"table_creator must be a tfde TableCreator, got {type(self.table_creator).__name__}")
        self.trainable = bool(trainable)
        if placement is None:
            placement = _exchange.ROWS
        if not isinstance(placement, _exchange.Placement):
            raise ConfigError(
                f"placement must be a tfde.exchange.Placement (tfde.exchange.ROWS or tfde.exchange.OnWorker(w)), "
                f"got {placement!r}"
            )
        self.placement = placement
        # The tf.distribute strategy in scope at creation: between-step work
        # (restriction) finds its workers through it even outside the scope.
        self._strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        self._serving = None  # the tables lookups read instead, within serving_from()
        # Semi-synchronous training's local tables (tfde/semi_sync.py,
        # LocalTables), which training steps read and write between syncs;
        # None: training reads and writes the store.
        self._local = None
        with tf.init_scope():
            self._tables = [
                self.table_creator.create(self._table_name(i), self.key_dtype, self.value_dtype, dim)
                for i in range(num_shards)
            ]
            if self.trainable:
                # Not mirrored by a strategy in scope: the step buffer
                # belongs to this process (tfde/local.py).
                self._rows_buffer = local_variable(
                    tf.zeros([0, dim], self.value_dtype), [None, dim], True, f"{self.name}/step_rows"
                )
                self._keys_buffer = local_variable(
                    tf.zeros([0], self.key_dtype), [None], False, f"{self.name}/step_keys"
                )
                self._rows_buffer._tfde_variable = self  # how the optimizer finds its way back
        self._slots = {}
        self.restrict_policy = None
        if restrict_policy is not None:
            self.restrict_policy = restrict_policy(self) if isinstance(restrict_policy, type) else restrict_policy
            self.restrict_policy.bind(self)
        self.admission_filter = admission_filter
        if admission_filter is not None:
            admission_filter.bind(self)
        # Held by a training step while it writes rows, slots and policy
        # state, and by removals (see exclusively); a layer of many tables
        # may give all of them one (DistributedEmbedding).
        self._write_section = write_section(self.name)
        self.changes = None
        if track_changes:
            self.changes = ChangeLog(self)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # Checkpoints: a Variable is saved whole (rows, slots, policy and
        # admission state, streamed in chunks) by tfde's registered saver
        # (tfde/saving/registered.py), so its tables, slot Variables and step
        # buffers are not separate checkpoint entries.
        if save_type == "checkpoint":
            return {}
        return super()._trackable_children(save_type, **kwargs)

    # ------------------------------------------------------------ identity

    @property
    def name(self) -> str:
        return self._full_name

    def _table_name(self, i: int) -> str:
        return f"{self._full_name}/shard_{i}_of_{self.num_shards}"

    @property
    def tables(self):
        return list(self._tables)

    @contextlib.contextmanager
    def serving_from(self, tables: Sequence[Table]) -> Iterator[None]:
        """Within: lookups read `tables` instead of this Variable's own: one
        table holding every key, or one per shard in this Variable's routing
        (read-only views, Table.serving_view); every write through the
        Variable raises ConfigError.  tfde.export_for_serving traces a model
        this way against the tables its SavedModel holds."""
        tables = list(tables)
        if len(tables) not in (1, self.num_shards):
            raise ConfigError(
                f"Variable {self.name!r} has {self.num_shards} shards; serve it from 1 table or "
                f"{self.num_shards}, got {len(tables)}"
            )
        if self._serving is not None:
            raise ConfigError(f"Variable {self.name!r} is being served from other tables already")
        self._serving = tables
        try:
            yield
        finally:
            self._serving = None

    def _read_tables(self) -> list:
        return self._tables if self._serving is None else self._serving

    def _write_tables(self) -> list:
        if self._serving is not None:
            raise ConfigError(
                f"Variable {self.name!r} is read-only while it is served from other tables "
                "(Variable.serving_from): a serving export traces lookups only"
            )
        return self._tables

    def _train_tables(self) -> list:
        """The tables training writes, and reads rows to update from: one per
        shard.  Between the syncs of semi-synchronous training, this
        worker's local tables (all shards share one); else the store."""
        if self._local is not None:
            return [self._local.rows] * self.num_shards
        return self._write_tables()

    @property
    def step_buffer(self) -> tf.Variable:
        """The trainable [None, dim] buffer of this step's looked-up rows."""
        if not self.trainable:
            raise ConfigError(f"Variable {self.name!r} was created with trainable=False")
        return self._rows_buffer

    def __repr__(self):
        return (
            f"tfde.Variable({self.name!r}, {self.key_dtype.name} -> {self.value_dtype.name}[{self.dim}], "
            f"shards={self.num_shards}, store={type(self._tables[0]).__name__})"
        )

    # ------------------------------------------------------------ routing

    def _keys(self, keys) -> tf.Tensor:
        return as_keys(keys, self.key_dtype, self.name)

    def _key_tensor(self, keys) -> tf.Tensor:
        """`keys` of any shape as a tensor of key_dtype: tensors must have it,
        Python ints and numpy arrays are converted exactly (an id outside
        the key dtype's range, or a float, is a ShapeError, never wrapped;
        tfde.tables.base.key_tensor)."""
        return key_tensor(keys, self.key_dtype, self.name)

    def _flat_keys(self, keys) -> tf.Tensor:
        return self._keys(self._key_tensor(keys))

    def _missing(self, flat_keys, for_update=False):
        if not for_update and self.admission_filter is not None and self.admission_filter.default == "zeros":
            return _init.InitSpec("constant", 0.0, 0.0, self.seed)
        if isinstance(self.initializer, _init.PerKey):
            rows = tf.convert_to_tensor(self.initializer.fn(flat_keys), dtype=self.value_dtype)
            return tf.ensure_shape(rows, [None, self.dim])
        return self.initializer

    def _split(self, flat_keys, shards=None):
        """(per-shard keys, per-shard positions) over `shards` (default:
        num_shards) tables."""
        shards = self.num_shards if shards is None else shards
        shard = shard_index(flat_keys, shards)
        keys = tf.dynamic_partition(flat_keys, shard, shards)
        pos = tf.dynamic_partition(tf.range(tf.size(flat_keys)), shard, shards)
        return keys, pos

    def _find(
        self, flat_keys, for_update: bool = False, in_step: bool = False, initial: bool = False
    ) -> Tuple[tf.Tensor, tf.Tensor]:
        """(rows, exists).  for_update: the rows a write will be computed
        from (a training step's read-modify-write), where missing rows read
        the initializer even when an admission filter makes lookups read
        zeros.  Both for_update and in_step (a training step's forward
        lookups, which the gradient is computed from) read with
        Table.find_to_update: never a lagging replica.  initial: missing
        rows read the initializer, as for_update, from the store (a sync of
        semi-synchronous training computes its writes from them)."""
        missing = self._missing(flat_keys, for_update or initial)
        tables = self._train_tables() if for_update and self._local is not None else self._read_tables()
        primary = for_update or in_step
        step = training_step() if primary else None

        def read(table, keys, missing):
            return table.find_to_update(keys, missing, step) if primary else table.find(keys, missing)

        if len(tables) == 1:
            values, exists = read(tables[0], flat_keys, missing)
        else:
            keys, pos = self._split(flat_keys, len(tables))
            found = []
            for i, table in enumerate(tables):
                shard_missing = missing if isinstance(missing, _init.InitSpec) else tf.gather(missing, pos[i])
                found.append(read(table, keys[i], shard_missing))
            values = tf.dynamic_stitch(pos, [f[0] for f in found])
            exists = tf.dynamic_stitch(pos, [f[1] for f in found])
        values.set_shape([None, self.dim])
        return values, exists

    def _cast_in_range(self, values, what):
        """`values` cast to the value dtype, refused where a finite value
        would become an infinity (1e300 into float32, 1e6 into float16):
        eagerly a ShapeError, in a graph an assert.  NaN and infinities
        given as such are kept."""
        cast = tf.cast(values, self.value_dtype)
        finite = tf.math.is_finite(values) if values.dtype.is_floating else tf.ones(tf.shape(values), tf.bool)
        overflow = tf.reduce_any(tf.logical_and(finite, tf.logical_not(tf.math.is_finite(cast))))
        checks = require(
            tf.logical_not(overflow),
            f"{what} for {self.name!r} ({values.dtype.name}) hold numbers beyond the range of its value dtype "
            f"{self.value_dtype.name}, which would be stored as infinities; scale them or use a wider value_dtype",
        )
        if not checks:
            return cast
        with tf.control_dependencies(checks):
            return tf.identity(cast)

    def _rows_arg(self, values, what="values", wider_ok=False):
        """`values` as [n, dim] rows of the value dtype; with wider_ok
        (accum's deltas, which Table.accum adds in the wider type before
        rounding the sum to the value dtype), float32 and float64 values
        stay as they are, numpy arrays keep their dtype, Python numbers
        become the compute type (float32, float64 for float64 Variables),
        and other number types are cast to it (tables/base.py widened_deltas)."""
        if wider_ok:
            hint = None if isinstance(values, np.ndarray) else compute_dtype(self.value_dtype)
            values = widened_deltas(tf.convert_to_tensor(values, dtype_hint=hint), self.value_dtype)
        elif isinstance(values, (list, tuple, float, int, np.ndarray, np.number)):
            # Python numbers keep float64 until the checked cast below (a
            # dtype hint would make 1e300 an inf of float32 silently); a
            # list holding tensors is stacked by TensorFlow (in a graph,
            # numpy cannot read them).
            if any(tf.is_tensor(x) or isinstance(x, tf.Variable) for x in tf.nest.flatten(values)):
                values = tf.convert_to_tensor(values)
            else:
                array = np.asarray(values)
                values = tf.constant(array) if array.dtype.kind in "fiu" else tf.convert_to_tensor(values)
        else:
            values = tf.convert_to_tensor(values, dtype_hint=self.value_dtype)
        if values.dtype != self.value_dtype and not (wider_ok and values.dtype in (tf.float32, tf.float64)):
            if not (values.dtype.is_floating or values.dtype.is_integer):
                raise ShapeError(f"{what} for {self.name!r} are {values.dtype.name}, expected {self.value_dtype.name}")
            values = self._cast_in_range(values, what)
        if values.shape.rank == 0:
            # Refused rather than broadcast: a scalar given for rows is more
            # often a mistake (a row, or the keys, missing) than a wish to
            # fill every row with one number, and refusing changes nothing.
            raise ShapeError(
                f"{what} for {self.name!r} are a scalar; expected shape keys.shape + [{self.dim}] "
                f"(one row of {self.dim} values per key). A scalar is not broadcast: to give every "
                f"key the same row pass e.g. tf.fill(tf.concat([tf.shape(keys), [{self.dim}]], 0), "
                "value)"
            )
        if (
            values.shape.rank is not None
            and values.shape.rank >= 1
            and values.shape[-1] is not None
            and values.shape[-1] != self.dim
        ):
            raise ShapeError(
                f"{what} for {self.name!r} have last dimension {values.shape[-1]}, but the Variable "
                f"holds rows of dim {self.dim}; expected shape keys.shape + [{self.dim}]"
            )
        if values.shape.rank == 2 and values.shape[-1] == self.dim:  # already [n, dim]: no op needed
            return values
        if values.shape.rank is None or values.shape[-1] is None:
            # A graph's input of unknown shape: the reshape below would
            # accept rows of another width whenever the sizes divide (none at
            # all for no keys), so the width is checked when the graph runs.
            shape = tf.shape(values)
            fits = (tf.size(shape) >= 1) & tf.reduce_all(tf.equal(shape[-1:], self.dim))
            check = tf.debugging.Assert(
                fits,
                [
                    f"tfde: {what} for {self.name} must have shape keys.shape + "
                    f"[{self.dim}] (rows of dim {self.dim}); got shape",
                    shape,
                ],
            )
            with tf.control_dependencies([check]):
                values = tf.identity(values)
        return tf.reshape(values, [-1, self.dim])

    def _for_each_shard(self, flat_keys, rows, fn):
        """fn(table, its keys, their rows) for each shard's part of a write."""
        tables = self._write_tables()
        if len(tables) == 1:
            return [fn(tables[0], flat_keys, rows)]
        keys, pos = self._split(flat_keys)
        return [fn(t, keys[i], None if rows is None else tf.gather(rows, pos[i])) for i, t in enumerate(tables)]

    # ------------------------------------------------------------ public API

    def lookup(self, keys: KeysLike, return_exists: bool = False) -> Union[tf.Tensor, Tuple[tf.Tensor, tf.Tensor]]:
        """Rows of `keys`, shape ``keys.shape + [dim]``; never inserts.

        `keys`: a tensor of key_dtype, or Python ints / a numpy integer array
        (converted exactly: an id outside key_dtype's range, or a float, is
        a ShapeError; the same holds for every method taking keys).

        With return_exists=True also returns a bool tensor of keys.shape
        telling which keys are stored."""
        keys = self._key_tensor(keys)
        find = self._reader()
        if keys.shape.rank == 1:  # the common case needs no reshapes
            values, exists = find(self._keys(keys))
            return (values, exists) if return_exists else values
        shape = tf.shape(keys)
        flat = self._keys(tf.reshape(keys, [-1]))
        values, exists = find(flat)
        values = tf.reshape(values, tf.concat([shape, [self.dim]], 0))
        if keys.shape.rank is not None:
            values.set_shape(keys.shape.concatenate([self.dim]))
        if return_exists:
            return values, tf.reshape(exists, shape)
        return values

    def upsert(self, keys: KeysLike, values: RowsLike) -> Optional[tf.Operation]:
        """Stores `values` (``keys.shape + [dim]``) under `keys`."""
        flat = self._flat_keys(keys)
        rows = self._counted(flat, self._rows_arg(values))
        with tf.control_dependencies(self._drop_local(flat)):
            return tf.group(self._for_each_shard(flat, rows, lambda t, k, r: t.insert(k, r)))

    def accum(self, keys: KeysLike, deltas: RowsLike, *tfra_form: Any) -> Optional[tf.Operation]:
        """Adds `deltas` to the rows of `keys`; a key not stored yet starts from
        its initial row.  Duplicated keys add up.  Deltas of a float16 or
        bfloat16 Variable are added in float32 (float64 ones in float64) and
        each sum is rounded to the value dtype once (a float64 sum through
        float32, as TensorFlow's cast does); give them as float32 to keep
        them unrounded: deltas of the value dtype were rounded already.
        TFRA's form accum(keys, old_values, new_values, exists) is refused
        with the tfde call to write instead (`tfra_form`)."""
        if tfra_form:
            raise ConfigError(
                f"Variable.accum takes (keys, deltas); {self.name!r} got {2 + len(tfra_form)} arguments, as TFRA's "
                "accum(keys, old_values, new_values, exists). tfde adds deltas atomically per key on every backend, "
                "a missing key starting from its initial row: call accum(keys, new_values - old_values), which stores "
                "what TFRA's form stores when old_values are the rows a lookup returned (for a missing key, its "
                "initial row). Nothing was written"
            )
        flat = self._flat_keys(keys)
        rows = self._counted(flat, self._rows_arg(deltas, "deltas", wider_ok=True))

        def one(table, k, d):
            # The initial row, also where an admission filter makes lookups
            # of keys not stored read zeros.
            missing = self._missing(k, for_update=True)
            return table.accum(k, d, missing)

        with tf.control_dependencies(self._drop_local(flat)):
            return tf.group(self._for_each_shard(flat, rows, one))

    def _drop_local(self, flat) -> list:
        """Between the syncs of semi-synchronous training, a write to the
        store drops the keys from this worker's local tables (what it
        trained of them since the last sync is lost), so their next lookup
        reads what was written (docs/semi-sync.md)."""
        if self._local is None:
            return []
        from tfde import semi_sync

        if self._local.copy and not semi_sync.rewriting():
            raise ConfigError(
                f"Variable {self.name!r} is written between the syncs of semi-synchronous training with copies of "
                "its table on every worker (PeriodicSync(replicate=True)): the other workers' copies would not "
                "see the write.  Write before start() or after stop(), or train with replicate=False"
            )
        return [self._local.rows.remove(flat), self._local.base.remove(flat)]

    def remove(self, keys: KeysLike) -> tf.Tensor:
        """Removes `keys` from the rows, every slot (optimizer and policy
        state) and the change log, in one step of the write section: a
        training step never sees a key half removed.  Returns how many rows
        were removed (int64 scalar)."""
        flat = self._flat_keys(keys)
        return self._exclusively(flat, self._remove_everywhere)

    def _remove_everywhere(self, flat):
        """(rows removed, the removal ops) over rows, slots and change log."""
        deps = ([] if self.changes is None else [self.changes.on_remove(flat)]) + self._drop_local(flat)
        with tf.control_dependencies(deps):
            removed = tf.add_n(self._for_each_shard(flat, None, lambda t, k, r: t.remove(k)))
        slot_writes = []
        with tf.control_dependencies([removed]):
            for slot in self._slots.values():
                count, writes = slot._remove_everywhere(flat)
                slot_writes += [count] + writes
        return removed, slot_writes

    def clear(self) -> tf.Tensor:
        """Removes every key, slots included (in the write section)."""
        return self._exclusively(tf.zeros([0], self.key_dtype), lambda _: (tf.constant(True), self._clear_all()))

    def _clear_all(self) -> list:
        ops = [t.clear() for t in self._write_tables()]
        if self._local is not None:
            ops += [self._local.rows.clear(), self._local.base.clear()]
        for slot in self._slots.values():
            ops.extend(slot._clear_all())
        return [o for o in ops if o is not None]

    def _exclusively(self, keys, fn):
        """Runs fn(keys) inside this Variable's write section; returns its
        result.  fn returns (result tensor, list of its write ops); see
        exclusively."""
        return exclusively(self._write_section, [([keys], lambda ordered: fn(ordered[0]))])[0]

    def size(self) -> tf.Tensor:
        """Number of stored keys over all shards (int64 scalar)."""
        return tf.add_n([t.size() for t in self._tables])

    def export(self, chunk_rows: int = DEFAULT_EXPORT_CHUNK_ROWS) -> Iterator[Tuple[tf.Tensor, tf.Tensor]]:
        """Eager iterator over (keys [m], rows [m, dim]) chunks of at most
        chunk_rows, shard after shard."""
        rows = int_arg(chunk_rows)
        if rows is None or rows < 1:
            raise ConfigError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
        return (chunk for t in self._tables for chunk in t.export(rows))

    def max_value(self, floor: float) -> float:
        """The largest value any stored row holds, or `floor` when it is
        larger or the Variable is empty (eager; for one-column state such as
        policy timestamps and change labels)."""
        for _, rows in self.export():
            floor = max(floor, float(tf.reduce_max(rows)))
        return floor

    def import_(self, keys: KeysLike, values: RowsLike, replace: bool = False) -> Optional[tf.Operation]:
        """Upserts (keys, values); replace=True clears the Variable first
        (rows and slots).  Bad input (key dtype, row dtype or dim, as many
        rows as keys) is refused before anything is cleared."""
        flat = self._flat_keys(keys)
        rows = self._counted(flat, self._rows_arg(values))
        if replace:
            with tf.control_dependencies([rows]):  # after the count check, when a graph runs
                self.clear()
        return self.upsert(flat, rows)

    def _counted(self, flat, rows):
        """`rows`, once known to hold one row per key of `flat`: statically
        (ShapeError), or when a graph runs if a length is only known then
        (split over shards, surplus rows would otherwise be dropped)."""
        self._check_count(flat, rows)
        checks = check_same_count(flat, rows, repr(self.name))
        if not checks:
            return rows
        with tf.control_dependencies(checks):
            return tf.identity(rows)

    def _check_count(self, flat, rows):
        if flat.shape[0] is not None and rows.shape[0] is not None and flat.shape[0] != rows.shape[0]:
            raise ShapeError(
                f"{flat.shape[0]} keys but {rows.shape[0]} rows for {self.name!r}; "
                f"values must have shape keys.shape + [{self.dim}]"
            )

    # ------------------------------------------------------------ slots

    def slot(
        self, slot_name: str, initial_value: float, dim: Optional[int] = None, value_dtype: Optional[DTypeLike] = None
    ) -> "Variable":
        """The slot `slot_name` (optimizer state, policy state): a Variable of
        the same key dtype, sharding and backend (and, unless given, dim and
        value dtype) whose missing rows read `initial_value`.  Created on
        first use; removed and cleared with this Variable's rows."""
        if slot_name not in self._slots:
            with tf.init_scope():
                self._slots[slot_name] = Variable(
                    f"{self._full_name}-{slot_name}",
                    key_dtype=self.key_dtype,
                    value_dtype=value_dtype or self.value_dtype,
                    dim=dim or self.dim,
                    initializer=float(initial_value),
                    num_shards=self.num_shards,
                    table_creator=self.table_creator,
                    trainable=False,
                    placement=self.placement,
                )
        return self._slots[slot_name]

    def _write_step(self, keys, rows, others, store: bool = False) -> list:
        """Writes a training step: `rows` ([n, dim] of value_dtype) under the
        unique flat `keys` ([n]) and, for each (slot Variable, values
        [n, slot.dim] of slot.value_dtype) of the dict `others` (optimizer
        slots, policy state, change labels), its values under the same keys.
        Per shard, one Table.insert_with call writes them all, so each key
        gets its row and all of its state or, when the write fails, none of
        it (the call raises).  Returns the write ops; the optimizer calls it
        inside the write section (_exclusively).  store=True writes the
        store even between the syncs of semi-synchronous training (its
        sync does), outside a training step."""
        others = list(others.items())
        for slot, _ in others:
            if slot.num_shards != self.num_shards or slot.key_dtype != self.key_dtype:
                raise ConfigError(
                    f"{slot.name!r} cannot be written with {self.name!r} in one step: it has "
                    f"{slot.num_shards} shards of {slot.key_dtype.name} keys, {self.name!r} has "
                    f"{self.num_shards} of {self.key_dtype.name}; make it with {self.name!r}.slot()"
                )

        def tables_of(var):
            return var._write_tables() if store else var._train_tables()

        tables = tables_of(self)
        step = None if store else training_step()
        if self.num_shards == 1:
            return tables[0].insert_with(keys, rows, [(tables_of(s)[0], v) for s, v in others], step)
        parts, pos = self._split(keys)
        ops = []
        for i, table in enumerate(tables):
            ops.extend(
                table.insert_with(
                    parts[i],
                    tf.gather(rows, pos[i]),
                    [(tables_of(s)[i], tf.gather(v, pos[i])) for s, v in others],
                    step,
                )
            )
        return ops

    def _step_state(self, keys, step) -> dict:
        """{slot Variable: values [n, slot.dim]}: what the restrict policy
        and the change log write for a training step's unique `keys` (`step`:
        the optimizer's iterations before the step), as absolute values that
        join the step's write (_write_step).  Called inside the write
        section, so reads of the current state (frequency counts) see the
        state the write replaces."""
        values = {}
        for hook in (self.restrict_policy, self.changes):
            if hook is not None:
                values.update(hook.step_values(keys, step))
        return values

    def _after_update(self, keys, step) -> list:
        """Ops that record a training step's writes of `keys` (the optimizer
        calls it after _write_step; `step`: its iterations before the step):
        whatever the restrict policy and the change log do besides the
        values of _step_state (their on_apply)."""
        ops = []
        for hook in (self.restrict_policy, self.changes):
            if hook is not None:
                op = hook.on_apply(keys, step)
                if op is not None:
                    ops.append(op)
        return ops

    def restrict(self, num_reserved: Optional[int] = None, trigger: Optional[int] = None) -> int:
        """Applies the restrict policy: see tfde.policy.  Returns the number
        of keys removed (rows, optimizer slots and policy state alike)."""
        if self.restrict_policy is None:
            raise ConfigError(
                f"Variable {self.name!r} has no restrict_policy; create it with one, e.g. "
                "restrict_policy=tfde.FrequencyRestrictPolicy"
            )
        if self._local is not None:
            # Semi-synchronous training: the workers' changes since the last
            # sync reach the stores first (a collective call, as restrict is),
            # so the policy decides on every worker's state and no later push
            # brings back a key it removes (docs/semi-sync.md).
            from tfde import semi_sync

            semi_sync.sync_now()
            with semi_sync.rewriting_stores():  # copies of the stores are made anew after it
                return self.restrict_policy.restrict(num_reserved, trigger)
        return self.restrict_policy.restrict(num_reserved, trigger)

    @property
    def slots(self) -> dict:
        return dict(self._slots)

    # ------------------------------------------------------------ step buffer

    def _find_everywhere_packed(self, flat_keys, ex=None):
        """Rows and exists of keys that may be owned by any worker, as one
        [n, dim + 1] tensor (exists as 0/1 in the last column: one exchange
        carries both); through `ex`, else the active exchange."""
        # Not active(): a plain read reads the stores, also between the syncs
        # of semi-synchronous training.
        ex = ex or _exchange.engine_active()
        unique, positions = tf.unique(flat_keys, out_idx=tf.int32)

        def find(keys):
            rows, exists = self._find(keys)
            return tf.concat([rows, tf.cast(exists, rows.dtype)[:, None]], 1)

        _, found, mine = ex.rows_for(unique, find, self.placement)
        return tf.gather(found, positions if mine is None else tf.gather(mine, positions))

    def _unpack(self, packed):
        return packed[:, : self.dim], packed[:, self.dim] > 0

    def _reader(self):
        """flat keys -> (rows, exists) for a plain (non-training) read.

        In a job of several workers, a read gives every worker the right
        rows of every key (docs/lookups.md): straight from the store when
        the workers share it (Redis) or when this process trains alone;
        otherwise through the active exchange (inside a step or
        strategy.run) or the way the engine offers (tfde.exchange.
        plain_reader: under tf.distribute an eager read runs the exchange
        through strategy.run and a read in a tf.data function launches the
        strategy's collectives itself, so every worker must make it).
        Where no engine can reach the other workers' keys from a tf.data
        function the read is refused, never answered with the initial rows
        of the keys other workers own.  Graphs traced outside strategy.run
        (Keras building a model or saving it, serving exports) read this
        worker's store."""
        in_tf_data = in_tf_data_function()
        if in_tf_data and self.shared_between_workers:
            return self._find
        reader = _exchange.plain_reader(self, in_tf_data)
        if reader is not None:
            return reader
        if in_tf_data:
            self._refuse_partial_read("in a tf.data function")
        return self._find

    @property
    def shared_between_workers(self) -> bool:
        """Whether every worker of a distributed job sees the same store."""
        return self._tables[0].shared_between_workers

    def _job_strategy(self):
        """The tf.distribute strategy in scope, else the one this Variable
        was created under (None: none)."""
        return tf.distribute.get_strategy() if tf.distribute.has_strategy() else self._strategy

    def _refuse_partial_read(self, where: str) -> None:
        workers = _exchange.workers(self._strategy)
        if workers <= 1:
            return
        raise ConfigError(
            f"tfde Variable {self.name!r} is read {where} in a job of {workers} workers, and its tables "
            f"({type(self._tables[0]).__name__}) are each worker's own: a worker holds only the keys it owns, so "
            "this read cannot see the rows the other workers hold. Use a store all workers share "
            "(table_creator=tfde.RedisTableCreator(...)) for this Variable, or read inside the training step or "
            "strategy.run (model.fit, model.evaluate and model.predict do); see docs/lookups.md"
        )

    def _read_unique(self, unique_keys):
        """Rows of deduplicated keys for a plain (non-training) read."""
        return self._reader()(unique_keys)[0]

    def _step_size(self):
        """Rows in the step buffer now (int32 scalar)."""
        return tf.raw_ops.VariableShape(input=self._rows_buffer.handle, out_type=tf.int32)[0]

    def _reset_step_buffer(self):
        return tf.group(
            self._rows_buffer.assign(tf.zeros([0, self.dim], self.value_dtype)),
            self._keys_buffer.assign(tf.zeros([0], self.key_dtype)),
        )


def write_section(name: str) -> tf.CriticalSection:
    """A new write section (see exclusively).  Its shared_name is unique per
    call: unnamed critical sections made in eager mode all share one mutex,
    and two of them in one step deadlock (the second lock can be taken
    first)."""
    with tf.init_scope():
        return tf.CriticalSection(name=f"{name}_writes", shared_name=f"tfde_writes_{next(_SECTION_IDS)}_{name}")


def exclusively(section: tf.CriticalSection, jobs: list) -> list:
    """Runs the jobs [(keys: list of tensors, fn)] inside the write section
    `section`, once each; returns their results.  fn(keys) returns (result
    tensor, list of its write ops) and must write through the keys it is
    given: they reach it through a stateful identity (TfdeOrdered) made
    after the section's lock, so every write depends on the lock by data,
    which graph optimizers keep (they drop control edges they judge
    redundant; measured: a policy write escaped the section under Grappler's
    arithmetic optimizer).  The section is released once every write and
    result are done.  Work whose inputs are computed outside fn (new rows,
    scores) runs before the lock is taken, so it is held only for the
    writes.  One graph must not enter the same section twice (TF orders the
    releases in program order but may take the second lock first, a
    deadlock): the optimizer enters each section once per step with every
    Variable it guards (Variables of one DistributedEmbedding share one),
    and removal runs eagerly between or beside steps."""
    ordered = _native.load().tfde_ordered

    def body():
        results = []
        for keys, fn in jobs:
            result, writes = fn([ordered(k) for k in keys])
            with tf.control_dependencies(writes):
                results.append(ordered(result))
        return results

    return section.execute(body, exclusive_resource_access=False)


def trainable_lookups(parts: Sequence[tuple]) -> list:
    """The rows of a training step's lookups of several Variables: parts is
    a list of (Variable, unique keys, positions into them); returns the rows
    gathered at the positions, per part.  Each part's rows are appended to
    its Variable's step buffer and gathered from it, so that the gradient
    reaches the buffer; under an exchange the buffer holds the rows of every
    worker's keys, in the same order on all workers.  The rows of every part come
    through one call of the exchange (Exchange.rows_for_many), so a layer of
    many tables pays the collectives of one (docs/distributed.md, "One
    exchange per step").  A Variable may appear in several parts (features
    sharing a table): each part appends its own rows to the buffer."""
    lookups = [
        _exchange.Lookup(keys, lambda k, v=var: v._find(k, in_step=True)[0], var.placement, var)
        for var, keys, _ in parts
    ]
    found = _exchange.active().rows_for_many(lookups)
    return _through_buffers([(var, positions) for var, _, positions in parts], found)


def trainable_lookups_of(parts: Sequence[tuple]) -> list:
    """trainable_lookups of ids not yet deduplicated: parts is a list of
    (Variable, flat ids [n]); returns the rows [n, dim] of the ids, per part.
    A process training alone reads the parts that qualify with one native op
    that deduplicates and finds (tfde/step_kernels.py, `lookup`); the others
    are deduplicated here and go through the exchange together."""
    ex = _exchange.active()
    tables = [ex.fused_table(var) for var, _ in parts]
    fused = [i for i, t in enumerate(tables) if t is not None]
    out = [None] * len(parts)
    if fused:
        looked = fused_lookup([parts[i] for i in fused], [tables[i] for i in fused])
        found = []
        for i, (unique, _, rows) in zip(fused, looked):
            with tf.control_dependencies(ex.looked_up(parts[i][0], unique)):
                found.append((unique, tf.identity(rows), None))
        rows = _through_buffers([(parts[i][0], positions) for i, (_, positions, _) in zip(fused, looked)], found)
        for i, r in zip(fused, rows):
            out[i] = r
    rest = [i for i in range(len(parts)) if out[i] is None]
    if rest:
        deduped = [tf.unique(parts[i][1], out_idx=tf.int32) for i in rest]
        rows = trainable_lookups([(parts[i][0], unique, positions) for i, (unique, positions) in zip(rest, deduped)])
        for i, r in zip(rest, rows):
            out[i] = r
    return out


def _through_buffers(parts: list, found: list) -> list:
    """Appends each part's rows to its Variable's step buffer and gathers
    them at its positions; parts: [(Variable, positions into its keys)],
    found: [(buffer keys, buffer rows, positions of the keys in them or
    None)] (Exchange.rows_for_many)."""
    out = []
    for (var, positions), (buffer_keys, rows, mine) in zip(parts, found):
        if mine is not None:
            positions = tf.gather(mine, positions)
        offset = var._step_size()  # after the appends of earlier parts (ops on one variable run in order)
        var._rows_buffer.assign(tf.concat([var._rows_buffer.read_value(), rows], 0))
        var._keys_buffer.assign(tf.concat([var._keys_buffer.read_value(), buffer_keys], 0))
        out.append(tf.gather(var._rows_buffer, positions + offset))
    return out


def is_step_buffer(var) -> bool:
    """Whether `var` is the step buffer of a tfde Variable (what the
    optimizer trains in its place; Variable.step_buffer)."""
    return getattr(var, "_tfde_variable", None) is not None


def in_tf_data_function() -> bool:
    """Whether the code running now is being traced into a tf.data function
    (Dataset.map, filter, reduce, ...; also a tf.function called from one).
    tf.data names the graphs of its functions after the transformation
    ("Dataset_map_<fn>", "tf_data_experimental_<...>"); no public API tells."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and hasattr(graph, "outer_graph"):  # FuncGraphs, innermost first
        name = getattr(graph, "name", "") or ""
        if name.startswith(("Dataset_", "tf_data_")):
            return True
        graph = graph.outer_graph
    return False


def model_variables(model) -> list:
    """The tfde Variables held by the layers of a Keras model (or by a
    tf.Module and its submodules), in layer order, each once."""
    if hasattr(model, "_flatten_layers"):  # Keras 3 and tf-keras
        owners = list(model._flatten_layers(include_self=True, recursive=True))
    else:
        owners = [model] + list(getattr(model, "submodules", ()))
    found = []
    for owner in owners:
        for value in vars(owner).values():
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, Variable) and all(v is not f for f in found):
                    found.append(v)
    return found


def get_variable(
    name: str,
    key_dtype: DTypeLike = tf.int64,
    value_dtype: DTypeLike = tf.float32,
    dim: int = 1,
    initializer: InitializerLike = None,
    **kwargs: Any,
) -> Variable:
    """Creates a tfde.Variable (TFRA-style spelling of the constructor)."""
    return Variable(name, key_dtype=key_dtype, value_dtype=value_dtype, dim=dim, initializer=initializer, **kwargs)
