"""tensorflow_recommenders_addons, spelled in tfde.

  import tfde.compat.tfra as tfra
  from tfde.compat.tfra import dynamic_embedding as de

TFRA programs run with only these import lines changed: the names of
`dynamic_embedding` (de.keras.layers.Embedding, de.RedisTableConfig,
de.DynamicEmbeddingOptimizer, ...) take TFRA's arguments and return tfde's
own objects.  Nothing here patches TensorFlow, so the import order of TFRA
programs does not matter.  What maps to what, and where tfde behaves
differently: docs/migrating-from-tfra.md.
"""

from tfde.compat.tfra import dynamic_embedding

__all__ = ["dynamic_embedding"]
