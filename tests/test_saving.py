"""Save and restore: every way a user saves (tf.train.Checkpoint and its
manager, model.save / load_model, save_weights / load_weights, Keras's and
tfde's ModelCheckpoint callbacks, tfde.saving.CheckpointManager) round-trips
rows, every optimizer slot, policy state, admission state and the optimizer's
step, on the cuckoo and Redis backends, under Keras 3 and tf-keras (this file
runs under both).  Training after a restore continues exactly as without the
save/restore.  Bad files give a CheckpointError naming the file."""

import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from distributed_check import redis_tag
from saving_model import K, assert_same, build, creator_for, layer, snapshot, train

import tfde

pytestmark = pytest.mark.keras


@pytest.fixture
def tag():
    with redis_tag() as t:
        yield t


def save(model, kind, path):
    if kind == "keras_file":
        model.save(str(path / "model.keras"))
    elif kind == "weights_file":
        model.save_weights(str(path / "model.weights.h5"))
    elif kind == "tf_checkpoint":
        tf.train.CheckpointManager(
            tf.train.Checkpoint(model=model, optimizer=model.optimizer), str(path / "tf"), max_to_keep=2
        ).save()
    elif kind == "tfde_manager":
        tfde.saving.CheckpointManager(str(path / "tfde"), model=model, optimizer=model.optimizer).save()


def restore(kind, path, backend, tag):
    if kind == "keras_file":
        return K.models.load_model(str(path / "model.keras"))
    model = build(backend, tag)
    if kind == "weights_file":
        # Keras restores optimizer variables only into a built optimizer.
        model.optimizer.build(model.trainable_variables)
        model.load_weights(str(path / "model.weights.h5"))
    elif kind == "tf_checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(
            tf.train.latest_checkpoint(str(path / "tf"))
        ).expect_partial()
    elif kind == "tfde_manager":
        assert tfde.saving.CheckpointManager(str(path / "tfde"), model=model, optimizer=model.optimizer).restore()
    return model


@pytest.mark.parametrize("backend", ["cuckoo", "redis"])
@pytest.mark.parametrize("kind", ["keras_file", "weights_file", "tf_checkpoint", "tfde_manager"])
def test_round_trip_continues_training_exactly(tmp_path, tag, backend, kind):
    model = build(backend, tag)
    train(model, 0, epochs=2)
    save(model, kind, tmp_path)
    saved = snapshot(model)
    train(model, 1)
    expected = snapshot(model)

    restored = restore(kind, tmp_path, backend, tag)  # with Redis: the same tables, refilled by the restore
    if kind == "weights_file":  # Keras's load_weights does not restore the step of an optimizer built empty
        restored.optimizer.iterations.assign(saved["iterations"])
    got = snapshot(restored)
    assert_same(got, saved)
    assert {"m", "v", "policy-frequency", "changes-step"} <= set(layer(restored, "item_emb").params.slots)
    train(restored, 1)
    assert_same(snapshot(restored), expected)


@pytest.mark.parametrize("callback", ["keras", "tfde"])
def test_checkpoint_callbacks(tmp_path, tag, callback):
    model = build("cuckoo", tag)
    if callback == "keras":
        cb = K.callbacks.ModelCheckpoint(str(tmp_path / "model.keras"), save_freq="epoch")
    else:
        cb = tfde.keras.callbacks.ModelCheckpoint(str(tmp_path / "ck"), save_freq=4, max_to_keep=2)
    train(model, 0, epochs=2, callbacks=[cb])  # 12 steps
    saved = snapshot(model)
    train(model, 1)
    expected = snapshot(model)
    if callback == "keras":
        restored = K.models.load_model(str(tmp_path / "model.keras"))
    else:
        assert [os.path.basename(p) for p in cb.manager.checkpoints] == ["ckpt-000000008", "ckpt-000000012"]
        restored = build("cuckoo", tag)
        resume = tfde.keras.callbacks.ModelCheckpoint(str(tmp_path / "ck"), save_freq=1000, restore=True)
        train(restored, 1, callbacks=[resume])  # restores on train begin, then trains
        assert resume.restored_from.endswith("ckpt-000000012")
        assert_same(snapshot(restored), expected)
        return
    assert_same(snapshot(restored), saved)
    train(restored, 1)
    assert_same(snapshot(restored), expected)


def test_redis_store_mode_2_checkpoints_hold_no_rows(tmp_path, tag):
    var = tfde.Variable("m2", dim=2, initializer=0.0, table_creator=creator_for("redis", tag, mode=2))
    var.upsert(tf.constant([1, 2], tf.int64), tf.ones([2, 2]))
    path = tf.train.Checkpoint(var=var).save(str(tmp_path / "ck"))
    names = [n for n, _ in tf.train.list_variables(path)]
    assert not any("/rows/" in n for n in names), names
    var.upsert(tf.constant([3], tf.int64), tf.ones([1, 2]))
    tf.train.Checkpoint(var=var).restore(path)
    assert int(var.size()) == 3  # Redis is the source of truth: the restore leaves it alone


def test_restore_into_another_dim_is_refused(tmp_path):
    var = tfde.Variable("dims", dim=2, initializer=0.0)
    var.upsert(tf.constant([1], tf.int64), tf.ones([1, 2]))
    path = tf.train.Checkpoint(var=var).save(str(tmp_path / "ck"))
    other = tfde.Variable("dims", dim=3)
    with pytest.raises(tfde.CheckpointError, match="dim 2 .*dim 3"):
        tf.train.Checkpoint(var=other).restore(path)


def _two_table_model(dims, learning_rate):
    """Two tables; each tower's score is its row's sum, so no dense weight
    depends on a table's dim."""
    ids = {name: K.Input(shape=(), dtype=tf.int64, name=name) for name in ("user", "item")}
    scores = [
        K.layers.Lambda(lambda x: tf.reduce_sum(x, axis=1, keepdims=True))(
            tfde.keras.layers.Embedding(dims[name], key_dtype=tf.int64, name=f"r-{name}")(ids[name])
        )
        for name in ("user", "item")
    ]
    model = K.Model(ids, K.layers.Dense(1, name="r-out")(K.layers.Concatenate()(scores)))
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(K.optimizers.Adam(learning_rate)), loss="mse")
    x = {"user": np.arange(64) % 7, "item": np.arange(64) % 5}
    model.fit(x, np.ones(64, "float32"), batch_size=16, verbose=0)
    return model


def _rows(model, name):
    var = model.get_layer(name).params
    return {int(k): r for keys, rows in var.export() for k, r in zip(keys.numpy(), rows.numpy())}


@pytest.mark.keras
@pytest.mark.parametrize("changed", ["user", "item"])
def test_a_restore_refused_by_one_table_changes_no_table_and_no_dense_variable(tmp_path, changed):
    """One table's dim changed between runs: the restore is refused, and
    neither the other table (whichever is restored first) nor the step,
    the learning rate or the dense weights take the checkpoint's values
    (TensorFlow restores dense variables before tfde's tables: the step
    went 5 -> 2 and the learning rate 0.001 -> 0.5 under Keras 3)."""
    saved = _two_table_model({"user": 4, "item": 4}, learning_rate=0.5)
    tfde.CheckpointManager(str(tmp_path / "ck"), model=saved, optimizer=saved.optimizer).save()
    model = _two_table_model({"user": 4, "item": 4, changed: 8}, learning_rate=0.001)
    before = (
        int(model.optimizer.iterations),
        float(model.optimizer.learning_rate),
        [w.copy() for w in model.get_layer("r-out").get_weights()],
        {name: _rows(model, name) for name in ("r-user", "r-item")},
    )
    # Checked before TensorFlow's read: under tf-keras, TensorFlow's own check of the layer's step buffer
    # (shape [None, dim]) came first, with "incompatible tensor with shape (0, 4)".
    with pytest.raises(tfde.CheckpointError, match=f"'r-{changed}' was saved with rows of dim 4 .* holds dim 8"):
        tfde.CheckpointManager(str(tmp_path / "ck"), model=model, optimizer=model.optimizer).restore()
    assert int(model.optimizer.iterations) == before[0] == 4
    assert float(model.optimizer.learning_rate) == before[1]
    for got, want in zip(model.get_layer("r-out").get_weights(), before[2]):
        np.testing.assert_array_equal(got, want)
    for name, rows_before in before[3].items():
        rows = _rows(model, name)
        assert rows.keys() == rows_before.keys(), name
        for k in rows:
            np.testing.assert_array_equal(rows[k], rows_before[k], name)


def test_large_tables_are_written_in_chunks(tmp_path, monkeypatch):
    """A table larger than one chunk is written as several bundle tensors
    (saving needs memory for a chunk, not the table) and reads back whole."""
    from tfde.saving import format as fmt

    monkeypatch.setattr(fmt, "CHUNK_BYTES", 4096)  # 4 KiB chunks: 31 rows of dim 32
    var = tfde.Variable("chunky", dim=32, initializer=0.0)
    keys = tf.range(1000, dtype=tf.int64)
    var.upsert(keys, tf.random.stateless_uniform([1000, 32], seed=[1, 2]))
    expected = var.lookup(keys).numpy()
    path = tfde.saving.CheckpointManager(str(tmp_path), var=var).save(step=1)
    chunks = [n for n, _ in tf.train.list_variables(os.path.join(path, "worker-00000-of-00001")) if "/rows/rows/" in n]
    assert len(chunks) == -(-1000 // fmt.chunk_rows(32, tf.float32)) > 30
    var.clear()
    tfde.saving.CheckpointManager(str(tmp_path), var=var).restore()
    np.testing.assert_array_equal(var.lookup(keys).numpy(), expected)


# ------------------------------------------------------------ damaged files


def _saved_var(tmp_path):
    var = tfde.Variable("damaged", dim=8, initializer=0.0)
    # A recognisable row pattern, to find the data file that holds the rows.
    var.upsert(tf.range(500, dtype=tf.int64), tf.fill([500, 8], 12345.678))
    return var


def _file_holding_rows(directory):
    marker = np.full(8, 12345.678, np.float32).tobytes()
    for f in sorted(glob.glob(os.path.join(directory, "**", "*.data-*"), recursive=True)):
        data = open(f, "rb").read()
        if marker in data:
            return f, data.index(marker)
    raise AssertionError("no data file holds the rows")


def test_corrupted_tfde_checkpoint_names_the_file(tmp_path):
    var = _saved_var(tmp_path)
    manager = tfde.saving.CheckpointManager(str(tmp_path), var=var)
    manager.save(step=1)
    f, at = _file_holding_rows(str(tmp_path))
    with open(f, "r+b") as fh:  # flip one byte inside the rows, same size
        fh.seek(at + 3)
        b = fh.read(1)
        fh.seek(at + 3)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(tfde.CheckpointError, match=r"worker-00000-of-00001.*(corrupted|Checksum|CRC)"):
        manager.restore()


def test_truncated_tfde_checkpoint_names_the_file(tmp_path):
    var = _saved_var(tmp_path)
    manager = tfde.saving.CheckpointManager(str(tmp_path), var=var)
    manager.save(step=1)
    f, _ = _file_holding_rows(str(tmp_path))
    os.truncate(f, os.path.getsize(f) // 2)
    with pytest.raises(tfde.CheckpointError, match=f"{os.path.basename(f)} has .* bytes.*truncated"):
        manager.restore()


def test_corrupted_tf_checkpoint_names_the_file(tmp_path):
    var = _saved_var(tmp_path)
    path = tf.train.Checkpoint(var=var).save(str(tmp_path / "ck"))
    f, at = _file_holding_rows(str(tmp_path))
    with open(f, "r+b") as fh:
        fh.seek(at + 5)
        fh.write(b"\x00\x01\x02")
    with pytest.raises(tfde.CheckpointError, match=r"ck-1.*(corrupted|Checksum)"):
        tf.train.Checkpoint(var=var).restore(path)


def test_corrupted_keras_weights_file_fails_its_crc(tmp_path, tag):
    import h5py

    model = build("cuckoo", tag)
    train(model, 0)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    with h5py.File(path, "r+") as f:
        found = []
        f.visititems(lambda name, obj: found.append(name) if name.endswith("rows.rows.0") else None)
        assert found, "no tfde rows in the weights file"
        data = f[found[0]][...]
        data[0, 0] += 1.0
        f[found[0]][...] = data
    # Keras 3 wraps the CheckpointError in a ValueError that quotes it.
    with pytest.raises((tfde.CheckpointError, ValueError), match="layer 'item_emb'.*fails its CRC32 check"):
        build("cuckoo", tag).load_weights(path)


def test_distributed_shard_alone_is_refused():
    from tfde.saving import format as fmt
    from tfde.saving import state

    class OneShard(fmt.ChunkReader):
        where = "ckpt/worker-00000-of-00002"

        def meta(self):
            return fmt.VariableMeta("v", "int64", {}, worker=0, workers=2, sharded=True)

    with pytest.raises(tfde.CheckpointError, match="worker 0's shard .* written by 2 workers.*CheckpointManager"):
        state.restore_variable(tfde.Variable("v", dim=1), [OneShard()])


def test_newer_format_is_refused():
    from tfde.saving import format as fmt

    with pytest.raises(tfde.CheckpointError, match="format 99, this tfde reads format 1"):
        fmt.VariableMeta.from_json('{"format": 99}', "some/file")


def test_fresh_process_loads_without_importing_tfde_keras_first(tmp_path, tag):
    """keras.models.load_model after a plain `import tfde` finds the layers
    and the wrapped optimizer (registered on import)."""
    import subprocess
    import sys

    model = build("cuckoo", tag)
    train(model, 0)
    model.save(str(tmp_path / "m.keras"))
    code = (
        "import tensorflow as tf, tfde; m = tf.keras.models.load_model(%r); "
        "print(type(m.optimizer).__mro__[1].__name__, int(m.optimizer.iterations))" % str(tmp_path / "m.keras")
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["DynamicEmbeddingMixin", "6"], out.stdout


@pytest.mark.parametrize(
    "key_dtype,value_dtype",
    [(tf.int32, tf.float16), (tf.string, tf.bfloat16), (tf.int64, tf.float64)],
    ids=lambda d: d.name,
)
def test_every_dtype_round_trips_into_another_shard_count(tmp_path, key_dtype, value_dtype):
    keys = tf.constant([f"k{i}" for i in range(300)]) if key_dtype == tf.string else tf.range(300, dtype=key_dtype) * 7
    var = tfde.Variable("dtypes", key_dtype=key_dtype, value_dtype=value_dtype, dim=3, initializer=0.0, num_shards=3)
    var.upsert(keys, tf.cast(tf.random.stateless_normal([300, 3], seed=[4, 2]), value_dtype))
    path = tf.train.Checkpoint(var=var).save(str(tmp_path / "ck"))
    fresh = tfde.Variable(
        "dtypes", key_dtype=key_dtype, value_dtype=value_dtype, dim=3, initializer=0.0, num_shards=2
    )  # keys are routed again on restore
    tf.train.Checkpoint(var=fresh).restore(path)
    assert int(fresh.size()) == 300
    np.testing.assert_array_equal(fresh.lookup(keys).numpy(), var.lookup(keys).numpy())


@pytest.mark.parametrize("value_dtype", [tf.float16, tf.bfloat16, tf.float64], ids=lambda d: d.name)
@pytest.mark.parametrize("kind", ["keras_file", "weights_file"])
def test_every_value_dtype_round_trips_through_a_keras_file(tmp_path, kind, value_dtype):
    """tf-keras's h5 store keeps a bfloat16 array as opaque 2-byte records
    (no dtype), which loading used to refuse ("No cast function
    available"); every value dtype loads back bit for bit, in both Keras."""

    def make():
        ids = K.Input(shape=(2,), dtype="int64")
        emb = tfde.keras.layers.Embedding(4, value_dtype=value_dtype, name="emb")
        vec = K.layers.Activation("linear", dtype="float32")(K.layers.Flatten()(emb(ids)))
        model = K.Model(ids, K.layers.Dense(1)(vec))
        model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(K.optimizers.Adam(0.01)), loss="mse")
        return model

    model = make()
    model.fit(np.arange(16, dtype=np.int64).reshape(8, 2), np.ones((8, 1), np.float32), verbose=0)
    keys = tf.range(16, dtype=tf.int64)
    before = model.get_layer("emb").params.lookup(keys)
    if kind == "keras_file":
        model.save(str(tmp_path / "model.keras"))
        loaded = K.models.load_model(str(tmp_path / "model.keras"))
    else:
        model.save_weights(str(tmp_path / "model.weights.h5"))
        loaded = make()
        loaded.load_weights(str(tmp_path / "model.weights.h5"))
    after = loaded.get_layer("emb").params.lookup(keys)
    assert after.dtype == value_dtype and int(loaded.get_layer("emb").params.size()) == 16
    np.testing.assert_array_equal(
        tf.bitcast(after, tf.uint16 if value_dtype.size == 2 else tf.uint64).numpy(),
        tf.bitcast(before, tf.uint16 if value_dtype.size == 2 else tf.uint64).numpy(),
    )


def test_a_savedmodel_holding_a_training_table_is_refused(tmp_path):
    """A SavedModel would recreate a training table empty on load, so it
    would serve initial rows: Keras 3's model.export and tf.saved_model.save
    of a module that holds a table are refused, pointing to
    tfde.export_for_serving, and write nothing."""
    from tfde.flavour import IS_KERAS3

    ids = K.Input(shape=(), dtype="int64")
    emb = tfde.keras.layers.Embedding(4, initializer="zeros", name="emb")
    model = K.Model(ids, emb(ids))
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(K.optimizers.SGD(1.0)), loss="mse")
    model.fit(tf.constant([1, 2, 3], tf.int64), np.ones((3, 4), np.float32), batch_size=3, verbose=0)
    if IS_KERAS3:  # tf-keras's export refuses the untracked table itself
        with pytest.raises(tfde.ConfigError, match="export_for_serving"):
            model.export(str(tmp_path / "export"))
        assert not (tmp_path / "export" / "saved_model.pb").exists()

    module = tf.Module()
    module.table = emb.params.tables[0]
    module.serve = tf.function(lambda k: emb.params.lookup(k), input_signature=[tf.TensorSpec([None], tf.int64)])
    with pytest.raises(tfde.ConfigError, match="would be recreated empty .* tfde.export_for_serving"):
        tf.saved_model.save(module, str(tmp_path / "module"))
    assert not (tmp_path / "module" / "saved_model.pb").exists()
    tfde.export_for_serving(model, str(tmp_path / "served"))  # the way that works
    assert (tmp_path / "served" / "saved_model.pb").exists()


@pytest.mark.parametrize(
    "variable,value",
    [
        ("TF_CONFIG", {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}}),
        ("HOROVOD_SIZE", "2"),
    ],
    ids=["tf_config", "horovod"],
)
def test_a_manager_that_cannot_see_its_job_refuses_to_save(tmp_path, monkeypatch, variable, value):
    """A CheckpointManager made outside strategy.scope() in a job of two
    workers used to have both write 'worker-00000-of-00001' into the same
    directory (and crash). Now it refuses before writing anything; alone,
    or as one worker of a job of one, it saves."""
    model = build("cuckoo", None)
    train(model, 0)
    monkeypatch.setenv(variable, json.dumps(value) if isinstance(value, dict) else value)
    manager = tfde.saving.CheckpointManager(str(tmp_path / "ck"), model=model, optimizer=model.optimizer)
    with pytest.raises(tfde.ConfigError, match=rf"one of 2 workers \({variable}\).* strategy\.scope\(\)"):
        manager.save()
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
    monkeypatch.delenv(variable)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker"}}))
    assert os.path.isdir(manager.save())
