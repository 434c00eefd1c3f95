"""Admission filters: which new keys get a stored, trainable row.

Passed as ``admission_filter=`` to a tfde.Variable or Keras layer.  The
optimizer asks the filter, every training step, which of the step's keys
that are not stored yet may be written; the others are left out of the
update (no row, no optimizer slot, no policy state is written for them) and
keep reading their default row.

* CounterFilter(min_count): a key is admitted in the step in which it is
  seen for the min_count-th time (a key seen several times in one batch
  counts once).  Its counter lives in a Variable of its own (same backend),
  which drops the counter once the key is admitted.
* ProbabilityFilter(p, seed): a key is admitted when its stable hash, mixed
  with the seed, falls below p of the uint64 range: deterministic, so every
  worker decides the same way without talking, and a rejected key stays out.

default: what a key that has no stored row reads in lookups: 'initializer'
(the Variable's initial row) or 'zeros'.  Once admitted, a key's first update
starts from its initial row either way.
"""

from __future__ import annotations

import abc
from typing import Optional

import tensorflow as tf

from tfde.errors import ConfigError
from tfde.hashing import stable_hash
from tfde.variable import Variable

_DEFAULTS = ("initializer", "zeros")


class AdmissionFilter(abc.ABC):
    # True when admit() reads and writes nothing but its arguments: such a
    # filter decides alike on every worker without talking.  Semi-synchronous
    # training (tfde/semi_sync.py) takes those, and those whose state is
    # per-key counts it can merge (sync_counts); it refuses the others.
    stateless = False

    def __init__(self, default: str = "initializer"):
        if default not in _DEFAULTS:
            raise ConfigError(f"default must be one of {_DEFAULTS}, got {default!r}")
        self.default = default
        self.variable = None

    def bind(self, variable: Variable) -> None:
        if self.variable is not None and self.variable is not variable:
            raise ConfigError(
                f"this {type(self).__name__} already belongs to Variable {self.variable.name!r}; an admission filter "
                f"keeps per-key state for one Variable: create one per Variable or layer (for {variable.name!r} too)"
            )
        self.variable = variable

    def get_config(self) -> dict:
        """Constructor arguments (layer configs carry them)."""
        return {"default": self.default}

    def sync_counts(self) -> Optional[Variable]:
        """The Variable of per-key counts that semi-synchronous training
        merges by summing the workers' deltas at each sync (dropping the
        counts of keys some worker admitted), or None (tfde/semi_sync.py)."""
        return None

    @abc.abstractmethod
    def admit(self, keys: tf.Tensor, stored: tf.Tensor) -> tf.Tensor:
        """bool mask over the step's unique `keys`: which may be written.
        `stored` tells which are stored already (those are always admitted)."""


class CounterFilter(AdmissionFilter):
    def __init__(self, min_count: int, default: str = "initializer"):
        super().__init__(default)
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ConfigError(f"min_count must be an int >= 1, got {min_count!r}")
        self.min_count = min_count
        self.counts = None

    def bind(self, variable: Variable) -> None:
        super().bind(variable)
        with tf.init_scope():
            self.counts = Variable(
                f"{variable.name}-admission",
                key_dtype=variable.key_dtype,
                value_dtype=tf.float64,
                dim=1,
                initializer=0.0,
                num_shards=variable.num_shards,
                table_creator=variable.table_creator,
                trainable=False,
            )

    def get_config(self) -> dict:
        return {"min_count": self.min_count, **super().get_config()}

    def sync_counts(self) -> Optional[Variable]:
        return self.counts

    def admit(self, keys: tf.Tensor, stored: tf.Tensor) -> tf.Tensor:
        candidates = tf.boolean_mask(keys, ~stored)
        # A local read: the candidates are this worker's own keys (in
        # distributed training the owner decides), so no exchange is needed.
        seen = self.counts._find(candidates, for_update=True)[0][:, 0] + 1.0
        admitted_new = seen >= float(self.min_count)
        if self.counts._local is not None:
            # Between the syncs of semi-synchronous training this worker
            # counts in its local tables; the sync sums the workers' counts
            # and drops those of the keys some worker admitted.
            ops = self.counts._write_step(candidates, seen[:, None], {})
        else:
            waiting = tf.boolean_mask(candidates, ~admitted_new)
            ops = [
                # A training step's write (the step's number: a step run again
                # after a failure reads the counts its first attempt read).
                *self.counts._write_step(waiting, tf.boolean_mask(seen, ~admitted_new)[:, None], {}),
                self.counts.remove(tf.boolean_mask(candidates, admitted_new)),
            ]
        with tf.control_dependencies([o for o in ops if o is not None]):
            # scatter the decisions for the candidates back over all keys
            positions = tf.where(~stored)[:, 0]
            return tf.tensor_scatter_nd_update(stored, positions[:, None], admitted_new)


class ProbabilityFilter(AdmissionFilter):
    stateless = True

    def __init__(self, p: float, seed: int = 0, default: str = "initializer"):
        super().__init__(default)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ConfigError(f"p must be a probability in [0, 1], got {p!r}")
        self.p, self.seed = float(p), int(seed)

    def get_config(self) -> dict:
        return {"p": self.p, "seed": self.seed, **super().get_config()}

    def admit(self, keys: tf.Tensor, stored: tf.Tensor) -> tf.Tensor:
        # Mix the seed into the stable hash, then compare the top 53 bits
        # (exact in float64) with p.
        h = tf.bitcast(stable_hash(keys), tf.uint64)
        mixed = tf.bitwise.bitwise_xor(h, tf.constant((self.seed * 0x9E3779B97F4A7C15) & (2**64 - 1), tf.uint64))
        mixed = tf.bitcast(stable_hash(tf.bitcast(mixed, tf.int64)), tf.uint64)
        u = tf.cast(tf.bitwise.right_shift(mixed, tf.constant(11, tf.uint64)), tf.float64) * (2.0**-53)
        return stored | (u < self.p)
