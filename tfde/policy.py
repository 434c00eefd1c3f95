"""Restrict policies: which keys a Variable keeps.

A policy is bound to one Variable and told about every training update
of the step's unique keys (lookups for inference never count): its
`step_values(keys, step)` gives the policy state the step writes, as
absolute values, which DynamicEmbeddingOptimizer writes together with the
rows and optimizer slots, all-or-nothing per key (Table.insert_with), and
its `on_apply(keys, step)` runs after that write for anything else (e.g.
in-process counters).  Its state lives in a slot of the Variable (same
backend, keys and shards, one float64 per key), so it is removed together
with the rows and the optimizer slots and is exported with them.

`variable.restrict(num_reserved, trigger)` keeps the `num_reserved` most
valuable keys once the Variable holds more than `trigger` (default
num_reserved) and removes the others from the rows, every optimizer slot and
the policy state.  Ties are broken by the stable key hash: of two keys with
the same value, the one with the smaller stable hash is kept, so every
worker decides alike.  tfde.AutoRestrictor and
tfde.keras.callbacks.RestrictCallback apply it automatically.

Restriction may run while training steps run (another thread, a callback):
a key is removed from the rows, every slot and the policy state in one step
of the Variable's write section, and a training step writes a key's row,
slots and policy state in one step of the same section (tfde.Variable), so
every key is always in all of the Variable's tables or in none.  A step that
read a key before its removal writes it back whole (it was trained in that
step).  Across processes sharing a Redis store, restriction is a collective
call made by every worker between steps (below), so no worker writes then.

In distributed training (tfde/exchange.py) every worker must call
restrict() at the same point (the automatic helpers decide with the global
table size, so they do); the workers then keep exactly the keys one worker
would keep: sizes are summed over workers' shards, each worker's best
num_reserved candidates are gathered to find the global cut, and each worker
removes its own keys below it (with a shared Redis store, the keys it owns).
"""

from __future__ import annotations

import abc
import numbers
import time
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfde import exchange
from tfde._defaults import CHUNK_ROWS
from tfde.errors import ConfigError
from tfde.hashing import stable_hash
from tfde.initializers import InitSpec
from tfde.tables.base import int_arg


class RestrictPolicy(abc.ABC):
    """Protocol of restrict policies (see the module docstring)."""

    variable = None

    def __init__(self, variable: Optional[Any] = None) -> None:
        # Variables accept a policy class too and instantiate it with
        # themselves; bind() is what attaches a policy to its Variable.
        pass

    def bind(self, variable: Any) -> None:
        """Called once, when the Variable is created."""
        if self.variable is not None and self.variable is not variable:
            raise ConfigError(
                f"this {type(self).__name__} already belongs to Variable {self.variable.name!r}; a policy keeps "
                f"per-key state for one Variable: pass the class (restrict_policy=tfde.{type(self).__name__}) or "
                f"one instance per Variable or layer (for {variable.name!r} too)"
            )
        self.variable = variable

    def step_values(self, keys: tf.Tensor, step: tf.Tensor) -> dict:
        """The policy state a training step writes for its unique `keys`
        ([n]; `step`: the optimizer's iteration count before the step, int64
        scalar): {slot Variable of the policy's Variable: values [n, slot.dim]}.
        Written with the step's rows and optimizer slots, all-or-nothing per
        key, so a failed step leaves no key with a row and no policy state.
        Called inside the Variable's write section, just before the write:
        a read of the current state (a count to increment) sees the value
        the write replaces.  Nothing ({}) by default."""
        return {}

    def fused_state(self) -> Optional[tuple]:
        """(state slot Variable, "add" or "set", the slot's initial value)
        when the fused training step (tfde/step_kernels.py) can write what
        step_values writes: each written key's value plus, or replaced by,
        fused_state_value(step) (a float64 dim-1 slot whose missing keys
        read a constant); and on_apply does not depend on the keys.
        None (the default, and for subclasses that override step_values or
        on_apply): the Variable trains on the optimizer's Python path."""
        return None

    def fused_state_value(self, step: tf.Tensor) -> tf.Tensor:
        """The float64 scalar fused_state's mode adds or sets at `step`."""
        raise NotImplementedError(f"{type(self).__name__} has no fused state")

    def on_apply(self, keys: tf.Tensor, step: tf.Tensor) -> Optional[tf.Operation]:
        """Called with the same arguments once the step's writes are done,
        for what step_values cannot state (state outside the Variable's
        slots); returns an op or None.  Nothing by default."""
        return None

    def restrict(self, num_reserved: Optional[int] = None, trigger: Optional[int] = None) -> int:
        """Removes keys the policy does not keep; returns how many."""
        raise NotImplementedError(f"{type(self).__name__} does not restrict")

    def get_config(self) -> dict:
        """Constructor arguments (layer configs carry them)."""
        return {}

    def sync_merges(self) -> Optional[dict]:
        """How a sync of semi-synchronous training (tfde/semi_sync.py)
        merges the workers' changes of the policy's per-key state since the
        last sync: {slot Variable: "sum" (the workers' deltas added, as
        counts) or "max" (the largest of the workers' values, as
        timestamps)}, or None when the state has no such rule (the
        Variable is then refused in semi-synchronous training).  None by
        default."""
        return None

    def after_restore(self) -> None:
        """Called when the Variable's state was restored from a checkpoint."""


class _WorkerView:
    """What one worker of a distributed job decides for (see the module
    docstring); with one worker, everything."""

    def __init__(self, variable):
        self.variable = variable
        self.host = exchange.host_collectives(variable._strategy)
        self.shared = variable.tables[0].shared_between_workers

    def size(self) -> int:
        """Keys stored over all workers."""
        local = int(self.variable.size())
        return local if self.host is None or self.shared else self.host.total(local)

    def mine(self, keys_tensor) -> Optional[np.ndarray]:
        """bool mask of the keys this worker decides for, or None for all."""
        if self.host is None or not self.shared:
            return None
        return self.variable.placement.owners(keys_tensor, self.host.size).numpy() == self.host.rank


def global_size(variable) -> int:
    """Keys stored by `variable` over every worker of the job (every worker
    must call it at the same point)."""
    return _WorkerView(variable).size()


class _ScoredPolicy(RestrictPolicy):
    """Keeps one float64 score per key in a slot named `policy-{state}`;
    restrict() keeps the highest scores."""

    state = "score"

    def bind(self, variable: Any) -> None:
        super().bind(variable)
        self.scores = variable.slot(f"policy-{self.state}", 0.0, dim=1, value_dtype=tf.float64)

    def _fused(self, mode: str) -> Optional[tuple]:
        """fused_state's answer for `mode` when the scores are what the
        kernels write (float64, dim 1, a constant initial value; a subclass
        may bind other scores), else None."""
        scores, init = self.scores, getattr(self.scores, "initializer", None)
        if scores.value_dtype != tf.float64 or scores.dim != 1:
            return None
        if not (isinstance(init, InitSpec) and init.kind == "constant"):
            return None
        return scores, mode, float(init.p0)

    def _stored_keys(self):
        for keys, _ in self.variable.export(CHUNK_ROWS):
            yield keys

    def _scored(self, view: Optional[_WorkerView] = None):
        """(keys, scores, stable hashes) of every stored key this worker
        decides for, numpy (empty arrays when there are none)."""
        keys, scores, hashes = [], [], []
        for chunk in self._stored_keys():
            mask = view.mine(chunk) if view is not None else None
            if mask is not None:
                chunk = tf.boolean_mask(chunk, mask)
            keys.append(chunk.numpy())
            # A local read, never a collective one: each worker scores its own
            # keys, and workers may hold different numbers of chunks.
            scores.append(self.scores._find(chunk)[0].numpy()[:, 0])
            hashes.append(stable_hash(chunk).numpy().view(np.uint64))
        if not keys:
            return (
                np.zeros(
                    [0], self.variable.key_dtype.as_numpy_dtype if self.variable.key_dtype != tf.string else object
                ),
                np.zeros([0]),
                np.zeros([0], np.uint64),
            )
        return np.concatenate(keys), np.concatenate(scores), np.concatenate(hashes)

    def restrict(self, num_reserved: Optional[int] = None, trigger: Optional[int] = None) -> int:
        reserved, limit = int_arg(num_reserved), int_arg(trigger)
        if reserved is None or reserved < 0:
            raise ConfigError(f"num_reserved must be an int >= 0, got {num_reserved!r}")
        if trigger is not None and (limit is None or limit < 0):
            raise ConfigError(
                f"trigger must be None or an int >= 0 (restriction runs when a table holds more than trigger "
                f"keys), got {trigger!r}"
            )
        num_reserved, trigger = reserved, reserved if trigger is None else limit
        view = _WorkerView(self.variable)
        if view.size() <= trigger:
            return 0
        keys, scores, hashes = self._scored(view)
        order = np.lexsort((hashes, -scores))  # best score first, then smaller stable hash
        if view.host is None:
            return self._remove(keys[order[num_reserved:]])
        # The global cut: no worker keeps more than num_reserved keys, so the
        # best num_reserved of each worker hold the global best num_reserved.
        best = order[:num_reserved]
        all_scores = view.host.gather(scores[best])
        all_hashes = view.host.gather(hashes[best].view(np.int64)).view(np.uint64)
        if len(all_scores) <= num_reserved:
            # Every worker's best are the global best (at most one worker
            # holds more than num_reserved keys: the others gave all of
            # theirs), so each keeps its own best and drops the rest.
            return self._remove(keys[order[num_reserved:]])
        last = np.lexsort((all_hashes, -all_scores))[num_reserved - 1] if num_reserved > 0 else None
        if last is None:
            return self._remove(keys)
        cut_score, cut_hash = all_scores[last], all_hashes[last]
        keep = (scores > cut_score) | ((scores == cut_score) & (hashes <= cut_hash))
        return self._remove(keys[~keep])

    def _remove(self, keys: np.ndarray) -> int:
        removed = 0
        for start in range(0, len(keys), CHUNK_ROWS):
            removed += int(
                self.variable.remove(tf.constant(keys[start : start + CHUNK_ROWS], dtype=self.variable.key_dtype))
            )
        return removed


class FrequencyRestrictPolicy(_ScoredPolicy):
    """Keeps the keys updated in the most training steps (a key seen several
    times in one batch counts once for that step)."""

    state = "frequency"

    def step_values(self, keys: tf.Tensor, step: tf.Tensor) -> dict:
        # Read and increment (keys are unique, the read runs in the write
        # section): an absolute value joins the step's all-or-nothing write,
        # where an accum would be a write of its own.
        return {self.scores: self.scores._find(keys, for_update=True)[0] + 1.0}

    def fused_state(self) -> Optional[tuple]:
        cls = type(self)  # a subclass that counts otherwise, or records more, keeps the Python path
        if cls.step_values is FrequencyRestrictPolicy.step_values and cls.on_apply is RestrictPolicy.on_apply:
            return self._fused("add")
        return None

    def fused_state_value(self, step: tf.Tensor) -> tf.Tensor:
        return tf.constant(1.0, tf.float64)

    def sync_merges(self) -> dict:
        # Each worker counts the steps in which it updated a key: a sync
        # adds the workers' counts.
        return {self.scores: "sum"}


class TimestampRestrictPolicy(_ScoredPolicy):
    """Keeps the most recently updated keys.

    clock: 'step' (the optimizer's iteration of the last update) or 'wall'
    (seconds since the epoch of the last update)."""

    state = "timestamp"

    def __init__(self, variable: Optional[Any] = None, clock: str = "step") -> None:
        super().__init__(variable)
        if clock not in ("step", "wall"):
            raise ConfigError(f"clock must be 'step' or 'wall', got {clock!r}")
        self.clock = clock

    def get_config(self) -> dict:
        return {"clock": self.clock}

    def _now(self, step):
        return tf.timestamp() if self.clock == "wall" else tf.cast(step, tf.float64)

    def step_values(self, keys: tf.Tensor, step: tf.Tensor) -> dict:
        return {self.scores: tf.fill([tf.size(keys), 1], self._now(step))}

    def fused_state(self) -> Optional[tuple]:
        # The time written is _now's (a subclass's own clock included);
        # TTLPolicy's on_apply records the step only.
        cls = type(self)
        if cls.step_values is TimestampRestrictPolicy.step_values and cls.on_apply in (
            RestrictPolicy.on_apply,
            TTLPolicy.on_apply,
        ):
            return self._fused("set")
        return None

    def fused_state_value(self, step: tf.Tensor) -> tf.Tensor:
        return self._now(step)

    def sync_merges(self) -> dict:
        return {self.scores: "max"}  # the latest update of any worker


class TTLPolicy(TimestampRestrictPolicy):
    """Evicts keys not updated for `ttl_steps` optimizer steps or `ttl_s`
    seconds (give exactly one).  restrict() takes no size arguments."""

    def __init__(
        self, variable: Optional[Any] = None, ttl_steps: Optional[int] = None, ttl_s: Optional[float] = None
    ) -> None:
        if (ttl_steps is None) == (ttl_s is None):
            raise ConfigError("TTLPolicy needs exactly one of ttl_steps= or ttl_s=")
        value = ttl_steps if ttl_steps is not None else ttl_s
        if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)) or not 0 < value < float("inf"):
            raise ConfigError(f"the TTL must be a positive, finite number, got {value!r}")
        if ttl_steps is not None and not float(ttl_steps).is_integer():
            raise ConfigError(f"ttl_steps counts optimizer steps: a whole number, got {ttl_steps!r}")
        super().__init__(clock="step" if ttl_steps is not None else "wall")
        self.ttl = float(value)
        self._latest_step = None

    def bind(self, variable: Any) -> None:
        super().bind(variable)
        with tf.init_scope():
            self._latest_step = tf.Variable(
                tf.constant(-1.0, tf.float64),
                trainable=False,
                name=f"{variable.name.replace('/', '_')}_ttl_latest_step",
            )

    def get_config(self) -> dict:
        return {"ttl_steps": int(self.ttl)} if self.clock == "step" else {"ttl_s": self.ttl}

    def after_restore(self) -> None:
        # The latest step this worker saw is the newest timestamp it holds.
        if self.clock == "step":
            self._latest_step.assign(self.scores.max_value(-1.0))

    def on_apply(self, keys: tf.Tensor, step: tf.Tensor) -> Optional[tf.Operation]:
        return self._latest_step.assign(tf.maximum(self._latest_step, tf.cast(step, tf.float64)))

    def restrict(self, num_reserved: Optional[int] = None, trigger: Optional[int] = None) -> int:
        if num_reserved is not None or trigger is not None:
            raise ConfigError("TTLPolicy.restrict() takes no num_reserved or trigger: the TTL decides")
        now = time.time() if self.clock == "wall" else float(self._latest_step.numpy())
        keys, scores, _ = self._scored(_WorkerView(self.variable))
        return self._remove(keys[scores < now - self.ttl])


def check_schedule(every_n_steps, max_size, num_reserved, who: str) -> None:
    """ConfigError unless the arguments of AutoRestrictor (and of the
    RestrictCallback that makes one) make a schedule: positive ints, at
    least one trigger, and no more keys kept than max_size allows."""
    if every_n_steps is None and max_size is None:
        raise ConfigError(f"{who} needs every_n_steps=, max_size= or both")
    for name, value in (("every_n_steps", every_n_steps), ("max_size", max_size), ("num_reserved", num_reserved)):
        if value is not None and (int_arg(value) is None or value < 1):
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if max_size is not None and num_reserved is not None and num_reserved > max_size:
        raise ConfigError(
            f"num_reserved ({num_reserved}) is above max_size ({max_size}): a table trimmed to num_reserved keys "
            "would still be over max_size; give num_reserved <= max_size (e.g. 90% of it)"
        )


class AutoRestrictor:
    """Applies restriction automatically in a custom training loop: call
    after_step(step) after every optimizer step.

    Args:
      variables: the tfde Variables to restrict (each needs a restrict policy).
      every_n_steps: restrict every this many steps.
      max_size: restrict whenever a Variable holds more than this many keys.
      num_reserved: keys kept by size-based policies (default: max_size).
    Give every_n_steps, max_size or both.  TTL policies evict by age each time.

    Example:
      >>> auto = tfde.AutoRestrictor([var], max_size=100_000)
      >>> for step, batch in enumerate(data): train_step(batch); auto.after_step(step + 1)
    """

    def __init__(
        self,
        variables: Sequence[Any],
        every_n_steps: Optional[int] = None,
        max_size: Optional[int] = None,
        num_reserved: Optional[int] = None,
    ) -> None:
        self.variables = list(variables)
        check_schedule(every_n_steps, max_size, num_reserved, "AutoRestrictor")
        every_n_steps, max_size, num_reserved = (int_arg(x) for x in (every_n_steps, max_size, num_reserved))
        for v in self.variables:
            if not (callable(getattr(v, "restrict", None)) and hasattr(v, "restrict_policy")):
                raise ConfigError(f"AutoRestrictor restricts tfde Variables (e.g. layer.params), got {v!r}")
            if v.restrict_policy is None:
                raise ConfigError(
                    f"Variable {v.name!r} has no restrict_policy; create it with one, e.g. "
                    "restrict_policy=tfde.FrequencyRestrictPolicy"
                )
        self.every_n_steps, self.max_size = every_n_steps, max_size
        self.num_reserved = num_reserved if num_reserved is not None else max_size
        if self.num_reserved is None and any(not isinstance(v.restrict_policy, TTLPolicy) for v in self.variables):
            raise ConfigError("size-based policies need num_reserved= (or max_size=) to know how many keys to keep")
        self.removed = 0

    def after_step(self, step: int) -> int:
        """Restricts what is due after training step `step`; returns keys removed."""
        removed = 0
        scheduled = self.every_n_steps is not None and step % self.every_n_steps == 0
        for v in self.variables:
            over = self.max_size is not None and global_size(v) > self.max_size
            if not (scheduled or over):
                continue
            if isinstance(v.restrict_policy, TTLPolicy):
                removed += v.restrict()
            else:
                removed += v.restrict(self.num_reserved)
        self.removed += removed
        return removed
