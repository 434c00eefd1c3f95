"""tfde.Variable: lookups of any shape, sharding, determinism, write ops."""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfde


def test_docstring_example():
    v = tfde.Variable("doc", dim=4, initializer=0.0)
    v.upsert([1, 2], [[1.0] * 4, [2.0] * 4])
    assert v.lookup([2, 3]).numpy().tolist() == [[2.0] * 4, [0.0] * 4]


@pytest.mark.parametrize("shape", [[], [5], [2, 3], [2, 1, 4]])
def test_lookup_shape_is_ids_shape_plus_dim(shape, creator):
    v = tfde.Variable("shape", dim=3, table_creator=creator)
    ids = tf.reshape(tf.range(int(np.prod(shape)), dtype=tf.int64), shape)
    out, exists = v.lookup(ids, return_exists=True)
    assert out.shape == shape + [3] and exists.shape == shape


def test_lookups_never_insert(creator):
    v = tfde.Variable("never", dim=2, table_creator=creator)
    v.lookup(tf.range(50, dtype=tf.int64))
    tfde.embedding_lookup(v, tf.range(50, dtype=tf.int64), training=False)
    assert int(v.size()) == 0


def test_initial_rows_are_deterministic_per_key_and_seed():
    a = tfde.Variable("a", dim=8, initializer=tf.keras.initializers.RandomNormal(seed=3))
    b = tfde.Variable("b", dim=8, initializer=tf.keras.initializers.RandomNormal(seed=3))
    c = tfde.Variable("c", dim=8, initializer=tf.keras.initializers.RandomNormal(seed=4))
    keys = tf.constant([5, 1, 99], tf.int64)
    np.testing.assert_array_equal(a.lookup(keys), b.lookup(keys))
    np.testing.assert_array_equal(a.lookup(keys)[0], a.lookup(tf.constant([5], tf.int64))[0])
    assert not np.allclose(a.lookup(keys), c.lookup(keys))


def test_initial_rows_agree_across_processes():
    code = (
        "import tfde, tensorflow as tf; v = tfde.Variable('user', dim=4); "
        "print(v.lookup(tf.constant([12345], tf.int64)).numpy().tobytes().hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert len(outs) == 1


@pytest.mark.parametrize(
    "init,check",
    [
        (0.5, lambda r: np.all(r == 0.5)),
        ("zeros", lambda r: np.all(r == 0)),
        (tf.random_uniform_initializer(-0.1, 0.1), lambda r: r.min() >= -0.1 and r.max() < 0.1),
        (tf.keras.initializers.TruncatedNormal(stddev=0.01), lambda r: np.abs(r).max() <= 0.02 + 1e-7),
        (tf.keras.initializers.GlorotUniform(), lambda r: np.abs(r).max() <= np.sqrt(6 / 16)),
        (
            tfde.initializers.PerKey(lambda k: tf.cast(k, tf.float32)[:, None] * tf.ones([1, 8])),
            lambda r: r[3, 0] == 3.0,
        ),
    ],
)
def test_initializers(init, check):
    v = tfde.Variable("init", dim=8, initializer=init)
    assert check(v.lookup(tf.range(200, dtype=tf.int64)).numpy())


def test_unsupported_initializer_names_the_options():
    with pytest.raises(tfde.ConfigError, match="Zeros, Ones, Constant"):
        tfde.Variable("bad", dim=2, initializer=tf.keras.initializers.Orthogonal())


def test_sharded_equals_unsharded(creator, rng):
    one = tfde.Variable("s1", dim=3, num_shards=1, table_creator=creator)
    many = tfde.Variable("s1", dim=3, num_shards=4, table_creator=creator)
    keys = tf.constant(rng.integers(0, 1000, 300), tf.int64)
    vals = tf.constant(rng.standard_normal((300, 3)), tf.float32)
    for v in (one, many):
        v.upsert(keys, vals)
        v.accum(keys[:50], vals[:50])
        v.remove(keys[100:120])
    probe = tf.range(1000, dtype=tf.int64)
    np.testing.assert_allclose(one.lookup(probe), many.lookup(probe), rtol=1e-6)
    assert int(one.size()) == int(many.size())
    sizes = [int(t.size()) for t in many.tables]
    assert min(sizes) > 0, sizes  # keys spread over every shard


def test_write_ops(creator):
    v = tfde.Variable("ops", dim=2, initializer=1.0, table_creator=creator)
    v.upsert(tf.constant([[1, 2], [3, 4]], tf.int64), tf.ones([2, 2, 2]) * 5)
    assert int(v.size()) == 4
    v.accum(tf.constant([1, 9], tf.int64), tf.ones([2, 2]))
    assert v.lookup(tf.constant([1, 9], tf.int64)).numpy().tolist() == [[6, 6], [2, 2]]
    assert int(v.remove(tf.constant([1, 2, 77], tf.int64))) == 2
    keys = sorted(np.concatenate([k.numpy() for k, _ in v.export()]).tolist())
    assert keys == [3, 4, 9]
    v.import_(tf.constant([100], tf.int64), tf.zeros([1, 2]), replace=True)
    assert int(v.size()) == 1
    v.clear()
    assert int(v.size()) == 0


@pytest.mark.parametrize(
    "delta",
    [[[2049.0]], np.array([[2049.0]], np.float32), np.array([[2049.0]], np.float64), [[2049]], np.array([[2049]])],
    ids=["list", "numpy-float32", "numpy-float64", "int-list", "numpy-int"],
)
def test_accum_of_a_float16_variable_adds_deltas_as_given(creator, delta):
    """-2048 + 2049 = 1 in float16, though 2049 is not a float16 (it rounds
    to 2048): Python numbers, numpy arrays and ints reach the table in
    float32 (or their own float64), not rounded to float16 first."""
    v = tfde.Variable("half", dim=1, value_dtype=tf.float16, initializer=0.0, table_creator=creator)
    key = tf.constant([1], tf.int64)
    v.upsert(key, tf.constant([[-2048.0]], tf.float16))
    v.accum(key, delta)
    assert v.lookup(key).numpy().tolist() == [[1.0]]


def test_string_keys(creator):
    v = tfde.Variable("str", key_dtype=tf.string, dim=2, initializer=0.0, table_creator=creator)
    v.upsert(tf.constant(["a", "bb"]), tf.constant([[1.0, 1.0], [2.0, 2.0]]))
    out, exists = v.lookup(tf.constant([["bb"], ["zz"]]), return_exists=True)
    assert out.numpy().tolist() == [[[2, 2]], [[0, 0]]] and exists.numpy().tolist() == [[True], [False]]


def test_bad_inputs_are_clear_and_lose_nothing():
    v = tfde.Variable("bad", dim=4)
    v.upsert(tf.constant([1], tf.int64), tf.ones([1, 4]))
    with pytest.raises(tfde.ShapeError, match="rows of dim 4"):
        v.upsert(tf.constant([2], tf.int64), tf.ones([1, 5]))
    with pytest.raises(tfde.ShapeError, match="are string, expected int64"):
        v.lookup(tf.constant(["x"]))
    with pytest.raises(tfde.ShapeError, match="2 keys but 3 rows"):
        v.upsert(tf.constant([2, 3], tf.int64), tf.ones([3, 4]))
    with pytest.raises(tfde.ConfigError, match="num_shards must be an int >= 1"):
        tfde.Variable("x", dim=2, num_shards=0)
    with pytest.raises(tfde.ConfigError, match="dim must be"):
        tfde.Variable("x", dim=-1)
    assert int(v.size()) == 1 and v.lookup(tf.constant([1], tf.int64)).numpy().tolist() == [[1.0] * 4]


def test_get_variable_and_repr():
    v = tfde.get_variable("gv", key_dtype=tf.int32, dim=2, initializer=0.0)
    assert v.key_dtype == tf.int32 and "gv" in repr(v)


def test_restrict_policy_hook_sees_every_training_update():
    class Recorder(tfde.RestrictPolicy):
        def __init__(self, variable=None):
            self.seen = []

        def on_apply(self, keys, step):
            self.seen.append((int(step), sorted(keys.numpy().tolist())))

    v = tfde.Variable("policy", dim=2, restrict_policy=Recorder)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tfde.embedding_lookup(v, tf.constant([3, 1, 3], tf.int64), training=True))
    opt.apply_gradients(zip(tape.gradient(loss, [v.step_buffer]), [v.step_buffer]))
    assert v.restrict_policy.variable is v and v.restrict_policy.seen == [(0, [1, 3])]


def test_a_served_variable_reads_the_serving_tables_and_refuses_writes():
    """Variable.serving_from (what tfde.export_for_serving traces through):
    lookups read the given tables, writes raise and change nothing, and the
    Variable reads its own tables again afterwards."""
    var = tfde.Variable("served", dim=2, initializer=0.0, num_shards=2)
    var.upsert(tf.constant([1, 2], tf.int64), tf.ones([2, 2]))
    serving = tfde.CuckooTableCreator().create("serving", tf.int64, tf.float32, 2)
    serving.insert(tf.constant([1, 3], tf.int64), tf.fill([2, 2], 7.0))
    with var.serving_from([serving]):
        rows, exists = var.lookup(tf.constant([1, 2, 3], tf.int64), return_exists=True)
        assert rows.numpy().tolist() == [[7, 7], [0, 0], [7, 7]] and exists.numpy().tolist() == [True, False, True]
        for write in (
            lambda: var.upsert(tf.constant([5], tf.int64), tf.ones([1, 2])),
            lambda: var.remove(tf.constant([1], tf.int64)),
            var.clear,
        ):
            with pytest.raises(tfde.ConfigError, match="read-only while it is served"):
                write()
        with pytest.raises(tfde.ConfigError, match="served from other tables already"):
            with var.serving_from([serving]):
                pass
    assert int(var.size()) == 2 and int(serving.size()) == 2
    assert var.lookup(tf.constant([1], tf.int64)).numpy().tolist() == [[1, 1]]
    with pytest.raises(tfde.ConfigError, match="has 2 shards; serve it from 1 table or 2, got 3"):
        with var.serving_from([serving] * 3):
            pass


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seed=1.5), "seed must be None or an int in \\[-2\\*\\*63, 2\\*\\*63\\), got 1.5"),
        (dict(seed="abc"), "seed must be .* got 'abc'"),  # was int()'s ValueError
        (dict(seed=2**70), "seed must be .* got 1180591620717411303424"),  # was an OverflowError
        (dict(trainable="no"), "trainable must be True or False, got 'no'"),  # was trainable
        (dict(restrict_policy="frequency"), "restrict_policy must be None or a tfde RestrictPolicy class or instance"),
        (dict(admission_filter=3), "admission_filter must be None or a tfde AdmissionFilter instance"),
        (dict(initializer=tf.keras.initializers.RandomUniform(1.0, -1.0)), "needs minval <= maxval"),
        (dict(initializer=tf.keras.initializers.RandomNormal(stddev=-1.0)), "needs stddev >= 0, got -1.0"),
    ],
    ids=lambda x: repr(x)[:40],
)
def test_arguments_of_the_wrong_kind_are_refused_by_the_variable(kwargs, message):
    with pytest.raises(tfde.ConfigError, match=message):
        tfde.Variable("wrong-kind", dim=2, **kwargs)


@pytest.mark.parametrize("chunk_rows", [0, -1, 1.5, None])
def test_export_refuses_chunk_sizes_that_are_not_positive_ints(chunk_rows):
    var = tfde.Variable("chunks", dim=2, initializer=0.0)
    var.upsert([1, 2, 3], tf.ones([3, 2]))
    with pytest.raises(tfde.ConfigError, match=f"chunk_rows must be an int >= 1, got {chunk_rows}"):
        var.export(chunk_rows)  # at the call, before any chunk is asked for
    assert [len(k) for k, _ in var.export(np.int64(2))] == [2, 1]


def test_a_checkpoint_manager_of_a_none_object_is_refused(tmp_path):
    model = tf.keras.Sequential([tfde.keras.layers.Embedding(2, name="none-opt")])
    optimizer = getattr(model, "optimizer", None)  # tf-keras: None until compile(); Keras 3: no attribute yet
    with pytest.raises(tfde.ConfigError, match="CheckpointManager got None for optimizer; pass the objects"):
        tfde.CheckpointManager(str(tmp_path), model=model, optimizer=optimizer)  # TensorFlow failed at save()


def test_rows_given_as_a_list_of_tensors_inside_a_tf_function_are_stacked():
    # The overflow check's numpy path must leave symbolic tensors to TensorFlow (np.asarray cannot read them).
    var = tfde.Variable("list-of-tensors", dim=2, initializer=0.0)

    @tf.function
    def write(a, b):
        var.upsert([1, 2], [a, b])
        var.import_([3], [a])

    write(tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0]))
    np.testing.assert_array_equal(var.lookup([1, 2, 3]).numpy(), [[1, 2], [3, 4], [1, 2]])
