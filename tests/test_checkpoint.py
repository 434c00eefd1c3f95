"""tf.train.Checkpoint of cuckoo-backed Variables: rows, optimizer slots and
policy state round-trip, and training continues exactly after a restore."""

import numpy as np
import pytest
import tensorflow as tf

import tfde

pytestmark = pytest.mark.keras


def make():
    var = tfde.Variable("ckpt", dim=3, seed=1, restrict_policy=tfde.FrequencyRestrictPolicy)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05))
    return var, opt


def steps(var, opt, seed, n):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        ids = tf.constant(rng.integers(0, 30, 8), tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tfde.embedding_lookup(var, ids, training=True) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))


def state(var):
    keys = tf.range(30, dtype=tf.int64)
    out = {"rows": var.lookup(keys).numpy(), "size": int(var.size())}
    for name, slot in var.slots.items():
        out[name] = (slot.lookup(keys).numpy(), int(slot.size()))
    return out


def test_restore_continues_training_exactly(tmp_path):
    var, opt = make()
    steps(var, opt, 0, 10)
    path = tf.train.Checkpoint(var=var, opt=opt).save(str(tmp_path / "ck"))
    steps(var, opt, 1, 10)
    expected = state(var)

    fresh, fresh_opt = make()  # new tables, nothing in them
    tf.train.Checkpoint(var=fresh, opt=fresh_opt).restore(path)
    assert int(fresh_opt.iterations) == 10
    steps(fresh, fresh_opt, 1, 10)
    got = state(fresh)
    assert got["size"] == expected["size"]
    np.testing.assert_allclose(got["rows"], expected["rows"], rtol=1e-6, atol=1e-7)
    assert sorted(got) == sorted(expected)  # same slots: m, v and the policy state
    for name in expected:
        if name not in ("rows", "size"):
            np.testing.assert_allclose(got[name][0], expected[name][0], rtol=1e-6, atol=1e-7)
            assert got[name][1] == expected[name][1], name


def test_restore_replaces_what_the_table_held(tmp_path):
    var = tfde.Variable("ckpt2", dim=2, initializer=0.0)
    var.upsert(tf.constant([1, 2], tf.int64), tf.ones([2, 2]))
    path = tf.train.Checkpoint(var=var).save(str(tmp_path / "ck"))
    var.upsert(tf.constant([3], tf.int64), tf.ones([1, 2]))
    var.remove(tf.constant([1], tf.int64))
    tf.train.Checkpoint(var=var).restore(path)
    assert int(var.size()) == 2 and var.lookup(tf.constant([1, 3], tf.int64)).numpy().tolist() == [[1, 1], [0, 0]]
