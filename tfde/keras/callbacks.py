"""Keras callbacks of tfde: RestrictCallback (restrict policies during
model.fit), ModelCheckpoint (atomic, per-worker checkpoints) and
PeriodicSync (semi-synchronous training)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import tensorflow as tf

from tfde import exchange, semi_sync
from tfde.errors import ConfigError
from tfde.policy import AutoRestrictor, check_schedule
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
        check_schedule(every_n_steps, max_size, num_reserved, "RestrictCallback")  # here, not when fit starts
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
    last one.  Where the engine's step would read metrics across the
    workers, each step's logs are its worker's own and each epoch's logs
    exact training's (docs/semi-sync.md, "Logs between syncs"): put this
    callback before those that read them.

    Args:
      every: steps between syncs (int >= 1).
      replicate: each worker keeps a copy of the tables sharded over the
        workers between syncs, so lookups run no collective between syncs
        (tfde.semi_sync.PeriodicSync's replicate).
      slots: with replicate=True, "merged" (default) or "local": each
        worker keeps its own optimizer slots across syncs
        (tfde.semi_sync.PeriodicSync's slots).

    Example:
      >>> model.fit(data, callbacks=[tfde.keras.callbacks.PeriodicSync(every=16)])
    """

    def __init__(self, every: int, replicate: bool = False, slots: str = "merged") -> None:
        super().__init__()
        self.every = semi_sync.every_arg(every)
        self.replicate, self.slots = semi_sync.sync_options(replicate, slots)
        self.sync = None
        self._last = 0

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.every == 1:
            return
        stale = semi_sync.running()
        if stale is not None and getattr(stale, "_from_keras_callback", False):
            # Keras does not end a fit that raised: what it left on goes,
            # without a sync (its deltas are lost, as the failure's).
            stale.abort()
            if stale._fit_logs is not None:
                stale._fit_logs.remove()  # what the fit that raised left on the model
        model = self.model
        variables = [v for v in model_variables(model) if v.trainable]
        if not variables:
            raise ConfigError("PeriodicSync found no trainable tfde Variable in the model; it has nothing to sync")
        strategy = getattr(model, "distribute_strategy", None)

        # The model's weights once its first step built them (PeriodicSync
        # averages the floating ones that are not step buffers).
        def dense():
            return model.weights

        self.sync = semi_sync.PeriodicSync(
            self.every, variables, model.optimizer, dense, strategy=strategy, replicate=self.replicate, slots=self.slots
        )
        self.sync._from_keras_callback = True
        self.sync._fit_logs = None  # the engine's FitLogs, once the sync has started
        self.sync.start()
        self._last = int(model.optimizer.iterations.numpy())
        self.sync._fit_logs = exchange.local_fit_logs(model, strategy)
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
            if self.sync._fit_logs is not None and logs is not None:
                # In place: the callbacks after this one and the History see them.
                logs.update(self.sync._fit_logs.exact(logs))

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
            if self.sync._fit_logs is not None:
                self.sync._fit_logs.remove()
            self.sync = None
            self.model.train_function = None  # the next fit traces an exact step
