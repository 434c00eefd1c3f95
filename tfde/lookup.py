"""Embedding lookups on tfde Variables.

Every lookup deduplicates the ids of the batch before the store is touched,
and never inserts (docs/design.md, decision 3).  In training mode the rows go through
the Variable's step buffer so that gradients reach
tfde.DynamicEmbeddingOptimizer (see tfde/variable.py).
"""

from __future__ import annotations

from typing import Optional, Union

import tensorflow as tf

from tfde.errors import ConfigError, ShapeError
from tfde.tables.base import require
from tfde.types import KeysLike
from tfde.variable import Variable, in_tf_data_function, trainable_lookups_of

COMBINERS = ("sum", "mean", "sqrtn")


def _tape_recording() -> bool:
    try:
        from tensorflow.python.eager import record

        return bool(record.could_possibly_record())
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        return True


def _use_buffer(var: Variable, training: Optional[bool]) -> bool:
    """Whether this lookup is part of a training step, and so feeds the
    optimizer through the step buffer (docs/lookups.md, "Which lookups
    train").

    Only a lookup made while a GradientTape records (Keras fit and
    train_step record one; so does a custom loop's `with tf.GradientTape()`)
    and outside tf.data functions trains, and training=False always reads
    plainly.  `training=True` alone is not enough: a tf.data map function, a
    metric's pass over candidates, predict, evaluate and serving may say
    training=True or None, and a write into the buffer from there would
    collide with the training step that owns it (tf.data runs its functions
    on its own threads, while a step is under way)."""
    if not var.trainable or training is False:
        return False
    return _tape_recording() and not in_tf_data_function()


def _check_var(var):
    if not isinstance(var, Variable):
        raise ConfigError(f"expected a tfde.Variable, got {type(var).__name__}; create one with tfde.Variable(...)")


def _rows_for_unique(var: Variable, flat_ids, training):
    """(rows gathered per flat id [n, dim])."""
    if _use_buffer(var, training):
        return trainable_lookups_of([(var, flat_ids)])[0]
    unique, positions = tf.unique(flat_ids, out_idx=tf.int32)
    return tf.gather(var._read_unique(unique), positions)


def embedding_lookup(
    var: Variable, ids: KeysLike, training: Optional[bool] = None, name: Optional[str] = None
) -> tf.Tensor:
    """Rows of `ids` (any shape): output ``ids.shape + [dim]``.

    Args:
      var: the tfde.Variable.
      ids: tensor of var.key_dtype, any shape (scalar included).
      training: False is a plain read.  True or None: the rows go through
        the step buffer (so gradients reach the optimizer) only when the
        lookup is part of a training step, a recording GradientTape outside
        tf.data functions (_use_buffer; docs/lookups.md).
    """
    _check_var(var)
    with tf.name_scope(name or "tfde_embedding_lookup"):
        ids = var._key_tensor(ids)  # exact: ids that do not fit the key dtype are refused, never wrapped
        flat = var._keys(tf.reshape(ids, [-1]))
        rows = _rows_for_unique(var, flat, training)
        out = tf.reshape(rows, tf.concat([tf.shape(ids), [var.dim]], 0))
        if ids.shape.rank is not None:
            out.set_shape(ids.shape.concatenate([var.dim]))
        return out


def _combine(rows, segment_ids, num_segments, weights, combiner):
    """Combines rows [n, dim] into [num_segments, dim]; empty segments give 0."""
    if combiner not in COMBINERS:
        raise ConfigError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    if weights is not None:
        weights = tf.cast(weights, rows.dtype)
        rows = rows * weights[:, None]
    else:
        weights = tf.ones(tf.shape(rows)[:1], rows.dtype)
    summed = tf.math.unsorted_segment_sum(rows, segment_ids, num_segments)
    if combiner == "sum":
        return summed
    if combiner == "mean":
        denom = tf.math.unsorted_segment_sum(weights, segment_ids, num_segments)
    else:
        denom = tf.sqrt(tf.math.unsorted_segment_sum(weights * weights, segment_ids, num_segments))
    return tf.math.divide_no_nan(summed, denom[:, None])


def _same(a, b):
    """Whether a and b (int64) have the same shape and values."""
    if a.shape.rank != b.shape.rank:
        return tf.constant(False)
    if a.shape.is_fully_defined() and b.shape.is_fully_defined():  # tf.cond would trace a reshape that cannot be
        return tf.reduce_all(tf.equal(a, b)) if a.shape == b.shape else tf.constant(False)
    return tf.cond(
        tf.reduce_all(tf.equal(tf.shape(a), tf.shape(b))),
        lambda: tf.reduce_all(tf.equal(a, tf.reshape(b, tf.shape(a)))),
        lambda: tf.constant(False),
    )


def _sparse_checks(sp_ids, sp_weights):
    """The assertions embedding_lookup_sparse runs before combining: every
    id's row is within the batch, and weights sit at the ids' positions
    (they are paired with the ids by position)."""
    row = sp_ids.indices[:, 0]
    checks = require(
        tf.reduce_all(tf.logical_and(row >= 0, row < sp_ids.dense_shape[0])),
        "sp_ids has an index whose row is outside its dense_shape[0] (the batch): the row of every id must be in "
        "[0, batch)",
    )
    if sp_weights is not None:
        checks.extend(
            require(
                tf.logical_and(
                    _same(sp_ids.indices, sp_weights.indices), _same(sp_ids.dense_shape, sp_weights.dense_shape)
                ),
                "sp_weights must have the same indices and dense_shape as sp_ids (one weight at the "
                "position of each id); give a weight for every id, in the same order",
            )
        )
    return checks


def embedding_lookup_sparse(
    var: Variable,
    sp_ids: tf.SparseTensor,
    sp_weights: Optional[tf.SparseTensor] = None,
    combiner: str = "mean",
    training: Optional[bool] = None,
    name: Optional[str] = None,
) -> tf.Tensor:
    """Combined rows per row of a 2-D SparseTensor of ids: ``[batch, dim]``.

    Rows with no ids give zeros.  sp_weights, when given, must have the same
    indices as sp_ids.  combiner: 'sum', 'mean' (weighted mean) or 'sqrtn'
    (sum divided by the L2 norm of the weights).
    """
    _check_var(var)
    if not isinstance(sp_ids, tf.SparseTensor):
        raise ShapeError(f"sp_ids must be a tf.SparseTensor, got {type(sp_ids).__name__}")
    if sp_ids.shape.rank is not None and sp_ids.shape.rank != 2:
        raise ShapeError(f"sp_ids must be 2-D [batch, ids], got rank {sp_ids.shape.rank}")
    if sp_weights is not None and not isinstance(sp_weights, tf.SparseTensor):
        raise ShapeError(f"sp_weights must be None or a tf.SparseTensor like sp_ids, got {type(sp_weights).__name__}")
    with tf.name_scope(name or "tfde_embedding_lookup_sparse"):
        with tf.control_dependencies(_sparse_checks(sp_ids, sp_weights)):  # before any row is read or made
            rows = _rows_for_unique(var, var._keys(sp_ids.values), training)
        segments = tf.cast(sp_ids.indices[:, 0], tf.int32)
        batch = tf.cast(sp_ids.dense_shape[0], tf.int32)
        weights = None if sp_weights is None else sp_weights.values
        return _combine(rows, segments, batch, weights, combiner)


def embedding_lookup_ragged(
    var: Variable,
    ragged_ids: tf.RaggedTensor,
    combiner: Optional[str] = "mean",
    weights: Optional[tf.RaggedTensor] = None,
    training: Optional[bool] = None,
    name: Optional[str] = None,
) -> Union[tf.Tensor, tf.RaggedTensor]:
    """Rows of a RaggedTensor of ids.

    combiner=None returns the ragged rows (``ids.shape + [dim]``, ragged);
    'sum' / 'mean' / 'sqrtn' reduce the ragged dimension of a 2-D ragged
    tensor to ``[batch, dim]`` (empty rows give zeros).
    """
    _check_var(var)
    if not isinstance(ragged_ids, tf.RaggedTensor):
        raise ShapeError(f"ragged_ids must be a tf.RaggedTensor, got {type(ragged_ids).__name__}")
    if combiner is not None and ragged_ids.ragged_rank != 1:
        raise ShapeError(
            f"combining needs a 2-D ragged tensor [batch, (ids)]; got ragged_rank {ragged_ids.ragged_rank}"
        )
    if weights is not None and not isinstance(weights, tf.RaggedTensor):
        raise ShapeError(f"weights must be None or a tf.RaggedTensor like ragged_ids, got {type(weights).__name__}")
    with tf.name_scope(name or "tfde_embedding_lookup_ragged"):
        checks = []
        if weights is not None and combiner is not None:
            checks.extend(
                require(
                    _same(tf.cast(ragged_ids.row_splits, tf.int64), tf.cast(weights.row_splits, tf.int64)),
                    "weights must have the row lengths of ragged_ids (one weight per id, in the same rows)",
                )
            )
        with tf.control_dependencies(checks):  # before any row is read or made
            rows = _rows_for_unique(var, var._keys(ragged_ids.flat_values), training)
        if combiner is None:
            return ragged_ids.with_flat_values(rows)
        segments = tf.cast(ragged_ids.value_rowids(), tf.int32)
        batch = tf.cast(ragged_ids.nrows(), tf.int32)
        w = None if weights is None else weights.flat_values
        return _combine(rows, segments, batch, w, combiner)
