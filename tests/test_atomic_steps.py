"""A training step writes each key all-or-nothing: its row, every optimizer
slot and its policy state (and change label), on every backend.  Here the
writes of Adam steps against a real redis-server fail part-way (the server
runs out of memory, or is killed, between two commands of a step: a small
proxy of this file injects either at a chosen command), and afterwards
every key that has a row has all of its state, read directly in Redis
(HKEYS / HLEN of each table's bucket hashes, the layout of
tfde/tables/redis_table.py) and through the tables.  The failed step is
reported, leaves the step buffer empty, and running the same batch again
applies it once: the result equals a run without the fault."""

import socket
import threading
import uuid

import numpy as np
import pytest
import redis
import redis_servers
import tensorflow as tf

import tfde

DIM = 32
BATCH = 256
FRESH = 200  # keys of a batch seen for the first time (the rest repeat older ones)


def _batches(count, seed=0):
    """int64 id batches [BATCH]: FRESH new keys each, plus keys of earlier
    batches (so steps also update stored rows)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(count):
        fresh = np.arange(b * FRESH, (b + 1) * FRESH)
        old = rng.integers(0, max(b * FRESH, 1), BATCH - FRESH)
        out.append(rng.permutation(np.concatenate([fresh, old])).astype(np.int64))
    return out


def _redis_fields(client, tag, table_name):
    """The keys (fields) a table holds, read straight from its bucket hashes
    ``{tag}:{table name}:{hash tag}``, and the sum of their HLENs."""
    fields, total = set(), 0
    for bucket in client.scan_iter(match=f"{tag}:{table_name}:{{*"):
        if client.type(bucket) != b"hash":
            continue
        fields |= set(client.hkeys(bucket))
        total += client.hlen(bucket)
    return fields, total


def _stored(var):
    chunks = [k.numpy() for k, _ in var.export()]
    return set(np.concatenate(chunks).tolist()) if chunks else set()


def assert_every_key_whole(var, client, tag):
    """Every key with a row has all its slots (optimizer and policy state),
    and no slot holds a key without a row: in Redis and through the tables."""
    assert var.slots, "the Variable has no slots to check"
    for i, table in enumerate(var.tables):
        rows, count = _redis_fields(client, tag, table.name)
        assert rows and count == len(rows), (table.name, count, len(rows))
        broken = {}
        for name, slot in var.slots.items():
            held, held_count = _redis_fields(client, tag, slot.tables[i].name)
            assert held_count == len(held)
            if held != rows:
                broken[name] = f"{len(rows - held)} keys have a row and no {name!r}, {len(held - rows)} the reverse"
        assert not broken, f"shard {i} of {len(rows)} keys: {broken}"
    keys = _stored(var)
    for name, slot in var.slots.items():
        assert _stored(slot) == keys, name
        _, exists = slot.lookup(tf.constant(sorted(keys), tf.int64), return_exists=True)
        assert bool(tf.reduce_all(exists)), name


def _state(var, keys):
    """Rows and every slot's rows of `keys`, float64 numpy, by slot name."""
    ids = tf.constant(keys, tf.int64)
    out = {"rows": var.lookup(ids).numpy().astype(np.float64)}
    for name, slot in var.slots.items():
        out[name] = slot.lookup(ids).numpy().astype(np.float64)
    return out


def _assert_same_state(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-6, err_msg=name)


@pytest.fixture
def tag():
    return f"tfde-atomic-{uuid.uuid4().hex[:12]}"


# ------------------------------------------------------------ the fault proxy


class FaultOnWrite:
    """A loopback TCP proxy in front of a redis-server on `upstream_port`.
    Once armed, when a write command (HSET, EVAL, EVALSHA) naming `marker`
    reaches it, it calls fault() before passing that command on: the
    commands sent before it have reached the server, this one and the rest
    meet the fault.  With drop=True it then closes the connection instead of
    passing the command on (fault() killed the server).  Connections that
    cannot reach the server are closed at once, as a dead server's would be.
    Faults happen at a command, never at a time."""

    WRITES = (b"HSET", b"HMSET", b"EVAL", b"EVALSHA")

    def __init__(self, upstream_port: int, marker: bytes, fault, drop: bool):
        self.upstream_port, self.marker, self.fault, self.drop = upstream_port, marker, fault, drop
        self.armed = threading.Event()
        self.fired = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._replies, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._commands, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _replies(upstream, client):
        try:
            while data := upstream.recv(1 << 16):
                client.sendall(data)
        except OSError:
            pass
        for s in (client, upstream):
            s.close()

    def _commands(self, client, upstream):
        buf = b""
        try:
            while data := client.recv(1 << 16):
                buf += data
                sent = complete = 0  # bytes of buf passed on; bytes of buf in complete commands
                for end, args in _resp_commands(buf):
                    if (
                        self.armed.is_set()
                        and args
                        and args[0].upper() in self.WRITES
                        and any(self.marker in a for a in args[1:])
                    ):
                        self.armed.clear()
                        upstream.sendall(buf[sent:complete])  # the commands before this one
                        sent = complete
                        self.fault()
                        self.fired.set()
                        if self.drop:
                            raise OSError("dropped")
                    complete = end
                upstream.sendall(buf[sent:complete])
                buf = buf[complete:]
        except OSError:
            pass
        for s in (client, upstream):
            s.close()

    def close(self):
        self._listener.close()


def _resp_commands(buf):
    """(end offset, args) of each complete RESP command at the start of buf."""
    pos = 0
    while pos < len(buf):
        if buf[pos : pos + 1] != b"*":
            raise ValueError(f"not a RESP array at byte {pos}: {buf[pos : pos + 20]!r}")
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return
        count, at, args = int(buf[pos + 1 : nl]), nl + 2, []
        for _ in range(count):
            nl = buf.find(b"\r\n", at)
            if nl < 0:
                return
            size = int(buf[at + 1 : nl])
            if len(buf) < nl + 2 + size + 2:
                return
            args.append(buf[nl + 2 : nl + 2 + size])
            at = nl + 2 + size + 2
        pos = at
        yield pos, args


# ------------------------------------------------------------ out of memory, model.fit


def _fit_model(creator, num_shards):
    emb = tfde.keras.layers.Embedding(
        DIM,
        seed=3,
        num_shards=num_shards,
        table_creator=creator,
        name="emb",
        restrict_policy=tfde.FrequencyRestrictPolicy,
    )
    model = tf.keras.Sequential([emb, tf.keras.layers.Flatten(), tf.keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01)), loss="mse")
    return model, emb.params


def _fit(model, ids):
    y = np.asarray(np.sin(ids.astype(np.float64)), np.float32)[:, None]
    model.fit(ids[:, None], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


@pytest.mark.keras
@pytest.mark.parametrize("storage_slice,num_shards", [(2, 1), (2, 2)])
def test_out_of_memory_mid_step_leaves_every_key_whole(tag, storage_slice, num_shards):
    """model.fit with Adam and a frequency policy; in step 3 the server runs
    out of memory (maxmemory set below its use) just before the first write
    of Adam's m slot reaches it: the step fails with the server's OOM, and
    no key is left with a row but no m, v or count."""
    port = redis_servers.standalone(["--maxmemory-policy", "noeviction"])
    admin = redis.Redis(port=port)
    proxy = FaultOnWrite(port, b"emb-m/", lambda: admin.config_set("maxmemory", 1), drop=False)
    try:
        model, var = _fit_model(
            tfde.RedisTableCreator(
                {"redis_host_port": proxy.port, "model_tag_runtime": tag, "storage_slice": storage_slice}
            ),
            num_shards,
        )
        batches = _batches(6)
        for ids in batches[:3]:
            _fit(model, ids)
        proxy.armed.set()
        with pytest.raises((tf.errors.OpError, tfde.TfdeError), match="OOM"):
            _fit(model, batches[3])
        assert proxy.fired.is_set(), "the step failed before its writes"
        assert int(tf.shape(var.step_buffer)[0]) == 0, "the failed step left rows in the step buffer"
        assert_every_key_whole(var, admin, tag)

        admin.config_set("maxmemory", 0)  # memory freed: the same batch again, then the rest
        for ids in batches[3:]:
            _fit(model, ids)
        assert_every_key_whole(var, admin, tag)
    finally:
        proxy.close()
    if num_shards == 1:
        # One server, one shard: the failed step was one write (one Redis
        # transaction), nothing of it was applied, so running it again
        # applied it once.  (With several shards, a shard written before
        # the failure keeps its keys, whole, and the batch run again trains
        # them twice.)
        reference, ref_var = _fit_model(tfde.CuckooTableCreator(), num_shards)
        for ids in batches:
            _fit(reference, ids)
        keys = sorted(_stored(ref_var))
        assert sorted(_stored(var)) == keys
        _assert_same_state(_state(var, keys), _state(ref_var, keys))
        assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == len(batches)


# ------------------------------------------------------------ server killed, tf.function


def _adam_step(var, opt):
    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            rows = tfde.embedding_lookup(var, ids, training=True)
            loss = tf.reduce_sum(tf.square(rows - 1.0))
        opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))

    return step


def _variable(creator):
    return tfde.Variable(
        "kill", dim=DIM, seed=4, table_creator=creator, restrict_policy=tfde.FrequencyRestrictPolicy, track_changes=True
    )


def test_server_killed_mid_step_leaves_every_key_whole_and_the_step_retries_once(tag):
    """A custom tf.function Adam step; at step 3 the server is killed just
    before the first write of Adam's m slot reaches it, and comes back (from
    its append-only file) only after the step has failed."""
    server = redis_servers.Restartable()
    proxy = FaultOnWrite(server.port, b"kill-m/", server.kill, drop=True)
    try:
        var = _variable(
            tfde.RedisTableCreator(
                {
                    "redis_host_port": proxy.port,
                    "model_tag_runtime": tag,
                    "redis_connect_timeout": 200,
                    "redis_retry_deadline_ms": 750,
                }
            )
        )
        opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01))
        step = _adam_step(var, opt)
        batches = _batches(6, seed=1)
        for ids in batches[:3]:
            step(tf.constant(ids))
        proxy.armed.set()
        with pytest.raises((tf.errors.OpError, tfde.TfdeError)):
            step(tf.constant(batches[3]))
        assert proxy.fired.is_set(), "the step failed before its writes"
        server.start()
        direct = redis.Redis(port=server.port)
        assert int(tf.shape(var.step_buffer)[0]) == 0
        assert_every_key_whole(var, direct, tag)

        for ids in batches[3:]:  # the failed batch again, then the rest
            step(tf.constant(ids))
        assert_every_key_whole(var, direct, tag)

        reference = _variable(tfde.CuckooTableCreator())
        ref_step = _adam_step(reference, tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01)))
        for ids in batches:
            ref_step(tf.constant(ids))
        keys = sorted(_stored(reference))
        assert sorted(_stored(var)) == keys
        _assert_same_state(_state(var, keys), _state(reference, keys))
        assert int(opt.iterations) == len(batches)
    finally:
        proxy.close()
        server.kill()
