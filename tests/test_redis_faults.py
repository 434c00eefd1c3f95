"""Faults from the outside: a loopback proxy (tests/fault_proxy.py) between
tfde and a real redis-server replaces, delays, drops, corrupts or cuts the
server's replies at chosen positions of a pipeline, and private servers run
out of memory, die, or come back empty.  After each fault the consistency
checks run: lookups return the right rows (against a dict reference or the
rows read straight from the server) and every key with a row has all of its
optimizer slots.  Timeouts are short (FAST), so the file runs in well under
a minute."""

import os
import re
import threading
import time
import uuid

import numpy as np
import pytest
import redis
import redis_servers
import tensorflow as tf
from fault_proxy import FaultProxy

import tfde
from tfde.hashing import stable_hash_py

# Short timeouts, and retries that give up after 750 ms of backoff (5 attempts).
FAST = {"redis_connect_timeout": 200, "redis_socket_timeout": 200, "redis_retry_deadline_ms": 750}
TABLE = "v/shard_0_of_1"


@pytest.fixture
def tag():
    t = f"tfde-faults-{uuid.uuid4().hex[:12]}"
    yield t
    client = redis.Redis()
    keys = [k for pattern in (f"{t}:*", f"tfde-*:{t}:*") for k in client.scan_iter(match=pattern)]
    if keys:
        client.delete(*keys)


def _bucket(key: int, buckets: int = 2) -> int:
    return ((stable_hash_py(key) & 0xFFFFFFFF) * buckets) >> 32


def _balanced_keys(per_bucket: int, buckets: int = 2) -> np.ndarray:
    """Int keys, `per_bucket` in each bucket, bucket 0's first."""
    out = []
    for b in range(buckets):
        out += [k for k in range(10_000) if _bucket(k, buckets) == b][:per_bucket]
    return np.array(out, np.int64)


def _rows(keys, shift=0.0) -> np.ndarray:
    k = keys.astype(np.float32)
    return np.stack([k, -k, k / 2 + shift, np.full_like(k, shift)], 1)


def _variable(port, tag, name="v", **config):
    """A Variable of dim 4 on one Redis table of 2 buckets, 4 keys per
    command: 8 keys of a bucket make 2 commands."""
    creator = tfde.RedisTableCreator(
        {
            "redis_host_port": port,
            "model_tag_runtime": tag,
            "storage_slice": 2,
            "keys_sending_size": 4,
            **FAST,
            **config,
        }
    )
    return tfde.Variable(name, dim=4, seed=1, table_creator=creator)


class _Ephemeral(redis_servers.Restartable):
    """A private redis-server without persistence that can be killed and
    started again on its port: it comes back empty."""

    def __init__(self):
        super().__init__(persist=False)

    def restart_empty(self):
        self.kill()
        self.start()


@pytest.fixture
def ephemeral():
    server = _Ephemeral()
    yield server
    server.kill()


# ------------------------------------------------------------ the client stays in step (issue #15, points 1, 7)


def test_error_reply_mid_pipeline_leaves_the_client_in_step(tag):
    """The issue's recipe: a lookup whose first HMGET is refused (a bucket
    replaced by a string) fails; once the bucket is back, every lookup
    returns the right rows (before the fix they returned the rows of other
    keys, from the unread replies of the refused call)."""
    var = _variable(6379, tag)
    keys = _balanced_keys(4)  # one HMGET per bucket
    rows = _rows(keys)
    var.upsert(keys, rows)
    admin = redis.Redis()
    bucket0 = f"{tag}:{TABLE}:{{0}}"
    saved = admin.hgetall(bucket0)
    assert len(saved) == 4
    admin.delete(bucket0)
    admin.set(bucket0, "not a hash")
    with pytest.raises(
        tfde.BackendError,
        match=rf"Redis at 127\.0\.0\.1:6379 refused find of table '{TABLE}': "
        r".*WRONGTYPE",
    ):
        var.lookup(keys)
    admin.delete(bucket0)
    admin.hset(bucket0, mapping=saved)
    for _ in range(3):
        np.testing.assert_array_equal(var.lookup(keys).numpy(), rows)


FAULTS = [  # (fault, what the call raises; None: retried, it succeeds)
    ("-WRONGTYPE Operation against a key holding the wrong kind of value", tfde.BackendError),
    ("-OOM command not allowed when used memory > 'maxmemory'.", tfde.CapacityError),
    ("-NOSCRIPT No matching script. Please use EVAL.", tfde.BackendError),
    ("-ERR unknown command", tfde.BackendError),
    ("-NOPERM this user has no permissions to run this command", tfde.CredentialsError),
    ("-LOADING Redis is loading the dataset in memory", None),
    ("-BUSY Redis is busy running a script.", None),
    ("-TRYAGAIN Multiple keys request during rehashing of slot", None),
    ("-CLUSTERDOWN The cluster is down", None),
    ("-MASTERDOWN Link with MASTER is down", None),
    ("-READONLY You can't write against a read only replica.", None),
    ("close", None),
    ("corrupt", None),
    ("drop", None),
    (("delay", 0.3), None),  # longer than the socket timeout
]


@pytest.mark.parametrize("fault,raised", FAULTS, ids=[str(f[0]).split(" ")[0].strip("-(',") for f in FAULTS])
def test_every_fault_at_every_position_of_a_pipeline(tag, fault, raised):
    """A fault at reply i of the n replies of an upsert (native HSETs), a
    lookup (native HMGETs) or a size (native HLENs): a refusal raises its
    tfde class at once, anything else is retried and succeeds; either way
    the next calls return the right rows and counts.  Both clients classify
    every error code alike (tfde/errors.py REDIS_ERROR_KINDS)."""
    keys = _balanced_keys(8)  # 2 buckets x 2 chunks of 4 keys: 4 commands per call
    with FaultProxy(6379) as proxy:
        var = _variable(proxy.port, tag)
        reference = _rows(keys)
        var.upsert(keys, reference)
        np.testing.assert_array_equal(var.lookup(keys).numpy(), reference)
        assert int(var.size()) == len(keys)
        for position in range(4):
            rows = _rows(keys, shift=position + 1.0)
            proxy.inject(fault, at=position)
            if raised is None:
                var.upsert(keys, rows)
            else:
                with pytest.raises(raised, match=rf"Redis at 127\.0\.0\.1:{proxy.port} .*insert of table '{TABLE}'"):
                    var.upsert(keys, rows)
                var.upsert(keys, rows)  # the step is run again
            assert proxy.pending == 0
            reference = rows

            proxy.inject(fault, at=position)
            if raised is None:
                np.testing.assert_array_equal(var.lookup(keys).numpy(), reference)
            else:
                with pytest.raises(raised, match=rf"Redis at 127\.0\.0\.1:{proxy.port} .*find of table '{TABLE}'"):
                    var.lookup(keys)
            assert proxy.pending == 0
            np.testing.assert_array_equal(var.lookup(keys).numpy(), reference)

        for position in range(2):  # size: one HLEN per bucket
            proxy.inject(fault, at=position)
            if raised is None:
                assert int(var.size()) == len(keys)
            else:
                with pytest.raises(raised, match=rf"Redis at 127\.0\.0\.1:{proxy.port} .*size of table '{TABLE}'"):
                    var.size()
            assert proxy.pending == 0
            assert int(var.size()) == len(keys)


@pytest.mark.parametrize("lost", [0, 1, 2, 3])
def test_accum_whose_reply_was_lost_is_applied_once(tag, lost):
    """The connection closes instead of delivering the reply of accum
    script `lost` of 4 (2 buckets x 2 chunks): every chunk before it was
    applied and answered, that one was applied, the rest may or may not
    have run.  The client sends them all again; each chunk's marker makes
    a second run a no-op, so every key is added to exactly once.  Remove
    likewise removes and counts each key once."""
    keys = _balanced_keys(8)
    zero = tfde.initializers.InitSpec("constant", 0.0)
    with FaultProxy(6379) as proxy:
        var = _variable(proxy.port, tag)
        table = var.tables[0]
        table.accum(keys, tf.ones([len(keys), 4]), zero)  # connected, the table checked
        proxy.inject("close", at=lost)
        table.accum(keys, tf.fill([len(keys), 4], 2.0), zero)
        assert proxy.injected == 1 and proxy.pending == 0
        np.testing.assert_array_equal(table.find(keys, tf.zeros([1, 4]))[0].numpy(), np.full((len(keys), 4), 3.0))
        # In a graph too, and remove / size / clear on the same client.
        accum = tf.function(lambda k, d: table.accum(k, d, zero))
        accum(tf.constant(keys), tf.zeros([len(keys), 4]))  # the graph's kernel connected, the table checked
        proxy.inject("close", at=lost)
        accum(tf.constant(keys), tf.fill([len(keys), 4], 0.5))
        assert proxy.injected == 2
        np.testing.assert_array_equal(var.lookup(keys).numpy(), np.full((len(keys), 4), 3.5))
        # remove: one script per chunk; the reply of chunk `lost` is lost
        # after it ran, and the retried call still counts every key once.
        assert int(table.remove(keys[-1:] + 10**6)) == 0  # its kernel connected, the table checked
        proxy.inject("close", at=lost)
        assert int(table.remove(keys)) == len(keys) and int(table.size()) == 0
        assert proxy.injected == 3 and int(table.remove(keys[:3])) == 0
        table.accum(keys, tf.ones([len(keys), 4]), zero)
        table.clear()
        assert int(table.size()) == 0


def test_out_of_memory_then_memory_freed_leaves_no_stale_error():
    """Point 7: while the server is out of memory every write fails with
    CapacityError (ResourceExhausted in graphs), not retried; once memory is
    freed the next write succeeds and is read back (before the fix the op
    kept reporting the old OOM replies)."""
    port = redis_servers.standalone()
    var = _variable(port, "oom")
    keys = _balanced_keys(8)
    rows = _rows(keys)
    admin = redis.Redis(port=port)
    admin.config_set("maxmemory", 1)
    try:
        for _ in range(2):
            with pytest.raises(
                tfde.CapacityError,
                match=rf"Redis at 127\.0\.0\.1:{port} is out of memory during "
                rf"insert of table '{TABLE}': .*OOM command not allowed",
            ):
                var.upsert(keys, rows)

        @tf.function
        def write(k, r):
            var.upsert(k, r)

        with pytest.raises(
            tf.errors.ResourceExhaustedError,
            match=rf"tfde\.CapacityError: Redis at 127\.0\.0\.1:{port} is out of memory",
        ):
            write(keys, rows)
    finally:
        admin.config_set("maxmemory", 0)
    var.upsert(keys, rows)
    np.testing.assert_array_equal(var.lookup(keys).numpy(), rows)
    write(keys, rows + 1)
    np.testing.assert_array_equal(var.lookup(keys).numpy(), rows + 1)


# ------------------------------------------------------------ error classes (point 12)


def test_tfde_store_errors_are_tensorflow_errors():
    """Each store error is also TensorFlow's class of the same code, is
    raised with its message alone, survives pickling (worker processes),
    and comes back from a failed op's message (tfde.errors.from_op_error)."""
    import pickle

    from tfde.errors import from_op_error, graph_message, redis_error_class
    from tfde.tables.redis_table import backoff_s

    for cls, tf_cls in (
        (tfde.BackendUnavailableError, tf.errors.UnavailableError),
        (tfde.BackendError, tf.errors.FailedPreconditionError),
        (tfde.CredentialsError, tf.errors.FailedPreconditionError),
        (tfde.CapacityError, tf.errors.ResourceExhaustedError),
    ):
        error = cls("Redis at h:1 said so")
        again = pickle.loads(pickle.dumps(error))
        assert isinstance(error, tf_cls) and type(again) is cls and str(again) == str(error) == error.message
        op_error = tf_cls(None, None, f"{{{{function_node f}}}} {graph_message(error)} [Op:TfdeRedisFind] name: ")
        back = from_op_error(op_error)
        assert type(back) is cls and str(back) == "Redis at h:1 said so"
    assert isinstance(tfde.CredentialsError("x"), tfde.ConfigError)
    assert [redis_error_class(c) for c in ("LOADING", "OOM", "WRONGPASS", "WRONGTYPE", "ERR")] == [
        tfde.BackendUnavailableError,
        tfde.CapacityError,
        tfde.CredentialsError,
        tfde.BackendError,
        tfde.BackendError,
    ]
    assert [backoff_s(n) for n in range(1, 7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]


def test_both_clients_wait_by_one_backoff_policy():
    """The native client's waits (resp::BackoffMs) are the redis-py side's
    (backoff_s), failure by failure, read without sleeping."""
    import ctypes
    import os

    from tfde import _native
    from tfde.tables.redis_table import backoff_s

    _native.load()
    native = ctypes.CDLL(str(_native.loaded_path()), mode=os.RTLD_NOW | os.RTLD_NOLOAD).tfde_redis_backoff_ms
    assert [native(n) for n in range(1, 16)] == [round(backoff_s(n) * 1000) for n in range(1, 16)]


def test_a_refusal_in_a_graph_is_failed_precondition_at_once(tag):
    """WRONGTYPE inside tf.function: FailedPreconditionError whose message
    starts with the tfde class, raised after one attempt (no backoff);
    eagerly the same is a tfde.BackendError, itself a
    FailedPreconditionError.  Size and export say the same."""
    keys = _balanced_keys(8)
    with FaultProxy(6379) as proxy:
        var = _variable(proxy.port, tag)
        var.upsert(keys, _rows(keys))
        lookup = tf.function(lambda k: var.lookup(k))
        np.testing.assert_array_equal(lookup(keys).numpy(), _rows(keys))  # traced, connected
        redis.Redis().delete(f"{tag}:{TABLE}:{{0}}")
        redis.Redis().set(f"{tag}:{TABLE}:{{0}}", "not a hash")
        before, start = proxy.replies, time.perf_counter()
        with pytest.raises(
            tf.errors.FailedPreconditionError,
            match=rf"tfde\.BackendError: Redis at 127\.0\.0\.1:{proxy.port} refused find of table "
            rf"'{TABLE}': .*WRONGTYPE",
        ) as info:
            lookup(keys)
        elapsed = time.perf_counter() - start
        assert not isinstance(info.value, tfde.TfdeError)  # TensorFlow's own class, in a graph
        assert proxy.replies - before == 4  # one attempt: its 4 HMGETs
        assert elapsed < 0.5  # all retries would wait >= 0.75 s
        with pytest.raises(tf.errors.FailedPreconditionError) as info:
            var.lookup(keys)
        assert isinstance(info.value, tfde.BackendError)
        with pytest.raises(
            tf.errors.FailedPreconditionError,
            match=rf"tfde\.BackendError: Redis at 127\.0\.0\.1:{proxy.port} refused size of table "
            rf"'{TABLE}': .*WRONGTYPE",
        ):
            tf.function(lambda: var.size())()
        with pytest.raises(
            tf.errors.FailedPreconditionError,
            match=rf"tfde\.BackendError: Redis at 127\.0\.0\.1:{proxy.port} refused export of table "
            rf"'{TABLE}': .*WRONGTYPE",
        ):
            tf.function(lambda: var.tables[0].export_chunk(0, 100))()


def test_transient_replies_are_retried_then_unavailable(tag):
    """LOADING (a server loading its data after a restart) is retried with
    backoff, on a pipeline and on a reconnection's table check alike; five
    attempts in a row answered LOADING give UnavailableError naming
    tfde.BackendUnavailableError, the server, the operation and the cause."""
    keys = _balanced_keys(8)
    loading = "-LOADING Redis is loading the dataset in memory"
    with FaultProxy(6379) as proxy:
        var = _variable(proxy.port, tag)
        var.upsert(keys, _rows(keys))
        lookup = tf.function(lambda k: var.lookup(k))
        lookup(keys)
        var.lookup(keys)  # each op holds its own connection: both are open now
        # Attempt 1: the first HMGET; attempt 2: the new connection's table
        # check (EXISTS, reply 4); attempt 3 succeeds.
        proxy.inject(loading, at=0)
        proxy.inject(loading, at=4)
        start = time.perf_counter()
        np.testing.assert_array_equal(lookup(keys).numpy(), _rows(keys))
        assert proxy.pending == 0 and time.perf_counter() - start >= 0.15  # backed off 50 + 100 ms
        for at in (0, 4, 5, 6, 7):
            proxy.inject(loading, at=at)
        with pytest.raises(
            tf.errors.UnavailableError,
            match=rf"tfde\.BackendUnavailableError: Redis at 127\.0\.0\.1:{proxy.port} unreachable "
            rf"during find of table '{TABLE}' after 5 attempts in 750 ms of retries "
            r"\(redis_retry_deadline_ms 750\): .*LOADING",
        ):
            lookup(keys)
        for at in (0, 4, 5, 6, 7):
            proxy.inject(loading, at=at)
        with pytest.raises(
            tfde.BackendUnavailableError,
            match=r"after 5 attempts in 750 ms of retries \(redis_retry_deadline_ms 750\): .*LOADING",
        ):
            var.lookup(keys)
        np.testing.assert_array_equal(var.lookup(keys).numpy(), _rows(keys))


@pytest.mark.keras
def test_model_fit_with_the_server_killed_raises_unavailable(ephemeral):
    """A server killed mid-training: model.fit raises TensorFlow's
    UnavailableError (not InternalError) naming tfde.BackendUnavailableError,
    the server and the operation; so do size and export in graphs."""
    creator = tfde.RedisTableCreator(
        {
            "redis_host_port": ephemeral.port,
            "model_tag_runtime": "fit",
            "redis_connect_timeout": 100,
            "redis_retry_deadline_ms": 750,
        }
    )
    layer = tfde.keras.layers.Embedding(4, seed=3, table_creator=creator, name="r")
    model = tf.keras.Sequential([layer, tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), loss="mse")
    x = np.random.default_rng(0).integers(0, 50, (64, 2))
    y = np.zeros((64, 1), np.float32)

    class KillAtBatch1(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                ephemeral.kill()

    with pytest.raises(
        tf.errors.UnavailableError,
        match=rf"tfde\.BackendUnavailableError: Redis at 127\.0\.0\.1:{ephemeral.port} unreachable "
        r"during \w+ of table 'r/shard_0_of_1' after 5 attempts",
    ):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[KillAtBatch1()])
    with pytest.raises(
        tf.errors.UnavailableError,
        match=r"tfde\.BackendUnavailableError: .* unreachable during size of table 'r/shard_0_of_1'",
    ):
        tf.function(lambda: layer.params.size())()
    with pytest.raises(
        tf.errors.UnavailableError,
        match=r"tfde\.BackendUnavailableError: .* unreachable during export of table 'r/shard_0_of_1'",
    ):
        tf.function(lambda: layer.params.tables[0].export_chunk(0, 100))()


# ------------------------------------------------------------ a wiped store (point 4)


def _fit_with_restart(port, recreate, restart):
    creator = tfde.RedisTableCreator(
        {"redis_host_port": port, "model_tag_runtime": "wiped", "recreate_if_missing": recreate, **FAST}
    )
    layer = tfde.keras.layers.Embedding(4, seed=3, table_creator=creator, name="w")
    model = tf.keras.Sequential([layer, tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), loss="mse")
    x = np.random.default_rng(0).integers(0, 50, (64, 2))
    y = np.ones((64, 1), np.float32)

    class RestartAtBatch2(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                restart()

    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[RestartAtBatch2()])
    return layer


@pytest.mark.keras
def test_a_server_restarted_empty_is_noticed(ephemeral):
    """Restarted without persistence mid-training, the server holds nothing:
    the next step fails (FailedPrecondition in model.fit, BackendError
    eagerly, through either client) naming the server and the table, and
    writes nothing, instead of training on from initial rows."""
    with pytest.raises(
        tf.errors.FailedPreconditionError,
        match=rf"tfde\.BackendError: Redis at 127\.0\.0\.1:{ephemeral.port} no longer holds table "
        r"'w(-\w+)?/shard_0_of_1' \(its meta key 'wiped:w(-\w+)?/shard_0_of_1:meta' is gone\).*"
        r"recreate_if_missing",
    ):
        _fit_with_restart(ephemeral.port, False, ephemeral.restart_empty)
    admin = redis.Redis(port=ephemeral.port)
    assert admin.dbsize() == 0
    # A flush is noticed too, by every connection opened after it.
    creator = tfde.RedisTableCreator({"redis_host_port": ephemeral.port, "model_tag_runtime": "flushed", **FAST})
    var = tfde.Variable("x", dim=2, table_creator=creator)
    var.upsert(tf.constant([1], tf.int64), tf.ones([1, 2]))
    admin.flushall()
    admin.client_kill_filter(_type="normal", skipme=True)
    with pytest.raises(
        tfde.BackendError,
        match=rf"Redis at 127\.0\.0\.1:{ephemeral.port} no longer holds table "
        r"'x/shard_0_of_1'",
    ):
        var.size()  # the native client
    with pytest.raises(tfde.BackendError, match="no longer holds table 'x/shard_0_of_1'"):
        tfde.Variable("y", dim=2, table_creator=creator)  # redis-py, opening another table
    assert admin.dbsize() == 0


@pytest.mark.keras
def test_recreate_if_missing_starts_the_table_afresh(ephemeral, capfd):
    """With recreate_if_missing the tables are recreated, with a warning on
    stderr that TF_CPP_MIN_LOG_LEVEL does not hide, and training carries on."""
    layer = _fit_with_restart(ephemeral.port, True, ephemeral.restart_empty)
    admin = redis.Redis(port=ephemeral.port)
    assert admin.exists("wiped:w/shard_0_of_1:meta") and int(layer.params.size()) > 0
    ephemeral.restart_empty()
    capfd.readouterr()
    assert int(layer.params.size()) == 0
    assert re.search(r"tfde: warning: .*held no table 'w/shard_0_of_1' .*recreated it empty", capfd.readouterr().err)
    assert admin.exists("wiped:w/shard_0_of_1:meta")


# ------------------------------------------------------------ training through faults


def _slot_tables_consistent(tag, name="v"):
    """Straight from the server: the keys of every bucket of the row table
    and of each Adam slot table (m, v), and the rows."""
    admin = redis.Redis()
    rows, slots = {}, {"m": set(), "v": set()}
    for b in range(2):
        rows.update(admin.hgetall(f"{tag}:{name}/shard_0_of_1:{{{b}}}"))
        for s in slots:
            slots[s] |= set(admin.hkeys(f"{tag}:{name}-{s}/shard_0_of_1:{{{b}}}"))
    return rows, slots


def test_training_through_faults_keeps_rows_and_slots_together(tag):
    """Adam steps through the proxy, each on 16 new keys (8 per bucket, so
    every step sends the same commands), with one fault per step at a
    different command of the step (a lookup's HMGET, a slot read, a write),
    and steps whose server dies between two of the step's write commands
    (cut): after every step every key with a row has both Adam slots, and
    lookups return the rows the server holds."""
    faults = [
        "close",
        "-LOADING Redis is loading",
        "corrupt",
        "-BUSY busy",
        "drop",
        ("delay", 0.05),
        "-WRONGTYPE Operation against a key holding the wrong kind of value",
    ]
    pool = _balanced_keys(8 * 40).reshape(2, 40, 8)  # [bucket, step, key]
    batches = iter(np.concatenate([pool[0], pool[1]], axis=1))
    with FaultProxy(6379) as proxy:
        var = _variable(proxy.port, tag)
        opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.1))

        def step():
            ids = tf.constant(next(batches), tf.int64)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tfde.embedding_lookup(var, ids, training=True) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))

        step()  # builds the slots and opens every op's connection
        before = proxy.requests
        step()
        per_step = proxy.requests - before  # commands of one step, reads then writes
        writes = 3 * 4  # HSETs: rows, m, v, 2 commands per bucket each
        plan = [(f, (i * 4) % per_step) for i, f in enumerate(faults)]
        plan += [("cut", per_step - w) for w in (writes, 9, 6, 3, 1)]  # within the writes
        failed = 0
        for fault, at in plan:
            if fault == "cut":
                proxy.cut(at=at)
            else:
                proxy.inject(fault, at=at)
            try:
                step()
            except (tfde.TfdeError, tf.errors.OpError):
                failed += 1
            proxy.heal()
            proxy.clear()
            rows, slots = _slot_tables_consistent(tag)
            missing = {s: len(set(rows) - keys) for s, keys in slots.items()}
            assert missing == {"m": 0, "v": 0}, (
                f"after {fault!r} at command {at} of {per_step}: keys with a row but no slot"
            )
            keys = np.frombuffer(b"".join(rows), "<i8")
            stored = np.stack([np.frombuffer(rows[k.tobytes()], "<f4") for k in keys])
            np.testing.assert_array_equal(var.lookup(keys).numpy(), stored)
        assert failed >= 5  # the refusal and the cuts failed their steps


def test_export_walks_every_bucket_in_bounded_chunks_through_faults(tag):
    """TfdeRedisExport: chunks of at most max_rows whose union is the table,
    the last one already saying -1; a lost reply is retried; a refused page
    fails the call and leaves its cursor where it was, so asking again
    carries on; an export started eagerly goes on in a graph; a finished or
    unknown cursor is refused."""
    keys = np.arange(1, 3001, dtype=np.int64)  # several HSCAN pages per bucket
    with FaultProxy(6379) as proxy:
        var = _variable(proxy.port, tag, keys_sending_size=1000)
        var.upsert(keys, _rows(keys))
        table = var.tables[0]
        seen, cursor, calls = {}, 0, 0
        in_graph = tf.function(lambda c: table.export_chunk(c, 700))
        while cursor >= 0:
            if calls == 1:
                proxy.inject("close", at=0)  # retried
            if calls == 2:
                proxy.inject("-ERR injected refusal", at=0)
                with pytest.raises(tfde.BackendError, match=f"refused export of table '{TABLE}'"):
                    table.export_chunk(cursor, 700)
                assert proxy.pending == 0  # the call needed a page, and the refusal hit it
                other = _variable(proxy.port, tag, name="w").tables[0]
                with pytest.raises(tfde.ShapeError, match="unknown or finished"):
                    other.export_chunk(cursor, 700)  # another table's cursor
            chunk_keys, chunk_rows, nxt = table.export_chunk(cursor, 700) if calls < 3 else in_graph(cursor)
            assert proxy.pending == 0
            assert len(chunk_keys) <= 700 and (int(nxt) == -1 or len(chunk_keys) == 700)
            seen.update(zip(chunk_keys.numpy().tolist(), chunk_rows.numpy()))
            cursor, calls = int(nxt), calls + 1
        assert proxy.injected == 2 and calls == 5  # 3000 rows in chunks of 700
        assert sorted(seen) == keys.tolist()
        for k in (1, 1500, 3000):
            np.testing.assert_array_equal(seen[k], _rows(np.array([k]))[0])
        with pytest.raises(tfde.ShapeError, match=f"cursor {2**62} .* unknown or finished; start again from 0"):
            table.export_chunk(2**62, 10)
        with pytest.raises(tfde.ShapeError, match="max_rows must be > 0"):
            table.export_chunk(0, 0)
        redis.Redis().hset(f"{tag}:{TABLE}:{{0}}", b"12345678", b"short")
        with pytest.raises(tfde.ShapeError, match="a row of 5 bytes where 16 are expected"):
            list(table.export(10_000))


def test_a_write_retried_on_a_server_that_never_had_its_first_attempt_is_no_loss(tmp_path):
    """A write whose first attempt reached the server but was never
    acknowledged (the connection died before its last command), retried on
    a server that lacks that attempt (here rewound to a snapshot of before
    it, as a failover to a replica that had not received it would be): the
    retry counts the same write count again, which is no loss, since no
    write the table was told of is gone.  Before, the count of the failed
    attempt was remembered and the retry raised "lost acknowledged writes"."""
    port = redis_servers.standalone(("--enable-debug-command", "yes", "--dir", str(tmp_path)))
    server = redis.Redis(port=port)
    keys = _balanced_keys(4)  # 2 buckets: HSET, INCR, HSET, INCR
    with FaultProxy(port) as proxy:
        var = _variable(proxy.port, "retried", keys_sending_size=1024, redis_retry_deadline_ms=10_000)
        for _ in range(5):
            var.upsert(keys, _rows(keys))
        server.save()
        proxy.cut(at=3)  # the second bucket's INCR never arrives; the first's reply was read
        outcome = []
        writer = threading.Thread(target=lambda: outcome.append(_call(lambda: var.upsert(keys, _rows(keys, 1.0)))))
        writer.start()
        deadline = time.monotonic() + 10
        while not proxy.was_cut:
            assert time.monotonic() < deadline, "the write never reached the cut"
            time.sleep(0.01)
        server.execute_command("DEBUG", "RELOAD", "NOSAVE")  # the unacknowledged attempt is gone
        proxy.heal()
        writer.join()
        assert outcome == [None], outcome
        np.testing.assert_array_equal(var.lookup(tf.constant(keys)).numpy(), _rows(keys, 1.0))


def _call(fn):
    try:
        fn()
    except Exception as e:  # the test reports it
        return e
    return None


# ------------------------------------------------------------ a failed step run again


def _two_tables(port, tag):
    """A two-tower-like step on Redis: a user and an item Variable (the
    item one with a frequency policy: its scores are written with its rows),
    a dense weight, one Adam; retries for 100 ms only, so a server that
    stays unreachable fails the step."""
    creator = tfde.RedisTableCreator(
        {
            "redis_host_port": port,
            "model_tag_runtime": tag,
            "storage_slice": 2,
            "keys_sending_size": 8,
            "redis_connect_timeout": 200,
            "redis_socket_timeout": 200,
            "redis_retry_deadline_ms": 100,
        }
    )
    user = tfde.Variable("user", dim=4, seed=1, table_creator=creator)
    item = tfde.Variable("item", dim=4, seed=2, table_creator=creator, restrict_policy=tfde.FrequencyRestrictPolicy)
    dense = tf.Variable(tf.fill([4, 1], 0.5))
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05))

    @tf.function
    def step(users, items):
        with tf.GradientTape() as tape:
            u = tfde.embedding_lookup(user, users, training=True)
            i = tfde.embedding_lookup(item, items, training=True)
            loss = tf.reduce_sum(tf.square(tf.matmul(u * i, dense) - 1.0))
        variables = [user.step_buffer, item.step_buffer, dense]
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    def state(n=30):
        keys = tf.range(n, dtype=tf.int64)
        out = [dense.numpy()]
        for var in (user, item):
            out.append(var.lookup(keys).numpy())
            out += [var.slots[name].lookup(keys).numpy() for name in sorted(var.slots)]
        out.append(item.restrict_policy.scores.lookup(keys).numpy())
        return out

    return step, state


def _fail_step_at(proxy, step, batches, at):
    """Trains batches[:4] through `proxy`, then fails the fifth step with
    the server cut off at the point `at` (0..1) of a step's commands."""
    for users, items in batches[:3]:
        step(users, items)
    before = proxy.requests
    step(*batches[3])
    per_step = proxy.requests - before
    proxy.cut(at=int(at * per_step))
    with pytest.raises(tf.errors.UnavailableError):
        step(*batches[4])


def _batches(steps=7):
    rng = np.random.default_rng(11)
    return [(tf.constant(rng.integers(0, 30, 16), tf.int64), tf.constant(rng.integers(0, 30, 16), tf.int64))
            for _ in range(steps)]  # fmt: skip


@pytest.mark.parametrize(
    "at, second",
    [(a, None) for a in (0.02, 0.1, 0.25, 0.4, 0.55, 0.7, 0.8, 0.9, 0.95, 0.99)]
    + [(0.8, 0.6), (0.8, 0.8), (0.8, 0.95)],
)
def test_a_step_that_failed_part_way_and_is_run_again_applies_once(tag, at, second):
    """Step 4 of 7 fails at a point `at` of its commands (the server is cut
    off there: the commands before it ran, their replies may be lost, the
    rest never arrive), after writing some of its tables or buckets and not
    others (the user Variable's, then the item Variable's), and is run again
    on the same batch: the end state (rows, Adam's m and v, the policy
    scores, the dense weight) equals an uninterrupted run's.  The step run
    again reads what its first attempt wrote as it was before (the step
    stamps, and the rows the process kept from before the step), so it
    computes the same update and applies it
    once.  Before, the buckets the first attempt had written were updated a
    second time.  With `second`, the step run again fails too, at that
    later point (after writing the user Variable once more), and a third
    attempt follows: the second must keep the rows the first kept, not keep
    the rows the first attempt wrote over them (`second` is a
    point of the commands of the step run again, which are fewer: a probe
    run on tables of their own counts them)."""
    batches = _batches()
    step, state = _two_tables(6379, f"{tag}-reference")
    for users, items in batches:
        step(users, items)
    want = state()
    rerun = None
    if second is not None:
        with FaultProxy(6379) as proxy:
            step, _ = _two_tables(proxy.port, f"{tag}-probe")
            _fail_step_at(proxy, step, batches, at)
            proxy.heal()
            proxy.clear()
            before = proxy.requests
            step(*batches[4])
            rerun = proxy.requests - before
    with FaultProxy(6379) as proxy:
        step, state = _two_tables(proxy.port, tag)
        _fail_step_at(proxy, step, batches, at)
        proxy.heal()
        proxy.clear()
        if second is not None:
            proxy.cut(at=int(second * rerun))
            with pytest.raises(tf.errors.UnavailableError):
                step(*batches[4])
            proxy.heal()
            proxy.clear()
        for users, items in batches[4:]:
            step(users, items)
        got = state()
    for n, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"state {n}")


def test_a_step_run_again_is_applied_once_while_another_process_writes_the_same_buckets(tag):
    """The shared-store layout: two processes write their own keys of the
    same buckets.  Here the first fails step 4 part-way (after its user
    Variable's write), the second trains a step on its own keys in between,
    and the first runs its step again: its keys end as in a run without the
    second process.  Each process keeps its own step stamps and rows from
    before the step (once, the stamps and undo entries were one key per
    bucket, and the second process's write wiped the first one's)."""
    import subprocess
    import sys
    from pathlib import Path

    even = [(2 * u, 2 * i) for u, i in _batches()]
    step, state = _two_tables(6379, f"{tag}-reference")
    for users, items in even:
        step(users, items)
    want = state(60)
    other = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import tensorflow as tf
from test_redis_faults import _batches, _two_tables
step, _ = _two_tables(6379, {tag!r})
users, items = _batches()[0]
step(2 * users + 1, 2 * items + 1)
"""
    with FaultProxy(6379) as proxy:
        step, state = _two_tables(proxy.port, tag)
        _fail_step_at(proxy, step, even, 0.8)  # after the user Variable's write
        subprocess.run(
            [sys.executable, "-c", other], check=True, timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        )
        proxy.heal()
        for users, items in even[4:]:
            step(users, items)
        got = state(60)
    mine = np.arange(0, 60, 2)  # the first process's keys (the second's are odd)
    for n, (g, w) in enumerate(zip(got, want)):
        if g.shape[0] == 60:
            g, w = g[mine], w[mine]
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"state {n}")
