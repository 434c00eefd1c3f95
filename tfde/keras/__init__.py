"""Keras integration: layers over tfde Variables (Keras 3 or tf-keras)."""

import tensorflow as _tf

from tfde.keras import callbacks, layers
from tfde.keras.loading import load_model
from tfde.optimizer import refuse_plain_optimizers as _refuse_plain
from tfde.optimizer import register_keras_optimizers as _register

# Saved models name their optimizer "tfde>DynamicEmbeddingAdam" etc.: make
# every supported class known before keras.models.load_model looks for it.
_register(_tf.keras.optimizers)
# A model compiled without tfde.DynamicEmbeddingOptimizer gets an error naming it.
_refuse_plain(_tf.keras.optimizers)

__all__ = ["callbacks", "layers", "load_model"]
