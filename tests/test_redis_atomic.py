"""RedisTable.insert_with (the native TfdeRedisInsertGroup op): one write of a
step's keys to a row table and its slot tables, all-or-nothing per key,
against real redis-server processes on loopback: read back through every
table, a server out of memory, a connection cut mid-write (by a small proxy
of this file) and retried, an error inside the transaction."""

import socket
import threading

import numpy as np
import pytest
import redis
import redis_servers
import tensorflow as tf

import tfde
from tfde.hashing import stable_hash_np
from tfde.tables.cuckoo import CuckooTableCreator

N = 3000  # keys per write: big enough that a write spans many reads on the server


def _tables(port, tag, **cfg):
    """A row table and two slot-like tables of other dtypes and dims, made by
    one creator as a Variable makes them."""
    creator = tfde.RedisTableCreator(
        {"redis_host_port": port, "model_tag_runtime": tag, "storage_slice": 3, "keys_sending_size": 256, **cfg}
    )
    return (
        creator.create("emb", tf.int64, tf.float32, 8),
        creator.create("emb-m", tf.int64, tf.float64, 8),
        creator.create("emb-v", tf.int64, tf.bfloat16, 4),
    )


def _batch(tables, n=N, base=0.0):
    keys = tf.range(n, dtype=tf.int64) * 7 + 1
    rows = [tf.cast(tf.reshape(tf.range(n * t.dim), [n, t.dim]) % 97, t.value_dtype) + base for t in tables]
    return keys, rows


def _write(tables, keys, rows):
    return tables[0].insert_with(keys, rows[0], list(zip(tables[1:], rows[1:])))


def _held(table, keys):
    """(rows, exists) of keys, read back through the table."""
    values, exists = table.find(keys, tf.zeros([1, table.dim], table.value_dtype))
    return values.numpy(), exists.numpy()


def _assert_all_written(tables, keys, rows):
    for table, expected in zip(tables, rows):
        values, exists = _held(table, keys)
        assert exists.all(), f"{table.name}: {int((~exists).sum())} keys missing"
        np.testing.assert_array_equal(values, expected.numpy(), err_msg=table.name)


def _assert_none_written(tables, keys):
    for table in tables:
        assert not _held(table, keys)[1].any(), f"{table.name} holds keys of a write that failed"


def _exec_calls(port):
    return redis.Redis(port=port).info("commandstats").get("cmdstat_exec", {}).get("calls", 0)


class CuttingProxy:
    """A loopback TCP proxy in front of a redis-server.  Transparent until
    armed: cut_requests(after, times) closes the connection that carries the
    after-th request byte from now on (the server gets exactly `after` bytes
    more), `times` times over; cut_exec_reply() closes the next connection
    whose server starts answering an EXEC (the transaction ran, its reply is
    lost).  Faults happen at byte positions, never at a time."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.after = self.budget = self.times = 0
        self.exec_replies = 0
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_requests(self, after: int, times: int = 1):
        with self.lock:
            self.after = self.budget = after
            self.times = times

    def cut_exec_reply(self, times: int = 1):
        with self.lock:
            self.exec_replies = times

    def disarm(self):
        with self.lock:
            self.times = self.exec_replies = 0

    def close(self):
        self.listener.close()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(client, upstream, self._requests, pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self._replies, pair), daemon=True).start()

    def _pump(self, src, dst, fault, pair):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                data, cut = fault(data)
                if data:
                    dst.sendall(data)
                if cut:
                    break
        except OSError:
            pass
        for s in pair:  # either side ending ends the connection
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _requests(self, data):
        with self.lock:
            if self.times <= 0:
                return data, False
            if len(data) < self.budget:
                self.budget -= len(data)
                return data, False
            data = data[: self.budget]
            self.times -= 1
            self.budget = self.after
            self.cuts += 1
            return data, True

    def _replies(self, data):
        with self.lock:
            # Inside MULTI the server answers +OK / +QUEUED; an array ("*")
            # is EXEC's reply, sent after the transaction ran.
            if self.exec_replies > 0 and (data.startswith(b"*") or b"\r\n*" in data):
                self.exec_replies -= 1
                self.cuts += 1
                return b"", True
            return data, False


@pytest.fixture
def server():
    return redis_servers.standalone(["--maxmemory-policy", "noeviction"])


@pytest.fixture
def proxy(server):
    p = CuttingProxy(server)
    yield p
    p.close()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_insert_with_writes_every_table_in_one_transaction(server, graph):
    tables = _tables(server, "group")
    keys, rows = _batch(tables)
    write = lambda k, r: _write(tables, k, r)
    write = tf.function(write) if graph else write
    before = _exec_calls(server)
    write(keys, rows)
    _assert_all_written(tables, keys, rows)
    assert _exec_calls(server) - before == 1  # one MULTI ... EXEC for the whole write on one server
    keys2, rows2 = _batch(tables, n=10, base=1.0)  # an upsert: the last write wins
    write(keys2, rows2)
    _assert_all_written(tables, keys2, rows2)
    _assert_all_written(tables, keys[10:], [r[10:] for r in rows])


def test_insert_with_on_a_cluster_is_one_transaction_per_bucket():
    ports = redis_servers.cluster()
    tables = _tables(
        ports[0], "group-cluster", redis_connection_mode=0, redis_host_ip=["127.0.0.1"] * 3, redis_host_port=ports
    )
    keys, rows = _batch(tables)

    def execs():
        return sum(_exec_calls(p) for p in ports)

    before = execs()
    _write(tables, keys, rows)
    _assert_all_written(tables, keys, rows)
    assert execs() - before == 3  # storage_slice 3: bucket b of every table is one slot, one transaction


def test_out_of_memory_writes_nothing(server):
    """maxmemory leaves room for about half of the write: separate HSETs would
    store the row table and part of the slots; the transaction is refused as
    a whole (EXECABORT) and no table holds any of the keys.  After memory is
    freed, the same write succeeds."""
    tables = _tables(server, "oom")
    keys, rows = _batch(tables)
    admin = redis.Redis(port=server)
    used = admin.info("memory")["used_memory"]
    batch_bytes = sum(int(tf.size(r)) * t.value_dtype.size for t, r in zip(tables, rows))
    admin.config_set("maxmemory", used + batch_bytes // 2)
    with pytest.raises(tfde.TfdeError, match="OOM"):
        _write(tables, keys, rows)
    admin.config_set("maxmemory", 0)
    _assert_none_written(tables, keys)
    _write(tables, keys, rows)
    _assert_all_written(tables, keys, rows)


def test_connection_cut_mid_write_is_retried_whole(server, proxy):
    """The connection closes halfway through the write; the server discards
    the unfinished transaction, the client resends it, and every table holds
    every key."""
    tables = _tables(proxy.port, "cut-once")
    keys, rows = _batch(tables)
    before = _exec_calls(server)
    proxy.cut_requests(after=N * 80, times=1)  # about half of the ~N * 166 request bytes
    _write(tables, keys, rows)
    assert proxy.cuts == 1
    _assert_all_written(tables, keys, rows)
    assert _exec_calls(server) - before == 1  # the cut transaction never ran


def test_connection_cut_on_every_attempt_writes_nothing(proxy):
    """Every attempt is cut halfway: the write fails (after the client's
    retries) and leaves no key in any table, rather than rows without slots."""
    tables = _tables(proxy.port, "cut-always", redis_retry_deadline_ms=750)
    keys, rows = _batch(tables)
    proxy.cut_requests(after=N * 80, times=1000)
    with pytest.raises(tfde.BackendUnavailableError, match="unreachable"):
        _write(tables, keys, rows)
    assert proxy.cuts >= 2  # the client retried
    proxy.disarm()
    _assert_none_written(tables, keys)


def test_reply_lost_after_exec_is_resent_harmlessly(server, proxy):
    """The transaction ran but its reply is lost: the client sends it again,
    and writing the same absolute values twice equals writing them once."""
    tables = _tables(proxy.port, "lost-reply")
    keys, rows = _batch(tables)
    before = _exec_calls(server)
    proxy.cut_exec_reply()
    _write(tables, keys, rows)
    assert proxy.cuts == 1 and _exec_calls(server) - before == 2
    _assert_all_written(tables, keys, rows)


def test_error_inside_the_transaction_is_reported(server):
    """A bucket key of one slot table holds a string: its HSET fails while
    the transaction runs (the rest of it is applied), and the op says so,
    naming the table and bucket, instead of returning as if all were written."""
    tables = _tables(server, "wrongtype")
    keys, rows = _batch(tables, n=30)
    redis.Redis(port=server).set("wrongtype:emb-m:{1}", "not a hash")
    with pytest.raises(
        tfde.TfdeError,
        match="HSET wrongtype:emb-m:\\{1\\} \\(table 'emb-m', bucket 1\\) failed "
        "inside the transaction: WRONGTYPE.*its other writes were applied",
    ):
        _write(tables, keys, rows)


def test_rows_of_the_wrong_shape_are_refused_before_anything_is_written(server):
    tables = _tables(server, "shapes")
    keys, rows = _batch(tables, n=5)
    with pytest.raises(tfde.ShapeError, match="rows for table 'emb-m' have shape \\(4, 8\\) for 5 keys"):
        _write(tables, keys, [rows[0], rows[1][:4], rows[2]])
    with pytest.raises(tfde.ShapeError, match="'emb-v' must have shape \\[n, 4\\]"):
        _write(tables, keys, [rows[0], rows[1], tf.zeros([5, 3], tf.bfloat16)])

    # Shapes known only when the graph runs: the kernel checks them.
    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None, 8], tf.float32),
            tf.TensorSpec([None, 8], tf.float64),
            tf.TensorSpec([None, 4], tf.bfloat16),
        ]
    )
    def write(k, a, b, c):
        return _write(tables, k, [a, b, c])

    with pytest.raises(
        tf.errors.InvalidArgumentError, match="rows for table 'emb-v' must have shape \\[5, 4\\] for 5 keys"
    ):
        write(keys, rows[0], rows[1], rows[2][:3])
    _assert_none_written(tables, keys)
    write(keys, *rows)
    _assert_all_written(tables, keys, rows)


def test_insert_with_other_backends_falls_back_to_one_insert_per_table(server):
    row, slot, _ = _tables(server, "mixed")
    local = CuckooTableCreator().create("local", tf.int64, tf.float32, 2)
    keys = tf.constant([1, 2, 3], tf.int64)
    row.insert_with(keys, tf.ones([3, 8]), [(slot, tf.fill([3, 8], 2.0)), (local, tf.fill([3, 2], tf.constant(3.0)))])
    assert _held(row, keys)[1].all() and (_held(slot, keys)[0] == 2.0).all()
    assert (_held(local, keys)[0] == 3.0).all()


@pytest.mark.parametrize("read_first", ["none", "all", "some"])
@pytest.mark.parametrize("layout", ["standalone", "cluster"])
def test_a_step_s_write_keeps_the_rows_it_overwrote_for_a_read_of_that_step_again(server, layout, read_first):
    """insert_with with a training step number (the optimizer's write):
    a training read of that same step afterwards (the step run again after
    a failure) reads each table as it was before the write, "not stored"
    for a key the write created, and a read of the next step reads the
    write.  The rows from before come from the step's own read of the table
    when it read every key (read_first="all"), else the write reads them
    itself ("none"; "some": the step's read missed keys of the write).  The
    same step written a second time (a replay that failed again) keeps the
    rows from before the first write, not the first write's."""
    if layout == "cluster":
        ports = redis_servers.cluster()
        cfg = {"redis_connection_mode": 0, "redis_host_ip": ["127.0.0.1"] * 3, "redis_host_port": ports}
        tables = _tables(ports[0], f"undo-{read_first}", **cfg)
    else:
        tables = _tables(server, f"undo-{read_first}")
    keys, before = _batch(tables, n=600)
    stored = keys[:400]  # the rest is new to the tables
    _write(tables, stored, [r[:400] for r in before])
    after = [r + tf.cast(5, r.dtype) for r in before]
    step = tf.constant(41, tf.int64)

    def read(table, step, k=keys):
        return table.find_to_update(k, tf.zeros([1, table.dim], table.value_dtype), step)

    if read_first != "none":
        for t in tables:
            read(t, step, keys if read_first == "all" else keys[::2])
    tables[0].insert_with(keys, after[0], list(zip(tables[1:], after[1:])), step)
    after = [r + tf.cast(9, r.dtype) for r in before]
    tables[0].insert_with(keys, after[0], list(zip(tables[1:], after[1:])), step)
    for t, b, a in zip(tables, before, after):
        values, exists = read(t, step)
        np.testing.assert_array_equal(exists.numpy(), np.arange(600) < 400, err_msg=t.name)
        np.testing.assert_array_equal(values.numpy()[:400], b.numpy()[:400], err_msg=t.name)
        np.testing.assert_array_equal(values.numpy()[400:], 0, err_msg=t.name)
        values, exists = read(t, step + 1)
        assert exists.numpy().all()
        np.testing.assert_array_equal(values.numpy(), a.numpy(), err_msg=t.name)


def test_a_step_s_later_read_takes_the_rows_of_its_first_read(server):
    """The optimizer reads the rows the forward pass read, in the same step:
    that read takes them from the step's first read of the table.  It
    returns what the server holds, and a key neither read found gets the
    later read's missing row (here ones where the first read filled zeros),
    with "not stored"."""
    table = _tables(server, "reread")[0]
    keys, rows = _batch([table], n=300)
    table.insert(keys[:200], rows[0][:200])
    step = tf.constant(7, tf.int64)
    table.find_to_update(keys, tf.zeros([1, 8]), step)
    values, exists = table.find_to_update(keys[::-3], tf.ones([1, 8]), step)
    want = np.where((np.arange(300) < 200)[:, None], rows[0].numpy(), 1.0)[::-3]
    np.testing.assert_array_equal(values.numpy(), want)
    np.testing.assert_array_equal(exists.numpy(), (np.arange(300) < 200)[::-3])


@pytest.mark.parametrize("write", ["insert", "insert_with", "grouped", "accum", "remove", "clear", "reopen"])
def test_a_write_between_a_step_s_reads_is_read_by_the_later_one(server, write):
    """A write of the table outside the step's own write (a user's upsert,
    accum or remove between the forward pass and apply_gradients, in the
    same step; a grouped write outside a step; redis-py writing the rows,
    then the table opened again, as model_tag_import does) is what the
    step's later read returns: the table forgets the rows its first read
    kept."""
    tables = _tables(server, f"between-{write}")
    table = tables[0]
    keys, rows = _batch([table], n=300)
    table.insert(keys, rows[0])
    step = tf.constant(3, tf.int64)
    table.find_to_update(keys, tf.zeros([1, 8]), step)
    new = rows[0] + 10.0
    if write == "insert":
        table.insert(keys, new)
    elif write == "insert_with":
        table.insert_with(keys, new, [])
    elif write == "grouped":
        _, others = _batch(tables[1:], n=300)
        table.insert_with(keys, new, list(zip(tables[1:], others)))
    elif write == "reopen":
        ks = keys.numpy()
        buckets = table._bucket_of(stable_hash_np(ks))
        client = redis.Redis(port=server)
        for field, b, row in zip(table._fields(ks), buckets, new.numpy()):
            client.hset(table._buckets[b], field, row.tobytes())
        table = _tables(server, f"between-{write}")[0]
    elif write == "accum":
        table.accum(keys, tf.fill([300, 8], 10.0), tfde.initializers.InitSpec("constant", 0.0, 0.0, 0))
    elif write == "remove":
        table.remove(keys)
    else:
        table.clear()
    values, exists = table.find_to_update(keys, tf.ones([1, 8]), step)
    if write in ("remove", "clear"):
        assert not exists.numpy().any()
        np.testing.assert_array_equal(values.numpy(), 1.0)
    else:
        assert exists.numpy().all()
        np.testing.assert_array_equal(values.numpy(), new.numpy())


def test_a_step_run_again_on_fewer_keys_keeps_the_rows_from_before_the_step(server):
    """A step's write fails after its transaction ran (here a slot table's
    bucket holds a string: WRONGTYPE inside the transaction, the rest of it
    applied), and the step is run again on a subset of its keys, which
    succeeds: a read of that step still finds every key of the first
    attempt as it was before the step.  Before, the run again was served
    the first attempt's read, whose stamps said "not written", so it
    dropped the rows kept for the keys it did not write, and those read the
    first attempt's rows."""
    tables = _tables(server, "fewer")
    keys, before = _batch(tables, n=60)
    _write(tables, keys, before)
    step = tf.constant(12, tf.int64)
    for t in tables:
        t.find_to_update(keys, tf.zeros([1, t.dim], t.value_dtype), step)
    client = redis.Redis(port=server)
    client.set("fewer:emb-m:{1}", "not a hash")
    first = [r + tf.cast(5, r.dtype) for r in before]
    with pytest.raises(tfde.TfdeError, match="WRONGTYPE"):
        tables[0].insert_with(keys, first[0], list(zip(tables[1:], first[1:])), step)
    client.delete("fewer:emb-m:{1}")
    some = keys[::3]
    for t in tables:
        t.find_to_update(some, tf.zeros([1, t.dim], t.value_dtype), step)
    again = [tf.gather(r, tf.range(0, 60, 3)) + tf.cast(7, r.dtype) for r in before]
    tables[0].insert_with(some, again[0], list(zip(tables[1:], again[1:])), step)
    values, exists = tables[0].find_to_update(keys, tf.zeros([1, 8]), step)
    assert exists.numpy().all()
    np.testing.assert_array_equal(values.numpy(), before[0].numpy())
