"""The types of tfde's public signatures (for annotations only)."""

from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np
import tensorflow as tf

DTypeLike = Union[tf.DType, str]
"""A TensorFlow dtype or its name ("int64", "string", ...)."""

KeysLike = Union[tf.Tensor, np.ndarray, Sequence[int], Sequence[str], Sequence[bytes], int, str, bytes]
"""Keys: a tensor of the key dtype, or Python / numpy values converted
exactly (docs/guide.md, "Keys and rows")."""

RowsLike = Union[tf.Tensor, np.ndarray, Sequence[Any], float]
"""Rows or deltas: anything tf.convert_to_tensor takes, of shape keys.shape + [dim]."""

InitializerLike = Union[None, float, int, str, Any]
"""A number, an initializer's name, a Keras or tf initializer object, or
tfde.initializers.PerKey (docs/guide.md, "Initializers")."""
