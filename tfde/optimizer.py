"""DynamicEmbeddingOptimizer: lets a Keras optimizer train tfde Variables.

``tfde.DynamicEmbeddingOptimizer(opt)`` returns `opt` itself, upgraded in
place (its class becomes a subclass of its own class), so
``model.compile(optimizer=...)``, isinstance checks, hyperparameters,
learning-rate schedules, ``iterations`` and serialization of the dense part
behave as before.  On ``apply_gradients`` it splits the pairs:

* gradients of tfde step buffers (tfde.Variable.step_buffer) are mapped back
  to keys, summed per key, clipped like the optimizer clips, and applied
  lazily to the touched rows with the optimizer's own formula
  (tfde/optimizer_rules.py); rows and optimizer slots are read from and
  written back to the Variable's store, and the step buffer is emptied;
* every other pair goes to the wrapped optimizer unchanged.

The rows' update runs in one native op per layer where the Variables and
the step allow it (tfde/step_kernels.py: the fused step), else through the
TensorFlow ops below (the Python path, the reference); both store the same
rows and slots.

Rows whose gradient contains NaN or Inf are left unchanged, slots included
(the rest of the batch is applied), so a bad batch never corrupts a table.
Supported: SGD (momentum, nesterov), Adagrad, Adam (amsgrad), AdamW, RMSprop
(momentum, centered), Ftrl — from Keras 3 and tf-keras; clipnorm, clipvalue,
global_clipnorm and weight_decay are honoured.  EMA and gradient accumulation
are rejected.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import tensorflow as tf

from tfde import exchange as _exchange
from tfde import semi_sync as _semi_sync
from tfde import step_kernels
from tfde.errors import ConfigError, UnsupportedOptimizerError
from tfde.flavour import flavour_fix, keras_flavour_name
from tfde.optimizer_rules import RULES, compute_dtype, hp
from tfde.optimizer_rules import rule_for as _rule_for
from tfde.saving import registered as _registered
from tfde.tables.base import require
from tfde.variable import exclusively, is_step_buffer, next_training_step, training_step


def _check_options(opt):
    if hp(opt, "use_ema", False):
        raise UnsupportedOptimizerError(
            "use_ema=True is not supported with tfde Variables (an EMA of a dynamic table would need a copy of "
            "every row); create the optimizer with use_ema=False"
        )
    if hp(opt, "gradient_accumulation_steps", None):
        raise UnsupportedOptimizerError(
            "gradient_accumulation_steps is not supported with tfde Variables; use a larger batch instead"
        )


def current_learning_rate(opt):
    """The learning rate for this step (schedules evaluated at iterations)."""
    if hasattr(opt, "_get_current_learning_rate"):  # Keras 3
        return opt._get_current_learning_rate()
    lr = getattr(opt, "_learning_rate", None)
    if lr is not None and callable(lr) and not isinstance(lr, tf.Variable):
        return lr(opt.iterations)  # tf-keras LearningRateSchedule
    return opt.learning_rate


class _SparseGrad:
    """The deduplicated gradient of one Variable for this step."""

    def __init__(self, var, keys, grads):
        self.var, self.keys, self.grads = var, keys, grads


# Optimizer config keys that only the other Keras writes, by the major
# version of the Keras running: tf-keras (2) reading Keras 3's, and Keras 3
# reading tf-keras's (DynamicEmbeddingMixin.from_config).
_OTHER_KERAS_OPTIMIZER_KEYS = {
    2: frozenset({"loss_scale_factor", "gradient_accumulation_steps"}),
    3: frozenset({"is_legacy_optimizer", "jit_compile"}),
}


class DynamicEmbeddingMixin:
    """Methods mixed into the optimizer's class by DynamicEmbeddingOptimizer."""

    @property
    def _tfde_rule(self):
        # Computed, not stored: an optimizer that wraps this one (a
        # distributed engine's) may rebuild it from its config, which
        # carries no tfde attributes.
        return _rule_for(self)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # A saved model's compile config names this class (see
        # _register_serializable) under either Keras; a config written by
        # the other Keras would fail in the base class with "Argument(s) not
        # recognized", so it is refused here naming the Keras that wrote it.
        # By the Keras classes in the MRO, not cls itself: a distributed
        # engine's optimizer may subclass this class in a module of its own.
        running = 2 if any(c.__module__.startswith("tf_keras") for c in cls.__mro__) else 3
        other = _OTHER_KERAS_OPTIMIZER_KEYS[running].intersection(config)
        if other:
            saved = 5 - running
            raise ConfigError(
                f"the config of optimizer {config.get('name')!r} was written by {keras_flavour_name(saved)} (it "
                f"has {', '.join(sorted(other))}), but this process runs {keras_flavour_name(running)}; "
                f"{flavour_fix(saved)}"
            )
        return super().from_config(config, custom_objects=custom_objects)

    def build(self, var_list, *args, **kwargs):
        return super().build([v for v in var_list if not is_step_buffer(v)], *args, **kwargs)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # TF checkpoints of the optimizer also record which slots it keeps
        # for tfde rows, so that restoring another optimizer's checkpoint is
        # refused before it changes anything (tfde/saving/registered.py).
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "checkpoint":
            children = {**children, _registered.OPTIMIZER_SLOTS: _registered.optimizer_slots(self)}
        return children

    def compute_gradients(self, loss, var_list, tape=None):  # tf-keras; an engine's optimizer may wrap this
        _exchange.current().register_step_buffers(self, var_list)
        return super().compute_gradients(loss, var_list, tape)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if not any(is_step_buffer(v) for _, v in grads_and_vars):
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        dense, ready = self._tfde_apply_sparse(self._tfde_engine_gradients(grads_and_vars))
        if _semi_sync.local_steps_on() and "skip_gradients_aggregation" in _parameters(super().apply_gradients):
            # tf-keras under tf.distribute: a local step updates this
            # worker's dense weights with its own gradients (tfde/semi_sync.py).
            kwargs["skip_gradients_aggregation"] = True
        with tf.control_dependencies(ready):
            if dense:
                return super().apply_gradients(dense, *args, **kwargs)
            return self._iterations.assign_add(1)

    def _all_reduce_sum_gradients(self, grads_and_vars):  # Keras 3 under tf.distribute
        # A local step of semi-synchronous training updates this worker's
        # dense weights with its own gradients (tfde/semi_sync.py).
        if _semi_sync.local_steps_on():
            return list(grads_and_vars)
        return super()._all_reduce_sum_gradients(grads_and_vars)

    def apply(self, grads, trainable_variables=None):  # Keras 3's entry point
        if trainable_variables is None or not any(is_step_buffer(v) for v in trainable_variables):
            return super().apply(grads, trainable_variables)
        dense, ready = self._tfde_apply_sparse(self._tfde_engine_gradients(list(zip(grads, trainable_variables))))
        with tf.control_dependencies(ready):
            if dense:
                return super().apply([g for g, _ in dense], [v for _, v in dense])
            return self._iterations.assign_add(1)

    def _tfde_engine_gradients(self, grads_and_vars):
        """The pairs with the dense gradients averaged over the workers when
        the engine left that to the optimizer (Exchange.prepare_gradients),
        so that a step is exact whatever calls apply_gradients: Keras's
        default train_step (through minimize and compute_gradients, where an
        engine's optimizer wrapper may average), tfrs.Model.train_step or a
        custom step (tape.gradient, then apply_gradients directly)."""
        return _exchange.current().prepare_gradients(self, grads_and_vars)

    def _tfde_apply_sparse(self, grads_and_vars):
        """Applies the step-buffer pairs; returns (dense pairs, possibly
        rescaled by global_clipnorm, and the ops the dense update must follow)."""
        sparse = [(g, v) for g, v in grads_and_vars if is_step_buffer(v)]
        dense = [(g, v) for g, v in grads_and_vars if not is_step_buffer(v)]
        rule = self._tfde_rule
        fused = step_kernels.step_qualifies(self, rule)
        ex = _exchange.active()
        # Alone, a qualifying cuckoo Variable's buffer gradient goes to the
        # fused kernel as it is: the kernel sums it per key
        # (tfde/step_kernels.py); a Redis one's comes summed (prepared).
        # (Not when the exchange scales the gradients: semi-synchronous
        # training's local steps under tf.distribute, tfde/semi_sync.py.)
        alone = not ex.collective and ex.gradient_scale(self) == 1.0
        direct = [] if not alone or not fused else [(g, v._tfde_variable) for g, v in sparse if g is not None]
        direct = [
            (g, var) for g, var in direct if step_kernels.qualifies(var) and step_kernels.takes_buffer_gradients(var)
        ]
        taken = {id(var) for _, var in direct}
        prepared = self._tfde_prepare_all(
            [(g, v._tfde_variable) for g, v in sparse if id(v._tfde_variable) not in taken]
        )
        scales = self._tfde_global_clip_scale(prepared, dense)
        if scales is not None:
            rows_scale, dense_scale = scales
            for p in prepared:
                p.grads = p.grads * tf.cast(rows_scale, p.grads.dtype)
            dense = [(None if g is None else _scale_grad(g, dense_scale), v) for g, v in dense]
        parts = [self._tfde_direct_part(g, var) for g, var in direct]
        python = []
        for p in prepared:
            if fused and step_kernels.qualifies(p.var):
                indices = tf.range(tf.size(p.keys, out_type=tf.int32))
                parts.append(step_kernels.Part(p.var, p.keys, indices, p.grads, None, self._tfde_decays(p.var)))
            else:
                python.append(p)
        # The step buffers are emptied once their keys, gradients and rows
        # are read, before the writes: a step whose writes fail (the error
        # leaves apply_gradients; nothing of a key was written, see
        # _tfde_python_write) leaves them empty too, so the next step, or the
        # same batch again, starts clean.
        read = [t for p in python for t in (p.keys, p.grads)]
        read += [
            t for p in parts for t in (p.keys, p.indices, p.values) + ((p.defaults,) if p.defaults is not None else ())
        ]
        with tf.control_dependencies(read):
            resets = [v._tfde_variable._reset_step_buffer() for _, v in sparse]
        with tf.control_dependencies(resets):
            updates = self._tfde_write(rule, parts, [self._tfde_python_write(p) for p in python])
        # The step is done once every write succeeded: a step that failed
        # keeps its number, so running it again reads what its first attempt
        # read (Table.find_to_update's step).
        with tf.control_dependencies(updates):
            updates.append(next_training_step())
        return dense, updates

    def _tfde_direct_part(self, grad, var):
        """The fused step's Part of a Variable trained alone: its step
        buffer's keys and rows, and the buffer's gradient as it is."""
        compute = compute_dtype(var.value_dtype)
        if isinstance(grad, tf.IndexedSlices):
            indices, values = grad.indices, grad.values
        else:
            values = tf.convert_to_tensor(grad)
            indices = tf.range(tf.shape(values)[0])
        values = tf.ensure_shape(tf.cast(values, compute), [None, var.dim])
        values = _fitting_the_step(var, grad, indices, values)
        keys, rows = var._keys_buffer.read_value(), var._rows_buffer.read_value()
        return step_kernels.Part(var, keys, tf.cast(indices, tf.int32), values, rows, self._tfde_decays(var))

    def _tfde_decays(self, var) -> bool:
        return hp(self, "weight_decay", None) is not None and self._tfde_use_weight_decay(var)

    def _tfde_write(self, rule, parts, python_jobs):
        """Writes the step: the fused parts (one op per group of
        step_kernels.group_key) and the Python path's jobs, each write
        section entered once with everything it guards (Variables of one
        DistributedEmbedding share one section).  Returns the ops."""
        by_section = {}
        for var, job in python_jobs:
            by_section.setdefault(id(var._write_section), (var._write_section, []))[1].append(job)
        groups = {}
        for p in parts:
            for name, init in rule.slots(self):
                p.var.slot(name, init)  # made now, outside the write section
            groups.setdefault(step_kernels.group_key(p), []).append(p)
        lr = current_learning_rate(self)
        for group in groups.values():
            section = group[0].var._write_section

            def fused(keys, group=group):
                written = step_kernels.apply(self, rule, group, lr, keys, step=training_step())
                return tf.add_n(written), written

            by_section.setdefault(id(section), (section, []))[1].append(([p.keys for p in group], fused))
        updates = []
        for section, jobs in by_section.values():
            updates.extend(exclusively(section, jobs))
        return updates

    # ---------------------------------------------------------------- internals

    def _tfde_prepare_all(self, pairs):
        """_SparseGrads of the (gradient, Variable) pairs: every worker's
        gradients reach each key's owner, for all Variables in one call of
        the exchange (Exchange.owner_gradients_many: its collectives do not
        grow with the number of Variables), then scaled and clipped."""
        ex = _exchange.active()
        if ex.collective and pairs and hp(self, "global_clipnorm", None) is not None:
            raise UnsupportedOptimizerError(
                "global_clipnorm is not supported in distributed training with tfde Variables yet; use "
                "clipnorm or clipvalue"
            )
        taken, parts = [], []
        for grad, var in pairs:
            if grad is None:
                if not ex.collective:
                    continue
                # Another worker may have a gradient for this Variable: take
                # part in the exchange with zeros.
                grad = tf.zeros([var._step_size(), var.dim], var.value_dtype)
            if isinstance(grad, tf.IndexedSlices):
                indices, values = grad.indices, grad.values
            else:
                values = tf.convert_to_tensor(grad)
                indices = tf.range(tf.shape(values)[0])
            compute = compute_dtype(var.value_dtype)
            values = tf.ensure_shape(tf.cast(values, compute), [None, var.dim])
            values = _fitting_the_step(var, grad, indices, values)
            taken.append(var)
            parts.append(_exchange.Gradient(var._keys_buffer.read_value(), indices, values, var.placement))
        if not parts:
            return []
        return [self._tfde_finish(var, *owned) for var, owned in zip(taken, ex.owner_gradients_many(parts))]

    def _tfde_finish(self, var, unique, summed):
        """The _SparseGrad of `var` from the keys it owns and their summed
        gradients: the engine's scale, loss scaling, clipping."""
        ex = _exchange.active()
        compute = summed.dtype
        factor = ex.gradient_scale(self)
        if factor != 1.0:
            summed = summed * tf.cast(factor, compute)
        scale = hp(self, "loss_scale_factor", None)
        if scale is not None:
            summed = summed / tf.cast(scale, compute)
        clipnorm, clipvalue = hp(self, "clipnorm", None), hp(self, "clipvalue", None)
        if clipnorm is not None or clipvalue is not None:
            # Rows whose gradient holds NaN or Inf are skipped (see the module
            # docstring): so clipping measures, and changes, the finite rows
            # only, and leaves the others non-finite for _tfde_python_write to
            # skip.  (One NaN row would make the norm NaN; tf.clip_by_norm
            # then passes every row through unclipped, and clip_by_value
            # would turn an Inf row into a finite, trained one.)
            finite = _finite_rows(summed)
            clipped = tf.where(finite, summed, tf.zeros_like(summed))
            if clipnorm is not None:
                clipped = tf.clip_by_norm(clipped, tf.cast(clipnorm, compute))
            if clipvalue is not None:
                clipped = tf.clip_by_value(clipped, -tf.cast(clipvalue, compute), tf.cast(clipvalue, compute))
            summed = tf.where(finite, clipped, summed)
        return _SparseGrad(var, unique, summed)

    def _tfde_global_clip_scale(self, prepared, dense):
        """(scale of the rows' gradients, scale of the dense gradients) for
        global_clipnorm, or None.  The global norm is taken over the finite
        rows of the tfde gradients (non-finite rows are skipped, see
        _tfde_finish) and over the dense gradients.  A non-finite dense
        gradient makes the dense scale NaN, as Keras's own clipping does
        (the dense part keeps Keras's behaviour); the rows are then scaled
        by the norm of the finite gradients, dense ones included, and still
        trained.  When everything is finite the two scales are one."""
        clip = hp(self, "global_clipnorm", None)
        if clip is None:
            return None
        rows_sq = [_sum_of_squares(tf.where(_finite_rows(p.grads), p.grads, tf.zeros_like(p.grads))) for p in prepared]
        dense_sq = [
            _sum_of_squares(g.values if isinstance(g, tf.IndexedSlices) else g) for g, _ in dense if g is not None
        ]
        if not rows_sq and not dense_sq:
            return None
        rows_total = tf.add_n(rows_sq) if rows_sq else tf.constant(0.0)
        finite_dense = [tf.where(tf.math.is_finite(sq), sq, 0.0) for sq in dense_sq]
        clip = tf.cast(clip, tf.float32)

        def scale(sum_sq):
            return tf.minimum(1.0, clip / tf.maximum(tf.sqrt(sum_sq), 1e-12))

        if not dense_sq:
            return (scale(rows_total),) * 2
        return scale(rows_total + tf.add_n(finite_dense)), scale(rows_total + tf.add_n(dense_sq))

    def _tfde_python_write(self, p: _SparseGrad):
        """(Variable, write-section job) of the Python path: the new rows and
        slots of `p` are computed here, outside the section; the job writes
        them (tfde.variable.exclusively)."""
        var, rule = p.var, self._tfde_rule
        # One read of the step's rows serves the admission decision (which
        # keys are stored) and the update.
        all_rows, stored = var._find(p.keys, for_update=True)
        keep = tf.reduce_all(tf.math.is_finite(p.grads), axis=1)
        if var.admission_filter is not None:
            keep = keep & var.admission_filter.admit(p.keys, stored)
        keys = tf.boolean_mask(p.keys, keep)
        g = tf.boolean_mask(p.grads, keep)
        compute = g.dtype
        rows = tf.cast(tf.boolean_mask(all_rows, keep), compute)
        slot_vars = {name: var.slot(name, init) for name, init in rule.slots(self)}
        slots = {name: tf.cast(s._find(keys, for_update=True)[0], compute) for name, s in slot_vars.items()}
        lr = tf.cast(current_learning_rate(self), compute)
        t = tf.cast(self.iterations + 1, compute)
        wd = hp(self, "weight_decay", None)
        if wd is not None and self._tfde_use_weight_decay(var):
            rows = rows - rows * tf.cast(wd, compute) * lr
        new_rows, new_slots = rule.update(self, rows, g, slots, lr, t)
        new_rows = tf.cast(new_rows, var.value_dtype)
        new_slots = {name: tf.cast(value, var.value_dtype) for name, value in new_slots.items()}
        step = tf.identity(self.iterations)

        def write(ordered_keys):
            # A key's row, optimizer slots and policy state are one write per
            # shard (Variable._write_step: Table.insert_with), so a failed
            # step leaves every key with all of them or none, and it is made
            # in the Variable's write section, so a concurrent removal
            # (restrict) sees a key in all of its tables or in none.
            (keys,) = ordered_keys
            values = {slot_vars[name]: value for name, value in new_slots.items()}
            values.update(var._step_state(keys, step))
            ops = var._write_step(keys, new_rows, values)
            with tf.control_dependencies(ops):
                ops.extend(var._after_update(keys, step))
            return tf.size(keys), ops

        return var, ([keys], write)

    def _tfde_use_weight_decay(self, var) -> bool:
        try:
            return bool(self._use_weight_decay(var.step_buffer))
        except Exception:  # exclusion lists that cannot judge a raw tf.Variable
            return True


def _parameters(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return frozenset()


def _finite_rows(grads):
    """[n, 1] bool: whether each row of `grads` ([n, dim]) is all finite."""
    return tf.reduce_all(tf.math.is_finite(grads), axis=1, keepdims=True)


def _sum_of_squares(g):
    """Sum of the squared entries of `g`, float32 scalar (squared in float32,
    so float16 gradients do not overflow)."""
    g = tf.cast(g, tf.float32)
    return tf.reduce_sum(g * g)


def _fitting_the_step(var, grad, indices, values):
    """`values`, once the gradient is known to fit `var`'s step buffer: a
    row per key this step looked up (or IndexedSlices indices among them).
    Checked before the buffer is read and emptied, so a gradient of another
    shape changes nothing and the right one can still be applied: eagerly
    a ShapeError, in a graph an assert naming the table."""
    size = var._step_size()
    if isinstance(grad, tf.IndexedSlices):
        indices = tf.cast(indices, tf.int32)
        fits = tf.logical_and(
            tf.equal(tf.shape(values)[0], tf.size(indices)),
            tf.reduce_all(tf.logical_and(indices >= 0, indices < size)),
        )
        seen = "indices outside (or values not one per index of)"
    else:
        fits = tf.equal(tf.shape(values)[0], size)
        seen = "another number of rows than"
    checks = require(
        fits,
        f"the gradient of {var.name!r}'s step buffer has {seen} the keys this step looked up; pass the "
        "gradients tape.gradient returned for the model's trainable variables, unchanged in shape",
        {"gradient rows": tf.shape(values)[0], "keys": size},
    )
    if not checks:
        return values
    with tf.control_dependencies(checks):
        return tf.identity(values)


def _scale_grad(g, scale):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(scale, g.dtype)


_classes = {}


def _wrapped_class(base):
    if base not in _classes:
        cls = type(
            base.__name__,
            (DynamicEmbeddingMixin, base),
            {
                "__module__": base.__module__,
                "__doc__": f"{base.__name__} that also trains tfde Variables (see tfde.DynamicEmbeddingOptimizer).",
            },
        )
        _classes[base] = _register_serializable(cls, base)
    return _classes[base]


def _register_serializable(cls, base):
    """Registers the wrapped class with the Keras `base` comes from, as
    "tfde>DynamicEmbedding<Name>": a saved model's compile config then names
    it, and keras.models.load_model rebuilds a tfde optimizer, not a plain
    one (tfde.keras registers every supported class when imported)."""
    name = f"DynamicEmbedding{base.__name__}"
    try:
        if base.__module__.startswith("tf_keras"):
            import tf_keras as keras_module
        elif base.__module__.startswith("keras"):
            import keras as keras_module
        else:
            return cls  # a user subclass outside Keras: serialized as its base
        return keras_module.saving.register_keras_serializable(package="tfde", name=name)(cls)
    except (ImportError, AttributeError):  # pragma: no cover - Keras without a saving API
        return cls


def refuse_plain_optimizers(optimizers_module) -> None:
    """Makes a Keras optimizer that is not wrapped by
    DynamicEmbeddingOptimizer refuse, when it is first built, to train a
    tfde step buffer, with an error naming the wrapper.  Without this, the
    mistake (e.g. model.compile() with Keras's default optimizer) surfaces as
    an error about the buffer's unknown first dimension, or under
    MultiWorkerMirroredStrategy as "`colocate_vars_with` must only be passed
    a variable created in this tf.distribute.Strategy.scope()".  Patches the
    root build() of the Keras's optimizers (every optimizer's build calls it
    first); DynamicEmbeddingMixin.build leaves step buffers out before."""
    roots = [c for c in type.mro(optimizers_module.Optimizer) if "build" in vars(c)]
    if not roots:  # pragma: no cover - a Keras without build()
        return
    root = roots[-1]
    original = vars(root)["build"]
    if getattr(original, "_tfde_checked", False):
        return

    def build(self, var_list, *args, **kwargs):
        inner = getattr(self, "inner_optimizer", None)  # LossScaleOptimizer builds its inner one with the same list
        if not isinstance(self, DynamicEmbeddingMixin) and not isinstance(inner, DynamicEmbeddingMixin):
            tables = sorted({v._tfde_variable.name for v in var_list if is_step_buffer(v)})
            if tables:
                name = type(self).__name__
                raise UnsupportedOptimizerError(
                    f"the optimizer {name} is asked to train the tfde embedding table(s) {', '.join(tables)}, but "
                    "it is not wrapped by tfde.DynamicEmbeddingOptimizer, which alone can update table rows. "
                    f"Compile with model.compile(optimizer=tfde.DynamicEmbeddingOptimizer("
                    f"tf.keras.optimizers.{name}(...)), ...) (model.compile() without an optimizer uses a plain "
                    "RMSprop)"
                    + _unused_wrapper_hint(self)
                    + "".join(f"; {hint}" for hint in _exchange.wrapping_hints())
                )
        return original(self, var_list, *args, **kwargs)

    build._tfde_checked = True
    build.__wrapped__ = original
    build.__doc__ = original.__doc__
    setattr(root, "build", build)


# Every optimizer DynamicEmbeddingOptimizer upgraded in this process: the
# refusal of an unwrapped one says when the program made one it did not pass.
_upgraded = weakref.WeakSet()


def _unused_wrapper_hint(refused) -> str:
    """ "; this program made ..." when a tfde optimizer other than `refused`
    exists (TFRA's MWMS program builds one and calls model.compile() without
    it), else ""."""
    made = sorted({type(o).__name__ for o in list(_upgraded) if o is not refused})
    if not made:
        return ""
    return (
        f"; this program made tfde.DynamicEmbeddingOptimizer({' / '.join(made)}), which does not train these "
        "tables: if it was meant to, pass that optimizer, e.g. model.compile(optimizer=optimizer, ...)"
    )


def register_keras_optimizers(optimizers_module) -> None:
    """Wraps (and so registers) every supported optimizer class of a Keras
    optimizers module, so that loading a saved model finds them."""
    for name in RULES:
        base = getattr(optimizers_module, name, None)
        if isinstance(base, type):
            _wrapped_class(base)


def DynamicEmbeddingOptimizer(optimizer: Any) -> Any:
    """Returns `optimizer`, upgraded in place to also train tfde Variables.

    Args:
      optimizer: a Keras 3 (``keras.optimizers.*``) or tf-keras
        (``tf_keras.optimizers.*``) SGD, Adagrad, Adam, AdamW, RMSprop or Ftrl.

    Raises:
      UnsupportedOptimizerError: for any other optimizer (the message lists
        the supported ones), legacy tf-keras optimizers, EMA or gradient
        accumulation.

    Example:
      >>> opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01))
      >>> isinstance(opt, tf.keras.optimizers.Adam)
      True
    """
    if isinstance(optimizer, DynamicEmbeddingMixin):
        return optimizer
    _exchange.check_optimizer(optimizer)  # an engine's own wrapper must come outside
    _rule_for(optimizer)
    _check_options(optimizer)
    optimizer.__class__ = _wrapped_class(type(optimizer))
    _upgraded.add(optimizer)
    return optimizer
