"""The model the save/restore tests train (tests/test_saving*.py and the
processes they start): int64 item ids (2 shards, frequency policy, admission
filter, change tracking) and string user ids, into a Dense layer."""

import numpy as np
import tensorflow as tf

import tfde

K = tf.keras
KEYS = np.arange(0, 120, dtype=np.int64)


def creator_for(backend, tag, mode=0):
    if backend == "cuckoo":
        return None
    return tfde.RedisTableCreator({"model_tag_runtime": tag, "table_store_mode": mode})


def build(backend, tag, optimizer="adam"):
    """A small ranking model: int64 item ids (2 shards, frequency policy,
    admission filter, change tracking) and string user ids."""
    creator = creator_for(backend, tag)
    items = K.Input(shape=(3,), dtype="int64", name="items")
    users = K.Input(shape=(1,), dtype="string", name="user")
    e = tfde.keras.layers.Embedding(
        4,
        name="item_emb",
        num_shards=2,
        table_creator=creator,
        restrict_policy=tfde.FrequencyRestrictPolicy,
        admission_filter=tfde.CounterFilter(2),
        track_changes=True,
    )(items)
    u = tfde.keras.layers.Embedding(3, key_dtype=tf.string, name="user_emb", table_creator=creator, track_changes=True)(
        users
    )
    x = K.layers.Concatenate()([K.layers.Flatten()(e), K.layers.Flatten()(u)])
    out = K.layers.Dense(1, kernel_initializer=K.initializers.GlorotUniform(seed=1))(x)
    model = K.Model([items, users], out)
    opt = {
        "adam": lambda: K.optimizers.Adam(0.05),
        "sgd": lambda: K.optimizers.SGD(0.1, momentum=0.9),
        "ftrl": lambda: K.optimizers.Ftrl(0.1),
    }[optimizer]()
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(opt), loss="mse")
    return model


def data(seed, n=96):
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 120, (n, 3)).astype(np.int64)
    users = np.array([[f"u{i}"] for i in rng.integers(0, 40, n)])
    return [tf.constant(items), tf.constant(users)], rng.random((n, 1)).astype(np.float32)


def train(model, seed, epochs=1, callbacks=(), steps=None):
    """fit on data(seed) in batches of 16 (6 steps an epoch, or `steps` steps)."""
    x, y = data(seed, n=96 if steps is None else 16 * steps)
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))


def layer(model, name):
    return next(lay for lay in model.layers if lay.name == name)


def snapshot(model):
    """Everything a restore must bring back: rows, slots, admission counts,
    tombstones, dense weights, the optimizer's step and predictions."""
    out = {"iterations": int(model.optimizer.iterations.numpy())}
    for name, keys in (("item_emb", tf.constant(KEYS)), ("user_emb", tf.constant([f"u{i}" for i in range(40)]))):
        var = layer(model, name).params
        out[name] = var.lookup(keys).numpy()
        out[f"{name}/size"] = int(var.size())
        for slot_name, slot in var.slots.items():
            out[f"{name}/{slot_name}"] = slot.lookup(keys).numpy()
            out[f"{name}/{slot_name}/size"] = int(slot.size())
        counts = getattr(var.admission_filter, "counts", None)
        if counts is not None:
            out[f"{name}/admission"] = counts.lookup(keys).numpy()
    for i, w in enumerate(model.layers[-1].get_weights()):
        out[f"dense/{i}"] = np.asarray(w)
    out["predict"] = model.predict(data(99)[0], verbose=0)
    return out


def assert_same(got, expected):
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=name)
