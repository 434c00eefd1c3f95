"""One suite for every Table backend, checked against the reference table
(a Python dict, the executable spec)."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tfde
from backends import BACKENDS as ALL_BACKENDS
from backends import TABLE_BACKENDS, FreshRedis
from tfde.initializers import InitSpec
from tfde.tables import CuckooTableCreator, ReferenceTableCreator
from tfde.tables.base import Table, creator_config, creator_from_config

BACKENDS = {name: ALL_BACKENDS[name] for name in TABLE_BACKENDS}
KEY_DTYPES = [tf.int64, tf.int32, tf.string]
INIT = InitSpec("uniform", -1.0, 1.0, 3)


def make_keys(dtype, values):
    values = list(values)
    if dtype == tf.string:
        return tf.constant([f"k{v}".encode() for v in values], tf.string) if values else tf.zeros([0], tf.string)
    return tf.constant(values, dtype) if values else tf.zeros([0], dtype)


def exported(table):
    keys, rows = [], []
    for k, v in table.export(chunk_rows=7):
        keys.extend(k.numpy().tolist())
        rows.extend(v.numpy())
    order = np.argsort(np.array(keys, dtype=object)) if keys else []
    return [keys[i] for i in order], np.array([rows[i] for i in order])


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    made = BACKENDS[request.param]()
    yield made
    made.cleanup()


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=lambda d: d.name)
def test_basic_ops_match_reference(backend, key_dtype, rng):
    dim = 5
    t = backend.create("basic", key_dtype, tf.float32, dim)
    ref = ReferenceTableCreator().create("basic", key_dtype, tf.float32, dim)
    for step in range(6):
        ks = make_keys(key_dtype, rng.integers(0, 40, 25))
        vals = tf.constant(rng.standard_normal((25, dim)), tf.float32)
        for table in (t, ref):
            table.insert(ks, vals)
        deltas = tf.constant(rng.standard_normal((25, dim)), tf.float32)
        ks2 = make_keys(key_dtype, rng.integers(0, 60, 25))
        for table in (t, ref):
            table.accum(ks2, deltas, INIT)
        gone = make_keys(key_dtype, rng.integers(0, 60, 10))
        assert int(t.remove(gone)) == int(ref.remove(gone))
        probe = make_keys(key_dtype, range(70))
        v1, e1 = t.find(probe, INIT)
        v2, e2 = ref.find(probe, INIT)
        np.testing.assert_array_equal(e1.numpy(), e2.numpy())
        np.testing.assert_allclose(v1.numpy(), v2.numpy(), rtol=1e-6, atol=1e-6)
        assert int(t.size()) == int(ref.size())
    k1, r1 = exported(t)
    k2, r2 = exported(ref)
    assert k1 == k2
    np.testing.assert_allclose(r1, r2, rtol=1e-6, atol=1e-6)
    t.clear()
    assert int(t.size()) == 0 and not any(True for _ in t.export())


@pytest.mark.parametrize("value_dtype", [tf.float32, tf.float64, tf.float16, tf.bfloat16], ids=lambda d: d.name)
def test_value_dtypes(backend, value_dtype):
    t = backend.create("vd", tf.int64, value_dtype, 3)
    t.insert(tf.constant([1, 2], tf.int64), tf.constant([[1, 2, 3], [4, 5, 6]], value_dtype))
    t.accum(
        tf.constant([2, 9], tf.int64), tf.constant([[1, 1, 1], [0.5, 0.5, 0.5]], value_dtype), InitSpec("constant", 1.0)
    )
    v, e = t.find(tf.constant([1, 2, 9, 3], tf.int64), InitSpec("constant", -1.0))
    assert v.dtype == value_dtype
    np.testing.assert_allclose(tf.cast(v, tf.float64).numpy(), [[1, 2, 3], [5, 6, 7], [1.5, 1.5, 1.5], [-1, -1, -1]])
    assert e.numpy().tolist() == [True, True, True, False]


@pytest.mark.parametrize("dim", [1, 2, 3, 64, 1024, 1031])
def test_dims(backend, dim, rng):
    t = backend.create(f"dim{dim}", tf.int64, tf.float32, dim)
    vals = rng.standard_normal((50, dim)).astype(np.float32)
    t.insert(tf.range(50, dtype=tf.int64), vals)
    v, _ = t.find(tf.range(50, dtype=tf.int64), tf.zeros([1, dim]))
    np.testing.assert_array_equal(v.numpy(), vals)


def test_defaults_tensor_per_key_and_broadcast(backend):
    t = backend.create("defaults", tf.int64, tf.float32, 2)
    t.insert(tf.constant([5], tf.int64), tf.constant([[9.0, 9.0]]))
    v, _ = t.find(tf.constant([4, 5, 6], tf.int64), tf.constant([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
    assert v.numpy().tolist() == [[1, 1], [9, 9], [3, 3]]
    v, _ = t.find(tf.constant([4, 5], tf.int64), tf.constant([[7.0, 8.0]]))
    assert v.numpy().tolist() == [[7, 8], [9, 9]]


def test_find_never_inserts(backend):
    t = backend.create("noinsert", tf.int64, tf.float32, 2)
    t.find(tf.range(100, dtype=tf.int64), INIT)
    assert int(t.size()) == 0


def test_empty_batches(backend):
    t = backend.create("empty", tf.string, tf.float32, 4)
    e = tf.zeros([0], tf.string)
    v, ex = t.find(e, INIT)
    assert v.shape == (0, 4) and ex.shape == (0,)
    t.insert(e, tf.zeros([0, 4]))
    t.accum(e, tf.zeros([0, 4]), INIT)
    assert int(t.remove(e)) == 0 and int(t.size()) == 0


def test_duplicates_in_one_batch(backend):
    t = backend.create("dups", tf.int64, tf.float32, 1)
    k = tf.constant([3, 3, 3], tf.int64)
    t.insert(k, tf.constant([[1.0], [2.0], [3.0]]))
    assert t.find(tf.constant([3], tf.int64), INIT)[0].numpy().tolist() == [[3.0]]  # last wins
    t.accum(k, tf.constant([[1.0], [1.0], [1.0]]), INIT)
    assert t.find(tf.constant([3], tf.int64), INIT)[0].numpy().tolist() == [[6.0]]  # all add


# (value dtype, delta dtype, half an ulp of the value dtype at 1.0, a part of
# the delta that rounding it to the value dtype first would drop; 1 + both is
# exact in the delta dtype)
ONCE_CASES = [
    (tf.float16, tf.float32, 2.0**-11, 2.0**-22),
    (tf.bfloat16, tf.float32, 2.0**-8, 2.0**-20),
    (tf.float32, tf.float64, 2.0**-24, 2.0**-40),
]


@pytest.mark.parametrize("value_dtype,delta_dtype,half_ulp,tail", ONCE_CASES, ids=lambda c: getattr(c, "name", None))
def test_accum_of_wider_deltas_rounds_each_sum_once(backend, value_dtype, delta_dtype, half_ulp, tail):
    """Deltas wider than the rows (float32 for a float16 or bfloat16 table,
    float64 for a float32 one) are added in the wider type and the sum is
    rounded once (semi-synchronous training's syncs push float32 deltas):
    1 + (half an ulp + a little) rounds up; rounding the delta to the
    table's dtype first made it a tie, which rounds to 1 (even)."""
    t = backend.create("once", tf.int64, value_dtype, 2)
    keys = tf.constant([1, 2, 3], tf.int64)
    t.insert(keys, tf.ones([3, 2], value_dtype))
    # Key 3: the sum is formed in the delta dtype (float32 for float16 rows,
    # as the native ops and the Python path do), where 1 + half an ulp + half
    # the delta dtype's ulp at 1 is a tie that rounds to 1 + half an ulp, and
    # that again to 1.  Rounding the exact sum at once would round it up.
    finest = 2.0**-24 if delta_dtype == tf.float32 else 2.0**-53
    delta = tf.constant([[half_ulp + tail, -(half_ulp + tail)], [half_ulp, 0.0], [half_ulp + finest, 0.0]], delta_dtype)
    t.accum(keys, delta, INIT)
    rows = t.find(keys, INIT)[0]
    assert rows.dtype == value_dtype
    up, down = 1.0 + 2 * half_ulp, 1.0 - half_ulp  # the neighbours of 1.0 (the ulp below 1 is half the one above)
    assert rows.numpy().astype(np.float64).tolist() == [[up, down], [1.0, 1.0], [1.0, 1.0]]  # [1, 0]: a tie, to even


@pytest.mark.parametrize("value_dtype", [tf.float16, tf.bfloat16, tf.float32], ids=lambda d: d.name)
@pytest.mark.parametrize("delta_dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
def test_accum_of_wider_deltas_matches_the_reference_bit_for_bit(backend, rng, value_dtype, delta_dtype):
    """Random rows and deltas of every scale, some keys missing (their
    initial row), a key given twice: every backend stores what the
    reference's numpy sums store, bit for bit (Redis's accum script forms
    the sums in Lua and must round as the native ops do)."""
    dim = 6
    t = backend.create("wide", tf.int64, value_dtype, dim)
    ref = ReferenceTableCreator().create("wide", tf.int64, value_dtype, dim)
    stored = tf.constant(np.arange(0, 40), tf.int64)
    rows = tf.cast(tf.constant(rng.standard_normal((40, dim)) * 10.0 ** rng.integers(-3, 3, (40, 1))), value_dtype)
    for table in (t, ref):
        table.insert(stored, rows)
    for _ in range(3):
        keys = np.concatenate([rng.integers(0, 60, 30), [7, 7]])
        scale = 10.0 ** rng.integers(-8, 1, (32, 1))
        deltas = tf.constant(rng.standard_normal((32, dim)) * scale, delta_dtype)
        for table in (t, ref):
            table.accum(tf.constant(keys, tf.int64), deltas, INIT)
    got, want = exported(t), exported(ref)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1].astype(np.float64), want[1].astype(np.float64))


@pytest.mark.parametrize(
    "value_dtype,row,delta,want",
    [
        (tf.float16, 1.0, 2.0**-11 + 2.0**-40, 1.0),  # float64 1 + 2^-11 + 2^-40 -> float32 1 + 2^-11 -> a tie: 1
        (tf.bfloat16, 65536.0, 16777217.0, 16777216.0),
    ],
    ids=["float16", "bfloat16"],
)
def test_a_float64_sum_reaches_a_half_row_through_float32(backend, value_dtype, row, delta, want):
    """Every backend converts a float64 sum to float16 or bfloat16 as
    TensorFlow's cast does (through float32), so they all store one value."""
    t = backend.create("through", tf.int64, value_dtype, 1)
    key = tf.constant([1], tf.int64)
    t.insert(key, tf.constant([[row]], value_dtype))
    t.accum(key, tf.constant([[delta]], tf.float64), INIT)
    assert float(t.find(key, INIT)[0].numpy()[0, 0]) == want
    assert float(tf.cast(tf.constant(row, tf.float64) + delta, value_dtype)) == want  # TensorFlow's own


@pytest.mark.parametrize("value_dtype", [tf.float16, tf.bfloat16], ids=lambda d: d.name)
def test_a_nan_delta_stores_a_nan_of_its_sign(backend, value_dtype):
    """float32 NaN deltas with any payload, either sign: the row becomes
    the quiet NaN of the delta's sign on every backend (Redis's script once
    rounded a bfloat16 NaN's payload into -0.0)."""
    bits = np.array([0x7FFFFFFF, 0x7FFF8001, 0x7FBFFFFF, 0xFFFF8000, 0x7FC00000, 0xFFC00000], np.uint32)
    deltas = bits.view(np.float32).reshape(-1, 1)
    keys = tf.range(len(bits), dtype=tf.int64)
    t = backend.create("nan", tf.int64, value_dtype, 1)
    t.insert(keys, tf.ones([len(bits), 1], value_dtype))
    t.accum(keys, tf.constant(deltas), INIT)
    rows = t.find(keys, INIT)[0].numpy().astype(np.float32)[:, 0]
    assert np.isnan(rows).all(), rows
    assert np.signbit(rows).tolist() == [b >= 0x80000000 for b in bits.tolist()]


def test_accum_refuses_more_deltas_than_keys(backend):
    t = backend.create("count", tf.int64, tf.float32, 2)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        t.accum(tf.constant([1], tf.int64), tf.ones([2, 2]), INIT)
    assert int(t.size()) == 0


def test_export_in_bounded_chunks(backend):
    t = backend.create("chunks", tf.int64, tf.float32, 2)
    t.insert(tf.range(1000, dtype=tf.int64), tf.zeros([1000, 2]))
    sizes = [int(tf.size(k)) for k, _ in t.export(chunk_rows=128)]
    assert max(sizes) <= 128 and sum(sizes) == 1000
    keys = np.concatenate([k.numpy() for k, _ in t.export(chunk_rows=128)])
    assert sorted(keys.tolist()) == list(range(1000))


def test_import_replace(backend):
    t = backend.create("imp", tf.int64, tf.float32, 1)
    t.insert(tf.constant([1, 2], tf.int64), tf.constant([[1.0], [2.0]]))
    t.import_(tf.constant([3], tf.int64), tf.constant([[3.0]]), replace=True)
    assert int(t.size()) == 1
    rows, exists = t.find(tf.constant([1, 2, 3], tf.int64), InitSpec("constant", -1.0))
    assert exists.numpy().tolist() == [False, False, True]
    assert rows.numpy().tolist() == [[-1.0], [-1.0], [3.0]]


def test_works_inside_tf_function(backend):
    t = backend.create("graph", tf.int64, tf.float32, 3)

    @tf.function
    def step(k, v):
        t.insert(k, v)
        t.accum(k, v, INIT)
        rows, exists = t.find(k, INIT)
        return rows, exists, t.size()

    rows, exists, size = step(tf.constant([1, 2], tf.int64), tf.ones([2, 3]))
    assert rows.numpy().tolist() == [[2.0] * 3] * 2 and int(size) == 2


# ---------------------------------------------------------------- bad input


def test_wrong_key_dtype_is_a_clear_error(backend):
    t = backend.create("kd", tf.int64, tf.float32, 2)
    with pytest.raises(tfde.ShapeError, match="are string, expected int64"):
        t.find(tf.constant(["a"]), INIT)
    with pytest.raises(tfde.ShapeError, match="cast them"):
        t.insert(tf.constant([1], tf.int32), tf.zeros([1, 2]))


def test_wrong_dim_is_a_clear_error(backend):
    t = backend.create("wd", tf.int64, tf.float32, 4)
    with pytest.raises(tfde.ShapeError, match=r"shape \[n, 4\]"):
        t.insert(tf.constant([1], tf.int64), tf.zeros([1, 3]))
    assert int(t.size()) == 0


def test_native_op_validates_shapes_itself():  # cuckoo only: its kernels
    # Bypass the Python checks: the kernel must refuse before touching memory.
    t = CuckooTableCreator().create("raw", tf.int64, tf.float32, 4)
    ops = tfde._native.load()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"values must have shape \[2, 4\]"):
        ops.tfde_table_insert(t.resource_handle, tf.constant([1, 2], tf.int64), tf.zeros([3, 4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="keys must be a vector"):
        ops.tfde_table_insert(t.resource_handle, tf.constant([[1]], tf.int64), tf.zeros([1, 4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="keys are string but the table"):
        ops.tfde_table_find(t.resource_handle, tf.constant(["x"]), tf.zeros([1, 4]), dim=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"defaults must have shape"):
        ops.tfde_table_find(t.resource_handle, tf.constant([1, 2], tf.int64), tf.zeros([3, 4]), dim=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="values are double"):
        ops.tfde_table_insert(t.resource_handle, tf.constant([1], tf.int64), tf.zeros([1, 4], tf.float64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_rows must be > 0"):
        ops.tfde_table_export(t.resource_handle, 0, 0, dim=4, Tkey=tf.int64, Tvalue=tf.float32)
    assert int(t.size()) == 0


@pytest.mark.parametrize("expected_rows", [0, 200_000])
@pytest.mark.parametrize("dim", [64, 66])
def test_big_batches_stream_their_rows(expected_rows, dim):  # cuckoo only: its kernels
    # Finds of >= 16 MiB of rows write them with streaming stores
    # (backends/cuckoo/row_copy.h); inserts of as many rows, new and stored.
    # dim 66: 264-byte rows, so half the destinations are only 8-aligned.
    # expected_rows > 0: the rows' memory is mapped when the table is made.
    rng = np.random.default_rng(dim)
    n = 70_000
    t = CuckooTableCreator(expected_rows=expected_rows).create("big", tf.int64, tf.float32, dim)
    keys = rng.choice(1 << 40, size=2 * n, replace=False).astype(np.int64)
    first = rng.standard_normal((n, dim)).astype(np.float32)
    t.insert(tf.constant(keys[:n]), tf.constant(first))  # all new
    mixed_keys = np.concatenate([keys[n // 2 : n], keys[n : n + n // 2]])  # half stored, half new
    mixed = rng.standard_normal((n, dim)).astype(np.float32)
    t.insert(tf.constant(mixed_keys), tf.constant(mixed))
    expect = dict(zip(keys[:n].tolist(), first))
    expect.update(zip(mixed_keys.tolist(), mixed))
    probe = np.concatenate([keys[: n + n // 2], keys[n + n // 2 :]])  # stored, then missing
    values, exists = t.find(tf.constant(probe), InitSpec("constant", 0.5, 0.0, 0))
    want = np.stack([expect.get(k, np.full(dim, 0.5, np.float32)) for k in probe.tolist()])
    np.testing.assert_array_equal(values.numpy(), want)
    np.testing.assert_array_equal(exists.numpy(), [k in expect for k in probe.tolist()])
    assert int(t.size()) == len(expect)


@pytest.mark.parametrize("dim", [0, -3, 1 << 20, 2.5, True])
def test_bad_dims(dim):
    with pytest.raises(tfde.ConfigError, match="dim must be an int between 1 and 65536"):
        CuckooTableCreator().create("bad", tf.int64, tf.float32, dim)


def test_bad_dtypes():
    with pytest.raises(tfde.ConfigError, match="key_dtype float32 is not supported"):
        CuckooTableCreator().create("bad", tf.float32, tf.float32, 2)
    with pytest.raises(tfde.ConfigError, match="value_dtype int32 is not supported"):
        CuckooTableCreator().create("bad", tf.int64, tf.int32, 2)


# ---------------------------------------------------------------- state machine


class TableMachine(RuleBasedStateMachine):
    """Random operation sequences on a backend and on the reference table."""

    keys = st.lists(st.integers(0, 30), min_size=0, max_size=12)

    @initialize(backend=st.sampled_from(sorted(BACKENDS)), key_dtype=st.sampled_from(KEY_DTYPES))
    def setup(self, backend, key_dtype):
        self.key_dtype = key_dtype
        self.made = BACKENDS[backend]()
        self.t = self.made.create("sm", key_dtype, tf.float32, 3)
        self.ref = ReferenceTableCreator().create("sm", key_dtype, tf.float32, 3)
        self.counter = 0

    def _rows(self, n):
        self.counter += 1
        return tf.constant(np.arange(n * 3, dtype=np.float32).reshape(n, 3) + self.counter)

    @rule(ks=keys)
    def insert(self, ks):
        rows = self._rows(len(ks))
        for table in (self.t, self.ref):
            table.insert(make_keys(self.key_dtype, ks), rows)

    @rule(ks=keys)
    def accum(self, ks):
        rows = self._rows(len(ks))
        for table in (self.t, self.ref):
            table.accum(make_keys(self.key_dtype, ks), rows, INIT)

    @rule(ks=keys)
    def remove(self, ks):
        k = make_keys(self.key_dtype, ks)
        assert int(self.t.remove(k)) == int(self.ref.remove(k))

    @rule()
    def clear(self):
        self.t.clear()
        self.ref.clear()

    @rule(ks=keys)
    def find(self, ks):
        k = make_keys(self.key_dtype, ks)
        v1, e1 = self.t.find(k, INIT)
        v2, e2 = self.ref.find(k, INIT)
        np.testing.assert_array_equal(e1.numpy(), e2.numpy())
        np.testing.assert_allclose(v1.numpy(), v2.numpy(), rtol=1e-6, atol=1e-6)

    @invariant()
    def same_size(self):
        if hasattr(self, "t"):
            assert int(self.t.size()) == int(self.ref.size())

    def teardown(self):
        if hasattr(self, "t"):
            try:
                k1, r1 = exported(self.t)
                k2, r2 = exported(self.ref)
                assert k1 == k2
                if k1:
                    np.testing.assert_allclose(r1, r2, rtol=1e-6, atol=1e-6)
            finally:
                self.made.cleanup()


TableMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_table_state_machine = TableMachine.TestCase


@pytest.mark.parametrize("mode", [2, 0, 1], ids=["standalone", "cluster", "sentinel"])
@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=lambda d: d.name)
def test_redis_serving_view_reads_what_the_table_holds(mode, key_dtype):
    """The native read-only view (TfdeRedisFind, used by SavedModels that keep
    reading Redis) finds exactly what the Python RedisTable finds: stored
    rows, and initializer or default rows for missing keys."""
    backend = FreshRedis(mode)
    try:
        table = backend.create("serving_view", key_dtype, tf.float32, 5)
        table.insert(make_keys(key_dtype, range(0, 200, 2)), tf.random.stateless_normal([100, 5], seed=[1, 1]))
        view = table.serving_view()
        keys = make_keys(key_dtype, range(0, 120, 3))
        for missing in (INIT, tf.fill([40, 5], -3.0)):
            want_rows, want_exists = table.find(keys, missing)
            got_rows, got_exists = view.find(keys, missing)
            np.testing.assert_array_equal(got_exists.numpy(), want_exists.numpy())
            np.testing.assert_array_equal(got_rows.numpy(), want_rows.numpy())
        with pytest.raises(tfde.ConfigError, match="read-only"):
            view.insert(keys, tf.zeros([40, 5]))
    finally:
        backend.cleanup()


def test_redis_serving_view_names_an_unreachable_server():
    from tfde.tables.redis_table import RedisServingTable

    backend = FreshRedis(2)
    try:
        table = backend.create("serving_down", tf.int64, tf.float32, 2)
        view = RedisServingTable(table)
        view._attrs.update(servers=["127.0.0.1:1"], retry_deadline_ms=50, connect_timeout_ms=200)
        with pytest.raises(
            tf.errors.UnavailableError,
            match=r"tfde\.BackendUnavailableError: Redis at 127\.0\.0\.1:1 unreachable during find of "
            r"table 'serving_down' after 2 attempts in 50 ms of retries \(redis_retry_deadline_ms 50\): cannot connect",
        ):
            view.find(tf.constant([1], tf.int64), INIT)
    finally:
        backend.cleanup()


def test_every_backend_declares_its_capabilities(backend):
    """The Table protocol's capabilities are answered by every backend, not
    found by getattr: memory held here, a serving view (or None), the
    checkpoint layout, close()."""
    t = backend.create("caps", tf.int64, tf.float32, 4)
    t.insert(tf.constant([1, 2, 3], tf.int64), tf.ones([3, 4]))
    held = int(t.memory_bytes())
    if t.shared_between_workers:  # a store outside the process
        assert held == 0
        view = t.serving_view()
        assert isinstance(view, Table)
        rows, exists = view.find(tf.constant([1, 9], tf.int64), InitSpec("constant", -1.0))
        assert exists.numpy().tolist() == [True, False] and rows.numpy()[0].tolist() == [1.0] * 4
        with pytest.raises(tfde.ConfigError, match="read-only"):
            view.insert(tf.constant([5], tf.int64), tf.ones([1, 4]))
    else:
        assert held >= 3 * 4 * 4  # at least the rows themselves
        assert t.serving_view() is None  # serving exports copy in-process rows
    assert t.files_dir is None or isinstance(t.files_dir, str)
    assert isinstance(t.in_checkpoints, bool)
    t.close()


@pytest.mark.parametrize("name", ["cuckoo", "reference", "redis"])
def test_a_creator_comes_back_from_its_config(name):
    made = ALL_BACKENDS[name]()
    try:
        config = creator_config(made.creator)
        again = creator_from_config(config)
        assert type(again) is type(made.creator) and again.get_config() == made.creator.get_config()
    finally:
        made.cleanup()


def test_a_config_naming_an_unknown_creator_is_refused():
    with pytest.raises(
        tfde.ConfigError,
        match=r"unknown table creator 'MyCreator'.*CuckooTableCreator.*"
        r"RedisTableCreator.*ReferenceTableCreator",
    ):
        creator_from_config({"class_name": "MyCreator", "config": {}})


def test_a_second_creator_class_of_a_registered_name_is_refused():
    from tfde.tables.base import register_creator

    class CuckooTableCreator(tfde.tables.CuckooTableCreator):  # same name, another class
        pass

    with pytest.raises(tfde.ConfigError, match="named 'CuckooTableCreator' is registered already"):
        register_creator(CuckooTableCreator)
    assert (
        creator_from_config({"class_name": "CuckooTableCreator", "config": {}}).__class__
        is tfde.tables.CuckooTableCreator
    )
