"""The restrict-policy hook of a Variable.

A policy is bound to one Variable and told about every training update; it
decides which keys a Variable keeps.  The concrete policies (frequency,
timestamp, admission filters, TTL) build on this protocol.
"""

from __future__ import annotations

import abc
from typing import Optional

import tensorflow as tf


class RestrictPolicy(abc.ABC):
    """Protocol of restrict policies.

    bind(variable) is called once when the Variable is created;
    on_apply(keys) after the optimizer wrote the rows of `keys` (unique, 1-D)
    in a training step; it may return an op (graph mode) or None.
    """

    variable = None

    def bind(self, variable) -> None:
        self.variable = variable

    @abc.abstractmethod
    def on_apply(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Called with the keys updated in this training step."""
