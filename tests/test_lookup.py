"""Lookups: dense/sparse/ragged ids, combiners, deduplication, gradients."""

import numpy as np
import pytest
import tensorflow as tf

import tfde
from tfde.tables import ReferenceTable, ReferenceTableCreator


class CountingCreator(ReferenceTableCreator):
    """Reference tables that record the keys every find receives."""

    def create(self, name, key_dtype, value_dtype, dim):
        table = ReferenceTable(name, key_dtype, value_dtype, dim)
        table.finds = []
        original = table.find

        def find(keys, missing):
            table.finds.append(keys.numpy().tolist())
            return original(keys, missing)

        table.find = find
        return table


def test_duplicates_are_deduplicated_before_the_store():
    v = tfde.Variable("dedup", dim=2, table_creator=CountingCreator())
    ids = tf.constant([[4, 4, 2], [2, 4, 7]], tf.int64)
    out = tfde.embedding_lookup(v, ids, training=False)
    assert v.tables[0].finds == [[4, 2, 7]]
    np.testing.assert_array_equal(out[0, 0], out[1, 1])


def _var_with_rows():
    v = tfde.Variable("sp", dim=2, initializer=0.0)
    v.upsert(tf.constant([1, 2, 3], tf.int64), tf.constant([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]]))
    return v


@pytest.mark.parametrize(
    "combiner,expected",
    [
        ("sum", [[1.0, 2.0], [0.0, 0.0], [3.0, 3.0]]),
        ("mean", [[0.5, 1.0], [0.0, 0.0], [3.0, 3.0]]),
        ("sqrtn", [[1 / np.sqrt(2), 2 / np.sqrt(2)], [0.0, 0.0], [3.0, 3.0]]),
    ],
)
def test_sparse_and_ragged_combiners(combiner, expected):
    v = _var_with_rows()
    sp = tf.sparse.SparseTensor(
        indices=[[0, 0], [0, 1], [2, 0]], values=tf.constant([1, 2, 3], tf.int64), dense_shape=[3, 2]
    )
    np.testing.assert_allclose(
        tfde.embedding_lookup_sparse(v, sp, combiner=combiner, training=False), expected, rtol=1e-6
    )
    rg = tf.ragged.constant([[1, 2], [], [3]], dtype=tf.int64)
    np.testing.assert_allclose(
        tfde.embedding_lookup_ragged(v, rg, combiner=combiner, training=False), expected, rtol=1e-6
    )


def test_sparse_weights():
    v = _var_with_rows()
    sp = tf.sparse.SparseTensor([[0, 0], [0, 1]], tf.constant([1, 2], tf.int64), [1, 2])
    w = tf.sparse.SparseTensor([[0, 0], [0, 1]], tf.constant([2.0, 1.0]), [1, 2])
    np.testing.assert_allclose(
        tfde.embedding_lookup_sparse(v, sp, w, combiner="mean", training=False), [[2 / 3, 2 / 3]], rtol=1e-6
    )


SPARSE_SPEC = tf.SparseTensorSpec([None, None], tf.int64)
WEIGHT_SPEC = tf.SparseTensorSpec([None, None], tf.float32)
IDS = tf.SparseTensor([[0, 0], [0, 1], [1, 0]], tf.constant([1, 2, 3], tf.int64), [2, 2])


@pytest.mark.parametrize("mode", ["eager", "function", "function of any shape"])
@pytest.mark.parametrize(
    "weights",
    [
        tf.SparseTensor([[0, 0], [1, 0], [1, 1]], [1.0, 2.0, 3.0], [2, 2]),  # other positions, same count
        tf.SparseTensor([[0, 0], [0, 1], [1, 0]], [1.0, 2.0, 3.0], [5, 7]),  # another dense_shape
        tf.SparseTensor([[0, 0]], [1.0], [2, 2]),  # fewer weights than ids
    ],
    ids=["positions", "dense_shape", "count"],
)
def test_sparse_weights_at_other_positions_than_the_ids_are_refused(weights, mode):
    # They were paired with the ids by their order alone: the first case gave the result of matching weights.
    v = _var_with_rows()
    lookup = lambda ids, w: tfde.embedding_lookup_sparse(v, ids, w, combiner="sum")  # noqa: E731
    if mode == "function":
        lookup = tf.function(lookup)
    elif mode == "function of any shape":
        lookup = tf.function(lookup, input_signature=[SPARSE_SPEC, WEIGHT_SPEC])
    error = tfde.ShapeError if mode == "eager" else tf.errors.InvalidArgumentError
    with pytest.raises(error, match="sp_weights must have the same indices and dense_shape as sp_ids"):
        lookup(IDS, weights)
    good = tf.SparseTensor(IDS.indices, [1.0, 2.0, 3.0], IDS.dense_shape)
    np.testing.assert_allclose(lookup(IDS, good), [[1.0, 4.0], [9.0, 9.0]], rtol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_sparse_ids_outside_their_batch_and_ragged_weights_of_other_rows_are_refused(mode):
    v = _var_with_rows()
    run = (lambda f: f()) if mode == "eager" else (lambda f: tf.function(f)())
    error = tfde.ShapeError if mode == "eager" else tf.errors.InvalidArgumentError
    outside = tf.SparseTensor([[5, 0]], tf.constant([1], tf.int64), [2, 2])
    with pytest.raises(error, match="sp_ids has an index whose row is outside its dense_shape"):
        run(lambda: tfde.embedding_lookup_sparse(v, outside))
    ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
    weights = tf.ragged.constant([[1.0], [2.0, 1.0]])
    with pytest.raises(error, match="weights must have the row lengths of ragged_ids"):
        run(lambda: tfde.embedding_lookup_ragged(v, ids, "sum", weights=weights, training=True))
    assert int(v._step_size()) == 0  # refused before the lookup


def test_ragged_without_combiner_keeps_ragged_shape():
    v = _var_with_rows()
    out = tfde.embedding_lookup_ragged(
        v, tf.ragged.constant([[1, 2], [3]], dtype=tf.int64), combiner=None, training=False
    )
    assert isinstance(out, tf.RaggedTensor) and out.shape.as_list() == [2, None, 2]


def test_bad_combiner_and_types():
    v = _var_with_rows()
    with pytest.raises(tfde.ConfigError, match="combiner must be one of"):
        tfde.embedding_lookup_ragged(v, tf.ragged.constant([[1]], dtype=tf.int64), combiner="max")
    with pytest.raises(tfde.ShapeError, match="SparseTensor"):
        tfde.embedding_lookup_sparse(v, tf.constant([[1]], tf.int64))
    with pytest.raises(tfde.ConfigError, match="expected a tfde.Variable"):
        tfde.embedding_lookup(tf.Variable([1.0]), tf.constant([1], tf.int64))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gradient_reaches_the_step_buffer(mode):
    v = tfde.Variable("grad", dim=2, initializer=1.0)

    def step(ids):
        with tf.GradientTape() as tape:
            emb = tfde.embedding_lookup(v, ids)
            loss = tf.reduce_sum(emb * tf.constant([1.0, 2.0]))
        return tape.gradient(loss, v.step_buffer)

    fn = tf.function(step) if mode == "function" else step
    g = fn(tf.constant([5, 6, 5], tf.int64))
    assert isinstance(g, tf.IndexedSlices)
    keys = tf.gather(v._keys_buffer, g.indices).numpy().tolist()
    assert sorted(keys) == [5, 5, 6] and g.values.numpy().tolist() == [[1.0, 2.0]] * 3


def test_inference_in_eager_does_not_fill_the_buffer():
    v = tfde.Variable("inf", dim=2)
    tfde.embedding_lookup(v, tf.constant([1, 2], tf.int64))  # no tape: a plain read
    assert tf.shape(v.step_buffer).numpy().tolist() == [0, 2]
