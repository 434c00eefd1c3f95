"""tf-keras model.fit's logs during semi-synchronous training under
MultiWorkerMirroredStrategy (docs/semi-sync.md, "Logs between syncs").

tf-keras's step reads every metric across the workers (a collective per
metric variable) and reduces the step's logs across them.  A local step
that kept these would still wait for every worker.  While the PeriodicSync
callback runs, `FitLogs.install` makes the step report its own worker's
logs, and `FitLogs.exact` gives back, at an epoch's end (a sync point), what
exact training reports.  Reached by the core through
tfde.exchange.local_fit_logs (TfDistributeEngine.local_fit_logs).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import tensorflow as tf


class FitLogs:
    """The logs of `model`'s local steps: each step reports its own
    worker's (no collective); exact() gives what exact training reports at
    an epoch's end; remove() gives the model its own step back."""

    def __init__(self, model, strategy) -> None:
        self.model, self.strategy = model, strategy
        self.method = model.distribute_reduction_method  # exact training's reduction of the logs
        # What remove() puts back: a train_step set on the model itself, and the reduction as it was set.
        self._own_step, self._own_method = model.__dict__.get("train_step"), model._distribute_reduction_method
        self._installed = True
        self.step_keys: set = set()  # what the step reports (not what a callback added to the logs)
        self._exact = None

    @classmethod
    def install(cls, model, strategy) -> Optional["FitLogs"]:
        """Makes `model`'s next traced step report local logs; None where
        its steps hold no such collective (no tf-keras model, or not
        several workers under MultiWorkerMirroredStrategy)."""
        tf_keras = sys.modules.get("tf_keras")
        if tf_keras is None or not isinstance(model, tf_keras.Model):
            return None
        if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or strategy.num_replicas_in_sync < 2:
            return None
        logs = cls(model, strategy)
        step = model.train_step

        def local_train_step(data):
            with _local_metric_reads():
                outputs = step(data)
            if isinstance(outputs, dict):
                logs.step_keys = set(outputs)
            return outputs

        model.train_step = local_train_step
        model.distribute_reduction_method = "first"  # this worker's logs, not a collective over them
        return logs

    def remove(self) -> None:
        """Gives the model its own step and log reduction back (once)."""
        if not self._installed:
            return
        self._installed = False
        model = self.model
        if self._own_step is not None:
            model.train_step = self._own_step
        elif "train_step" in model.__dict__:
            delattr(model, "train_step")  # the class's again
        model._distribute_reduction_method = self._own_method

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
