"""tfrs models as TFRA users write them (tests/README: the programs of TFRA
issue #365), in one process: a two-tower retrieval model whose
FactorizedTopK metric maps the item tower over the candidates, exactly as
written there (`candidate_dataset.map(item_model)`, training=None, inside a
tf.data function).  The metric must never touch training state: training
with it gives the same tables and weights as training without it, run after
run, and its values equal the metric computed with training=False.

tfrs needs tf-keras: this module runs in the tf-keras run of scripts/test.sh
(TF_USE_LEGACY_KERAS=1; conftest.py leaves it out of the Keras 3 run and says
so in the report header).  The multi-process versions are in
tests/test_distributed.py and tests/horovod/."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_recommenders as tfrs
from distributed_check import redis_tag

import tfde

pytestmark = pytest.mark.keras

USERS = np.array([f"user{i}" for i in range(300)])
MOVIES = np.array([f"movie title {i}" for i in range(500)])


def ratings(n=640, seed=3):
    rng = np.random.default_rng(seed)
    return {"user_id": USERS[rng.zipf(1.4, n) % len(USERS)], "movie_title": MOVIES[rng.zipf(1.3, n) % len(MOVIES)]}


class TwoTowerModel(tfrs.Model):
    """As the programs write it: compute_loss calls the towers without training=."""

    def __init__(self, user_model, item_model, task):
        super().__init__()
        self.user_model, self.item_model, self.task = user_model, item_model, task

    def compute_loss(self, features, training=False):
        return self.task(self.user_model(features["user_id"]), self.item_model(features["movie_title"]))


def tower(name, creator):
    return tf.keras.Sequential(
        [
            tfde.keras.layers.Embedding(
                32,
                key_dtype=tf.string,
                initializer=tf.random_uniform_initializer(),
                name=name,
                table_creator=creator,
                restrict_policy=tfde.FrequencyRestrictPolicy,
            ),
            # Seeded: the metric's map builds the item tower before training, and
            # unseeded weights would then draw other initial values.
            tf.keras.layers.Dense(
                32, activation="gelu", kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2)
            ),
            tf.keras.layers.Dense(16, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3)),
            tf.keras.layers.Lambda(lambda x: tf.math.l2_normalize(x, axis=1)),
        ],
        name=f"{name}_model",
    )


def build(creator=None, metric="program"):
    """metric: "program" (candidates.map(item_model)), "eval" (the same with
    training=False), or None (no metric)."""
    tf.keras.utils.set_random_seed(1)
    user_model, item_model = tower("user-embedding", creator), tower("movie-embedding", creator)
    candidates = tf.data.Dataset.from_tensor_slices(MOVIES).batch(128)
    metrics = None
    if metric == "program":
        metrics = tfrs.metrics.FactorizedTopK(candidates.map(item_model))
    elif metric == "eval":
        metrics = tfrs.metrics.FactorizedTopK(candidates.map(lambda x: item_model(x, training=False)))
    model = TwoTowerModel(user_model, item_model, tfrs.tasks.Retrieval(metrics=metrics))
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)))
    return model


def train(model):
    data = tf.data.Dataset.from_tensor_slices(ratings()).batch(64)
    history = model.fit(data, epochs=1, verbose=0)
    return history.history


def state(model):
    out = {}
    for tower_model in (model.user_model, model.item_model):
        var = tower_model.layers[0].params
        for name, v in [("rows", var)] + sorted(var.slots.items()):
            keys, rows = [], []
            for k, r in v.export():
                keys += k.numpy().tolist()
                rows.append(r.numpy())
            order = np.argsort(keys)
            out[f"{var.name}/{name}"] = (np.array(keys)[order], np.concatenate(rows)[order])
        out[f"{var.name}/step_buffer"] = var.step_buffer.numpy()
        out[f"{tower_model.name}/dense"] = [w.numpy() for w in tower_model.trainable_weights[1:]]
    return out


def assert_same_state(a, b):
    assert set(a) == set(b)
    for name in a:
        if name.endswith("/dense"):
            for x, y in zip(a[name], b[name]):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=name)
        elif name.endswith("/step_buffer"):
            assert a[name].shape[0] == 0 and b[name].shape[0] == 0, f"{name} not emptied after training"
        else:
            np.testing.assert_array_equal(a[name][0], b[name][0], err_msg=name)
            np.testing.assert_allclose(a[name][1], b[name][1], rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_programs_metric_never_touches_training_twenty_runs_in_a_row():
    """Before: one run in three failed (`indices[0] = 7903 is not in [0, 0)`):
    the metric's tf.data function wrote into the step buffer while the step
    used it."""
    reference = build(metric=None)
    train(reference)
    expected = state(reference)
    for run in range(20):
        model = build(metric="program")
        history = train(model)
        assert np.isfinite(history["loss"]).all(), (run, history)
        assert_same_state(expected, state(model))


def test_the_programs_metric_equals_the_metric_with_training_false():
    model = build(metric="program")
    train(model)
    evaluation = tf.data.Dataset.from_tensor_slices(ratings(256, seed=5)).batch(64)
    seen = model.evaluate(evaluation, return_dict=True, verbose=0)
    # The same towers, the metric computed with training=False.
    model.task = tfrs.tasks.Retrieval(
        metrics=tfrs.metrics.FactorizedTopK(
            tf.data.Dataset.from_tensor_slices(MOVIES).batch(128).map(lambda x: model.item_model(x, training=False))
        )
    )
    model.compile(optimizer=model.optimizer)
    expected = model.evaluate(evaluation, return_dict=True, verbose=0)
    top = [k for k in expected if "top_" in k]
    assert top, expected
    assert 0 < expected["factorized_top_k/top_100_categorical_accuracy"] < 1, expected
    for k in top:
        assert seen[k] == pytest.approx(expected[k], abs=1e-6), (k, seen, expected)


def test_the_programs_metric_with_redis_tables():
    with redis_tag() as tag:
        creator = lambda run: tfde.RedisTableCreator({"model_tag_runtime": f"{tag}-{run}"})  # noqa: E731
        reference = build(creator(0), metric=None)
        train(reference)
        expected = state(reference)
        for run in range(1, 4):
            model = build(creator(run), metric="program")
            train(model)
            assert_same_state(expected, state(model))


def test_a_lookup_in_a_dataset_function_says_training_true_and_still_reads_plainly():
    """Whatever `training` says, a lookup in a tf.data function is not part
    of a training step."""
    layer = tfde.keras.layers.Embedding(4, key_dtype=tf.string, initializer=1.0)
    with tf.GradientTape():  # recording while tf.data traces the function
        out = tf.data.Dataset.from_tensor_slices(MOVIES[:10]).batch(5).map(lambda x: layer(x, training=True))
        rows = np.concatenate([r.numpy() for r in out])
    np.testing.assert_array_equal(rows, np.ones([10, 4]))
    assert layer.params.step_buffer.numpy().shape[0] == 0
