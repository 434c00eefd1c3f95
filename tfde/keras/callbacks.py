"""Keras callbacks of tfde: RestrictCallback (restrict policies during
model.fit), ModelCheckpoint (atomic, per-worker checkpoints) and
PeriodicSync (semi-synchronous training)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Optional, Sequence, Union

import tensorflow as tf

from tfde import semi_sync
from tfde.errors import ConfigError
from tfde.policy import AutoRestrictor
from tfde.saving import CheckpointManager
from tfde.variable import model_variables


def _policy_variables(model) -> list:
    """Variables with a restrict policy of every tfde layer in `model`."""
    return [v for v in model_variables(model) if v.restrict_policy is not None]


class RestrictCallback(tf.keras.callbacks.Callback):
    """Applies restrict policies during model.fit, so nobody has to remember
    to: after every training batch, tfde.AutoRestrictor.after_step with the
    optimizer's iteration count.

    Args: as tfde.AutoRestrictor; variables default to every tfde layer of
    the model that has a restrict policy.

    Example:
      >>> model.fit(data, callbacks=[tfde.keras.callbacks.RestrictCallback(max_size=1_000_000)])
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        max_size: Optional[int] = None,
        num_reserved: Optional[int] = None,
        variables: Optional[Sequence[Any]] = None,
    ) -> None:
        super().__init__()
        self._args = dict(every_n_steps=every_n_steps, max_size=max_size, num_reserved=num_reserved)
        self._variables = variables
        self.restrictor = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        variables = self._variables if self._variables is not None else _policy_variables(self.model)
        if not variables:
            raise ConfigError(
                "RestrictCallback found no tfde layer with a restrict_policy in the model; give the "
                "layers one (e.g. restrict_policy=tfde.FrequencyRestrictPolicy) or pass variables="
            )
        self.restrictor = AutoRestrictor(variables, **self._args)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.restrictor.after_step(int(self.model.optimizer.iterations.numpy()))


class ModelCheckpoint(tf.keras.callbacks.Callback):
    """Saves the model, its optimizer and every tfde Variable during
    model.fit with tfde.saving.CheckpointManager: each worker of a
    distributed job writes its own files; saves are atomic; the last
    `max_to_keep` are kept.  With restore=True, training starts from the
    latest checkpoint in `directory` when there is one (and from scratch
    otherwise), so a restarted job resumes where it stopped.

    Args:
      directory: where checkpoints go (see tfde.saving.CheckpointManager).
      save_freq: "epoch" (after every epoch) or an int: every that many
        training steps.
      max_to_keep: checkpoints kept (None: all).
      restore: restore the latest checkpoint when training begins.

    Example:
      >>> model.fit(data, epochs=3, callbacks=[tfde.keras.callbacks.ModelCheckpoint("ckpts", save_freq=1000)])
    """

    def __init__(
        self,
        directory: str,
        save_freq: Union[str, int] = "epoch",
        max_to_keep: Optional[int] = 5,
        restore: bool = False,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ConfigError(f"save_freq must be 'epoch' or an int >= 1 (steps), got {save_freq!r}")
        self.directory, self.save_freq, self.max_to_keep, self.restore = directory, save_freq, max_to_keep, restore
        self.manager = None
        self.restored_from = None

    def _manager(self):
        if self.manager is None:
            strategy = getattr(self.model, "distribute_strategy", None)
            if strategy is not None and strategy.num_replicas_in_sync <= 1:
                strategy = None
            self.manager = CheckpointManager(
                self.directory,
                max_to_keep=self.max_to_keep,
                strategy=strategy,
                model=self.model,
                optimizer=self.model.optimizer,
            )
        return self.manager

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.restore:
            self.restored_from = self._manager().restore()

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.save_freq != "epoch":
            step = int(self.model.optimizer.iterations.numpy())
            if step % self.save_freq == 0:
                self._manager().save(step)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self.save_freq == "epoch":
            self._manager().save()


class PeriodicSync(tf.keras.callbacks.Callback):
    """Semi-synchronous training during model.fit: the workers train apart
    and sync every `every` steps (tfde.semi_sync.PeriodicSync;
    docs/semi-sync.md).  every=1 is exact synchronous training: the callback
    then does nothing.

    Every trainable tfde Variable of the model takes local steps, and all
    of the model's dense weights are averaged at each sync.  Validation
    during fit (validation_data) syncs first, and each epoch's end syncs
    (a callback after this one that saves sees synced stores).  The step
    function is traced again when training begins and ends, so a later fit
    without the callback is exact again.  With steps_per_execution > 1 a
    sync comes after the first batch end at least `every` steps after the
    last one.  Under MultiWorkerMirroredStrategy each step's logs are its
    worker's own and each epoch's logs exact training's (docs/semi-sync.md,
    "Logs between syncs"): put this callback before those that read them.

    Args:
      every: steps between syncs (int >= 1).
      replicate: each worker keeps a copy of the tables sharded over the
        workers between syncs, so lookups run no collective between syncs
        (tfde.semi_sync.PeriodicSync's replicate).

    Example:
      >>> model.fit(data, callbacks=[tfde.keras.callbacks.PeriodicSync(every=16)])
    """

    def __init__(self, every: int, replicate: bool = False) -> None:
        super().__init__()
        self.every = semi_sync.every_arg(every)
        if not isinstance(replicate, bool):
            raise ConfigError(f"replicate must be True or False, got {replicate!r}")
        self.replicate = replicate
        self.sync = None
        self._last = 0
        self._logs = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.every == 1:
            return
        stale = semi_sync.running()
        if stale is not None and getattr(stale, "_from_keras_callback", False):
            # Keras does not end a fit that raised: what it left on goes,
            # without a sync (its deltas are lost, as the failure's).
            stale.abort()
        model = self.model
        _LocalLogs.remove(model)  # what a fit that raised left on the model
        variables = [v for v in model_variables(model) if v.trainable]
        if not variables:
            raise ConfigError("PeriodicSync found no trainable tfde Variable in the model; it has nothing to sync")
        strategy = getattr(model, "distribute_strategy", None)

        # The model's weights once its first step built them (PeriodicSync
        # averages the floating ones that are not step buffers).
        def dense():
            return model.weights

        self.sync = semi_sync.PeriodicSync(
            self.every, variables, model.optimizer, dense, strategy=strategy, replicate=self.replicate
        )
        self.sync._from_keras_callback = True
        self.sync.start()
        self._last = int(model.optimizer.iterations.numpy())
        self._logs = _LocalLogs.install(model, strategy)
        model.make_train_function(force=True)  # traced again, with local steps

    def _count(self) -> int:
        """Steps since the last sync (the optimizer's iterations: right with
        steps_per_execution > 1 too), told to the PeriodicSync."""
        step = int(self.model.optimizer.iterations.numpy())
        self.sync.steps = step - self._last
        return step

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.sync is None:
            return
        step = self._count()
        if self.sync.steps >= self.every:
            self.sync.sync()
            self._last = step

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        # A callback after this one may save a checkpoint or export at the
        # end of an epoch (ModelCheckpoint): it reads synced stores.
        if self.sync is not None:
            self._last = self._count()
            self.sync.sync()
            if self._logs is not None and logs is not None:
                # In place: the callbacks after this one and the History see them.
                logs.update(self._logs.exact(logs))

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        # Validation during fit reads the stores: sync first (every worker
        # validates at the same point), so it sees every worker's updates.
        if self.sync is not None:
            self._last = self._count()
            self.sync.sync()

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        if self.sync is None:
            return
        try:
            self._count()
            self.sync.stop()
        finally:
            self.sync = None
            self._logs = None
            _LocalLogs.remove(self.model)
            self.model.train_function = None  # the next fit traces an exact step


class _LocalLogs:
    """The logs of local steps under tf-keras model.fit with
    MultiWorkerMirroredStrategy on several workers (docs/semi-sync.md,
    "Logs between syncs").  tf-keras reads each metric across the workers
    in every step (a collective per metric variable) and reduces the step's
    logs across them (one more): a local step would still wait for every
    worker.  While PeriodicSync runs, each step reports its own worker's
    logs (no collective), and each epoch's end, a sync point, puts back
    the logs exact training reports: every metric read across the workers
    and every value reduced the model's way (distribute_reduction_method)."""

    _ATTRIBUTE = "_tfde_exact_step"

    def __init__(self, model, strategy, method) -> None:
        self.model, self.strategy, self.method = model, strategy, method
        self.step_keys: set = set()  # what the step reports (not what a callback added to the logs)
        self._exact = None

    @classmethod
    def install(cls, model, strategy) -> Optional["_LocalLogs"]:
        """Makes `model`'s next traced step report local logs; None where
        its steps hold no such collective (Horovod, one worker, Keras 3)."""
        tf_keras = sys.modules.get("tf_keras")
        if tf_keras is None or not isinstance(model, tf_keras.Model):
            return None
        if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or strategy.num_replicas_in_sync < 2:
            return None
        original_step = model.__dict__.get("train_step")
        method = model.distribute_reduction_method
        setattr(model, cls._ATTRIBUTE, (original_step, model._distribute_reduction_method))
        step = model.train_step
        logs = cls(model, strategy, method)

        def local_train_step(data):
            with _local_metric_reads():
                outputs = step(data)
            if isinstance(outputs, dict):
                logs.step_keys = set(outputs)
            return outputs

        model.train_step = local_train_step
        model.distribute_reduction_method = "first"  # this worker's logs, not a collective over them
        return logs

    @classmethod
    def remove(cls, model) -> None:
        saved = model.__dict__.pop(cls._ATTRIBUTE, None)
        if saved is None:
            return
        original_step, method = saved
        if original_step is None:
            model.__dict__.pop("train_step", None)
        else:
            model.train_step = original_step
        model._distribute_reduction_method = method

    def exact(self, logs: dict) -> dict:
        """What exact training reports at an epoch's end in place of `logs`
        (this worker's last step).  Where the step reports the model's
        metrics and nothing else, tf-keras itself puts back their results
        read over all workers (nothing to do here); where it reports more (a
        train_step of the model's own, as tfrs.Model's), it keeps the last
        step's logs: every metric's result over all workers and every other
        value, reduced across the workers the model's way."""
        if set(self.model.get_metrics_result()) == self.step_keys:
            return {}
        local = {
            name: tf.constant(value, tf.float32)
            for name, value in logs.items()
            if name in self.step_keys
            and (isinstance(value, (int, float)) or (hasattr(value, "shape") and not value.shape))
        }
        if self._exact is None:
            from tf_keras.src.engine.training import reduce_per_replica

            model, strategy, method = self.model, self.strategy, self.method

            def on_replica(values):
                out = dict(values)
                for metric in model.metrics:
                    result = metric.result()  # read across the workers (tf-keras's result wrapper)
                    out.update(result if isinstance(result, dict) else {metric.name: result})
                return {name: tf.cast(value, tf.float32) for name, value in out.items() if name in values}

            @tf.function
            def exact(values):
                return reduce_per_replica(strategy.run(on_replica, args=(values,)), strategy, method)

            self._exact = exact
        return {name: float(value) for name, value in self._exact(local).items()}


class _Forward:
    """`target` with some attributes replaced."""

    def __init__(self, target, **replaced) -> None:
        self._target, self._replaced = target, replaced

    def __getattr__(self, name: str):
        return self._replaced[name] if name in self._replaced else getattr(self._target, name)


@contextlib.contextmanager
def _local_metric_reads():
    """tf-keras metric results read from this worker's variables alone,
    while a step is traced.  tf-keras's result wrapper reads a metric's
    sync-on-read variables across all replicas (a collective): in
    TensorFlow's sync-on-read context where the strategy needs no merge
    call, in a merge call (cross-replica context) where it does, as
    MultiWorkerMirroredStrategy's step does.  A replica that reads them
    outside both reads its own.  Only the wrapper's module sees the
    change, for the time of the trace (the optimizer's own merge calls
    stay as they are)."""
    from tf_keras.src.utils import metrics_utils

    tf_module = metrics_utils.tf
    distribute = _Forward(
        tf_module.__internal__.distribute,
        strategy_supports_no_merge_call=lambda: True,
        variable_sync_on_read_context=contextlib.nullcontext,
    )
    metrics_utils.tf = _Forward(tf_module, __internal__=_Forward(tf_module.__internal__, distribute=distribute))
    try:
        yield
    finally:
        metrics_utils.tf = tf_module
