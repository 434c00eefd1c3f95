"""Property-based fuzzing of tfde's native ops (backends/cuckoo/ops.cc,
backends/redis/ops.cc) and of the Table and Variable API over them.

Every example runs in this process, eagerly and inside tf.function (whose
inputs have unknown shapes, so that the kernels' own checks, not shape
inference, meet every bad shape).  Each call either returns the reference
answer (a dict model following tfde/tables/reference.py, the executable
spec) or raises a TF InvalidArgument / FailedPrecondition or a tfde error
with a message, and a refused call changes nothing.  A crash kills the run:
that is a found bug.

The examples come from a fixed seed, TFDE_FUZZ_SEED (printed), so every run
fuzzes the same inputs; set it to explore others, and TFDE_FUZZ_SCALE to run
more (or fewer) examples.  Run with -s to see the examples fuzzed per op.
"""

import collections
import itertools
import os
import uuid

import numpy as np
import pytest
import redis
import tensorflow as tf
from hypothesis import HealthCheck, assume, given, seed, settings
from hypothesis import strategies as st

import tfde
from tfde import _native, hashing
from tfde.errors import TfdeError
from tfde.initializers import InitSpec, init_rows_reference
from tfde.tables import CuckooTableCreator, ReferenceTableCreator
from tfde.tables.redis_table import _ACCUM_LUA, _REMOVE_LUA

OPS = _native.load()
FUZZ_SEED = int(os.environ.get("TFDE_FUZZ_SEED", "15"))
SCALE = float(os.environ.get("TFDE_FUZZ_SCALE", "1"))
MODES = ("eager", "graph")

KEY_DTYPES = (tf.int64, tf.int32, tf.string)
VALUE_DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16)
# Closeness of a row to its reference: inserted rows are copied bit for bit;
# initial rows and sums may differ by an ulp (the native code rounds
# double -> float -> half, numpy double -> half).
TOLERANCE = {tf.float32: 1e-6, tf.float64: 1e-12, tf.float16: 2e-3, tf.bfloat16: 1.6e-2}
# What a missing key reads, besides default rows: one spec per init kind.
SPECS = (
    InitSpec("constant", 0.5, 0.0, 0),
    InitSpec("uniform", -1.0, 1.0, 3),
    InitSpec("normal", 0.25, 2.0, -7),
    InitSpec("truncated_normal", 0.0, 1.0, 2**40),
)
MAX_DIM = 65536
# Refusals: a kernel's InvalidArgument / FailedPrecondition, a tfde error.
REFUSALS = (tf.errors.InvalidArgumentError, tf.errors.FailedPreconditionError, TfdeError)

COUNTS = collections.Counter()  # (op, mode, "answered" | "refused") -> examples


def fuzz(max_examples):
    """Hypothesis settings of every test here: bounded, seeded, no database."""

    def wrap(test):
        test = settings(
            max_examples=max(1, int(max_examples * SCALE)),
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        )(test)
        return seed(FUZZ_SEED)(test)

    return wrap


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    print(f"\nfuzz seed {FUZZ_SEED} (TFDE_FUZZ_SEED), scale {SCALE}")
    yield
    ops = sorted({op for op, _, _ in COUNTS})
    print("\nexamples fuzzed per op (answered / refused; eager + tf.function):")
    for op in ops:
        answered = sum(COUNTS[op, m, "answered"] for m in MODES)
        refused = sum(COUNTS[op, m, "refused"] for m in MODES)
        print(f"  {op:28s} {answered:6d} / {refused:6d}")
    print(
        f"  {'total':28s} {sum(v for (_, _, r), v in COUNTS.items() if r == 'answered'):6d} / "
        f"{sum(v for (_, _, r), v in COUNTS.items() if r == 'refused'):6d}"
    )


# ---------------------------------------------------------------- calling ops

_GRAPH_FNS = {}


def run_op(how, name, *inputs, **attrs):
    """OPS.<name>(*inputs, **attrs), eagerly or in a tf.function whose input
    shapes are unknown (one trace per op, input dtypes and attrs); `how` is
    "eager" or "graph" (not `mode`: the Redis ops have a mode attr)."""
    fn = getattr(OPS, name)
    if how == "eager":
        return fn(*inputs, **attrs)
    key = (
        name,
        tuple(x.dtype for x in inputs),
        tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items())),
    )
    graph_fn = _GRAPH_FNS.get(key)
    if graph_fn is None:

        def body(*args):
            out = fn(*args, **attrs)
            return None if isinstance(out, tf.Operation) else out

        graph_fn = _GRAPH_FNS[key] = tf.function(body, input_signature=[tf.TensorSpec(None, x.dtype) for x in inputs])
    return graph_fn(*inputs)


def answered(op, mode, call):
    out = call()
    COUNTS[op, mode, "answered"] += 1
    return out


def refused(op, mode, call, also=()):
    """Runs a call that must be refused; returns the error."""
    try:
        out = call()
    except REFUSALS + tuple(also) as e:
        assert str(e).strip(), f"{op}: {type(e).__name__} without a message"
        COUNTS[op, mode, "refused"] += 1
        return e
    raise AssertionError(f"{op} ({mode}) accepted a bad call and returned {out}")


# ---------------------------------------------------------------- inputs


def np_dtype(dtype):
    return object if dtype == tf.string else dtype.as_numpy_dtype


def py_key(k):
    return k if isinstance(k, bytes) else int(k)


def key_pool(rng, key_dtype, size):
    """Distinct keys to draw batches from (extremes included), as numpy."""
    if key_dtype == tf.string:
        fixed = [b"", b"a", b"\0", b"\0\0\0\0\0\0\0\0\0", b"x" * 40, "ünï".encode()]
        rand = [bytes(rng.integers(0, 256, rng.integers(0, 24)).astype(np.uint8)) for _ in range(size)]
        return np.array(list(dict.fromkeys(fixed + rand)), dtype=object)
    info = np.iinfo(key_dtype.as_numpy_dtype)
    fixed = [0, 1, -1, info.min, info.max, info.min + 1, 2**20]
    rand = rng.integers(info.min, info.max, size, dtype=np.int64, endpoint=True).tolist()
    return np.array(list(dict.fromkeys(fixed + rand)), dtype=key_dtype.as_numpy_dtype)


def draw_keys(rng, pool, n):
    return pool[rng.integers(0, len(pool), n)] if n else pool[:0]


def rows(rng, n, dim, value_dtype):
    return rng.uniform(-8, 8, (n, dim)).astype(np_dtype(value_dtype))


def tensor(x, dtype):
    return tf.constant(x, dtype=dtype) if dtype == tf.string or np.size(x) else tf.zeros(np.shape(x), dtype)


# ---------------------------------------------------------------- the model


class Model:
    """The reference answers of one raw table: a dict key -> numpy row."""

    def __init__(self, key_dtype, value_dtype, dim):
        self.key_dtype, self.value_dtype, self.dim = key_dtype, value_dtype, dim
        self.np = np_dtype(value_dtype)
        self.acc = np.float64 if value_dtype == tf.float64 else np.float32
        self.rows = {}

    def missing(self, keys, spec, defaults):
        """What each of `keys` reads when absent ([n, dim] numpy)."""
        if spec is not None:
            return init_rows_reference([py_key(k) for k in keys], spec, self.dim).astype(self.np)
        return np.broadcast_to(defaults, (len(keys), self.dim)) if len(defaults) == 1 else defaults

    def find(self, keys, spec, defaults):
        out = self.missing(keys, spec, defaults).copy()
        exists = np.zeros(len(keys), bool)
        for i, k in enumerate(keys):
            if py_key(k) in self.rows:
                out[i] = self.rows[py_key(k)]
                exists[i] = True
        return out, exists

    def insert(self, keys, values):
        for k, v in zip(keys, values):
            self.rows[py_key(k)] = v.copy()

    def accum(self, keys, deltas, spec, defaults):
        init = self.missing(keys, spec, defaults)
        for i, (k, d) in enumerate(zip(keys, deltas)):
            base = self.rows.get(py_key(k), init[i])
            self.rows[py_key(k)] = (base.astype(self.acc) + d.astype(self.acc)).astype(self.np)

    def remove(self, keys):
        return sum(self.rows.pop(py_key(k), None) is not None for k in keys)


def assert_rows_close(got, want, value_dtype, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    tol = TOLERANCE[value_dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


def export_all(handle, model, mode, max_rows):
    """Walks the whole table; checks chunk bounds and termination."""
    got, cursor, calls = {}, 0, 0
    while cursor >= 0:
        keys, values, nxt = answered(
            "TfdeTableExport",
            mode,
            lambda: run_op(
                mode,
                "tfde_table_export",
                handle,
                tf.constant(cursor, tf.int64),
                tf.constant(max_rows, tf.int64),
                dim=model.dim,
                Tkey=model.key_dtype,
                Tvalue=model.value_dtype,
            ),
        )
        keys, values, nxt = keys.numpy(), values.numpy(), int(nxt)
        assert len(keys) <= max_rows and values.shape == (len(keys), model.dim)
        assert nxt == -1 or nxt > cursor, f"export from cursor {cursor} continues at {nxt}"
        for k, v in zip(keys, values):
            assert py_key(k) not in got, f"export returned key {k!r} twice"
            got[py_key(k)] = v
        cursor, calls = nxt, calls + 1
        assert calls <= len(model.rows) // max_rows + 2, "export does not terminate"
    return got


def assert_table_is(handle, model, mode, max_rows=None):
    size = int(answered("TfdeTableSize", mode, lambda: run_op(mode, "tfde_table_size", handle)))
    assert size == len(model.rows), f"size {size}, expected {len(model.rows)}"
    got = export_all(handle, model, mode, max_rows or max(1, len(model.rows) // 3 + 1))
    assert set(got) == set(model.rows), "exported keys differ from the reference"
    for k, v in got.items():
        assert_rows_close(v, model.rows[k], model.value_dtype, f"row of key {k!r}")


# ---------------------------------------------------------------- raw table ops

_tables = itertools.count()


def create_table(mode, key_dtype, value_dtype, dim, expected_rows=0):
    return run_op(
        mode,
        "tfde_cuckoo_table",
        key_dtype=key_dtype,
        value_dtype=value_dtype,
        dim=dim,
        expected_rows=expected_rows,
        shared_name=f"fuzz_{next(_tables)}",
    )


def destroy(handle):
    tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)


OTHER_KEY = {tf.int64: tf.int32, tf.int32: tf.int64, tf.string: tf.int64}
OTHER_VALUE = {tf.float32: tf.float64, tf.float64: tf.float32, tf.float16: tf.bfloat16, tf.bfloat16: tf.float16}
# Deltas an accum op must refuse: a dtype neither the table's nor float32 or
# float64 (which it adds in the wider type).
BAD_DELTAS = {tf.float32: tf.float16, tf.float64: tf.bfloat16, tf.float16: tf.bfloat16, tf.bfloat16: tf.float16}


def keys_arg(keys, key_dtype, bad):
    """The keys tensor, or a corrupted one."""
    if bad == "keys_rank0":
        return tensor(keys[:1].reshape(()) if len(keys) else keys_for_dtype(key_dtype, 1)[0], key_dtype)
    if bad == "keys_rank2":
        return tensor(keys.reshape(1, -1), key_dtype)
    if bad == "keys_dtype":
        other = OTHER_KEY[key_dtype]
        return tf.zeros([len(keys)], other) if other != tf.string else tf.constant([b"k"] * len(keys))
    return tensor(keys, key_dtype)


def keys_for_dtype(key_dtype, n):
    return np.array([b"k"] * n, object) if key_dtype == tf.string else np.arange(n).astype(key_dtype.as_numpy_dtype)


def rows_arg(values, value_dtype, bad):
    n, dim = values.shape
    if bad == "rows_count":
        return tf.zeros([n + 1, dim], value_dtype)
    if bad == "rows_dim":
        return tf.zeros([n, dim + 1], value_dtype)
    if bad == "rows_rank1":
        return tf.zeros([n * dim], value_dtype)
    if bad == "rows_rank3":
        return tf.zeros([n, dim, 1], value_dtype)
    if bad == "rows_dtype":
        return tf.zeros([n, dim], OTHER_VALUE[value_dtype])
    if bad == "deltas_dtype":
        return tf.zeros([n, dim], BAD_DELTAS[value_dtype])
    return tensor(values, value_dtype)


def defaults_arg(defaults, value_dtype, n, dim, bad):
    if bad == "rows_dtype":  # values and defaults share one dtype attr: both of the other dtype
        return tf.zeros([1, dim], OTHER_VALUE[value_dtype])
    if bad == "defaults_count":
        return tf.zeros([n + 2, dim], value_dtype)
    if bad == "defaults_dim":
        return tf.zeros([1, dim + 1], value_dtype)
    if bad == "defaults_rank1":
        return tf.zeros([dim], value_dtype)
    return tensor(defaults, value_dtype)


CORRUPTIONS = {
    "find": (
        "keys_rank0",
        "keys_rank2",
        "keys_dtype",
        "defaults_count",
        "defaults_dim",
        "defaults_rank1",
        "rows_dtype",
        "dim_attr",
        "destroyed",
    ),
    "insert": (
        "keys_rank0",
        "keys_rank2",
        "keys_dtype",
        "rows_count",
        "rows_dim",
        "rows_rank1",
        "rows_rank3",
        "rows_dtype",
        "destroyed",
    ),
    "accum": (
        "keys_rank0",
        "keys_rank2",
        "keys_dtype",
        "rows_count",
        "rows_dim",
        "rows_rank1",
        "rows_dtype",
        "deltas_dtype",
        "defaults_count",
        "defaults_dim",
        "destroyed",
    ),
    "remove": ("keys_rank0", "keys_rank2", "keys_dtype", "destroyed"),
    "export": (
        "cursor_negative",
        "max_rows_zero",
        "max_rows_negative",
        "cursor_vector",
        "keys_dtype",
        "rows_dtype",
        "dim_attr",
        "destroyed",
    ),
    "size": ("destroyed",),
    "clear": ("destroyed",),
    "memory": ("destroyed",),
}


# Ops of a random sequence, weighted towards the ones that change or read rows.
OP_MIX = ("find",) * 3 + ("insert",) * 3 + ("accum",) * 2 + ("remove",) * 2 + ("export", "size", "clear", "memory")


@st.composite
def table_cases(draw):
    key_dtype = draw(st.sampled_from(KEY_DTYPES))
    value_dtype = draw(st.sampled_from(VALUE_DTYPES))
    dim = draw(st.sampled_from([1, 2, 3, 8, 8, 33, 1024, MAX_DIM]))
    # A presized table maps at least 64 rows per shard up front (4096 rows):
    # wide rows are not presized here, or a table would take gigabytes.
    expected_rows = draw(st.sampled_from([0, 0, 1, 100, 5000])) if dim <= 64 else 0
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(OP_MIX))
        bad = draw(st.one_of(st.none(), st.none(), st.sampled_from(CORRUPTIONS[op])))
        # Batches: mostly small, sometimes big (a few tens of thousands of
        # keys, fewer for wide rows), sometimes empty.
        size_class = draw(st.sampled_from(["small"] * 6 + ["empty", "big"]))
        limit = max(1, (1 << 22) // (dim * 8))  # keeps a batch below ~4 MiB of rows
        n = {"empty": 0, "small": draw(st.integers(1, 64)), "big": draw(st.integers(1000, 30000))}[size_class]
        steps.append((op, bad, min(n, limit), draw(st.sampled_from((None,) + SPECS)), draw(st.booleans())))
    return key_dtype, value_dtype, dim, expected_rows, draw(st.integers(1, 600)), steps, draw(st.integers(0, 2**32))


def _missing(model, spec, rng, n, broadcast):
    """(spec or None, defaults numpy, init attrs) of a find/accum."""
    if spec is not None:
        return spec, np.zeros((0, model.dim), model.np), spec.attrs()
    return None, rows(rng, 1 if broadcast else n, model.dim, model.value_dtype), {"init_kind": "defaults"}


def table_step(mode, handle, dead, model, rng, pool, op, bad, n, spec, broadcast):
    """One call of a raw table op (corrupted as `bad` says, or not) against
    the model: the reference answer, or a refusal that changed nothing."""
    key_dtype, value_dtype, dim = model.key_dtype, model.value_dtype, model.dim
    keys = draw_keys(rng, pool, n)
    if n * dim > 4096:
        spec = None  # the reference initial rows are pure Python: default rows for big batches
    h = dead if bad == "destroyed" else handle
    if op == "find":
        spec, defaults, attrs = _missing(model, spec, rng, n, broadcast)
        if bad in ("defaults_count", "defaults_dim", "defaults_rank1"):
            spec, attrs = None, {"init_kind": "defaults"}
        call = lambda: run_op(
            mode,
            "tfde_table_find",
            h,
            keys_arg(keys, key_dtype, bad),
            defaults_arg(defaults, value_dtype, n, dim, bad),
            dim=dim + 1 if bad == "dim_attr" else dim,
            **attrs,
        )
        if not bad:
            values, exists = answered("TfdeTableFind", mode, call)
            want, want_exists = model.find(keys, spec, defaults)
            np.testing.assert_array_equal(exists.numpy(), want_exists)
            assert_rows_close(values.numpy(), want, value_dtype, "find")
    elif op == "insert":
        values = rows(rng, n, dim, value_dtype)
        call = lambda: run_op(
            mode, "tfde_table_insert", h, keys_arg(keys, key_dtype, bad), rows_arg(values, value_dtype, bad)
        )
        if not bad:
            answered("TfdeTableInsert", mode, call)
            model.insert(keys, values)
    elif op == "accum":
        deltas = rows(rng, n, dim, value_dtype)
        spec, defaults, attrs = _missing(model, spec, rng, n, broadcast)
        if bad in ("defaults_count", "defaults_dim"):
            spec, attrs = None, {"init_kind": "defaults"}
        call = lambda: run_op(
            mode,
            "tfde_table_accum",
            h,
            keys_arg(keys, key_dtype, bad),
            rows_arg(deltas, value_dtype, bad),
            defaults_arg(defaults, value_dtype, n, dim, bad),
            **attrs,
        )
        if not bad:
            answered("TfdeTableAccum", mode, call)
            model.accum(keys, deltas, spec, defaults)
    elif op == "remove":
        call = lambda: run_op(mode, "tfde_table_remove", h, keys_arg(keys, key_dtype, bad))
        if not bad:
            assert int(answered("TfdeTableRemove", mode, call)) == model.remove(keys)
    elif op == "export":
        cursor = {"cursor_negative": -1 - n}.get(bad, 0)
        max_rows = {"max_rows_zero": 0, "max_rows_negative": -(2**40)}.get(bad, 10)
        cursor_t = tf.constant([cursor, 0] if bad == "cursor_vector" else cursor, tf.int64)
        call = lambda: run_op(
            mode,
            "tfde_table_export",
            h,
            cursor_t,
            tf.constant(max_rows, tf.int64),
            dim=dim + 1 if bad == "dim_attr" else dim,
            Tkey=OTHER_KEY[key_dtype] if bad == "keys_dtype" else key_dtype,
            Tvalue=OTHER_VALUE[value_dtype] if bad == "rows_dtype" else value_dtype,
        )
        if not bad:
            assert_table_is(handle, model, mode, max_rows=max(1, n, len(model.rows) // 8))
            # A cursor out of any range the table made: rows of the table or none.
            cursor = int(rng.choice([2**31, 2**32 - 1, 2**32 + 5, 63 << 32, 64 << 32, 2**62, 2**63 - 1]))
            keys_out, values_out, nxt = answered(
                "TfdeTableExport",
                mode,
                lambda: run_op(
                    mode,
                    "tfde_table_export",
                    handle,
                    tf.constant(cursor, tf.int64),
                    tf.constant(2**62, tf.int64),
                    dim=dim,
                    Tkey=key_dtype,
                    Tvalue=value_dtype,
                ),
            )
            assert int(nxt) == -1 or int(nxt) >= cursor
            for k, v in zip(keys_out.numpy(), values_out.numpy()):
                assert_rows_close(v, model.rows[py_key(k)], value_dtype, "export from an odd cursor")
    else:
        name = {"size": "TfdeTableSize", "clear": "TfdeTableClear", "memory": "TfdeTableMemoryBytes"}[op]
        call = lambda: run_op(
            mode, {"size": "tfde_table_size", "clear": "tfde_table_clear", "memory": "tfde_table_memory_bytes"}[op], h
        )
        if not bad:
            out = answered(name, mode, call)
            if op == "size":
                assert int(out) == len(model.rows)
            elif op == "memory":
                assert int(out) > 0
            else:
                model.rows.clear()
    if bad:
        refused(
            {
                "find": "TfdeTableFind",
                "insert": "TfdeTableInsert",
                "accum": "TfdeTableAccum",
                "remove": "TfdeTableRemove",
                "export": "TfdeTableExport",
                "size": "TfdeTableSize",
                "clear": "TfdeTableClear",
                "memory": "TfdeTableMemoryBytes",
            }[op],
            mode,
            call,
            # a graph refuses a dim out of range while tracing (shape inference)
            also=(ValueError,) if mode == "graph" and bad == "dim_attr" else (),
        )
        assert_table_is(handle, model, mode)  # a refused call changed nothing


class RawTable:
    """A raw cuckoo table, a destroyed one, and their model (a context)."""

    def __init__(self, mode, key_dtype, value_dtype, dim, expected_rows=0):
        self.mode = mode
        self.model = Model(key_dtype, value_dtype, dim)
        self.handle = answered(
            "TfdeCuckooTable", mode, lambda: create_table(mode, key_dtype, value_dtype, dim, expected_rows)
        )
        self.dead = create_table(mode, key_dtype, value_dtype, dim)
        destroy(self.dead)

    def step(self, rng, pool, op, bad, n, spec=None, broadcast=False):
        table_step(self.mode, self.handle, self.dead, self.model, rng, pool, op, bad, n, spec, broadcast)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        destroy(self.handle)


@pytest.mark.parametrize("mode", MODES)
@fuzz(100)
@given(case=table_cases())
def test_raw_table_ops_answer_like_the_reference_or_refuse(mode, case):
    """Random sequences of raw table ops, mostly well formed."""
    key_dtype, value_dtype, dim, expected_rows, pool_size, steps, rng_seed = case
    rng = np.random.default_rng(rng_seed)
    pool = key_pool(rng, key_dtype, pool_size)
    with RawTable(mode, key_dtype, value_dtype, dim, expected_rows) as table:
        for op, bad, n, spec, broadcast in steps:
            table.step(rng, pool, op, bad, n, spec, broadcast)
        assert_table_is(table.handle, table.model, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op,bad", [(op, bad) for op in sorted(CORRUPTIONS) for bad in CORRUPTIONS[op]])
@fuzz(3)
@given(
    key_dtype=st.sampled_from(KEY_DTYPES),
    value_dtype=st.sampled_from(VALUE_DTYPES),
    dim=st.sampled_from([1, 3, 8]),
    n=st.sampled_from([0, 1, 2, 17]),
    rng_seed=st.integers(0, 2**32),
)
def test_raw_table_ops_refuse_every_corruption(mode, op, bad, key_dtype, value_dtype, dim, n, rng_seed):
    """Each corruption of each op's inputs, on a table holding rows: refused
    with a message, nothing changed."""
    rng = np.random.default_rng(rng_seed)
    pool = key_pool(rng, key_dtype, 20)
    with RawTable(mode, key_dtype, value_dtype, dim) as table:
        table.step(rng, pool, "insert", None, 12)
        table.step(rng, pool, op, bad, n, SPECS[rng_seed % len(SPECS)] if rng_seed % 2 else None, n % 2 == 0)


# ---------------------------------------------------------------- attrs, creation, hashing, init rows


@pytest.mark.parametrize("mode", MODES)
@fuzz(25)
@given(
    key_dtype=st.sampled_from(KEY_DTYPES),
    value_dtype=st.sampled_from(VALUE_DTYPES),
    dim=st.sampled_from([-(2**40), -5, -1, 0, MAX_DIM + 1, 2**31, 2**40]),
    expected_rows=st.sampled_from([-1, -(2**62)]),
    which=st.sampled_from(["dim", "expected_rows", "both"]),
)
def test_create_refuses_bad_attrs(mode, key_dtype, value_dtype, dim, expected_rows, which):
    good_dim = which == "expected_rows"
    good_rows = which == "dim"
    refused(
        "TfdeCuckooTable",
        mode,
        lambda: create_table(mode, key_dtype, value_dtype, 4 if good_dim else dim, 0 if good_rows else expected_rows),
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expected_rows", [2**40, 2**62, 2**63 - 1])
def test_create_with_absurd_expected_rows_is_a_capacity_error(mode, expected_rows):
    # Sized up front: far more than the machine has must fail at once, as
    # ResourceExhausted (tfde maps it to CapacityError), without touching it.
    e = refused(
        "TfdeCuckooTable",
        mode,
        lambda: create_table(mode, tf.int64, tf.float32, 8, expected_rows),
        also=(tf.errors.ResourceExhaustedError,),
    )
    assert isinstance(e, (tf.errors.ResourceExhaustedError, tfde.CapacityError)), e


@pytest.mark.parametrize("mode", MODES)
@fuzz(25)
@given(
    attr=st.sampled_from(["find_dim", "export_dim", "init_rows_dim"]),
    dim=st.sampled_from([-(2**40), -5, -1, 0, 7, MAX_DIM + 1, 2**40]),
)
def test_row_ops_refuse_a_dim_attr_that_is_not_the_tables(mode, attr, dim):
    """The dim attr of find and export sizes their outputs in graphs (shape
    inference); it must be the table's dim and a valid one, or the graph
    would carry a wrong static shape (or TF abort on a negative one)."""
    handle = create_table(mode, tf.int64, tf.float32, 3)
    try:
        answered(
            "TfdeTableInsert",
            mode,
            lambda: run_op(mode, "tfde_table_insert", handle, tf.constant([1, 2], tf.int64), tf.ones([2, 3])),
        )
        keys = tf.constant([1, 5], tf.int64)
        if attr == "find_dim":
            call = lambda: run_op(mode, "tfde_table_find", handle, keys, tf.zeros([1, 3]), dim=dim)
        elif attr == "export_dim":
            call = lambda: run_op(
                mode,
                "tfde_table_export",
                handle,
                tf.constant(0, tf.int64),
                tf.constant(10, tf.int64),
                dim=dim,
                Tkey=tf.int64,
                Tvalue=tf.float32,
            )
        else:
            call = lambda: run_op(mode, "tfde_init_rows", keys, Tvalue=tf.float32, dim=dim, init_kind="constant")
        if attr == "init_rows_dim" and 1 <= dim <= MAX_DIM:
            assert answered("TfdeInitRows", mode, call).shape == (2, dim)  # no table: any valid dim
        else:
            # Graphs refuse a bad dim while tracing (shape inference: ValueError).
            refused(attr, mode, call, also=(ValueError,) if mode == "graph" else ())
        model = Model(tf.int64, tf.float32, 3)
        model.insert([1, 2], np.ones([2, 3], np.float32))
        assert_table_is(handle, model, mode)
    finally:
        destroy(handle)


def _keys_of_rank(rng, key_dtype, shape):
    n = int(np.prod(shape))
    if key_dtype == tf.string:
        flat = [bytes(rng.integers(0, 256, rng.integers(0, 20)).astype(np.uint8)) for _ in range(n)]
        return np.array(flat, dtype=object).reshape(shape)
    info = np.iinfo(key_dtype.as_numpy_dtype)
    return rng.integers(info.min, info.max, shape, dtype=np.int64, endpoint=True).astype(key_dtype.as_numpy_dtype)


@pytest.mark.parametrize("mode", MODES)
@fuzz(40)
@given(
    key_dtype=st.sampled_from(KEY_DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    num_shards=st.sampled_from([0, 1, 2, 7, 1000, 2**31 - 1, 2**31, 2**32 + 3, 2**62, -1, -(2**40)]),
    rng_seed=st.integers(0, 2**32),
)
def test_stable_hash_matches_the_reference_or_refuses(mode, key_dtype, shape, num_shards, rng_seed):
    keys = _keys_of_rank(np.random.default_rng(rng_seed), key_dtype, shape)
    call = lambda: run_op(mode, "tfde_stable_hash", tf.constant(keys, key_dtype), num_shards=num_shards)
    if not 0 <= num_shards < 2**31:
        # Shards are int32: more than 2^31 - 1 cannot be answered right.
        refused("TfdeStableHash", mode, call)
        return
    h, s = answered("TfdeStableHash", mode, call)
    assert h.shape == shape and s.shape == shape
    want = np.array([hashing.stable_hash_py(py_key(k)) for k in keys.reshape(-1)], np.uint64)
    np.testing.assert_array_equal(h.numpy().reshape(-1).view(np.uint64), want)
    want_shard = [hashing.shard_of_py(int(x), num_shards) if num_shards else 0 for x in want]
    np.testing.assert_array_equal(s.numpy().reshape(-1), np.array(want_shard, np.int32))


@pytest.mark.parametrize("mode", MODES)
@fuzz(40)
@given(
    key_dtype=st.sampled_from(KEY_DTYPES),
    value_dtype=st.sampled_from(VALUE_DTYPES),
    shape=st.sampled_from([(0,), (1,), (17,), (), (2, 3), (0, 4)]),
    dim=st.sampled_from([1, 4, 9]),
    spec=st.sampled_from(SPECS + (None,)),
    rng_seed=st.integers(0, 2**32),
)
def test_init_rows_match_the_reference_or_refuse(mode, key_dtype, value_dtype, shape, dim, spec, rng_seed):
    keys = _keys_of_rank(np.random.default_rng(rng_seed), key_dtype, shape)
    attrs = spec.attrs() if spec is not None else {"init_kind": "defaults"}
    call = lambda: run_op(mode, "tfde_init_rows", tf.constant(keys, key_dtype), Tvalue=value_dtype, dim=dim, **attrs)
    if spec is None or len(shape) != 1:
        refused("TfdeInitRows", mode, call)
        return
    got = answered("TfdeInitRows", mode, call)
    want = init_rows_reference([py_key(k) for k in keys], spec, dim).astype(np_dtype(value_dtype))
    assert_rows_close(got.numpy(), want, value_dtype, "initial rows")


@pytest.mark.parametrize("mode", MODES)
@fuzz(10)
@given(
    dtype=st.sampled_from([tf.int64, tf.string, tf.float16, tf.bool]),
    shape=st.lists(st.integers(0, 4), max_size=3).map(tuple),
)
def test_ordered_forwards_any_tensor(mode, dtype, shape):
    x = tf.zeros(shape, dtype)
    y = answered("TfdeOrdered", mode, lambda: run_op(mode, "tfde_ordered", x))
    assert y.dtype == dtype and y.shape == shape


# ---------------------------------------------------------------- public Table and Variable API

_VARIABLES = {}
_var_ids = itertools.count()


def _no_output(fn):
    def run(*args):
        fn(*args)

    return run


def variable(backend, key_dtype, value_dtype, dim, num_shards):
    """One Variable per configuration, reused (cleared) across examples so
    that its tf.functions are traced once."""
    key = (backend, key_dtype, value_dtype, dim, num_shards)
    if key not in _VARIABLES:
        creator = CuckooTableCreator() if backend == "cuckoo" else ReferenceTableCreator()
        v = tfde.Variable(
            f"fuzz_{backend}_{next(_var_ids)}",
            key_dtype=key_dtype,
            value_dtype=value_dtype,
            dim=dim,
            initializer=tfde.initializers.InitSpec("uniform", -0.5, 0.5, 11),
            num_shards=num_shards,
            table_creator=creator,
            trainable=False,
        )
        spec_k, spec_v = tf.TensorSpec(None, key_dtype), tf.TensorSpec(None, value_dtype)
        fns = {
            "lookup": tf.function(lambda k: v.lookup(k, return_exists=True), input_signature=[spec_k]),
            "upsert": tf.function(_no_output(v.upsert), input_signature=[spec_k, spec_v]),
            "accum": tf.function(_no_output(v.accum), input_signature=[spec_k, spec_v]),
            "remove": tf.function(lambda k: v.remove(k), input_signature=[spec_k]),
            "size": tf.function(lambda: v.size(), input_signature=[]),
        }
        _VARIABLES[key] = (v, fns)
    v, fns = _VARIABLES[key]
    v.clear()
    return v, fns


def var_call(mode, v, fns, op, *args):
    if mode == "graph":
        return fns[op](*args)
    return {
        "lookup": lambda k: v.lookup(k, return_exists=True),
        "upsert": v.upsert,
        "accum": v.accum,
        "remove": v.remove,
        "size": v.size,
    }[op](*args)


def var_state(v):
    out = {}
    for keys, values in v.export():
        for k, r in zip(keys.numpy(), values.numpy()):
            out[py_key(k)] = r
    return out


BAD_VAR_INPUTS = (
    "float_keys",
    "bool_keys",
    "int8_keys",
    "count_mismatch",
    "wrong_dim",
    "rank3_values",
    "string_values",
    "ragged_keys",
    "wide_ids",
    "fractional_ids",
)
EAGER_ONLY = ("float_keys", "bool_keys", "int8_keys", "ragged_keys", "string_values", "wide_ids", "fractional_ids")


@st.composite
def variable_cases(draw):
    key_dtype = draw(st.sampled_from(KEY_DTYPES))
    value_dtype = draw(st.sampled_from(VALUE_DTYPES))
    dim = draw(st.sampled_from([1, 4]))
    num_shards = draw(st.sampled_from([1, 3]))
    steps = [
        (
            draw(st.sampled_from(["lookup", "upsert", "accum", "remove", "size"])),
            draw(st.one_of(st.none(), st.sampled_from(BAD_VAR_INPUTS))),
            draw(st.sampled_from([0, 1, 5, 40])),
            draw(st.sampled_from([1, 2])),
        )
        for _ in range(draw(st.integers(1, 6)))
    ]
    return key_dtype, value_dtype, dim, num_shards, steps, draw(st.integers(0, 2**32))


def bad_var_args(bad, keys, key_dtype, values, value_dtype, dim):
    """(keys, values) given the way a user might get them wrong."""
    n = len(keys)
    if bad in ("wide_ids", "fractional_ids"):  # Python ids the key dtype cannot hold exactly
        wide = {tf.int32: 2**32 + 5, tf.int64: 2**64 + 5, tf.string: 5}[key_dtype]
        ids = [wide + i for i in range(max(n, 1))] if bad == "wide_ids" else [i + 0.5 for i in range(max(n, 1))]
        return ids, tensor(rows(np.random.default_rng(n), max(n, 1), dim, value_dtype), value_dtype)
    if bad == "float_keys":
        return tf.constant(np.arange(n, dtype=np.float32) + 0.5), tensor(values, value_dtype)
    if bad == "bool_keys":
        return tf.constant(np.arange(n) % 2 == 0), tensor(values, value_dtype)
    if bad == "int8_keys":
        return tf.constant(np.arange(n, dtype=np.int8)), tensor(values, value_dtype)
    if bad == "ragged_keys":
        return tf.ragged.constant([[1], [2, 3]], dtype=tf.int64), tensor(values, value_dtype)
    k = tensor(keys, key_dtype)
    if bad == "count_mismatch":
        return k, tf.zeros([n + 1, dim], value_dtype)
    if bad == "wrong_dim":
        return k, tf.zeros([n, dim + 1], value_dtype)
    if bad == "rank3_values":
        return k, tf.zeros([n, 2, dim + 1], value_dtype)
    if bad == "string_values":
        return k, tf.constant([["x"] * dim] * n)
    return k, tensor(values, value_dtype)


@pytest.mark.parametrize("mode", MODES)
@fuzz(30)
@given(case=variable_cases())
def test_variable_answers_like_the_reference_variable_or_refuses(mode, case):
    """Variable over cuckoo against Variable over the reference table, with
    inputs a user gets right and gets wrong; Python ints, numpy and tensors."""
    key_dtype, value_dtype, dim, num_shards, steps, rng_seed = case
    if mode == "graph":
        # Graph inputs are tensors: the conversions of Python values are eager.
        steps = [s for s in steps if s[1] not in EAGER_ONLY]
        assume(steps)
    rng = np.random.default_rng(rng_seed)
    pool = key_pool(rng, key_dtype, 30)
    v, fns = variable("cuckoo", key_dtype, value_dtype, dim, num_shards)
    ref, ref_fns = variable("reference", key_dtype, value_dtype, dim, num_shards)
    # The two are what they say (the reference Variable once ran on cuckoo
    # too: a comparison of cuckoo with itself).
    assert {type(t).__name__ for t in v.tables} == {"CuckooTable"}
    assert {type(t).__name__ for t in ref.tables} == {"ReferenceTable"}
    np_v = np_dtype(value_dtype)
    for op, bad, n, rank in steps:
        keys = draw_keys(rng, pool, n)
        values = rows(rng, n, dim, value_dtype)
        if bad is None:
            if rank == 2 and n % 5 == 0 and n:  # keys [n/5, 5], rows [n/5, 5, dim]
                k_in, v_in = tensor(keys.reshape(-1, 5), key_dtype), tensor(values.reshape(-1, 5, dim), value_dtype)
            elif mode == "eager" and n and rng.random() < 0.5 and key_dtype != tf.string:
                k_in, v_in = [py_key(k) for k in keys], values.astype(np.float64).tolist()  # Python values
            else:
                k_in, v_in = tensor(keys, key_dtype), tensor(values, value_dtype)
            args = (k_in,) if op in ("lookup", "remove") else (k_in, v_in) if op != "size" else ()
            want = var_call("eager", ref, ref_fns, op, *args)
            got = answered(f"Variable.{op}", mode, lambda: var_call(mode, v, fns, op, *args))
            if op == "lookup":
                np.testing.assert_array_equal(got[1].numpy(), want[1].numpy())
                assert_rows_close(got[0].numpy(), want[0].numpy(), value_dtype, "Variable.lookup")
            elif op in ("remove", "size"):
                assert int(got) == int(want)
        else:
            if (
                op == "size"
                or op in ("lookup", "remove")
                and bad in ("count_mismatch", "wrong_dim", "rank3_values", "string_values")
            ):
                continue  # these take no keys, or no rows
            before = var_state(v)
            k_in, v_in = bad_var_args(bad, keys, key_dtype, values, value_dtype, dim)
            args = (k_in,) if op in ("lookup", "remove") else (k_in, v_in)
            refused(
                f"Variable.{op}",
                mode,
                lambda: var_call(mode, v, fns, op, *args),
                also=(TypeError, ValueError) if bad == "ragged_keys" else (),
            )
            after = var_state(v)
            assert set(after) == set(before), f"a refused {op} ({bad}) changed the keys"
            for k in after:
                np.testing.assert_array_equal(after[k].astype(np.float64), before[k].astype(np.float64))
        state, ref_state = var_state(v), var_state(ref)
        assert set(state) == set(ref_state), f"after {op}: keys differ from the reference Variable"
        for k in state:
            assert_rows_close(state[k], ref_state[k].astype(np_v), value_dtype, f"after {op}: row of {k!r}")


# ---------------------------------------------------------------- Redis ops

REDIS_PORT = 6379


@pytest.fixture(scope="module")
def redis_prefix():
    """A model tag of this module's own on the server at 6379 (each example
    adds a suffix); every key under it is deleted afterwards."""
    tag = f"tfde-fuzz-{uuid.uuid4().hex[:12]}"
    yield tag
    client = redis.Redis(port=REDIS_PORT)
    for key in list(client.scan_iter(match=f"{tag}*")):
        client.delete(key)


def redis_attrs(prefix, dim, over):
    """Attrs of the Redis ops for a 2-bucket table under `prefix`, with `over` replacing some."""
    attrs = dict(
        dim=dim,
        buckets=[f"{prefix}:t:{{{b}}}" for b in range(2)],
        table_name="fuzz",
        chunk=5,
        mode=2,
        servers=[f"127.0.0.1:{REDIS_PORT}"],
        connect_timeout_ms=1000,
        socket_timeout_ms=1000,
        retry_deadline_ms=50,
    )
    attrs.update(over)
    return attrs


def redis_contents(prefix):
    client = redis.Redis(port=REDIS_PORT)
    out = {}
    for key in sorted(client.scan_iter(match=f"{prefix}:*", _type="HASH")):  # the buckets, not accum's markers
        out[key] = client.hgetall(key)
    return out


def redis_write(op, mode, call, prefix, bad, n) -> bool:
    """A writing op's call: refused, changing nothing in Redis, when `bad`
    (returns True); else, when `n` is given, run and answering n (returns
    False: the caller applies it to the model, or runs it itself)."""
    if bad:
        before = redis_contents(prefix)
        refused(op, mode, call)
        assert redis_contents(prefix) == before, f"a refused {op} ({bad}) changed Redis"
        return True
    if n is not None:
        assert int(answered(op, mode, call)) == n
    return False


BAD_REDIS = (
    "keys_rank0",
    "keys_rank2",
    "rows_count",
    "rows_dim",
    "rows_rank1",
    "defaults_count",
    "defaults_dim",
    "deltas_dtype",  # accum's; the other ops take it as rows_count
    "dim_attr",
    "chunk_attr",
    "no_buckets",
    "servers_attr",
    "mode_attr",
)


@pytest.mark.parametrize("mode", MODES)
@fuzz(25)
@given(
    key_dtype=st.sampled_from(KEY_DTYPES),
    value_dtype=st.sampled_from(VALUE_DTYPES),
    dim=st.sampled_from([1, 3]),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["find", "insert", "accum", "remove"]),
            st.one_of(st.none(), st.sampled_from(BAD_REDIS)),
            st.sampled_from([0, 1, 7, 30]),
            st.sampled_from((None,) + SPECS),
        ),
        min_size=1,
        max_size=5,
    ),
    rng_seed=st.integers(0, 2**32),
)
def test_redis_ops_answer_like_the_reference_or_refuse(
    redis_prefix, mode, key_dtype, value_dtype, dim, steps, rng_seed
):
    prefix = f"{redis_prefix}-{rng_seed}"
    rng = np.random.default_rng(rng_seed)
    pool = key_pool(rng, key_dtype, 20)
    model = Model(key_dtype, value_dtype, dim)
    try:
        for op, bad, n, spec in steps:
            if mode == "graph" and bad == "dim_attr":
                bad = "chunk_attr"  # a graph's shape inference of a bad dim: test_redis_find_shape_function...
            keys = draw_keys(rng, pool, n)
            over = {
                "dim_attr": {"dim": 0},
                "chunk_attr": {"chunk": 0},
                "no_buckets": {"buckets": []},
                "servers_attr": {"servers": ["127.0.0.1"]},
                "mode_attr": {"mode": 7},
            }.get(bad, {})
            attrs = redis_attrs(prefix, dim, over)
            if bad == "deltas_dtype" and op != "accum":
                bad = "rows_count"
            if op == "insert":
                if bad in ("defaults_count", "defaults_dim"):
                    bad = "rows_count"
                values = rows(rng, n, dim, value_dtype)
                call = lambda: run_op(
                    mode,
                    "tfde_redis_insert",
                    keys_arg(keys, key_dtype, bad),
                    rows_arg(values, value_dtype, bad),
                    **attrs,
                )
                if not redis_write("TfdeRedisInsert", mode, call, prefix, bad, n):
                    model.insert(keys, values)
            elif op == "accum":
                deltas = rows(rng, n, dim, value_dtype)
                spec_, defaults, _ = _missing(model, spec, rng, n, True)
                init_rows = model.missing(keys, spec_, defaults)
                # deltas take the rows corruptions, the initial rows the defaults ones
                init_bad = {"defaults_count": "rows_count", "defaults_dim": "rows_dim"}.get(bad)
                call = lambda: run_op(
                    mode,
                    "tfde_redis_accum",
                    keys_arg(keys, key_dtype, bad),
                    rows_arg(deltas, value_dtype, None if init_bad else bad),
                    rows_arg(np.ascontiguousarray(init_rows), value_dtype, init_bad),
                    script=_ACCUM_LUA,
                    **attrs,
                )
                if not redis_write("TfdeRedisAccum", mode, call, prefix, bad, n):
                    model.accum(keys, deltas, spec_, defaults)
            elif op == "remove":
                if not (bad is None or bad.startswith("keys_") or bad.endswith("_attr") or bad == "no_buckets"):
                    bad = "keys_rank2"
                call = lambda: run_op(
                    mode,
                    "tfde_redis_remove",
                    keys_arg(keys, key_dtype, bad),
                    Tvalue=value_dtype,
                    script=_REMOVE_LUA,
                    **attrs,
                )
                if not redis_write("TfdeRedisRemove", mode, call, prefix, bad, None):
                    assert int(answered("TfdeRedisRemove", mode, call)) == model.remove(keys)
            else:
                if bad in ("rows_count", "rows_dim", "rows_rank1"):
                    bad = "defaults_count"
                spec_, defaults, init = _missing(model, spec, rng, n, n % 2 == 0)
                if bad in ("defaults_count", "defaults_dim"):
                    spec_, init = None, {"init_kind": "defaults"}
                call = lambda: run_op(
                    mode,
                    "tfde_redis_find",
                    keys_arg(keys, key_dtype, bad),
                    defaults_arg(defaults, value_dtype, n, dim, bad),
                    tf.constant(-1, tf.int64),  # no training step
                    **attrs,
                    **init,
                )
                if bad:
                    refused("TfdeRedisFind", mode, call)
                else:
                    values, exists = answered("TfdeRedisFind", mode, call)
                    want, want_exists = model.find(keys, spec_, defaults)
                    np.testing.assert_array_equal(exists.numpy(), want_exists)
                    assert_rows_close(values.numpy(), want, value_dtype, "Redis find")
        stored = {}
        for fields in redis_contents(prefix).values():
            for f, row in fields.items():
                stored[f] = np.frombuffer(row, np_dtype(value_dtype))
        assert len(stored) == len(model.rows)
    finally:
        client = redis.Redis(port=REDIS_PORT)
        for key in list(client.scan_iter(match=f"{prefix}:*")):
            client.delete(key)


def test_redis_find_shape_function_refuses_bad_dim(tmp_path):
    """In a graph, TfdeRedisFind's shape function sizes its output by the dim
    attr: a negative one must be an error, not a CHECK failure that aborts
    the process (run in a child process so that an abort fails this test
    instead of killing the run)."""
    import subprocess
    import sys

    script = tmp_path / "redis_dim.py"
    script.write_text(f"""
import tensorflow as tf
from tfde import _native
ops = _native.load()
f = tf.function(lambda k, d: ops.tfde_redis_find(
    k, d, tf.constant(-1, tf.int64), dim=-5, buckets=["x"], mode=2, servers=["127.0.0.1:{REDIS_PORT}"]),
    input_signature=[tf.TensorSpec(None, tf.int64), tf.TensorSpec(None, tf.float32)])
try:
    f.get_concrete_function()
except (ValueError, tf.errors.InvalidArgumentError) as e:
    print("refused:", e)
""")
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0 and "refused:" in proc.stdout, (
        f"tracing TfdeRedisFind with dim=-5 exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
