"""The Redis backend against real redis-server processes on loopback: config
handling, errors, pipelining and training through it.  (The shared table
suite in test_tables.py also runs against Redis.)"""

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.cluster
import redis_servers
import tensorflow as tf

import tfde
from tfde.tables.redis_table import RedisTable

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "redis.json"


@pytest.fixture
def tag():
    t = f"tfde-test-{uuid.uuid4().hex[:12]}"
    yield t
    client = redis.Redis()
    keys = [k for pattern in (f"{t}:*", f"tfde-*:{t}:*") for k in client.scan_iter(match=pattern)]
    if keys:
        client.delete(*keys)


@pytest.fixture
def protected_server():
    """A redis-server of our own on a free loopback port, with a password."""
    return redis_servers.standalone(["--requirepass", "s3cret"])


# ------------------------------------------------------------ config


def test_tfra_config_file_loads_unchanged():
    cfg = tfde.RedisTableConfig.from_path(str(CONFIG))
    assert cfg.redis_connection_mode == 2 and cfg.storage_slice == 2
    assert cfg.hash_tags() == ("{1}", "{2}") and cfg.redis_host_port == (6379,)


def test_config_from_env_and_dict(monkeypatch):
    monkeypatch.setenv("TFDE_REDIS_CONFIG", str(CONFIG))
    assert tfde.RedisTableConfig.load(None).model_tag_runtime == "movielens.v6"
    assert tfde.RedisTableConfig.load({"redis_host_port": 6380}).redis_host_port == (6380,)


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", "is not valid JSON at line 1"),
        ('{"storage_slice": 2, // two buckets\n "redis_db": 0}', "JSON has no comments"),
        ('{"redis_host_port": [70000]}', "redis_host_port 70000 is out of range; expected 1..65535"),
        ('{"redis_host_ip": []}', "redis_host_ip is empty"),
        ('{"storage_slice": "2"}', "storage_slice must be an int"),
        ('{"redis_connection_mode": 5}', "redis_connection_mode must be 0 \\(cluster\\), 1 \\(sentinel\\) or 2"),
        ('{"storage_slice": 3, "redis_hash_tags_runtime": ["{1}", "{2}"]}', "has 2 tags for 3 buckets"),
        ('{"redis_hash_tags_runtime": ["x"]}', "is not a Redis hash tag"),
        # One hash for two buckets stored every key twice: size() 40 after 20 keys, each exported twice.
        ('{"storage_slice": 2, "redis_hash_tags_runtime": ["{1}", "{1}"]}', r"names \['\{1\}'\] for more than one"),
        ('{"storage_slice_import": 2, "redis_hash_tags_import": ["{a}", "{a}"]}', "redis_hash_tags_import names"),
        ('{"redis_password": 12345}', "redis_password must be a str, got <hidden>"),
    ],
)
def test_bad_config_files(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(tfde.ConfigError, match=match) as info:
        tfde.RedisTableConfig.from_path(str(path))
    assert "12345" not in str(info.value)


def test_missing_config_file():
    with pytest.raises(tfde.ConfigError, match="does not exist"):
        tfde.RedisTableConfig.from_path("/nonexistent/redis.json")


def test_unknown_field_warns():
    with pytest.warns(UserWarning, match=r"unknown Redis config field\(s\) \['redis_typo'\]"):
        tfde.RedisTableConfig.from_dict({"redis_typo": 1})


def test_password_never_shown():
    cfg = tfde.RedisTableConfig.from_dict({"redis_password": "hunter2", "redis_sentinel_password": "x9x9"})
    assert "hunter2" not in repr(cfg) and "x9x9" not in repr(cfg)
    assert "hunter2" not in json.dumps(tfde.RedisTableCreator(cfg).get_config())


def test_cluster_mode_against_a_standalone_server():
    with pytest.raises(tfde.ConfigError, match="is 0 \\(cluster\\) but 127.0.0.1:6379 is not a cluster node"):
        tfde.RedisTableCreator({"redis_connection_mode": 0}).create("t", tf.int64, tf.float32, 2)


# ------------------------------------------------------------ server errors


def test_wrong_password_is_a_clear_error(protected_server):
    creator = tfde.RedisTableCreator({"redis_host_port": protected_server, "redis_password": "wrong-pw"})
    with pytest.raises(tfde.ConfigError, match="refused the credentials of user 'default'") as info:
        creator.create("t", tf.int64, tf.float32, 2)
    assert "wrong-pw" not in str(info.value)
    ok = tfde.RedisTableCreator({"redis_host_port": protected_server, "redis_password": "s3cret"})
    t = ok.create("t", tf.int64, tf.float32, 2)
    t.insert(tf.constant([1], tf.int64), tf.ones([1, 2]))
    assert int(t.size()) == 1


def test_unreachable_server_is_retried_then_named():
    port = redis_servers.free_port()  # nothing listens there
    creator = tfde.RedisTableCreator(
        {"redis_host_port": port, "redis_connect_timeout": 100, "redis_retry_deadline_ms": 750}
    )
    start = time.perf_counter()
    with pytest.raises(tfde.BackendUnavailableError, match=f"127.0.0.1:{port} unreachable during open"):
        creator.create("t", tf.int64, tf.float32, 2)
    assert time.perf_counter() - start > 0.3  # it backed off and retried


def test_table_opened_with_another_dim_is_refused(tag):
    creator = tfde.RedisTableCreator({"model_tag_runtime": tag})
    t = creator.create("emb", tf.int64, tf.float32, 4)
    t.insert(tf.constant([1], tf.int64), tf.ones([1, 4]))
    with pytest.raises(
        tfde.ConfigError,
        match=r"already holds int64 -> float32\[4\].*asked for int64 -> "
        r"float32\[8\]",
    ):
        creator.create("emb", tf.int64, tf.float32, 8)
    again = creator.create("emb", tf.int64, tf.float32, 4)  # same spec: attaches to the stored rows
    assert again.find(tf.constant([1], tf.int64), tf.zeros([1, 4]))[1].numpy().tolist() == [True]


def test_lookup_is_one_pipelined_hmget_per_bucket_chunk():
    """A 4096-key lookup over 4 buckets with keys_sending_size 1024 sends at
    most 8 HMGETs (one per bucket and chunk of keys), pipelined over one
    connection: counted by a private server's own statistics."""
    port = redis_servers.standalone()
    creator = tfde.RedisTableCreator(
        {"redis_host_port": port, "model_tag_runtime": "rt", "storage_slice": 4, "keys_sending_size": 1024}
    )
    t = creator.create("rt", tf.int64, tf.float32, 8)
    t.insert(tf.range(4096, dtype=tf.int64), tf.ones([4096, 8]))
    t.find(tf.range(4, dtype=tf.int64), tf.zeros([1, 8]))  # the find op connects once
    client = redis.Redis(port=port)

    def stats():
        hmget = client.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0)
        return hmget, client.info("stats")["total_connections_received"]

    hmget, connections = stats()
    values, exists = t.find(tf.range(4096, dtype=tf.int64), tf.zeros([1, 8]))
    hmget2, connections2 = stats()
    assert bool(tf.reduce_all(exists))
    assert 4 <= hmget2 - hmget <= 4 + 4  # <= 2 chunks per bucket
    assert connections2 == connections  # no new connection: the lookup reused the one its op holds


def test_a_program_run_again_under_the_same_tag_trains_on_from_the_rows_and_slots_it_left(tag):
    """Redis tables outlive the program (docs/redis.md): a second model built
    on the same config, as a program run again builds it, reads the rows
    and Adam slots the first one trained, while its dense weights and its
    optimizer's step start anew."""
    config = {"model_tag_runtime": tag}
    ids = np.arange(16, dtype=np.int64)
    data = tf.data.Dataset.from_tensor_slices((ids, np.ones(16, np.float32))).batch(8)

    def program():
        emb = tfde.keras.layers.Embedding(4, table_creator=tfde.RedisTableCreator(config), name="emb")
        model = tf.keras.Sequential([emb, tf.keras.layers.Dense(1)])
        model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), loss="mse")
        return model, emb.params

    first, params = program()
    first.fit(data, epochs=2, verbose=0)
    keys = tf.constant(ids)
    names = sorted(params.slots)
    left = [params.lookup(keys).numpy()] + [params.slots[n].lookup(keys).numpy() for n in names]
    assert len(names) == 2 and np.abs(left[2]).sum() > 0  # Adam's m and v: trained
    again, params = program()
    again.build((None,))
    assert int(again.optimizer.iterations.numpy()) == 0
    assert int(params.size()) == 16
    np.testing.assert_array_equal(params.lookup(keys).numpy(), left[0])
    for name, stored in zip(names, left[1:]):  # the slot tables the optimizer will open
        np.testing.assert_array_equal(params.slot(name, 0.0).lookup(keys).numpy(), stored, err_msg=name)


def test_layout_is_readable_by_other_programs(tag):
    creator = tfde.RedisTableCreator({"model_tag_runtime": tag, "storage_slice": 2})
    t = creator.create("layout", tf.int64, tf.float32, 3)
    t.insert(tf.constant([7], tf.int64), tf.constant([[1.0, 2.0, 3.0]]))
    client = redis.Redis()
    bucket = ((tfde.hashing.stable_hash_py(7) & 0xFFFFFFFF) * 2) >> 32
    raw = client.hget(f"{tag}:layout:{{{bucket}}}", (7).to_bytes(8, "little"))
    assert np.frombuffer(raw, "<f4").tolist() == [1.0, 2.0, 3.0]


def test_native_writes_land_in_the_bucket_the_python_routing_names(tag):
    """The bucket formula exists in C++ (the native client's writes) and in
    Python (tfde.hashing.route_low_*: imports, restriction): they agree on
    every key."""
    creator = tfde.RedisTableCreator({"model_tag_runtime": tag, "storage_slice": 5})
    t = creator.create("route", tf.int64, tf.float32, 1)
    keys = np.random.default_rng(3).integers(-(2**62), 2**62, size=300)
    t.insert(tf.constant(keys), tf.ones([300, 1]))
    client = redis.Redis()
    buckets = tfde.hashing.route_low_np(tfde.hashing.stable_hash_np(keys), 5)
    for key, bucket in zip(keys.tolist(), buckets.tolist()):
        assert client.hexists(f"{tag}:route:{{{bucket}}}", int(key).to_bytes(8, "little", signed=True)), key


# ------------------------------------------------------------ training


@pytest.mark.keras
def test_model_fit_through_redis_matches_cuckoo(tag):
    def train(creator):
        model = tf.keras.Sequential(
            [
                tfde.keras.layers.Embedding(4, seed=3, table_creator=creator, name="r"),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(1, kernel_initializer="ones"),
            ]
        )
        model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), loss="mse")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 50, (64, 2))
        y = rng.standard_normal((64, 1)).astype(np.float32)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.layers[0].params

    redis_var = train(tfde.RedisTableCreator({"model_tag_runtime": tag, "storage_slice": 2}))
    cuckoo_var = train(tfde.CuckooTableCreator())
    keys = tf.range(50, dtype=tf.int64)
    np.testing.assert_allclose(redis_var.lookup(keys), cuckoo_var.lookup(keys), rtol=1e-5, atol=1e-6)
    assert int(redis_var.size()) == int(cuckoo_var.size()) > 0
    assert isinstance(redis_var.tables[0], RedisTable)
    assert all(isinstance(s.tables[0], RedisTable) for s in redis_var.slots.values())
    slot_hashes = [
        k
        for k in redis.Redis().scan_iter(match=f"{tag}:r-m/*")  # Adam's m slot lives in Redis too
        if not k.endswith(b":meta")
    ]
    assert slot_hashes and sum(redis.Redis().hlen(h) for h in slot_hashes) == int(redis_var.size())


# ------------------------------------------------------------ faults


def _sgd_steps(var, steps, on_step=None):
    _train(var, steps, tf.keras.optimizers.SGD(0.1), 5, on_step)


def _train(var, steps, optimizer, seed, on_step=None):
    """`steps` steps of `optimizer` on batches of 16 of 40 keys, calling
    on_step(step) before each."""
    opt = tfde.DynamicEmbeddingOptimizer(optimizer)
    rng = np.random.default_rng(seed)
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        ids = tf.constant(rng.integers(0, 40, 16), tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tfde.embedding_lookup(var, ids, training=True) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))


def _reference_rows(steps):
    var = tfde.Variable("fault", dim=4, seed=2)
    _sgd_steps(var, steps)
    return var.lookup(tf.range(40, dtype=tf.int64)).numpy()


def test_server_killed_and_restarted_during_training():
    server = redis_servers.Restartable()
    var = tfde.Variable(
        "fault",
        dim=4,
        seed=2,
        table_creator=tfde.RedisTableCreator({"redis_host_port": server.port, "model_tag_runtime": "fault"}),
    )

    def crash_at_10(step):
        if step == 10:
            # Killed between two steps and back on its port (with its data)
            # before the next: that step's calls meet dead connections and
            # must reconnect and retry.  Started here, not by a timer racing
            # the client's backoff (4 retries, 0.75 s in all).
            server.kill()
            server.start()

    _sgd_steps(var, 20, crash_at_10)
    np.testing.assert_allclose(
        var.lookup(tf.range(40, dtype=tf.int64)).numpy(), _reference_rows(20), rtol=1e-6, atol=1e-6
    )


def test_dropped_connections_are_retried(tag):
    var = tfde.Variable("fault", dim=4, seed=2, table_creator=tfde.RedisTableCreator({"model_tag_runtime": tag}))
    admin = redis.Redis()

    def drop(step):
        if step % 3 == 1:
            admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")

    _sgd_steps(var, 12, drop)
    np.testing.assert_allclose(
        var.lookup(tf.range(40, dtype=tf.int64)).numpy(), _reference_rows(12), rtol=1e-6, atol=1e-6
    )


def test_server_gone_for_good_names_server_and_operation():
    server = redis_servers.Restartable()
    var = tfde.Variable(
        "gone",
        dim=2,
        table_creator=tfde.RedisTableCreator(
            {
                "redis_host_port": server.port,
                "model_tag_runtime": "gone",
                "redis_connect_timeout": 100,
                "redis_retry_deadline_ms": 750,
            }
        ),
    )
    var.upsert(tf.constant([1], tf.int64), tf.ones([1, 2]))
    server.kill()
    with pytest.raises(
        tfde.BackendUnavailableError,
        match=f"127.0.0.1:{server.port} unreachable during find of table 'gone/shard_0_of_1' after 5 attempts",
    ):
        var.lookup(tf.constant([1], tf.int64))


# ------------------------------------------------------------ model tags


def test_import_from_model_tag_rebuckets_rows(tag):
    old = tfde.RedisTableCreator({"model_tag_runtime": tag + "-v1", "storage_slice": 3})
    t_old = old.create("emb", tf.string, tf.float32, 2)
    t_old.insert(tf.constant(["a", "b", "c"]), tf.constant([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
    new = tfde.RedisTableCreator(
        {"model_tag_runtime": tag, "model_tag_import": tag + "-v1", "storage_slice_import": 3, "storage_slice": 2}
    )
    t_new = new.create("emb", tf.string, tf.float32, 2)
    rows, exists = t_new.find(tf.constant(["a", "b", "c", "d"]), tf.zeros([1, 2]))
    assert rows.numpy().tolist() == [[1, 1], [2, 2], [3, 3], [0, 0]] and exists.numpy().tolist()[:3] == [True] * 3
    t_old.clear()  # the import was a copy
    assert int(t_new.size()) == 3
    client = redis.Redis()
    for k in client.scan_iter(match=f"{tag}-v1:*"):
        client.delete(k)


def test_close_sets_expiry_and_open_clears_it(tag):
    with tfde.RedisTableCreator({"model_tag_runtime": tag, "expire_model_tag_in_seconds": 600}) as creator:
        t = creator.create("ttl", tf.int64, tf.float32, 2)
        t.insert(tf.constant([1], tf.int64), tf.ones([1, 2]))
    client = redis.Redis()
    assert 0 < client.ttl(f"{tag}:ttl:{{0}}") <= 600 and 0 < client.ttl(f"{tag}:ttl:meta") <= 600
    tfde.RedisTableCreator({"model_tag_runtime": tag}).create("ttl", tf.int64, tf.float32, 2)
    assert client.ttl(f"{tag}:ttl:{{0}}") == -1  # persistent again while in use


# ------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_table_store_mode_in_checkpoints(tag, tmp_path, mode):
    creator = tfde.RedisTableCreator(
        {"model_tag_runtime": tag, "table_store_mode": mode, "model_lib_abs_dir": str(tmp_path / "lib")}
    )
    var = tfde.Variable("store", key_dtype=tf.string, dim=2, initializer=0.0, table_creator=creator)
    var.upsert(tf.constant(["a", "b"]), tf.constant([[1.0, 1.0], [2.0, 2.0]]))
    path = tf.train.Checkpoint(var=var).save(str(tmp_path / "ck"))
    var.clear()
    var.upsert(tf.constant(["c"]), tf.constant([[3.0, 3.0]]))
    tf.train.Checkpoint(var=var).restore(path)
    rows, exists = var.lookup(tf.constant(["a", "b", "c"]), return_exists=True)
    if mode == 2:  # Redis is the source of truth: the checkpoint held nothing
        assert exists.numpy().tolist() == [False, False, True]
    else:
        assert exists.numpy().tolist() == [True, True, False]
        assert rows.numpy().tolist()[:2] == [[1.0, 1.0], [2.0, 2.0]]
    names = [n for n, _ in tf.train.list_variables(path)]
    dumps = list((tmp_path / "lib" / tag).glob("*.index"))
    if mode == 1:  # the rows went to a dump in model_lib_abs_dir/model_tag_runtime, not the checkpoint
        assert len(dumps) == 1 and not any("/rows/" in n for n in names), (dumps, names)
        dumps[0].unlink()
        with pytest.raises(tfde.CheckpointError, match="keeps the rows of 'store' in .*which is missing"):
            tf.train.Checkpoint(var=var).restore(path)
    else:
        assert not dumps and any("/rows/" in n for n in names) == (mode == 0)


# ------------------------------------------------------------ opening: credentials and timeouts


def _graph_bytes(graph) -> bytes:
    return graph.as_graph_def().SerializeToString()  # nodes, attrs, constants and the function library


def test_password_is_in_no_graph(protected_server):
    """The password reaches the native ops without ever being a tensor: not
    in a TF1 graph (where the variable is made inside the graph), not in a
    tf.function's graph; and training against the protected server works."""
    cfg = {"redis_host_port": protected_server, "redis_password": "s3cret", "model_tag_runtime": "pw"}
    graph = tf.Graph()
    with graph.as_default():
        var = tfde.Variable("tf1", dim=2, initializer=0.0, table_creator=tfde.RedisTableCreator(cfg))
        write = var.upsert(tf.constant([1, 2], tf.int64), tf.ones([2, 2]))
        read = var.lookup(tf.constant([1, 2, 3], tf.int64))
    assert b"s3cret" not in _graph_bytes(graph)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(write)
        assert sess.run(read).tolist() == [[1, 1], [1, 1], [0, 0]]

    var = tfde.Variable("trained", dim=4, seed=2, table_creator=tfde.RedisTableCreator(cfg))
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))

    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tfde.embedding_lookup(var, ids, training=True) ** 2)
        grads = tape.gradient(loss, [var.step_buffer])
        opt.apply_gradients(zip(grads, [var.step_buffer]))
        return loss

    ids = tf.constant([1, 2, 3, 3], tf.int64)
    eager_loss = float(step(ids))
    traced = tf.function(step)
    traced_loss = float(traced(ids))
    assert traced_loss < eager_loss  # the eager step's update was written and read back
    assert b"s3cret" not in _graph_bytes(traced.get_concrete_function(ids).graph)
    assert int(var.size()) == 3
    assert redis.Redis(port=protected_server, password="s3cret").exists("pw:trained/shard_0_of_1:{0}")


def test_password_the_server_does_not_have_is_refused_at_open(tag):
    creator = tfde.RedisTableCreator({"model_tag_runtime": tag, "redis_password": "unneeded-pw"})
    with pytest.raises(
        tfde.ConfigError,
        match="Redis at 127.0.0.1:6379 has no password, but redis_password is "
        "set in the Redis config; remove redis_password",
    ) as info:
        creator.create("t", tf.int64, tf.float32, 2)
    assert "unneeded-pw" not in str(info.value)
    assert not list(redis.Redis().scan_iter(match=f"{tag}:*"))  # refused before anything was written


def test_missing_password_is_refused_at_open(protected_server):
    with pytest.raises(
        tfde.ConfigError,
        match=f"Redis at 127.0.0.1:{protected_server} requires a password, but "
        "redis_password is empty in the Redis config; set redis_password",
    ):
        tfde.RedisTableCreator({"redis_host_port": protected_server}).create("t", tf.int64, tf.float32, 2)


def test_unknown_user_is_refused_at_open(protected_server):
    creator = tfde.RedisTableCreator(
        {"redis_host_port": protected_server, "redis_user": "bob", "redis_password": "s3cret"}
    )
    with pytest.raises(
        tfde.ConfigError,
        match=f"Redis at 127.0.0.1:{protected_server} refused the credentials of "
        "user 'bob' \\(WRONGPASS\\); check redis_user and redis_password",
    ):
        creator.create("t", tf.int64, tf.float32, 2)


def test_sentinel_password_the_sentinel_does_not_have_is_refused_at_open():
    sentinel_port, _ = redis_servers.sentinel()
    creator = tfde.RedisTableCreator(
        {
            "redis_connection_mode": 1,
            "redis_host_port": sentinel_port,
            "redis_sentinel_password": "unneeded-pw",
            "model_tag_runtime": "sentinel-pw",
        }
    )
    with pytest.raises(
        tfde.ConfigError,
        match=f"Redis at 127.0.0.1:{sentinel_port} has no password, but redis_sentinel_password is set",
    ):
        creator.create("t", tf.int64, tf.float32, 2)


@pytest.mark.parametrize(
    "field",
    [
        "redis_connect_timeout",
        "redis_socket_timeout",
        "redis_sentinel_connect_timeout",
        "redis_sentinel_socket_timeout",
    ],
)
@pytest.mark.parametrize("value", [0, -5])
def test_timeouts_below_one_millisecond_are_refused(field, value):
    with pytest.raises(
        tfde.ConfigError,
        match=f'{field} must be a timeout of at least 1 millisecond, got {value}; tfde has no "no timeout"',
    ):
        tfde.RedisTableConfig.from_dict({field: value})


def test_timeout_beyond_the_native_clients_range_is_refused():
    with pytest.raises(
        tfde.ConfigError, match="redis_socket_timeout 2147483648 is too large; expected at most 2147483647 milliseconds"
    ):
        tfde.RedisTableConfig.from_dict({"redis_socket_timeout": 2**31})


@pytest.mark.parametrize(
    "field", ["redis_wait_timeout", "redis_connection_lifetime", "expire_model_tag_in_seconds", "redis_db"]
)
def test_negative_durations_are_refused(field):
    with pytest.raises(tfde.ConfigError, match=f"{field} must be >= 0, got -1"):
        tfde.RedisTableConfig.from_dict({field: -1})


# ------------------------------------------------------------ reads from replicas


def _replica_config(mode: int) -> tuple:
    """(config, master port, replica port) of a deployment with one replica."""
    if mode == 1:
        sentinel, master, replica = redis_servers.sentinel_with_replica()
        config = {"redis_connection_mode": 1, "redis_master_name": "replicated", "redis_host_port": sentinel}
    else:
        master, replica = redis_servers.cluster_with_replica()
        config = {"redis_connection_mode": 0, "redis_host_port": master}
    return config, master, replica


@pytest.mark.parametrize("mode", [1, 0], ids=["sentinel", "cluster"])
def test_read_access_slave_reads_a_replica(mode):
    """With redis_read_access_slave lookups read a replica (a row planted on
    the replica alone is what they return, eagerly and in a graph), through
    the same native client as everything else; writes, accum, remove and
    size go to the master.  Without it, lookups read the master."""
    config, master, replica = _replica_config(mode)
    tag = f"tfde-replica-{uuid.uuid4().hex[:8]}"
    on_replica = tfde.RedisTableCreator({**config, "model_tag_runtime": tag, "redis_read_access_slave": True})
    on_master = tfde.RedisTableCreator({**config, "model_tag_runtime": tag})
    reader = on_replica.create("t", tf.int64, tf.float32, 2)
    writer = on_master.create("t", tf.int64, tf.float32, 2)
    keys = tf.constant([1, 2, 3], tf.int64)
    reader.insert(keys, tf.constant([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
    reader.accum(keys[:1], tf.ones([1, 2]), tf.zeros([1, 2]))
    primary = redis.Redis(port=master)
    assert primary.execute_command("WAIT", 1, 5000) == 1  # the replica has every write
    bucket = reader._buckets[0]
    assert len(reader._buckets) == 1 and primary.hlen(bucket) == 3  # the writes went to the master
    secondary = redis.Redis(port=replica)
    find = tf.function(lambda k: reader.find(k, tf.zeros([1, 2]))[0])
    for read in (lambda: reader.find(keys, tf.zeros([1, 2]))[0], lambda: find(keys)):
        for server in (primary, secondary):
            server.config_resetstat()
        np.testing.assert_array_equal(read().numpy(), [[2, 2], [2, 2], [3, 3]])
        assert "cmdstat_hmget" in secondary.info("commandstats")  # the replica answered
        assert "cmdstat_hmget" not in primary.info("commandstats")
    if mode == 1:  # a row only the replica holds (a cluster replica takes no writes of its own)
        secondary.hset(bucket, np.array([3], "<i8").tobytes(), np.array([[7.0, 7.0]], np.float32).tobytes())
        np.testing.assert_array_equal(find(keys).numpy(), [[2, 2], [2, 2], [7, 7]])
        secondary.hset(bucket, np.array([3], "<i8").tobytes(), np.array([[3.0, 3.0]], np.float32).tobytes())
    primary.config_resetstat()
    np.testing.assert_array_equal(writer.find(keys, tf.zeros([1, 2]))[0].numpy(), [[2, 2], [2, 2], [3, 3]])
    assert "cmdstat_hmget" in primary.info("commandstats")
    assert int(reader.size()) == 3 and int(reader.remove(keys[:1])) == 1 and primary.hlen(bucket) == 2
    # The replica dies: the next lookups read the master (this deployment is
    # this test's alone; the next call of its helper starts a new one).
    secondary.shutdown(nosave=True)
    redis_servers.forget("sentinel_with_replica" if mode == 1 else "cluster_with_replica")
    for read in (lambda: reader.find(keys, tf.zeros([1, 2]))[0], lambda: find(keys)):
        np.testing.assert_array_equal(read().numpy(), [[0, 0], [2, 2], [3, 3]])
    reader.clear()
    assert primary.exists(bucket) == 0


def test_a_training_step_computes_its_writes_from_the_master():
    """With redis_read_access_slave a training step still reads from the
    master: its forward lookups (the gradient) and the rows, slots and
    policy state it updates.  A replica holding other (stale) values is
    what plain lookups see, never what a step computes from.  Before, the
    step read the replica's values, updated them and wrote them over the
    master's newer ones, silently."""
    sentinel, master, replica = redis_servers.sentinel_with_replica()
    tag = f"tfde-replica-step-{uuid.uuid4().hex[:8]}"
    creator = tfde.RedisTableCreator(
        {
            "redis_connection_mode": 1,
            "redis_master_name": "replicated",
            "redis_host_port": sentinel,
            "model_tag_runtime": tag,
            "redis_read_access_slave": True,
        }
    )
    var = tfde.Variable("step", dim=2, table_creator=creator, restrict_policy=tfde.FrequencyRestrictPolicy)
    keys = tf.constant([1, 2], tf.int64)
    var.upsert(keys, tf.constant([[1.0, 1.0], [2.0, 2.0]]))
    primary, secondary = redis.Redis(port=master), redis.Redis(port=replica)
    assert primary.execute_command("WAIT", 1, 5000) == 1
    # The replica "lags": other rows, and a frequency score the master never had.
    field = np.array([1], "<i8").tobytes()
    secondary.hset(var.tables[0]._buckets[0], field, np.array([50.0, 50.0], np.float32).tobytes())
    scores = var.restrict_policy.scores.tables[0]
    secondary.hset(scores._buckets[0], field, np.array([100.0], np.float64).tobytes())
    assert var.lookup(keys).numpy()[0].tolist() == [50.0, 50.0]  # lookups read the replica

    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.5))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tfde.embedding_lookup(var, keys, training=True) ** 2)  # gradient 2 x the rows
    opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))

    master_rows = tfde.RedisTableCreator(
        {"redis_connection_mode": 2, "redis_host_port": master, "model_tag_runtime": tag}
    )
    rows = master_rows.create("step/shard_0_of_1", tf.int64, tf.float32, 2).find(keys, tf.zeros([1, 2]))[0]
    np.testing.assert_array_equal(rows.numpy(), [[0.0, 0.0], [0.0, 0.0]])  # x - 0.5 * 2x
    score = master_rows.create("step-policy-frequency/shard_0_of_1", tf.int64, tf.float64, 1)
    np.testing.assert_array_equal(score.find(keys, tf.zeros([1, 1], tf.float64))[0].numpy(), [[1.0], [1.0]])
    for client in (primary, secondary):
        for key in client.scan_iter(match=f"{tag}:*"):
            client.delete(key)


# ------------------------------------------------------------ failover


def test_training_rides_out_a_sentinel_failover():
    """kill -9 of the master mid-training: the steps after it wait (retries
    within redis_retry_deadline_ms, finding the master through the sentinel
    on every attempt) until the sentinel promotes the replica, then train
    on; the end state equals an uninterrupted run's, since the replica had
    every write (the kill waits for replication).  Before, the step failed
    0.75 s after the kill, long before any failover could finish."""
    group = redis_servers.FailoverGroup()
    creator = tfde.RedisTableCreator(
        {
            "redis_connection_mode": 1,
            "redis_master_name": "group",
            "redis_host_port": group.sentinel,
            "model_tag_runtime": "failover",
            "redis_retry_deadline_ms": 30_000,
        }
    )
    var = tfde.Variable("fault", dim=4, seed=2, table_creator=creator)
    killed_at = []

    def kill_at_step_4(step):
        if step == 4:
            group.kill_master()
            killed_at.append(time.monotonic())

    _sgd_steps(var, 12, kill_at_step_4)
    assert killed_at and group.promoted()
    np.testing.assert_allclose(
        var.lookup(tf.range(40, dtype=tf.int64)).numpy(), _reference_rows(12), rtol=1e-6, atol=1e-6
    )


def test_training_rides_out_a_cluster_failover():
    """kill -9 of the master holding a table's bucket mid-training: the
    cluster promotes its replica (cluster-node-timeout 1000 ms), the client
    reads the slot map again on every retry, and training ends as an
    uninterrupted run does."""
    cluster = redis_servers.FailoverCluster()
    creator = tfde.RedisTableCreator(
        {
            "redis_connection_mode": 0,
            "redis_host_ip": ["127.0.0.1"] * len(cluster.ports),
            "redis_host_port": cluster.ports,
            "model_tag_runtime": "cluster-failover",
            "redis_retry_deadline_ms": 30_000,
        }
    )
    var = tfde.Variable("fault", dim=4, seed=2, table_creator=creator)
    victim = cluster.master_of(var.tables[0]._buckets[0])

    def kill_at_step_4(step):
        if step == 4:
            cluster.kill(victim)

    _sgd_steps(var, 12, kill_at_step_4)
    assert cluster.master_of(var.tables[0]._buckets[0]) != victim  # a replica took over
    np.testing.assert_allclose(
        var.lookup(tf.range(40, dtype=tf.int64)).numpy(), _reference_rows(12), rtol=1e-6, atol=1e-6
    )


def test_a_dead_master_with_no_replica_is_named_by_every_error():
    """A sentinel's master dies and has no replica to promote: size, lookups
    and opening a table fail naming the address the sentinels last gave
    (before, opening said only "No master found for 'lone'")."""
    server = redis_servers.Restartable(persist=False)
    sentinel = redis_servers._sentinel(
        "lone",
        server.port,
        lambda client: client.execute_command("SENTINEL get-master-addr-by-name lone"),
        "sentinel down-after-milliseconds lone 1000\n",
    )
    creator = tfde.RedisTableCreator(
        {
            "redis_connection_mode": 1,
            "redis_master_name": "lone",
            "redis_host_port": sentinel,
            "model_tag_runtime": "lone",
            "redis_retry_deadline_ms": 750,
        }
    )
    var = tfde.Variable("v", dim=2, table_creator=creator)
    var.upsert(tf.constant([1], tf.int64), tf.ones([1, 2]))
    server.kill()
    deadline = time.monotonic() + 20
    while "o_down" not in redis.Redis(port=sentinel).sentinel_master("lone")["flags"]:
        assert time.monotonic() < deadline, "the sentinel never saw its master down"
        time.sleep(0.1)
    address = f"127.0.0.1:{server.port}"
    for what, call in [
        ("size", var.size),
        ("find", lambda: var.lookup(tf.constant([1], tf.int64))),
        ("open", lambda: tfde.Variable("w", dim=2, table_creator=creator)),
    ]:
        with pytest.raises(tfde.BackendUnavailableError, match=f"during {what} of table") as raised:
            call()
        assert address in str(raised.value) and "'lone'" in str(raised.value), str(raised.value)


# ------------------------------------------------------------ durability


def test_write_replicas_makes_every_write_wait_for_the_replicas():
    """With redis_write_replicas 1 each write ends with WAIT 1: after every
    training step the replica already holds what the master holds (no wait
    in the test), and while the replica is stopped (SIGSTOP) a write fails
    with BackendUnavailableError saying that 0 of 1 replicas acknowledged
    it; once the replica runs again, the same write goes through.  Before,
    the field did not exist and the write "succeeded" with no replica
    holding it."""
    import os
    import signal

    master = redis_servers.standalone()
    replica = redis_servers.replica_of(master)
    primary, secondary = redis.Redis(port=master), redis.Redis(port=replica)
    creator = tfde.RedisTableCreator(
        {
            "redis_host_port": master,
            "model_tag_runtime": "durable",
            "redis_write_replicas": 1,
            "redis_write_replicas_timeout_ms": 200,
            "redis_retry_deadline_ms": 750,
        }
    )
    var = tfde.Variable("durable", dim=4, seed=2, table_creator=creator)
    buckets = [t._buckets[0] for t in [var.tables[0]] + [var.slots[n].tables[0] for n in sorted(var.slots)]]

    def replicated(step):
        if step > 0:  # the previous step's rows, m and v are on the replica already
            for bucket in buckets:
                assert secondary.hgetall(bucket) == primary.hgetall(bucket), (step, bucket)

    _adam_steps(var, 6, replicated)
    replicated(6)
    assert int(primary.info("commandstats")["cmdstat_wait"]["calls"]) >= 6

    keys, rows = tf.constant([1000, 1001], tf.int64), tf.fill([2, 4], 3.0)
    pid = int(secondary.info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(tfde.BackendUnavailableError, match=r"only 0 of the 1 replicas .* within 200 ms"):
            var.upsert(keys, rows)
    finally:
        os.kill(pid, signal.SIGCONT)
    var.upsert(keys, rows)  # the same write again: the replica answers now
    field = np.array([1000], "<i8").tobytes()
    assert secondary.hget(var.tables[0]._buckets[0], field) == np.full(4, 3.0, np.float32).tobytes()


def test_lost_acknowledged_writes_are_noticed_on_the_next_write(tmp_path):
    """The server goes back to an older state under a running job (as when
    a failover promotes a replica that lagged, or a restart loads an older
    snapshot: here DEBUG RELOAD of a snapshot taken 3 steps earlier).  The
    next training step fails with BackendError saying acknowledged writes
    were lost and by how many, instead of training on from stale rows (what
    happened before: nothing noticed).  Each bucket's write count is the
    key tfde.tables.redis_table.write_count_key names."""
    from tfde.tables.redis_table import write_count_key

    port = redis_servers.standalone(("--enable-debug-command", "yes", "--dir", str(tmp_path)))
    server = redis.Redis(port=port)
    var = tfde.Variable(
        "lost",
        dim=4,
        seed=2,
        table_creator=tfde.RedisTableCreator({"redis_host_port": port, "model_tag_runtime": "lost"}),
    )

    def rewind(step):
        if step == 4:
            server.save()
        if step == 7:
            assert int(server.get(write_count_key(var.tables[0]._buckets[0]))) == 7  # one per step
            server.execute_command("DEBUG", "RELOAD", "NOSAVE")  # back to the state after step 4

    with pytest.raises(tfde.BackendError, match=r"lost acknowledged writes .* at least 3 writes are gone"):
        _adam_steps(var, 8, rewind)


def test_tables_of_one_name_in_two_databases_keep_their_own_write_counts(tag):
    """Write counts are told apart by database: a table of the same name in
    db 0 (ahead: 5 writes) and db 1 (behind) trains on in both, with no
    false report of lost writes (which keying by server alone gave)."""
    ahead, behind = (
        tfde.Variable("same", dim=2, table_creator=tfde.RedisTableCreator({"model_tag_runtime": tag, "redis_db": db}))
        for db in (0, 1)
    )
    keys = tf.constant([1, 2], tf.int64)
    for _ in range(5):
        ahead.upsert(keys, tf.ones([2, 2]))
    for _ in range(3):
        behind.upsert(keys, tf.ones([2, 2]))
        ahead.upsert(keys, tf.ones([2, 2]))
    client = redis.Redis(db=1)
    for key in client.scan_iter(match=f"*{tag}:*"):
        client.delete(key)


def test_a_table_deleted_and_created_again_starts_its_own_write_counts(tag):
    """Counts are remembered per table object: after a table's keys are
    deleted (as a user's cleanup script does), a Variable created again
    under the same name trains from count 1 with no report of lost writes,
    while the old Variable, whose rows are gone, is told so at its next
    write."""
    creator = tfde.RedisTableCreator({"model_tag_runtime": tag})
    old = tfde.Variable("again", dim=2, table_creator=creator)
    keys = tf.constant([1, 2], tf.int64)
    for _ in range(5):
        old.upsert(keys, tf.ones([2, 2]))
    client = redis.Redis()
    client.delete(*[k for p in (f"{tag}:*", f"tfde-writes:{tag}:*") for k in client.scan_iter(match=p)])
    new = tfde.Variable("again", dim=2, table_creator=creator)
    for _ in range(3):
        new.upsert(keys, tf.ones([2, 2]))
    with pytest.raises(tfde.BackendError, match="lost acknowledged writes .* at least 2 writes are gone"):
        old.upsert(keys, tf.ones([2, 2]))


def test_a_cluster_table_whose_write_count_would_leave_its_slot_is_refused_at_creation():
    """ "e{}mb" puts an empty hash tag in every bucket name, so a bucket
    hashes whole and its write count would land in another slot (every
    write would then fail, CROSSSLOT or MOVED, for the whole retry
    deadline): refused when the table is made, naming the fix, and nothing
    is written."""
    ports = redis_servers.cluster()
    creator = tfde.RedisTableCreator(
        {
            "redis_connection_mode": 0,
            "redis_host_ip": ["127.0.0.1"] * len(ports),
            "redis_host_port": ports,
            "model_tag_runtime": "odd-names",
        }
    )
    with pytest.raises(tfde.ConfigError, match=r"different cluster slots.*empty hash tag"):
        tfde.Variable("e{}mb", dim=2, table_creator=creator)
    cluster = redis.cluster.RedisCluster(host="127.0.0.1", port=ports[0])
    assert not list(cluster.scan_iter(match="odd-names:*"))


def test_write_replicas_is_validated():
    for bad, match in [
        ({"redis_write_replicas": -1}, "redis_write_replicas must be 0"),
        ({"redis_write_replicas_timeout_ms": 0}, "redis_write_replicas_timeout_ms must be 1"),
    ]:
        with pytest.raises(tfde.ConfigError, match=match):
            tfde.RedisTableConfig(**bad)


# ------------------------------------------------------------ resharding


def _adam_steps(var, steps, on_step=None):
    """`steps` Adam steps on 40 keys (rows, m and v: three tables written in
    one transaction per bucket)."""
    _train(var, steps, tf.keras.optimizers.Adam(0.05), 7, on_step)


def _slot_values(var):
    keys = tf.range(40, dtype=tf.int64)
    return [var.lookup(keys).numpy()] + [var.slots[name].lookup(keys).numpy() for name in sorted(var.slots)]


@pytest.mark.parametrize("moves", ["all-keys-at-once", "one-key-at-a-time"])
def test_training_rides_out_a_slot_migration_with_a_long_ask_window(moves):
    """A bucket's slot migrates to another master during training, and the
    migration stays open (between MIGRATE and SETSLOT NODE) for 3 s, far
    longer than the retries allow (750 ms here).  Commands for the moved
    keys are answered ASK; the client sends them on to the importing node
    with ASKING at once (before, it read the slot map again, which still
    named the old node, until the retries ran out).  Moved one key at a
    time, a transaction finds some of its keys on each node and waits for
    the rest.  The end state equals an uninterrupted run's."""
    import threading

    cluster = redis_servers.MigratingCluster()
    creator = tfde.RedisTableCreator(
        {
            "redis_connection_mode": 0,
            "redis_host_ip": ["127.0.0.1"] * 3,
            "redis_host_port": cluster.ports,
            "model_tag_runtime": f"migrate-{moves}",
            "redis_retry_deadline_ms": 750,
        }
    )
    var = tfde.Variable("fault", dim=4, seed=2, table_creator=creator)
    bucket = var.tables[0]._buckets[0]
    window = {}

    def migrate():
        slot, source, target = window["slot"], window["source"], window["target"]
        keys = cluster.keys_in(source, slot)
        assert len(keys) >= 6, keys  # the buckets of the rows, of m and of v, and their write counts
        if moves == "all-keys-at-once":
            cluster.move(slot, source, target, keys)
        else:
            for key in keys:  # a transaction that meets the keys on two nodes waits (750 ms at most)
                cluster.move(slot, source, target, [key])
                time.sleep(0.05)
        time.sleep(3.0)
        window["steps_inside"] = window["step"] - window["opened_at"]
        cluster.finish(slot, target)

    def on_step(step):
        window["step"] = step
        if step == 4:
            window["slot"], window["source"], window["target"] = cluster.begin(bucket)
            window["opened_at"] = step
            window["thread"] = threading.Thread(target=migrate)
            window["thread"].start()
        if step >= 4:
            time.sleep(0.15)

    _adam_steps(var, 36, on_step)
    window["thread"].join()
    assert window["steps_inside"] >= 10, window  # the training ran inside the open migration
    assert cluster.master_of(bucket) == window["target"]
    assert cluster.asking_calls(window["target"]) > 0
    reference = tfde.Variable("fault", dim=4, seed=2)
    _adam_steps(reference, 36)
    for got, want in zip(_slot_values(var), _slot_values(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ a pipeline over several cluster nodes


def test_a_refusal_on_one_cluster_node_leaves_every_node_in_step():
    """A lookup sends every node its commands before reading any reply
    (backends/redis/resp_client.h TryPipeline), so when one node refuses,
    the others' replies are still on their way: they are read too, the
    lookup raises the refusal, and every later call on every node returns
    the right rows (an unread reply would be taken for the next command's)."""
    ports = redis_servers.cluster()
    tag = f"in-step-{uuid.uuid4().hex[:8]}"
    creator = tfde.RedisTableCreator(
        {
            "redis_connection_mode": 0,
            "redis_host_ip": ["127.0.0.1"] * len(ports),
            "redis_host_port": ports,
            "model_tag_runtime": tag,
            "storage_slice": 6,
            "keys_sending_size": 8,
            "redis_retry_deadline_ms": 0,
        }
    )
    var = tfde.Variable("v", dim=3, seed=1, table_creator=creator)
    table = var.tables[0]
    cluster = redis.cluster.RedisCluster(host="127.0.0.1", port=ports[0])
    nodes = {cluster.get_node_from_key(b).name for b in table._buckets}
    assert len(nodes) == 3, f"the 6 buckets should spread over the 3 masters, got {nodes}"
    keys = np.arange(600, dtype=np.int64)  # ~100 keys per bucket: several commands per node
    rows = np.stack([keys, -keys, keys / 7], 1).astype(np.float32)
    var.upsert(keys, rows)
    # The node that answers last in the client's order refuses; so does the first.
    for victim in (sorted(table._buckets)[0], sorted(table._buckets)[-1]):
        saved = cluster.hgetall(victim)
        cluster.delete(victim)
        cluster.set(victim, "not a hash")
        try:
            with pytest.raises(tfde.BackendError, match="WRONGTYPE"):
                var.lookup(keys)
            with pytest.raises(tfde.BackendError, match="WRONGTYPE"):
                var.upsert(keys, rows)
        finally:
            cluster.delete(victim)
            cluster.hset(victim, mapping=saved)
        for _ in range(3):
            np.testing.assert_array_equal(var.lookup(keys).numpy(), rows)
        var.upsert(keys, rows + 1)
        np.testing.assert_array_equal(var.lookup(keys).numpy(), rows + 1)
        var.upsert(keys, rows)
    stale = [k for n in cluster.get_primaries() for k in cluster.scan_iter(match=f"{tag}:*", target_nodes=n)]
    for k in stale:
        cluster.delete(k)
