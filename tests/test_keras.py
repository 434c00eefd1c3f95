"""Keras layers under Keras 3 and tf-keras: Sequential + model.fit, eager vs
tf.function vs model.fit, parity with tf.keras.layers.Embedding, configs."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfde
from tfde.compat.tfra import dynamic_embedding as tfra_de

pytestmark = pytest.mark.keras


def test_issue_snippet_string_keys_sequential_fit():
    user = tf.keras.Sequential(
        [
            tfde.keras.layers.Embedding(
                embedding_size=64,
                key_dtype=tf.string,
                initializer=tf.random_uniform_initializer(),
                name="user-embedding",
            ),
            tf.keras.layers.Dense(32),
        ]
    )
    model = user
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam()), loss="mse")
    ids = tf.constant(["alice", "bob", "carol", "alice", "dave", "bob"])
    targets = tf.constant(np.random.default_rng(0).standard_normal((6, 32)), tf.float32)
    ds = tf.data.Dataset.from_tensor_slices((ids, targets)).batch(3)
    history = model.fit(ds, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    emb = user.layers[0]
    assert int(emb.params.size()) == 4
    assert {int(s.size()) for s in emb.params.slots.values()} == {4}
    assert model.predict(ids, verbose=0).shape == (6, 32)


def test_nested_sequential_with_string_input():
    # Keras 3 gives a Sequential without an Input the float dtype of its
    # first layer when that layer is itself a model: declare the input.
    user = tf.keras.Sequential(
        [tfde.keras.layers.Embedding(8, key_dtype=tf.string, name="nested"), tf.keras.layers.Dense(4)]
    )
    model = tf.keras.Sequential([tf.keras.Input(shape=(), dtype=tf.string), user, tf.keras.layers.Dense(1)])
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.1)), loss="mse")
    ids = tf.constant(["a", "b", "c", "a"])
    history = model.fit(ids, tf.constant([1.0, 0, 1, 1]), batch_size=2, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_int64_keys_with_combiner_fit():
    model = tf.keras.Sequential(
        [tfde.keras.layers.Embedding(8, key_dtype=tf.int64, combiner="mean", name="bag"), tf.keras.layers.Dense(1)]
    )
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adagrad(0.5)), loss="mse")
    x = tf.constant(np.random.default_rng(0).integers(0, 100, (64, 5)), tf.int64)
    y = tf.cast(tf.reduce_sum(x % 2, axis=1, keepdims=True), tf.float32)
    history = model.fit(x, y, batch_size=16, epochs=5, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert model(x[:2]).shape == (2, 1)


def _build(seed_name):
    model = tf.keras.Sequential(
        [
            tfde.keras.layers.Embedding(4, seed=7, name=f"emb_{seed_name}"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(1, kernel_initializer="ones", name=f"dense_{seed_name}"),
        ]
    )
    model.build((None, 2))
    return model


def _data():
    rng = np.random.default_rng(3)
    xs = [tf.constant(rng.integers(0, 20, (6, 2)), tf.int64) for _ in range(5)]
    ys = [tf.constant(rng.standard_normal((6, 1)), tf.float32) for _ in range(5)]
    return xs, ys


def _final_state(model):
    rows = model.layers[0].params.lookup(tf.range(20, dtype=tf.int64)).numpy()
    return rows, model.layers[-1].kernel.numpy()


def test_eager_function_and_fit_agree():
    xs, ys = _data()
    loss_fn = tf.keras.losses.MeanSquaredError()
    results = {}
    for mode in ("eager", "function", "fit"):
        model = _build(mode)
        opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.05))
        if mode == "fit":
            model.compile(optimizer=opt, loss=loss_fn)
            ds = tf.data.Dataset.from_tensor_slices((tf.concat(xs, 0), tf.concat(ys, 0))).batch(6)
            model.fit(ds, epochs=1, shuffle=False, verbose=0)
        else:

            def step(x, y, model=model, opt=opt):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))

            fn = tf.function(step) if mode == "function" else step
            for x, y in zip(xs, ys):
                fn(x, y)
        results[mode] = _final_state(model)
    for mode in ("function", "fit"):
        np.testing.assert_allclose(results[mode][0], results["eager"][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(results[mode][1], results["eager"][1], rtol=1e-5, atol=1e-6)


def test_dense_part_matches_keras_embedding_when_every_row_is_touched():
    vocab, dim = 6, 4
    tfde_emb = tfde.keras.layers.Embedding(dim, seed=11, name="tfde_all")
    initial = tfde_emb.params.lookup(tf.range(vocab, dtype=tf.int64)).numpy()
    keras_emb = tf.keras.layers.Embedding(vocab, dim, name="keras_all")
    keras_emb.build((None,))
    keras_emb.set_weights([initial])
    models = []
    for emb in (tfde_emb, keras_emb):
        m = tf.keras.Sequential([emb, tf.keras.layers.Dense(1, kernel_initializer="glorot_uniform")])
        m.build((None,))
        models.append(m)
    models[1].layers[1].set_weights(models[0].layers[1].get_weights())
    opts = [tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), tf.keras.optimizers.Adam(0.05)]
    rng = np.random.default_rng(0)
    for _ in range(10):
        # Every row exactly once per step: lazy == dense, and Keras's own
        # sparse Adam (which squares IndexedSlices per duplicate) is exact.
        x = tf.constant(rng.permutation(vocab), tf.int64)
        y = tf.constant(rng.standard_normal((vocab, 1)), tf.float32)
        for m, opt in zip(models, opts):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((m(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables))
    np.testing.assert_allclose(
        tfde_emb.params.lookup(tf.range(vocab, dtype=tf.int64)).numpy(),
        keras_emb.get_weights()[0],
        rtol=1e-5,
        atol=2e-5,
    )
    for a, b in zip(models[0].layers[1].get_weights(), models[1].layers[1].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)


def test_same_layer_twice_in_a_model_trains_both_calls():
    emb = tfde.keras.layers.Embedding(2, initializer=0.0, name="shared")
    a = tf.keras.Input(shape=(), dtype=tf.int64, name="a")
    b = tf.keras.Input(shape=(), dtype=tf.int64, name="b")
    out = tf.keras.layers.Add()([emb(a), emb(b)])
    model = tf.keras.Model([a, b], out)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(1.0))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model([tf.constant([1], tf.int64), tf.constant([2], tf.int64)], training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    assert emb.params.lookup(tf.constant([1, 2], tf.int64)).numpy().tolist() == [[-1, -1], [-1, -1]]


def test_output_shapes_and_squashed():
    emb = tfde.keras.layers.Embedding(3, initializer=1.0)
    assert emb(tf.zeros([2, 5, 4], tf.int64)).shape == (2, 5, 4, 3)
    sq = tfde.keras.layers.SquashedEmbedding(4, initializer=1.0)
    assert sq(tf.constant([[1, 2, 3]], tf.int64)).numpy().tolist() == [[3.0, 3.0, 3.0, 3.0]]
    assert sq(tf.zeros([2, 3, 5], tf.int64)).shape == (2, 4)
    ragged = tfde.keras.layers.Embedding(2, initializer=1.0, combiner="sum")
    assert ragged(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)).numpy().tolist() == [[2, 2], [1, 1]]


def test_get_config_round_trip():
    layer = tfde.keras.layers.Embedding(
        5,
        key_dtype=tf.string,
        initializer=tf.keras.initializers.RandomNormal(stddev=0.3, seed=2),
        combiner="sum",
        num_shards=2,
        seed=9,
        name="cfg",
        table_creator=tfde.CuckooTableCreator(expected_rows=100),
    )
    clone = tfde.keras.layers.Embedding.from_config(layer.get_config())
    assert (clone.embedding_size, clone.key_dtype, clone.combiner, clone.num_shards, clone.seed) == (
        5,
        tf.string,
        "sum",
        2,
        9,
    )
    ids = tf.constant([["a", "b"]])
    np.testing.assert_array_equal(layer(ids, training=False), clone(ids, training=False))
    sq = tfde.keras.layers.SquashedEmbedding.from_config(tfde.keras.layers.SquashedEmbedding(3).get_config())
    assert sq.combiner == "sum"


@pytest.mark.parametrize(
    "policy,admission",
    [
        (tfde.FrequencyRestrictPolicy, tfde.CounterFilter(min_count=3)),
        (tfde.TimestampRestrictPolicy(clock="wall"), tfde.ProbabilityFilter(0.5)),
        (tfde.TTLPolicy(ttl_steps=7), None),
    ],
    ids=["frequency", "timestamp", "ttl"],
)
def test_policies_and_filters_survive_a_layer_config(policy, admission):
    layer = tfde.keras.layers.Embedding(2, restrict_policy=policy, admission_filter=admission, name="pol")
    config = layer.get_config()
    clone = tfde.keras.layers.Embedding.from_config({**config, "name": "pol2"})
    for mine, theirs in (
        (layer.params.restrict_policy, clone.params.restrict_policy),
        (layer.params.admission_filter, clone.params.admission_filter),
    ):
        assert type(mine) is type(theirs)
        if mine is not None:
            assert mine.get_config() == theirs.get_config()


def test_a_layer_config_naming_an_unknown_policy_is_refused():
    config = tfde.keras.layers.Embedding(2, restrict_policy=tfde.FrequencyRestrictPolicy, name="pol").get_config()
    config["restrict_policy"] = {"class_name": "RestrictPolicy", "config": {}}  # the abstract base
    with pytest.raises(
        tfde.ConfigError,
        match=r"unknown restrict policy or admission filter 'RestrictPolicy'.*"
        r"FrequencyRestrictPolicy, TimestampRestrictPolicy, TTLPolicy, "
        r"CounterFilter, ProbabilityFilter",
    ):
        tfde.keras.layers.Embedding.from_config({**config, "name": "pol3"})


def test_bad_layer_arguments():
    with pytest.raises(tfde.ConfigError, match="combiner must be None or one of"):
        tfde.keras.layers.Embedding(3, combiner="max")
    with pytest.raises(tfde.ConfigError, match="SquashedEmbedding needs a combiner"):
        tfde.keras.layers.SquashedEmbedding(3, combiner=None)
    layer = tfde.keras.layers.Embedding(3, key_dtype=tf.int64)
    with pytest.raises(Exception, match="are string, expected int64"):
        layer(tf.constant(["x"]))


def test_empty_batch_trains_without_error():
    layer = tfde.keras.layers.Embedding(3, initializer=1.0, name="empty_batch")
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.1))
    for ids in (tf.zeros([0], tf.int64), tf.zeros([0, 4], tf.int64), tf.constant([1, 2], tf.int64)):
        with tf.GradientTape() as tape:
            out = layer(ids, training=True)
            loss = tf.reduce_sum(out)
        assert out.shape == ids.shape + [3]
        grads = tape.gradient(loss, layer.trainable_variables)
        opt.apply_gradients(zip(grads, layer.trainable_variables))
    assert int(layer.params.size()) == 2 and int(opt.iterations) == 3


def test_summary_and_count_params():
    model = tf.keras.Sequential([tfde.keras.layers.Embedding(8, name="summ"), tf.keras.layers.Dense(2)])
    model.build((None,))
    model(tf.constant([1, 2], tf.int64))
    lines = []
    model.summary(print_fn=lambda line, *a, **k: lines.append(line))
    assert model.count_params() == 8 * 2 + 2  # rows live in the table, not in Keras parameters
    assert any("summ" in line for line in lines)


def fit_refused(**compile_args):
    """(model, the UnsupportedOptimizerError's text): a one-table model
    compiled with `compile_args` (no tfde optimizer) and fitted once, which
    must refuse (tests/horovod's wrapping-hint test uses it too)."""
    model = tf.keras.Sequential([tfde.keras.layers.Embedding(4, initializer=0.5), tf.keras.layers.Dense(1)])
    model.compile(loss="mse", **compile_args)
    data = tf.data.Dataset.from_tensor_slices((np.arange(8, dtype=np.int64), np.ones(8, np.float32))).batch(4)
    with pytest.raises(tfde.UnsupportedOptimizerError) as refused:
        model.fit(data, epochs=1, verbose=0)
    return model, str(refused.value)


@pytest.mark.parametrize(
    "compile_args",
    [{}, {"optimizer": "adam"}, {"optimizer": tf.keras.optimizers.SGD(0.1)}],
    ids=["no_optimizer", "by_name", "plain_instance"],
)
def test_a_model_compiled_without_the_tfde_optimizer_is_told_the_fix(compile_args):
    """model.compile() without tfde.DynamicEmbeddingOptimizer (the mistake of
    TFRA's MWMS program): the first step raises naming the wrapper, instead
    of Keras's "Cannot convert a partially known TensorShape"; nothing is
    written to the table."""
    model, message = fit_refused(**compile_args)
    assert re.search(
        r"not wrapped by tfde.DynamicEmbeddingOptimizer.*model.compile\(optimizer=tfde.DynamicEmbeddingOptimizer",
        message,
    ), message
    assert int(model.layers[0].params.size()) == 0


def test_a_model_compiled_without_the_tfde_optimizer_the_program_made_is_told_to_pass_it():
    """TFRA's MWMS program builds de.DynamicEmbeddingOptimizer(Adam()) and
    then calls model.compile() without it: the refusal says that the
    program made one and to pass it, beside the general fix."""
    made = tfra_de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01))
    model, message = fit_refused()
    assert re.search(
        r"made tfde.DynamicEmbeddingOptimizer\([^)]*Adam[^)]*\), which does not train these tables: if it "
        r"was meant to, pass that optimizer",
        message,
    ), message
    assert int(model.layers[0].params.size()) == 0
    assert isinstance(made, tfde.optimizer.DynamicEmbeddingMixin)


def test_the_unwrapped_optimizer_error_names_no_engine_the_program_does_not_use():
    """The distributed engines add their own wrapping hint only to programs
    that use them (tests/horovod checks Horovod's)."""
    import sys

    assert "horovod.tensorflow" not in sys.modules
    _, message = fit_refused(optimizer=tf.keras.optimizers.SGD(0.1))
    assert "hvd" not in message and "Horovod" not in message


def test_a_wrapped_optimizer_still_builds_and_trains():
    model = tf.keras.Sequential([tfde.keras.layers.Embedding(4, initializer=0.5), tf.keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.1)))
    data = tf.data.Dataset.from_tensor_slices((np.arange(8, dtype=np.int64), np.ones(8, np.float32))).batch(4)
    model.fit(data, epochs=1, verbose=0)
    assert int(model.layers[0].params.size()) == 8


def test_an_unseeded_keras_initializer_gives_the_same_rows_in_every_process():
    """Keras 3 gives an unseeded initializer a random seed of its own per
    process; tfde's initial rows must depend on the Variable's name only
    (every worker, and a process that reloads the model, must agree)."""
    import subprocess
    import sys

    code = (
        "import tensorflow as tf, tfde; l = tfde.keras.layers.Embedding(3, "
        "initializer=tf.keras.initializers.RandomNormal(), name='same_name'); "
        "print(l(tf.constant([1, 2], tf.int64)).numpy().round(6).tolist())"
    )
    env = {**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        .stdout.strip()
        .splitlines()[-1]
        for _ in range(2)
    ]
    assert runs[0] == runs[1], runs
