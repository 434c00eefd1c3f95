"""Variables of this process alone: step buffers and measurements."""

from __future__ import annotations

import tensorflow as tf


def local_variable(initial, shape, trainable: bool, name: str):
    """A plain ResourceVariable of this process, built directly so that a
    tf.distribute strategy in scope does not mirror it (step buffers,
    measurements).  distribute_strategy marks it as created in the strategy's
    scope, which Keras checks."""
    from tensorflow.python.ops import resource_variable_ops

    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    return resource_variable_ops.ResourceVariable(
        initial, shape=tf.TensorShape(shape), trainable=trainable, name=name, distribute_strategy=strategy
    )
