"""tfde.compat.tfra used the way a TFRA program uses
tensorflow_recommenders_addons: the same model written through the shim and
written with tfde directly trains to the same rows, slots, policy state and
dense weights; a TFRA redis.config file drives a Redis-backed layer; every
TFRA option tfde does not have is refused with a message naming the fix."""

import json
import os
import sys

import numpy as np
import pytest
import redis
import tensorflow as tf
from distributed_check import redis_tag

import tfde
import tfde.compat.tfra as tfra
from tfde.compat.tfra import dynamic_embedding as de

# The content of the users' redis.config (TFRA's format, as their programs
# read it), kept here so the test does not depend on files outside the repo.
TFRA_REDIS_CONFIG = {
    "redis_connection_mode": 2,
    "redis_master_name": "master",
    "redis_host_ip": ["127.0.0.1"],
    "redis_host_port": [6379],
    "redis_user": "default",
    "redis_password": "",
    "redis_db": 0,
    "redis_read_access_slave": False,
    "redis_connect_keep_alive": False,
    "redis_connect_timeout": 1000,
    "redis_socket_timeout": 1000,
    "redis_conn_pool_size": 20,
    "redis_wait_timeout": 100000000,
    "redis_connection_lifetime": 100,
    "redis_sentinel_user": "default",
    "redis_sentinel_password": "",
    "redis_sentinel_connect_timeout": 1000,
    "redis_sentinel_socket_timeout": 1000,
    "storage_slice_import": 2,
    "storage_slice": 2,
    "using_hash_storage_slice": False,
    "keys_sending_size": 1024,
    "using_md5_prefix_name": False,
    "redis_hash_tags_hypodispersion": True,
    "model_tag_import": "test",
    "redis_hash_tags_import": ["{1}", "{2}"],
    "model_tag_runtime": "movielens.v6",
    "redis_hash_tags_runtime": ["{1}", "{2}"],
    "expire_model_tag_in_seconds": 604800,
    "table_store_mode": 2,
    "model_lib_abs_dir": "/tmp/",
}


@pytest.fixture
def tag():
    with redis_tag() as t:
        yield t


@pytest.fixture
def redis_config_file(tmp_path, tag):
    """The users' redis.config with this test's model tag (so runs never
    share tables)."""
    path = tmp_path / "redis.config"
    path.write_text(json.dumps({**TFRA_REDIS_CONFIG, "model_tag_runtime": tag, "model_tag_import": tag}, indent=2))
    return str(path)


# ------------------------------------------------------------ the module's shape


def test_import_forms_reach_one_module():
    import tfde.compat.tfra.dynamic_embedding as de_module

    assert tfra.dynamic_embedding is de is de_module
    for name in (
        "RedisTableConfig",
        "RedisTableCreator",
        "CuckooHashTableCreator",
        "FileSystemSaver",
        "embedding_lookup",
        "get_variable",
        "Variable",
        "FrequencyRestrictPolicy",
        "TimestampRestrictPolicy",
        "DynamicEmbeddingOptimizer",
        "enable_inference_mode",
    ):
        assert callable(getattr(de, name)), name
    for name in ("Embedding", "SquashedEmbedding", "HvdAllToAllEmbedding", "BasicEmbedding"):
        assert callable(getattr(de.keras.layers, name)), name
    for name in ("DEHvdBroadcastGlobalVariablesCallback", "DEHvdModelCheckpoint", "ModelCheckpoint"):
        assert callable(getattr(de.keras.callbacks, name)), name


@pytest.mark.parametrize(
    "module, name, fix",
    [
        ("de", "HkvHashTableCreator", "use CuckooHashTableCreator"),
        ("de", "TrainableWrapper", "var.step_buffer"),
        ("de", "ModelMode", "lookups outside a training step never touch training state"),
        ("layers", "FieldWiseEmbedding", "SquashedEmbedding per field"),
    ],
)
def test_tfra_names_tfde_lacks_say_what_to_use(module, name, fix):
    where = de if module == "de" else de.keras.layers
    with pytest.raises(AttributeError, match=f"{name} \\(TFRA\\) has no tfde counterpart: .*{fix}"):
        getattr(where, name)
    assert not hasattr(de, "no_such_name")


# ------------------------------------------------------------ a TFRA program's model


class TwoTower(tf.keras.Model):
    """Two towers (string user ids, int64 item ids), a dot product, a logit."""

    def __init__(self, user_embedding, item_embedding):
        super().__init__()
        self.user = tf.keras.Sequential(
            [user_embedding, tf.keras.layers.Dense(8, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))]
        )
        self.item = tf.keras.Sequential(
            [item_embedding, tf.keras.layers.Dense(8, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))]
        )

    def call(self, features):
        return tf.reduce_sum(self.user(features["user"]) * self.item(features["item"]), axis=1)


def _ratings():
    rng = np.random.default_rng(7)
    users = np.array([f"u{i}" for i in rng.integers(0, 40, 256)])
    items = rng.integers(0, 60, 256).astype(np.int64)
    labels = ((rng.random(256) < 0.5) | (items % 3 == 0)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices(({"user": users, "item": items}, labels)).batch(32)


def _train(model, optimizer):
    model.compile(optimizer=optimizer, loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    history = model.fit(_ratings(), epochs=2, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    return model


def _contents(var):
    """{key: row} of a Variable."""
    out = {}
    for keys, rows in var.export():
        for k, r in zip(keys.numpy().tolist(), rows.numpy()):
            out[k] = r
    return out


def _state(model):
    """Rows, every slot (optimizer and restrict policy) and dense weights."""
    state = {}
    for tower in (model.user, model.item):
        var = tower.layers[0].params
        state[var.name] = _contents(var)
        for slot_name, slot in sorted(var.slots.items()):
            state[f"{var.name}/{slot_name}"] = _contents(slot)
        state[f"{var.name}/dense"] = {i: w.numpy() for i, w in enumerate(tower.layers[1].weights)}
    return state


def _assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert sorted(a[name]) == sorted(b[name]), name
        for key in a[name]:
            np.testing.assert_allclose(a[name][key], b[name][key], rtol=1e-6, atol=1e-7, err_msg=f"{name} {key}")


def _tfra_layer(name, key_dtype, kv_creator):
    # As the users' programs write it.
    return de.keras.layers.Embedding(
        embedding_size=16,
        key_dtype=key_dtype,
        value_dtype=tf.float32,
        initializer=tf.random_uniform_initializer(-0.1, 0.1),
        init_capacity=1000,
        restrict_policy=de.FrequencyRestrictPolicy,
        name=name,
        kv_creator=kv_creator,
        devices=["CPU"],
        with_unique=True,
    )


@pytest.mark.keras
def test_tfra_two_tower_trains_like_the_same_model_written_with_tfde():
    creator = de.CuckooHashTableCreator(saver=de.FileSystemSaver(proc_size=1, proc_rank=0))
    shim = _train(
        TwoTower(_tfra_layer("user-embedding", tf.string, creator), _tfra_layer("movie-embedding", tf.int64, creator)),
        de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)),
    )

    def tfde_layer(name, key_dtype):
        return tfde.keras.layers.Embedding(
            16,
            key_dtype=key_dtype,
            initializer=tf.random_uniform_initializer(-0.1, 0.1),
            table_creator=tfde.CuckooTableCreator(expected_rows=1000),
            restrict_policy=tfde.FrequencyRestrictPolicy,
            name=name,
        )

    direct = _train(
        TwoTower(tfde_layer("user-embedding", tf.string), tfde_layer("movie-embedding", tf.int64)),
        tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)),
    )

    layer = shim.user.layers[0]
    assert type(layer) is tfde.keras.layers.Embedding
    assert layer.params.table_creator == tfde.CuckooTableCreator(expected_rows=1000)  # init_capacity presized it
    assert isinstance(layer.params.restrict_policy, tfde.FrequencyRestrictPolicy)
    state = _state(shim)
    assert len(state["user-embedding"]) == 40 and "user-embedding/policy-frequency" in state
    _assert_same_state(state, _state(direct))


@pytest.mark.keras
def test_tfra_layers_save_as_tfde_layers():
    layer = de.keras.layers.SquashedEmbedding(
        4, key_dtype=tf.int64, combiner="mean", init_capacity=10, restrict_policy=de.TimestampRestrictPolicy, name="bag"
    )
    assert type(layer) is tfde.keras.layers.SquashedEmbedding
    config = layer.get_config()
    assert config["table_creator"] == {"class_name": "CuckooTableCreator", "config": {"expected_rows": 10}}
    assert config["restrict_policy"] == {"class_name": "TimestampRestrictPolicy", "config": {"clock": "wall"}}
    clone = tfde.keras.layers.SquashedEmbedding.from_config({**config, "name": "bag2"})
    assert clone.params.restrict_policy.clock == "wall"  # TFRA's timestamps are wall-clock seconds
    ids = tf.constant([[1, 2, 3]], tf.int64)
    assert clone(ids).shape == (1, 4)
    np.testing.assert_allclose(layer(ids), tf.reduce_mean(layer.params.lookup(ids), axis=1))


@pytest.mark.keras
def test_default_initializer_is_tfras_random_normal():
    ids = tf.constant(np.arange(2000), tf.int64)
    layer = de.keras.layers.Embedding(8, name="init-check")
    rows = layer(ids).numpy()
    same = tfde.keras.layers.Embedding(
        8, initializer=tf.keras.initializers.RandomNormal(seed=layer.params.seed), name="other-name"
    )(ids).numpy()
    np.testing.assert_array_equal(rows, same)
    assert abs(rows.std() - 0.05) < 0.003 and abs(rows.mean()) < 0.003


@pytest.mark.keras
def test_hvd_all_to_all_embedding_installs_tfdes_exchange(monkeypatch):
    from tfde.distributed import horovod

    calls = []

    class OneWorker:
        @staticmethod
        def size():
            return 1

    def install():
        calls.append("install")
        return OneWorker

    monkeypatch.setattr(horovod, "install", install)
    layer = de.keras.layers.HvdAllToAllEmbedding(
        embedding_size=4, key_dtype=tf.int64, init_capacity=100, devices=["CPU"], name="a2a", mpi_size=1
    )
    assert calls == ["install"]
    assert type(layer) is tfde.keras.layers.Embedding
    assert layer.params.table_creator == tfde.CuckooTableCreator(expected_rows=100)
    with pytest.raises(tfde.ConfigError, match="mpi_size=2, but Horovod runs 1 workers; drop mpi_size="):
        de.keras.layers.HvdAllToAllEmbedding(embedding_size=4, mpi_size=2)


def test_hvd_names_without_horovod_name_the_install_command(monkeypatch):
    # Horovod made unimportable (None in sys.modules), wherever it is installed.
    for name in ("horovod", "horovod.tensorflow", "horovod.tensorflow.keras"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="HOROVOD_WITH_TENSORFLOW=1"):
        de.keras.layers.HvdAllToAllEmbedding(embedding_size=4)
    with pytest.raises(ImportError, match="HOROVOD_WITH_TENSORFLOW=1"):
        de.keras.callbacks.DEHvdBroadcastGlobalVariablesCallback(root_rank=0)


# ------------------------------------------------------------ Redis, from a TFRA redis.config


def test_redis_config_from_a_tfra_file_every_way_tfra_takes_it(redis_config_file, tag, monkeypatch):
    monkeypatch.delenv(de.TFRA_CONFIG_ENV, raising=False)
    by_keyword = de.RedisTableConfig(redis_config_abs_dir=redis_config_file)
    assert isinstance(by_keyword, tfde.RedisTableConfig)
    assert by_keyword == tfde.RedisTableConfig.from_path(redis_config_file)
    assert (by_keyword.model_tag_runtime, by_keyword.storage_slice, by_keyword.hash_tags()) == (tag, 2, ("{1}", "{2}"))
    assert de.RedisTableConfig(redis_config_file) == by_keyword  # positional, as tfde issue #3 asked
    monkeypatch.setenv("MY_REDIS_CONFIG", redis_config_file)
    assert de.RedisTableConfig(redis_config_abs_dir_env="MY_REDIS_CONFIG") == by_keyword
    overridden = de.RedisTableConfig(
        redis_config_file, redis_host_port=[6380], storage_slice=1, redis_hash_tags_runtime=[]
    )
    assert (overridden.redis_host_port, overridden.storage_slice, overridden.model_tag_runtime) == ((6380,), 1, tag)
    # TFRA lets $TFRA_REDIS_CONFIG_PATH override the path given, and says so.
    other = os.path.join(os.path.dirname(redis_config_file), "other.config")
    with open(other, "w") as f:
        json.dump({"model_tag_runtime": "from-env"}, f)
    monkeypatch.setenv(de.TFRA_CONFIG_ENV, other)
    with pytest.warns(UserWarning, match="TFRA_REDIS_CONFIG_PATH is set, so its file"):
        assert de.RedisTableConfig(redis_config_file).model_tag_runtime == "from-env"
    assert de.RedisTableConfig().model_tag_runtime == "from-env"
    assert de.RedisTableCreator().config.model_tag_runtime == "from-env"
    monkeypatch.delenv(de.TFRA_CONFIG_ENV)
    assert de.RedisTableConfig() == tfde.RedisTableConfig()


def test_redis_config_errors(redis_config_file, monkeypatch):
    monkeypatch.delenv(de.TFRA_CONFIG_ENV, raising=False)
    with pytest.raises(tfde.ConfigError, match=r"unknown Redis config field\(s\) \['redis_hots'\]"):
        de.RedisTableConfig(redis_config_file, redis_hots=["127.0.0.1"])
    with pytest.raises(tfde.ConfigError, match="Redis config file '/nonexistent/redis.config' does not exist"):
        de.RedisTableConfig(redis_config_abs_dir="/nonexistent/redis.config")
    monkeypatch.delenv("UNSET_REDIS_CONFIG_VAR", raising=False)
    with pytest.raises(tfde.ConfigError, match="environment variable UNSET_REDIS_CONFIG_VAR is not set"):
        de.RedisTableConfig(redis_config_abs_dir_env="UNSET_REDIS_CONFIG_VAR")
    with pytest.raises(tfde.ConfigError, match="redis_config_abs_dir must be a path"):
        de.RedisTableConfig(redis_config_abs_dir=42)
    with pytest.raises(tfde.ConfigError, match="redis_host_port 70000 is out of range"):
        de.RedisTableConfig(redis_config_file, redis_host_port=70000)
    with pytest.raises(tfde.ConfigError, match="saver must be de.FileSystemSaver"):
        de.RedisTableCreator(de.RedisTableConfig(redis_config_file), saver="files")


@pytest.mark.keras
def test_redis_layers_from_a_tfra_config_train_like_cuckoo(redis_config_file, tag, monkeypatch):
    monkeypatch.delenv(de.TFRA_CONFIG_ENV, raising=False)
    redis_creator = tfra.dynamic_embedding.RedisTableCreator(
        tfra.dynamic_embedding.RedisTableConfig(redis_config_abs_dir=redis_config_file)
    )
    assert isinstance(redis_creator, tfde.RedisTableCreator)
    on_redis = _train(
        TwoTower(
            _tfra_layer("user-embedding", tf.string, redis_creator),
            _tfra_layer("movie-embedding", tf.int64, redis_creator),
        ),
        de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)),
    )
    layer = on_redis.user.layers[0]
    assert layer.params.table_creator is redis_creator  # init_capacity has no effect on Redis tables
    assert isinstance(layer.params.tables[0], tfde.tables.RedisTable)
    stored = [k for k in redis.Redis().scan_iter(match=f"{tag}:user-embedding/*") if not k.endswith(b":meta")]
    assert sorted(k.decode()[-4:] for k in stored) == [":{1}", ":{2}"]  # the config's two buckets and hash tags
    assert sum(redis.Redis().hlen(k) for k in stored) == 40

    on_cuckoo = _train(
        TwoTower(
            _tfra_layer("user-embedding", tf.string, de.CuckooHashTableCreator()),
            _tfra_layer("movie-embedding", tf.int64, de.CuckooHashTableCreator()),
        ),
        de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)),
    )
    a, b = _state(on_redis), _state(on_cuckoo)
    assert sorted(a) == sorted(b)
    for name in a:
        assert sorted(a[name]) == sorted(b[name]), name
        for key in a[name]:
            np.testing.assert_allclose(a[name][key], b[name][key], rtol=1e-5, atol=1e-6, err_msg=f"{name} {key}")


# ------------------------------------------------------------ variables, lookups, optimizer


def test_tfra_variable_custom_loop_trains_like_tfde():
    def train(var, lookup, opt):
        ids = tf.constant([[1, 2], [2, 3]], tf.int64)
        for _ in range(3):
            with tf.GradientTape() as tape:
                rows, trainable = lookup(var, ids)
                loss = tf.reduce_sum(tf.square(rows - 1.0))
            opt.apply_gradients(zip(tape.gradient(loss, [trainable]), [trainable]))
        return var

    shim_opt = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.5), synchronous=True)
    assert isinstance(shim_opt, tf.keras.optimizers.SGD)
    var = de.get_variable("v", key_dtype=tf.int64, dim=3, init_size=16, devices="/CPU:0")
    assert isinstance(var, tfde.Variable) and var.table_creator == tfde.CuckooTableCreator(expected_rows=16)
    np.testing.assert_array_equal(var.lookup([9]), [[0.0, 0.0, 0.0]])  # TFRA's Variable default: zeros

    shim = train(var, lambda v, ids: de.embedding_lookup(v, ids, name="lookup", return_trainable=True), shim_opt)
    direct = train(
        tfde.Variable("v", dim=3, initializer=0.0),
        lambda v, ids: (tfde.embedding_lookup(v, ids), v.step_buffer),
        tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.5)),
    )
    keys = tf.constant([1, 2, 3], tf.int64)
    np.testing.assert_allclose(shim.lookup(keys), direct.lookup(keys), rtol=1e-6)
    assert int(shim.size()) == 3

    other = de.Variable(
        key_dtype=tf.string, dim=2, name="named", initializer=1.0, kv_creator=de.CuckooHashTableCreator()
    )
    assert other.name == "named" and other.key_dtype == tf.string
    np.testing.assert_array_equal(de.embedding_lookup_unique([other], tf.constant(["a", "a"])), [[1.0, 1.0]] * 2)
    sparse = tf.sparse.from_dense(tf.constant([[1, 2], [3, 0]], tf.int64))
    np.testing.assert_allclose(
        de.embedding_lookup_sparse(shim, sparse, None, combiner="sum"),
        tfde.embedding_lookup_sparse(shim, sparse, combiner="sum"),
    )


@pytest.mark.keras
def test_inference_mode_is_not_needed():
    layer = de.keras.layers.Embedding(4, name="served")
    model = tf.keras.Sequential([layer, tf.keras.layers.Dense(1)])
    model.compile(optimizer=de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam()), loss="mse")
    x, y = tf.constant([[1], [2]], tf.int64), tf.constant([[1.0], [0.0]])
    model.fit(x, y, verbose=0)
    size = int(layer.params.size())
    assert de.enable_inference_mode() is None
    model.predict(tf.constant([[7], [8], [9]], tf.int64), verbose=0)  # new ids, outside training
    assert int(layer.params.size()) == size == 2
    assert int(tf.shape(layer.params.step_buffer)[0]) == 0
    assert de.enable_train_mode() is None
    model.fit(tf.constant([[7]], tf.int64), tf.constant([[1.0]]), verbose=0)
    assert int(layer.params.size()) == 3


@pytest.mark.keras
def test_model_checkpoint_writes_tfde_checkpoints_in_the_filepaths_directory(tmp_path):
    model_dir = tmp_path / "model_dir_0"
    callback = de.keras.callbacks.DEHvdModelCheckpoint(
        filepath=str(model_dir) + "/weights_epoch{epoch:03d}_loss{loss:.4f}",
        options=tf.saved_model.SaveOptions(namespace_whitelist=["TFRA"]),
    )
    assert isinstance(callback, tfde.keras.callbacks.ModelCheckpoint)
    assert (callback.directory, callback.max_to_keep, callback.restore) == (str(model_dir), None, False)

    def build():
        model = tf.keras.Sequential(
            [
                de.keras.layers.Embedding(4, name="ckpt-emb"),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(1, kernel_initializer="ones"),
            ]
        )
        model.compile(optimizer=de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.1)), loss="mse")
        return model

    x, y = tf.constant([[1], [2], [3], [4]], tf.int64), tf.constant([[1.0], [0.0], [1.0], [0.0]])
    model = build()
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[callback])
    steps = sorted(int(p.name[len("ckpt-") :]) for p in model_dir.iterdir() if p.name.startswith("ckpt-"))
    assert steps == [2, 4]  # one per epoch, every one kept
    restored = build()
    restored.build((None, 1))
    tfde.CheckpointManager(str(model_dir), model=restored, optimizer=restored.optimizer).restore()
    keys = tf.constant([1, 2, 3, 4], tf.int64)
    np.testing.assert_allclose(restored.layers[0].params.lookup(keys), model.layers[0].params.lookup(keys))
    assert de.keras.callbacks.DEHvdModelCheckpoint("weights.h5").directory == os.curdir


# ------------------------------------------------------------ refusals, each naming the fix


@pytest.mark.keras
@pytest.mark.parametrize("devices", ["/GPU:0", ["GPU"], ["CPU", "/device:GPU:1"], "TPU"])
def test_gpu_devices_are_refused(devices):
    with pytest.raises(tfde.ConfigError, match="tables live in this process on the CPU; pass devices=\\['CPU'\\]"):
        de.keras.layers.Embedding(4, devices=devices)


@pytest.mark.keras
@pytest.mark.parametrize("devices", ["CPU", "/CPU:0", ["cpu"], ["/job:worker/replica:0/task:0/device:CPU:0"]])
def test_cpu_devices_are_a_no_op(devices):
    assert type(de.keras.layers.Embedding(4, devices=devices)) is tfde.keras.layers.Embedding


@pytest.mark.keras
def test_devices_that_are_not_devices_are_refused():
    with pytest.raises(tfde.ConfigError, match="devices entry 'warp-drive' is not a device string"):
        de.keras.layers.Embedding(4, devices=["warp-drive"])
    with pytest.raises(tfde.ConfigError, match="devices must be a device string or a non-empty list"):
        de.keras.layers.Embedding(4, devices=[])


@pytest.mark.keras
def test_distribute_strategy_must_be_the_one_in_scope():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with pytest.raises(
        tfde.ConfigError,
        match="distribute_strategy=OneDeviceStrategy is not the strategy in scope "
        "\\(no strategy is in scope\\).*inside `with strategy.scope\\(\\):`",
    ):
        de.keras.layers.Embedding(4, distribute_strategy=strategy)
    other = tf.distribute.OneDeviceStrategy("/cpu:0")
    with other.scope():
        with pytest.raises(tfde.ConfigError, match="the strategy in scope is OneDeviceStrategy"):
            de.keras.layers.Embedding(4, distribute_strategy=strategy)
    with strategy.scope():
        layer = de.keras.layers.Embedding(4, distribute_strategy=strategy, name="in-scope")
    assert type(layer) is tfde.keras.layers.Embedding


def test_synchronous_false_is_refused():
    with pytest.raises(
        tfde.ConfigError,
        match="synchronous=False is not supported: tfde always averages dense gradients over Horovod workers",
    ):
        de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(), synchronous=False)
    with pytest.raises(tfde.ConfigError, match="bp_v2=True is not supported"):
        de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(), bp_v2=True)
    with pytest.raises(tfde.ConfigError, match=r"got keyword argument\(s\) \['clipnorm'\] that tfde does not take"):
        de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(), clipnorm=1.0)


def test_tfras_four_argument_accum_names_the_tfde_call():
    """TFRA's var.accum(keys, old_values, new_values, exists) was a bare
    TypeError; it is refused with the call to write, and writes nothing."""
    var = de.get_variable("accum-tfra-form", dim=2)
    keys = tf.constant([1, 2], tf.int64)
    old, new = tf.zeros([2, 2]), tf.ones([2, 2])
    with pytest.raises(
        tfde.ConfigError,
        match=r"TFRA's accum\(keys, old_values, new_values, exists\).*"
        r"call accum\(keys, new_values - old_values\)",
    ):
        var.accum(keys, old, new, tf.constant([True, False]))
    assert int(var.size()) == 0
    var.accum(keys, new - old)  # what the message says to write
    np.testing.assert_array_equal(var.lookup(keys).numpy(), np.ones([2, 2], np.float32))


@pytest.mark.keras
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bp_v2": True}, "bp_v2=True is not supported: tfde's training steps are synchronous"),
        ({"partitioner": lambda keys, n: keys % n}, "partitioner=.* is not supported: tfde routes keys"),
        ({"max_norm": 1.0}, "max_norm=1.0 is not supported: tfde does not clip"),
        ({"checkpoint": False}, "checkpoint=False is not supported: tfde always saves"),
        ({"init_capacity": -1}, "init_capacity must be an int >= 0"),
        ({"kv_creator": "redis"}, "kv_creator must be de.CuckooHashTableCreator"),
        (
            {"kv_creator": tfde.CuckooTableCreator(expected_rows=5), "init_capacity": 7},
            "init_capacity=7 and the kv_creator's expected_rows=5 disagree",
        ),
        ({"warm_start": True}, r"got keyword argument\(s\) \['warm_start'\] that tfde does not take; accepted: "),
    ],
)
def test_unsupported_layer_options_are_refused(kwargs, message):
    with pytest.raises(tfde.ConfigError, match=message):
        de.keras.layers.Embedding(4, **kwargs)


@pytest.mark.keras
def test_squashed_combiners_tfde_lacks_are_refused():
    with pytest.raises(tfde.ConfigError, match="combiner='max' is not supported; tfde combines with one of"):
        de.keras.layers.SquashedEmbedding(4, combiner="max")


def test_saver_and_creator_arguments():
    with pytest.raises(tfde.ConfigError, match="give both proc_size and proc_rank or neither"):
        de.FileSystemSaver(proc_size=2)
    with pytest.raises(tfde.ConfigError, match="0 <= proc_rank < proc_size"):
        de.FileSystemSaver(proc_size=2, proc_rank=2)
    with pytest.raises(tfde.ConfigError, match="save_path='/kv' is not supported: tfde writes no separate KV files"):
        de.FileSystemSaver(save_path="/kv")
    with pytest.raises(tfde.ConfigError, match="saver must be de.FileSystemSaver"):
        de.CuckooHashTableCreator(saver=object())
    assert de.CuckooHashTableCreator(de.CuckooHashTableConfig()) == tfde.CuckooTableCreator()


@pytest.mark.keras
def test_checkpoint_callback_refusals(tmp_path):
    with pytest.raises(tfde.ConfigError, match="save_best_only=True is not supported"):
        de.keras.callbacks.DEHvdModelCheckpoint(str(tmp_path / "w"), save_best_only=True)
    with pytest.raises(tfde.ConfigError, match="signatures=.* is not supported: .*tfde.export_for_serving"):
        de.keras.callbacks.DEHvdModelCheckpoint(str(tmp_path / "w"), signatures={"serve": None})
    with pytest.raises(tfde.ConfigError, match="the directory of filepath=.* is a template"):
        de.keras.callbacks.DEHvdModelCheckpoint(str(tmp_path / "ckpt_{epoch}" / "w"))
    with pytest.raises(tfde.ConfigError, match=r"keyword argument\(s\) \['period'\]"):
        de.keras.callbacks.DEHvdModelCheckpoint(str(tmp_path / "w"), period=2)


@pytest.mark.keras
@pytest.mark.parametrize("layer", ["Embedding", "SquashedEmbedding"])
def test_tfdes_own_layers_name_the_fix_for_tfra_kwargs(layer):
    cls = getattr(tfde.keras.layers, layer)
    with pytest.raises(
        tfde.ConfigError,
        match=f"tfde layer {layer} got TFRA keyword argument\\(s\\) "
        r"\['kv_creator', 'init_capacity'\].*kv_creator: tfde spells it "
        r"table_creator=.*expected_rows=N.*tfde.compat.tfra",
    ):
        cls(4, kv_creator=tfde.CuckooTableCreator(), init_capacity=10)
    for name in ("devices", "distribute_strategy", "with_unique"):
        with pytest.raises(tfde.ConfigError, match=f"\\['{name}'\\].*drop {name}="):
            cls(4, **{name: None})
