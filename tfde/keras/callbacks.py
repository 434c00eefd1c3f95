"""Keras callbacks of tfde."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfde.errors import ConfigError
from tfde.policy import AutoRestrictor
from tfde.variable import Variable


def _policy_variables(model) -> list:
    """Variables with a restrict policy of every tfde layer in `model`."""
    if hasattr(model, "_flatten_layers"):  # Keras 3 and tf-keras
        layers = model._flatten_layers(include_self=True, recursive=True)
    else:
        layers = getattr(model, "submodules", ())
    found = []
    for layer in layers:
        params = getattr(layer, "params", None)
        if isinstance(params, Variable) and params.restrict_policy is not None and params not in found:
            found.append(params)
    return found


class RestrictCallback(tf.keras.callbacks.Callback):
    """Applies restrict policies during model.fit, so nobody has to remember
    to: after every training batch, tfde.AutoRestrictor.after_step with the
    optimizer's iteration count.

    Args: as tfde.AutoRestrictor; variables default to every tfde layer of
    the model that has a restrict policy.

    Example:
      >>> model.fit(data, callbacks=[tfde.keras.callbacks.RestrictCallback(max_size=1_000_000)])
    """

    def __init__(self, every_n_steps: Optional[int] = None, max_size: Optional[int] = None,
                 num_reserved: Optional[int] = None, variables=None):
        super().__init__()
        self._args = dict(every_n_steps=every_n_steps, max_size=max_size, num_reserved=num_reserved)
        self._variables = variables
        self.restrictor = None

    def on_train_begin(self, logs=None):
        variables = self._variables if self._variables is not None else _policy_variables(self.model)
        if not variables:
            raise ConfigError("RestrictCallback found no tfde layer with a restrict_policy in the model; give the "
                              "layers one (e.g. restrict_policy=tfde.FrequencyRestrictPolicy) or pass variables=")
        self.restrictor = AutoRestrictor(variables, **self._args)

    def on_train_batch_end(self, batch, logs=None):
        self.restrictor.after_step(int(self.model.optimizer.iterations.numpy()))
