"""Keras integration: layers over tfde Variables (Keras 3 or tf-keras)."""

import tensorflow as _tf

from tfde.keras import callbacks, collection, layers
from tfde.keras.loading import load_model
from tfde.optimizer import refuse_plain_optimizers as _refuse_plain
from tfde.optimizer import register_keras_optimizers as _register

# Saved models name their optimizer "tfde>DynamicEmbeddingAdam" etc.: make
# every supported class known before keras.models.load_model looks for it.
_register(_tf.keras.optimizers)
# A model compiled without tfde.DynamicEmbeddingOptimizer gets an error naming it.
_refuse_plain(_tf.keras.optimizers)


def _autograph_leaves_tf_keras():
    """TensorFlow 2.16 lacks autograph's rule not to convert tf_keras (2.21
    has it, beside the one for keras): there, every tf-keras
    function a traced model reaches (Sequential.call, Layer.__call__, ...)
    is converted anew, which made tracing a tfrs model's metric over mapped
    candidates take 16-49 s on TF 2.16.2 instead of 0.2 s.  tf-keras is
    written to run unconverted; the rule TensorFlow itself added is added."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # pragma: no cover - private module moved
        return
    rules = config.CONVERSION_RULES
    if not any(isinstance(r, config.DoNotConvert) and r.matches("tf_keras") for r in rules):
        config.CONVERSION_RULES = tuple(rules) + (config.DoNotConvert("tf_keras"),)


_autograph_leaves_tf_keras()

# The many-feature layer is spelled tfde.keras.layers.DistributedEmbedding,
# beside the Embedding layers it is made of (collection.py imports layers.py).
layers.DistributedEmbedding = collection.DistributedEmbedding

__all__ = ["callbacks", "layers", "load_model"]
