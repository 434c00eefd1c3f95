"""The fused training step: one native op reads the rows of a step's lookups
of many tables, one writes its optimizer step (docs/lookups.md, "The fused
step").

The optimizer wrapper (tfde/optimizer.py) hands the gradients of the
Variables that qualify to `apply`, which makes one TfdeTableApply op per
group of Variables sharing a write section and dtypes
(backends/cuckoo/step_ops.cc): it sums each key's gradient, skips keys whose
gradient is not finite, reads rows and optimizer slots, applies the rule of
tfde/optimizer_rules.py (the same formulas in C++: backends/cuckoo/rules.h)
and writes rows and slots back.  A Variable on Redis gets one
TfdeRedisApply op (backends/redis/ops.cc, RedisTable.apply_step) for its
gradients summed per key: it reads the rows and slots before the step (the
step's kept read, the rest in one round trip), applies the same C++ rule and
writes rows and slots in the grouped insert's transactions, as a training
write (a step run again applies once).  Everything else takes the Python
path of the optimizer, which stays the reference:

* a Variable qualifies when its tables and its slots' are in-process cuckoo
  tables, or Redis tables of one creator, one shard each,
  with no admission filter or change tracking, and no restrict policy other
  than tfde's frequency, timestamp and TTL policies (the kernels write their
  state with the step: RestrictPolicy.fused_state) (`qualifies`);
* an optimizer step qualifies unless it clips (clipnorm, clipvalue,
  global_clipnorm) or scales the loss (`step_qualifies`).

`enabled` turns the fused step off for the whole process (the Python path
then trains every Variable), for comparisons and debugging.
"""

from __future__ import annotations

from typing import List, Optional

import tensorflow as tf

from tfde import _native, optimizer_rules
from tfde import initializers as _init
from tfde.optimizer_rules import hp
from tfde.tables.cuckoo import CuckooTable
from tfde.tables.redis_table import RedisTable

enabled = True  # False: every Variable takes the optimizer's Python path

# tfde/optimizer_rules.py rule name -> the kernel's rule attr.
_KERNEL_RULES = {
    "SGD": "sgd",
    "Adagrad": "adagrad",
    "Adam": "adam",
    "AdamW": "adam",
    "RMSprop": "rmsprop",
    "Ftrl": "ftrl",
}


class Part:
    """One Variable's share of a fused step: its step-buffer keys [b] (or
    the keys it owns, after an exchange), gradient rows `values` [m, dim] of
    the compute dtype at positions `indices` [m] int32 into the keys
    (repeats allowed), and `defaults` [b, dim] (the rows a missing key
    starts from: its step-buffer rows) or None (its initializer)."""

    def __init__(self, var, keys, indices, values, defaults=None, decay: bool = False):
        self.var, self.keys, self.indices, self.values, self.defaults, self.decay = (
            var,
            keys,
            indices,
            values,
            defaults,
            decay,
        )


def qualifies(var) -> bool:
    """Whether `var`'s training writes can take the fused step: on
    in-process cuckoo tables (TfdeTableApply) or on Redis tables of one
    creator (TfdeRedisApply, RedisTable.apply_step)."""
    if not enabled or var.num_shards != 1:
        return False
    if var.admission_filter is not None or var.changes is not None:
        return False
    if var.restrict_policy is not None and var.restrict_policy.fused_state() is None:
        return False
    return takes_buffer_gradients(var) or _on_redis(var)


def takes_buffer_gradients(var) -> bool:
    """Whether the fused step can take `var`'s step-buffer gradient as it is
    (keys repeated, summed in the kernel): its cuckoo kernel can; on Redis
    the gradients come summed per key."""
    return all(isinstance(t, CuckooTable) for t in var._train_tables()) and all(
        isinstance(t, CuckooTable) for s in var.slots.values() for t in s._train_tables()
    )


def _on_redis(var) -> bool:
    tables = var._train_tables()
    if not isinstance(tables[0], RedisTable):
        return False
    return all(tables[0]._shares_transactions_with(t) for s in var.slots.values() for t in s._train_tables())


def lookup_qualifies(var) -> bool:
    """Whether `var`'s training lookups can take the fused lookup (a process
    training alone; tfde.variable.trainable_lookups_of): one in-process
    cuckoo table whose missing keys read an initializer of the native kind."""
    return (
        enabled
        and var.num_shards == 1
        and var._serving is None
        and isinstance(var._tables[0], CuckooTable)
        and not isinstance(var.initializer, _init.PerKey)
    )


def fused_lookup(parts: list, tables: Optional[list] = None) -> list:
    """The rows of a training step's lookups: parts [(Variable, flat ids
    [n])] of Variables that lookup_qualifies, read from `tables` (one
    in-process cuckoo table per part; default: each Variable's store);
    returns per part (distinct ids [u] in order of first appearance,
    positions [n] int32 of the ids among them, their rows [u, dim]), one
    TfdeTableLookup op per key and value dtype."""
    tables = [var._tables[0] for var, _ in parts] if tables is None else tables
    groups = {}
    for i, (var, _) in enumerate(parts):
        groups.setdefault((var.key_dtype, var.value_dtype), []).append(i)
    out = [None] * len(parts)
    ops = _native.load()
    for indices in groups.values():
        chosen = [parts[i] for i in indices]
        attrs = [var._missing(ids, for_update=False).attrs() for var, ids in chosen]
        result = ops.tfde_table_lookup(
            tables=[tables[i].resource_handle for i in indices],
            keys=[ids for _, ids in chosen],
            dims=[var.dim for var, _ in chosen],
            Tvalue=chosen[0][0].value_dtype,
            init_kind=[a["init_kind"] for a in attrs],
            init_p0=[a["init_p0"] for a in attrs],
            init_p1=[a["init_p1"] for a in attrs],
            init_seed=[a["init_seed"] for a in attrs],
        )
        for k, i in enumerate(indices):
            out[i] = (result[0][k], result[1][k], result[2][k])
    return out


def step_qualifies(opt, rule) -> bool:
    """Whether this step of `opt` (whose Rule is `rule`) can take it: not
    when it clips or scales the loss, nor Ftrl with a learning_rate_power
    other than -0.5 (the kernel's power is a square root, see
    optimizer_rules.ftrl_power)."""
    if not enabled or rule.name not in _KERNEL_RULES:
        return False
    if rule.name == "Ftrl" and optimizer_rules.ftrl_power(opt) is not tf.sqrt:
        return False
    return all(
        hp(opt, name, None) is None for name in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")
    )


def _flags(opt, rule) -> dict:
    name = rule.name
    flags = {"rule": _KERNEL_RULES[name]}
    if name == "SGD":
        flags.update(momentum=float(hp(opt, "momentum", 0.0)) != 0.0, nesterov=bool(hp(opt, "nesterov", False)))
    elif name in ("Adam", "AdamW"):
        flags.update(amsgrad=bool(hp(opt, "amsgrad", False)))
    elif name == "RMSprop":
        flags.update(momentum=float(hp(opt, "momentum", 0.0)) > 0, centered=bool(hp(opt, "centered", False)))
    return flags


def _hyper(opt, rule, lr, compute):
    """The step's scalars (backends/cuckoo/rules.h, Hyper), computed with the
    TensorFlow ops tfde/optimizer_rules.py computes them with."""

    def f(value):
        return tf.cast(value, compute)

    wd = hp(opt, "weight_decay", None)
    head = [lr, f(0.0 if wd is None else wd)]
    name = rule.name
    if name == "SGD":
        rest = [f(float(hp(opt, "momentum", 0.0)))]
    elif name == "Adagrad":
        rest = [f(hp(opt, "epsilon", 1e-7))]
    elif name in ("Adam", "AdamW"):
        t = tf.cast(opt.iterations + 1, compute)
        b1, b2 = f(hp(opt, "beta_1", 0.9)), f(hp(opt, "beta_2", 0.999))
        b1_t, b2_t = tf.pow(b1, t), tf.pow(b2, t)
        alpha = lr * tf.sqrt(1 - b2_t) / (1 - b1_t)
        eps = f(hp(opt, "epsilon", 1e-7))
        if hp(opt, "adaptive_epsilon", False):
            eps = eps * tf.sqrt(1 - b2_t)
        rest = [alpha, 1 - b1, 1 - b2, eps]
    elif name == "RMSprop":
        rho = f(hp(opt, "rho", 0.9))
        rest = [rho, 1 - rho, f(hp(opt, "epsilon", 1e-7)), f(float(hp(opt, "momentum", 0.0)))]
    else:  # Ftrl
        l2 = f(hp(opt, "l2_regularization_strength", 0.0)) + f(hp(opt, "beta", 0.0)) / (2.0 * lr)
        rest = [
            f(0.0),  # unused: the power is -0.5 (step_qualifies)
            f(hp(opt, "l1_regularization_strength", 0.0)),
            2 * l2,
            2 * f(hp(opt, "l2_shrinkage_regularization_strength", 0.0)),
            f(0.0),
        ]
    return tf.stack(head + rest)


def group_key(part: Part):
    """Parts with the same key are written by one op (on Redis: one op each,
    in one group)."""
    var = part.var
    return (id(var._write_section), var.key_dtype, var.value_dtype, _on_redis(var))


def apply(opt, rule, parts: List[Part], lr, keys: Optional[list] = None, step=None) -> List[tf.Tensor]:
    """One TfdeTableApply op writing `parts` (one group_key; their slot
    Variables exist), or on Redis one TfdeRedisApply per part; `keys`: the
    parts' keys as the write section hands them (default: part.keys);
    `step`: the training step's number, which a Redis write carries
    (tfde.variable.training_step).  Returns the keys written per part (int64
    scalars)."""
    if _on_redis(parts[0].var):
        keys = keys if keys is not None else [p.keys for p in parts]
        return [_apply_redis(opt, rule, p, lr, k, step) for p, k in zip(parts, keys)]
    var0 = parts[0].var
    compute = optimizer_rules.compute_dtype(var0.value_dtype)
    slots = rule.slots(opt)
    kinds, p0, p1, seeds, defaults = [], [], [], [], []
    for p in parts:
        missing = p.var._missing(p.keys, for_update=True) if p.defaults is None else None
        if p.defaults is not None or not isinstance(missing, _init.InitSpec):
            rows = p.defaults if p.defaults is not None else missing
            defaults.append(tf.cast(rows, var0.value_dtype))
            kinds.append("defaults")
            p0.append(0.0), p1.append(0.0), seeds.append(0)
        else:
            defaults.append(tf.zeros([0, p.var.dim], var0.value_dtype))
            attrs = missing.attrs()
            kinds.append(attrs["init_kind"]), p0.append(attrs["init_p0"]), p1.append(attrs["init_p1"])
            seeds.append(attrs["init_seed"])
    slot_tables = [p.var.slot(name, init)._train_tables()[0].resource_handle for p in parts for name, init in slots]
    # The restrict policies' state, written with the rows (the Python path's
    # Variable._step_state), and their on_apply after: `iterations` is the
    # optimizer's count before the step, as there.
    iterations = tf.identity(opt.iterations)
    states = [(i, p.var.restrict_policy) for i, p in enumerate(parts) if p.var.restrict_policy is not None]
    fused_states = [policy.fused_state() for _, policy in states]
    values = [tf.cast(policy.fused_state_value(iterations), tf.float64) for _, policy in states]
    written = _native.load().tfde_table_apply(
        tables=[p.var._train_tables()[0].resource_handle for p in parts],
        slot_tables=slot_tables,
        keys=keys if keys is not None else [p.keys for p in parts],
        indices=[tf.cast(p.indices, tf.int32) for p in parts],
        grads=[tf.cast(p.values, compute) for p in parts],
        defaults=defaults,
        hyper=_hyper(opt, rule, tf.cast(lr, compute), compute),
        slot_init=[float(init) for _, init in slots],
        decay=[bool(p.decay) for p in parts],
        init_kind=kinds,
        init_p0=p0,
        init_p1=p1,
        init_seed=seeds,
        state_tables=[slot._train_tables()[0].resource_handle for slot, _, _ in fused_states],
        state_values=tf.stack(values) if values else tf.zeros([0], tf.float64),
        state_part=[i for i, _ in states],
        state_mode=[mode for _, mode, _ in fused_states],
        state_init=[float(init) for _, _, init in fused_states],
        **_flags(opt, rule),
    )
    with tf.control_dependencies(written):
        after = [op for i, _ in states for op in parts[i].var._after_update(parts[i].keys, iterations)]
    if not after:
        return written
    with tf.control_dependencies(after):
        return [tf.identity(w) for w in written]


def _apply_redis(opt, rule, part: Part, lr, keys, step) -> tf.Tensor:
    """The fused step of one Variable on Redis (RedisTable.apply_step): its
    part's keys are distinct and its gradients summed per key (the
    optimizer's prepared gradients), so `indices` is 0..n-1; `step`: the
    training step's number (tfde.variable.training_step)."""
    var = part.var
    if part.defaults is not None:
        raise ValueError(f"the fused step on Redis takes summed gradients; {var.name!r} came with step-buffer rows")
    compute = optimizer_rules.compute_dtype(var.value_dtype)
    slots = rule.slots(opt)
    table = var._train_tables()[0]
    # The restrict policy's state, written with the rows, and its on_apply
    # after (as in `apply`).
    iterations = tf.identity(opt.iterations)
    policy = var.restrict_policy
    state = None
    if policy is not None:
        slot, mode, init = policy.fused_state()
        state = (slot._train_tables()[0], mode, init, policy.fused_state_value(iterations))
    written = table.apply_step(
        keys,
        tf.cast(part.values, compute),
        var._missing(part.keys, for_update=True),
        [var.slot(name, init)._train_tables()[0] for name, init in slots],
        step,
        _hyper(opt, rule, tf.cast(lr, compute), compute),
        state=state,
        slot_init=[float(init) for _, init in slots],
        decay=bool(part.decay),
        **_flags(opt, rule),
    )
    if policy is None:
        return written
    with tf.control_dependencies([written]):
        after = var._after_update(keys, iterations)
    if not after:
        return written
    with tf.control_dependencies(after):
        return tf.identity(written)
