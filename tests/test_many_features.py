"""DistributedEmbedding in one process, used the way a ranking model uses it
(docs/distributed.md, "Many features in one layer"): trained with
model.fit, it gives what separate tfde Embedding layers give; it saves and
restores in every way a model saves; bad inputs get errors that change
nothing.  Runs under Keras 3 and tf-keras."""

import numpy as np
import pytest
import tensorflow as tf

import tfde
from tfde.errors import ConfigError, TfdeError

pytestmark = pytest.mark.keras
K = tf.keras
DIM = 4


def configs(threshold_dim=DIM, seed=7):
    user = tfde.TableConfig("user", embedding_dim=DIM, key_dtype=tf.string, seed=seed, expected_rows=500)
    item = tfde.TableConfig("item", embedding_dim=threshold_dim, seed=seed + 1, expected_rows=300)
    cat = tfde.TableConfig("cat", embedding_dim=2, seed=seed + 2, combiner="sum", expected_rows=20)
    return {
        "user": tfde.FeatureConfig(user),
        "item": tfde.FeatureConfig(item),
        "history": tfde.FeatureConfig(item, combiner="mean"),
        "cat": tfde.FeatureConfig(cat),
    }


def data(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "user": np.array([f"u{u}" for u in rng.integers(0, 60, n)]),
        "item": rng.integers(0, 80, n).astype(np.int64),
        "history": rng.integers(0, 80, (n, 3)).astype(np.int64),
        "cat": rng.integers(0, 9, (n, 2)).astype(np.int64),
    }
    y = ((x["item"] + x["cat"][:, 0]) % 2).astype(np.float32)
    return x, y


@K.utils.register_keras_serializable(package="tfde_tests")
class Ranker(K.Model):
    """A dense top over the concatenated features of one DistributedEmbedding."""

    def __init__(self, threshold=None, placement="auto", **kwargs):
        super().__init__(**kwargs)
        self.threshold = threshold
        self.placement = placement
        self.embedding = tfde.keras.layers.DistributedEmbedding(
            configs(), placement=placement, column_slice_threshold=threshold, name="emb"
        )
        self.top = K.layers.Dense(1, kernel_initializer="ones")

    def build(self, input_shape):
        self.top.build((None, 3 * DIM + 2))  # so that load_model builds the top before loading its weights
        self.built = True

    def call(self, inputs, training=None):
        rows = self.embedding(inputs, training=training)
        return self.top(tf.concat([rows[n] for n in ("user", "item", "history", "cat")], 1))

    def get_config(self):
        return {"threshold": self.threshold, "placement": self.placement}


class PerFeature(K.Model):
    """The same model with one tfde Embedding layer per table (the item
    layer called for two features), as a user writes it without the
    collection layer."""

    def __init__(self, seed=7):
        super().__init__()
        self.user = tfde.keras.layers.Embedding(DIM, key_dtype=tf.string, seed=seed, name="user")
        self.item = tfde.keras.layers.Embedding(DIM, seed=seed + 1, name="item")
        self.cat = tfde.keras.layers.Embedding(2, seed=seed + 2, combiner="sum", name="cat")
        self.top = K.layers.Dense(1, kernel_initializer="ones")

    def call(self, inputs, training=None):
        parts = [
            self.user(inputs["user"], training=training),
            self.item(inputs["item"], training=training),
            tf.reduce_mean(self.item(inputs["history"], training=training), 1),
            self.cat(inputs["cat"], training=training),
        ]
        return self.top(tf.concat(parts, 1))


def tensors(x):
    """numpy inputs as tensors (Keras 3's predict refuses numpy unicode arrays)."""
    return {k: tf.constant(v) for k, v in x.items()}


def compiled(model):
    model.compile(
        optimizer=tfde.DynamicEmbeddingOptimizer(K.optimizers.Adam(0.05)),
        loss=K.losses.BinaryCrossentropy(from_logits=True),
    )
    return model


def fit(model, epochs=2):
    x, y = data()
    return model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=epochs, verbose=0)


def table(var):
    out = {}
    for keys, rows in var.export():
        for k, r in zip(keys.numpy().tolist(), rows.numpy()):
            out[k.decode() if isinstance(k, bytes) else int(k)] = r
    return out


def test_one_layer_trains_exactly_like_one_embedding_layer_per_table():
    many = compiled(Ranker())
    apart = compiled(PerFeature())
    h_many, h_apart = fit(many), fit(apart)
    np.testing.assert_allclose(h_many.history["loss"], h_apart.history["loss"], rtol=1e-5)
    assert h_many.history["loss"][-1] < h_many.history["loss"][0]
    by_table = many.embedding.variables_by_table
    for name, layer in (("user", apart.user), ("item", apart.item), ("cat", apart.cat)):
        got, want = table(by_table[name][0]), table(layer.params)
        assert got.keys() == want.keys() and len(got) > 5, name
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    x, _ = data(64, seed=3)  # new ids too: they read their initial rows in both
    np.testing.assert_allclose(
        many.predict(tensors(x), verbose=0), apart.predict(tensors(x), verbose=0), rtol=1e-5, atol=1e-6
    )


def _save(model, kind, path):
    if kind == "keras_file":
        model.save(str(path / "m.keras"))
    elif kind == "weights_file":
        model.save_weights(str(path / "m.weights.h5"))
    elif kind == "tf_checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(path / "ckpt"))
    elif kind == "tfde_manager":
        tfde.saving.CheckpointManager(str(path / "tfde"), model=model, optimizer=model.optimizer).save()


def _restore(kind, path, **kwargs):
    if kind == "keras_file":
        return K.models.load_model(str(path / "m.keras"))
    model = compiled(Ranker(**kwargs))
    x, _ = data(8)
    model(tensors(x))
    model.optimizer.build(model.trainable_variables)
    if kind == "weights_file":
        model.load_weights(str(path / "m.weights.h5"))
    elif kind == "tf_checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(str(path / "ckpt")).assert_consumed()
    elif kind == "tfde_manager":
        assert tfde.saving.CheckpointManager(str(path / "tfde"), model=model, optimizer=model.optimizer).restore()
    return model


@pytest.mark.parametrize("threshold", [None, 3])
@pytest.mark.parametrize("kind", ["keras_file", "weights_file", "tf_checkpoint", "tfde_manager"])
def test_every_way_of_saving_restores_the_tables_and_training_continues_the_same(tmp_path, kind, threshold):
    model = compiled(Ranker(threshold=threshold))
    fit(model, epochs=1)
    _save(model, kind, tmp_path)
    restored = _restore(kind, tmp_path, threshold=threshold)
    x, _ = data(64, seed=5)
    np.testing.assert_allclose(restored.predict(tensors(x), verbose=0), model.predict(tensors(x), verbose=0), rtol=1e-6)
    for name, variables in model.embedding.variables_by_table.items():
        for a, b in zip(variables, restored.embedding.variables_by_table[name]):
            ta, tb = table(a), table(b)
            assert ta.keys() == tb.keys(), name
            for k in ta:
                np.testing.assert_array_equal(ta[k], tb[k])
    # The optimizer's slots came back: one more epoch moves both alike.
    after, again = fit(model, epochs=1), fit(restored, epochs=1)
    np.testing.assert_allclose(after.history["loss"], again.history["loss"], rtol=1e-5)


def test_a_serving_export_answers_like_the_model(tmp_path):
    model = compiled(Ranker(threshold=3))
    fit(model, epochs=1)
    x, _ = data(32, seed=9)
    want = model.predict(tensors(x), verbose=0)
    specs = {
        "user": tf.TensorSpec([None], tf.string),
        "item": tf.TensorSpec([None], tf.int64),
        "history": tf.TensorSpec([None, 3], tf.int64),
        "cat": tf.TensorSpec([None, 2], tf.int64),
    }
    tfde.saving.export_for_serving(model, str(tmp_path / "serving"), input_signature=specs)
    served = tf.saved_model.load(str(tmp_path / "serving"))
    fn = served.signatures["serving_default"]
    # The signature takes the dict's tensors flattened (sorted names) as x, x_1, ...
    flat = tf.nest.flatten(tensors(x))
    got = fn(**{("x" if i == 0 else f"x_{i}"): t for i, t in enumerate(flat)})
    np.testing.assert_allclose(next(iter(got.values())).numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_other_column_slices_is_refused(tmp_path):
    model = compiled(Ranker(threshold=None))
    fit(model, epochs=1)
    _save(model, "tfde_manager", tmp_path)
    with pytest.raises(
        tfde.errors.CheckpointError, match="table 'item': saved as columns \\[\\[0, 4\\]\\], this layer has"
    ):
        _restore("tfde_manager", tmp_path, threshold=3)


def test_get_config_round_trip_keeps_the_tables_shared():
    layer = tfde.keras.layers.DistributedEmbedding(configs(), column_slice_threshold=3, name="emb")
    again = tfde.keras.layers.DistributedEmbedding.from_config(layer.get_config())
    assert again.features["item"].table is again.features["history"].table
    assert [t.name for t in again.table_layers] == [t.name for t in layer.table_layers]
    assert str(again.plan) == str(layer.plan)
    x, _ = data(16)
    out = again(tensors(x))
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "user": (16, 4),
        "item": (16, 4),
        "history": (16, 4),
        "cat": (16, 2),
    }


def test_sparse_ragged_and_sequence_ids_give_the_rows_of_their_ids():
    item = tfde.TableConfig("item", embedding_dim=3, initializer=tf.random_uniform_initializer(seed=1))
    layer = tfde.keras.layers.DistributedEmbedding(
        [
            tfde.FeatureConfig(item, name="dense"),
            tfde.FeatureConfig(item, name="sparse", combiner="sum"),
            tfde.FeatureConfig(item, name="ragged", combiner="mean"),
            tfde.FeatureConfig(item, name="sequence", sequence=True),
        ]
    )
    ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
    dense, sparse, ragged, sequence = layer([tf.constant([1, 3], tf.int64), ids.to_sparse(), ids, ids])
    rows = layer.variables_by_table["item"][0].lookup(tf.constant([1, 2, 3], tf.int64)).numpy()
    np.testing.assert_allclose(dense.numpy(), rows[[0, 2]], rtol=1e-6)
    np.testing.assert_allclose(sparse.numpy(), [rows[0] + rows[1], rows[2]], rtol=1e-6)
    np.testing.assert_allclose(ragged.numpy(), [(rows[0] + rows[1]) / 2, rows[2]], rtol=1e-6)
    np.testing.assert_allclose(sequence.flat_values.numpy(), rows, rtol=1e-6)


@pytest.mark.parametrize(
    "inputs, match",
    [
        (lambda x: {k: v for k, v in x.items() if k != "cat"}, "lack"),
        (lambda x: {**x, "price": x["item"]}, "unknown"),
        (lambda x: [x["user"], x["item"]], "list of 2"),
        (lambda x: {**x, "item": x["user"]}, "item"),
        (lambda x: {**x, "cat": x["cat"].astype(np.float32) + 0.5}, "whole"),
        (lambda x: {**x, "user": x["item"]}, "user"),
    ],
)
def test_a_bad_input_is_refused_with_its_feature_named_and_changes_nothing(inputs, match):
    model = compiled(Ranker())
    fit(model, epochs=1)
    before = {n: table(v[0]) for n, v in model.embedding.variables_by_table.items()}
    x, y = data(64, seed=2)
    with pytest.raises((TfdeError, TypeError, ValueError, tf.errors.InvalidArgumentError), match=match):
        model.train_on_batch(inputs(x), y)
    after = {n: table(v[0]) for n, v in model.embedding.variables_by_table.items()}
    for n in before:
        assert before[n].keys() == after[n].keys(), n
        for k in before[n]:
            np.testing.assert_array_equal(before[n][k], after[n][k])


def test_bad_configs_are_refused():
    item = tfde.TableConfig("item", embedding_dim=4)
    with pytest.raises(ConfigError, match="placement"):
        tfde.keras.layers.DistributedEmbedding({"item": tfde.FeatureConfig(item)}, placement="greedy")
    with pytest.raises(ConfigError, match="two different TableConfigs"):
        tfde.keras.layers.DistributedEmbedding(
            {"a": tfde.FeatureConfig(item), "b": tfde.FeatureConfig(tfde.TableConfig("item", embedding_dim=4))}
        )
    with pytest.raises(ConfigError, match="named 'item'"):
        tfde.keras.layers.DistributedEmbedding([tfde.FeatureConfig(item), tfde.FeatureConfig(item)])
    policed = tfde.TableConfig("wide", embedding_dim=8, restrict_policy=tfde.FrequencyRestrictPolicy)
    with pytest.raises(ConfigError, match="column slices"):
        tfde.keras.layers.DistributedEmbedding([tfde.FeatureConfig(policed)], column_slice_threshold=4)
    with pytest.raises(ConfigError):
        tfde.keras.layers.DistributedEmbedding({})


def test_scalar_ids_are_refused_with_the_feature_named():
    item = tfde.TableConfig("item", embedding_dim=2)
    layer = tfde.keras.layers.DistributedEmbedding({"item": tfde.FeatureConfig(item)})
    with pytest.raises(tfde.errors.ShapeError, match="feature 'item': ids must have a batch axis, got a scalar"):
        layer({"item": tf.constant(3, tf.int64)})
