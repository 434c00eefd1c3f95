"""keys.sum_gathered: the per-key sums over every worker that Horovod's
exchange gives semi-synchronous training's syncs (Exchange.sum_everywhere),
checked against a dict over simulated workers: each worker's gathers return
what every worker passed to the same call, worker after worker."""

import numpy as np
import pytest
import tensorflow as tf

from tfde.distributed.keys import sum_gathered


def _run_workers(worker_parts, longest=12):
    """Runs sum_gathered as every worker of len(worker_parts) would: the
    i-th gather of each returns the concatenation of the i-th gathered
    tensor of every worker (recorded first, each worker alone)."""
    size = len(worker_parts)
    recorded = []
    for parts in worker_parts:
        calls = []

        def record(t, calls=calls):
            calls.append(t)
            return tf.concat([t] * size, 0)  # the shapes a gather of `size` workers returns

        sum_gathered(parts, record, lambda n: tf.constant(longest), size)
        recorded.append(calls)
    out = []
    for rank, parts in enumerate(worker_parts):
        count = iter(range(len(recorded[rank])))

        def gather(t, rank=rank, count=count):
            i = next(count)
            np.testing.assert_array_equal(t.numpy(), recorded[rank][i].numpy())
            return tf.concat([calls[i] for calls in recorded], 0)

        out.append(sum_gathered(parts, gather, lambda n: tf.constant(longest), size))
    return out


def _expected(worker_parts, part):
    """(keys in order of first appearance, worker after worker; their sums)."""
    sums = {}
    for parts in worker_parts:
        keys, values = parts[part]
        for k, v in zip(keys.numpy().tolist(), values.numpy().astype(np.float64)):
            sums[k] = sums.get(k, 0) + v
    return list(sums), np.array(list(sums.values()))


@pytest.mark.parametrize("size", [2, 3])
def test_every_worker_gets_every_keys_sum_in_the_same_order(size):
    rng = np.random.default_rng(size)
    worker_parts = []
    for w in range(size):
        ints = rng.choice(50, 20 + w, replace=False).astype(np.int64)
        strings = tf.constant([f"id-{i}".encode() for i in rng.choice(30, 7, replace=False)])
        worker_parts.append(
            [
                (tf.constant(ints), tf.constant(rng.normal(size=(len(ints), 3)), tf.float32)),
                (strings, tf.constant(rng.normal(size=(7, 2)), tf.float64)),  # float64: the carrier for all
                (tf.zeros([0], tf.int32), tf.zeros([0, 4], tf.float32)),  # empty on every worker
                (tf.constant([7, 7 + w], tf.int32), tf.ones([2, 1], tf.float16)),
            ]
        )
    results = _run_workers(worker_parts)
    for part in range(4):
        keys, sums = _expected(worker_parts, part)
        for out in results:
            union, summed = out[part]
            assert union.dtype == worker_parts[0][part][0].dtype
            assert summed.dtype == worker_parts[0][part][1].dtype
            assert summed.shape[1] == worker_parts[0][part][1].shape[1]
            assert union.numpy().tolist() == keys
            np.testing.assert_allclose(summed.numpy().astype(np.float64), sums.reshape(summed.shape), rtol=1e-6)
        for out in results[1:]:  # the same numbers on every worker, to the last bit
            np.testing.assert_array_equal(out[part][1].numpy(), results[0][part][1].numpy())


def test_nothing_on_any_worker_sums_to_nothing():
    # A sync after steps that changed no key: every part empty everywhere.
    empty = [(tf.zeros([0], tf.int64), tf.zeros([0, 3])), (tf.zeros([0], tf.int64), tf.zeros([0, 1]))]
    for out in _run_workers([empty] * 3):
        assert [(u.shape.as_list(), s.shape.as_list()) for u, s in out] == [([0], [0, 3]), ([0], [0, 1])]


def test_two_workers_sums_are_exact():
    # Two numbers summed once, in float32: what the owner's store adds.
    a = tf.constant([[1e8, 1.0]], tf.float32)
    b = tf.constant([[1.0, 2.0**-30]], tf.float32)
    results = _run_workers([[(tf.constant([5], tf.int64), a)], [(tf.constant([5], tf.int64), b)]])
    for out in results:
        np.testing.assert_array_equal(out[0][1].numpy(), (a + b).numpy())


def test_values_of_no_static_width_are_refused():
    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32)])
    def f(values):
        return sum_gathered([(tf.constant([1], tf.int64), values)], lambda t: t, lambda n: n, 1)

    with pytest.raises(ValueError, match=r"static d"):
        f.get_concrete_function()
