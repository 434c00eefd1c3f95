"""Bad inputs get a clear error and change nothing (issue 15, points 2, 13,
16, 17): ids are never wrapped or truncated into another key, rows of the
wrong shape and absurd sizes are refused, a table out of memory raises
tfde.CapacityError, and a Keras file saved by the other Keras is named."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from conftest import LEGACY_KERAS

import tfde

ROW = [[1.0, 2.0]]


def int32_variable(name):
    v = tfde.Variable(name, key_dtype=tf.int32, dim=2, initializer=0.0)
    v.upsert([5], ROW)
    return v


def assert_only_key_5(v):
    assert int(v.size()) == 1
    assert v.lookup(tf.constant([5], tf.int32)).numpy().tolist() == ROW


# ------------------------------------------------------------ point 2: ids outside the key dtype

OUT_OF_INT32 = [
    [2**40 + 5],
    np.array([2**32 + 5]),
    2**31,
    [-(2**31) - 1],
    np.array([2**32 + 5], np.uint64),
    [[1, 2], [3, 2**33 + 5]],
]


@pytest.mark.parametrize("ids", OUT_OF_INT32, ids=lambda x: repr(x)[:24])
def test_int32_variable_refuses_ids_outside_int32_and_changes_nothing(ids):
    v = int32_variable("wrap32")
    with pytest.raises(
        tfde.ShapeError,
        match=r"outside the range of its key dtype int32, \[-2147483648, "
        r"2147483647\].*key_dtype=tf.int64",
    ):
        v.lookup(ids)
    rows = np.full(np.shape(ids) + (2,), 9.0)
    for write in (
        lambda: v.upsert(ids, rows),
        lambda: v.accum(ids, rows),
        lambda: v.remove(ids),
        lambda: tfde.embedding_lookup(v, ids),
    ):
        with pytest.raises(tfde.ShapeError, match="outside the range"):
            write()
    assert_only_key_5(v)


def test_out_of_range_ids_are_refused_inside_tf_function_too():
    v = int32_variable("wrap32_graph")

    # With autograph (the default, and model.fit's) too: tfde errors pass
    # through it as themselves, not as a StagingError.
    for autograph in (False, True):

        @tf.function(autograph=autograph)
        def write():
            v.upsert(np.array([2**32 + 5]), [[7.0, 7.0]])

        with pytest.raises(tfde.ShapeError, match="key 4294967301 .* outside the range"):
            write()
    assert_only_key_5(v)


def test_int64_variable_refuses_ids_beyond_int64():
    v = tfde.Variable("wrap64", dim=2, initializer=0.0)
    for ids in ([2**63], np.array([2**63], np.uint64), [-(2**63) - 1], [2**64 + 1]):
        with pytest.raises(tfde.ShapeError, match="outside the range of its key dtype int64"):
            v.upsert(ids, [[1.0, 1.0]])
    assert int(v.size()) == 0


def test_in_range_python_and_numpy_ids_keep_working():
    v = int32_variable("in_range")
    v.upsert(np.array([2**31 - 1, -(2**31)], np.int64), [[3.0, 3.0], [4.0, 4.0]])
    assert v.lookup([2**31 - 1]).numpy().tolist() == [[3.0, 3.0]]
    assert v.lookup(np.array([[-(2**31)]], np.int64)).numpy().tolist() == [[[4.0, 4.0]]]
    assert v.lookup(np.uint16(5)).numpy().tolist() == ROW[0]
    assert v.lookup([]).shape == (0, 2)
    w = tfde.Variable("in_range64", dim=1, initializer=0.0)
    w.upsert(np.array([2**63 - 1], np.uint64), [[1.0]])
    assert w.lookup([2**63 - 1]).numpy().tolist() == [[1.0]]


@pytest.mark.parametrize("ids", [[1.7], np.array([1.0]), np.array([np.nan]), [1, 2.5]], ids=lambda x: repr(x)[:24])
def test_float_ids_are_refused_by_variable_methods(ids):
    v = int32_variable("floats")
    with pytest.raises(tfde.ShapeError, match=r"must be integers \(int32\), got the float .*astype\(np.int32\)"):
        v.upsert(ids, np.ones(np.shape(ids) + (2,)))
    with pytest.raises(tfde.ShapeError, match="must be integers"):
        v.lookup(ids)
    assert_only_key_5(v)


def test_bools_and_strings_are_not_int_ids():
    v = int32_variable("bools")
    with pytest.raises(tfde.ShapeError, match=r"got True \(bool\)"):
        v.upsert([1, True], [[1.0, 1.0]] * 2)
    with pytest.raises(tfde.ShapeError, match="key_dtype=tf.string"):
        v.lookup(["a"])
    assert_only_key_5(v)


def test_tensors_of_a_wider_or_float_dtype_are_refused_statically():
    v = int32_variable("tensors")
    with pytest.raises(
        tfde.ShapeError,
        match=r"are int64, expected int32; tf.cast\(keys, int32\) is safe only "
        r"for ids in \[-2147483648, 2147483647\]",
    ):
        v.upsert(tf.constant([2**32 + 5], tf.int64), [[7.0, 7.0]])
    with pytest.raises(tfde.ShapeError, match="are float32, expected int32; ids must be integers"):
        v.lookup(tf.constant([1.7]))
    assert_only_key_5(v)


# ------------------------------------------------------------ point 2: Keras layers check every id

pytest_keras = pytest.mark.keras


def int32_layer(name):
    layer = tfde.keras.layers.Embedding(2, key_dtype=tf.int32, initializer=0.0, name=name)
    layer.params.upsert([1], ROW)
    return layer


@pytest_keras
@pytest.mark.parametrize(
    "ids",
    [
        np.array([2**32 + 1]),
        tf.constant([2**32 + 1], tf.int64),
        np.array([1.7]),
        tf.constant([1.7]),
        tf.constant([1.5], tf.float64),
        tf.constant([np.inf]),
    ],
    ids=lambda x: repr(x)[:30],
)
def test_keras_layer_refuses_ids_that_would_wrap_or_truncate_eagerly(ids):
    layer = int32_layer("emb_eager")
    with pytest.raises(tfde.ShapeError, match="'emb_eager'"):
        layer(ids)


@pytest_keras
def test_keras_layer_casts_whole_ids_of_other_dtypes_exactly():
    layer = int32_layer("emb_cast")
    for ids in (
        np.array([1.0]),
        tf.constant([1], tf.int64),
        tf.constant([1.0], tf.float16),
        tf.constant([1], tf.uint8),
    ):
        assert layer(ids).numpy().tolist() == ROW
    sparse = tf.sparse.from_dense(tf.constant([[1, 0]], tf.int64))
    assert layer(sparse).numpy().tolist() == ROW
    bad = tf.SparseTensor([[0, 0]], tf.constant([2**32 + 1], tf.int64), [1, 1])
    with pytest.raises(tfde.ShapeError, match="outside the range"):
        layer(bad)
    with pytest.raises(tfde.ShapeError, match="outside the range"):
        layer(tf.ragged.constant([[2**32 + 1]], tf.int64))


@pytest_keras
@pytest.mark.parametrize("dtype,value", [("int64", 2**32 + 1), ("float32", 1.7), ("float32", float("nan"))])
def test_keras_fit_refuses_ids_that_would_wrap_and_changes_nothing(dtype, value):
    layer = int32_layer("emb_fit")
    inp = tf.keras.Input(shape=(1,), dtype=dtype)
    model = tf.keras.Model(inp, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(layer(inp))))
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(1.0)), loss="mse")
    x = np.array([[1], [value]], dtype)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"ids for table emb_fit .* must be whole numbers "
        r"in the range of its key dtype int32",
    ):
        model.fit(x, np.ones([2, 1]), batch_size=2, epochs=1, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="ids for table emb_fit"):
        model.predict(x, verbose=0)
    assert int(layer.params.size()) == 1 and int(layer.params._step_size()) == 0
    assert layer.params.lookup([1]).numpy().tolist() == ROW
    # whole-number ids of either dtype train as usual
    model.fit(np.array([[1], [2]], dtype), np.ones([2, 1]), batch_size=2, epochs=1, verbose=0)
    assert int(layer.params.size()) == 2


@pytest_keras
def test_a_sequential_without_an_input_refuses_int64_ids_beyond_its_int32_table():
    """Keras 3 casts a Sequential's data to its first layer's dtype before
    the layer runs: an int32 policy wrapped 2**40 + 1 to key 1 and trained
    it.  Integer tables take int64 data, which the layer checks."""
    layer = int32_layer("emb_seq")
    model = tf.keras.Sequential([layer, tf.keras.layers.Dense(1)])
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(1.0)), loss="mse")
    with pytest.raises(tf.errors.InvalidArgumentError, match="ids for table emb_seq .* key dtype int32"):
        model.fit(np.array([2**40 + 1] * 4, np.int64), np.ones([4, 1]), batch_size=2, verbose=0)
    assert int(layer.params.size()) == 1 and layer.params.lookup([1]).numpy().tolist() == ROW
    model.fit(np.array([1, 2, 3, 2**31 - 1], np.int64), np.ones([4, 1]), batch_size=2, verbose=0)
    keys = [int(k) for chunk, _ in layer.params.export() for k in chunk.numpy()]
    assert sorted(keys) == [1, 2, 3, 2**31 - 1]


# ------------------------------------------------------------ point 16: rows, numpy integers


@pytest.mark.parametrize(
    "value_dtype, rows",
    [
        (tf.float32, [[1e300, 1.0]]),  # a Python list: TensorFlow's float32 default made it inf
        (tf.float32, np.array([[1e300, 1.0]])),
        (tf.float32, tf.constant([[1e300, 1.0]], tf.float64)),
        (tf.float16, [[1e6, 1.0]]),
        (tf.float16, tf.constant([[70000, 1]], tf.int64)),
    ],
    ids=["list", "numpy", "float64 tensor", "float16 list", "int64 into float16"],
)
@pytest.mark.parametrize("mode", ["eager", "tf.function"])
def test_rows_beyond_the_value_dtype_are_refused_not_stored_as_infinities(value_dtype, rows, mode):
    v = tfde.Variable("overflow", dim=2, initializer=0.0, value_dtype=value_dtype)
    v.upsert([5], [[1.0, 2.0]])
    if mode == "eager":
        with pytest.raises(tfde.ShapeError, match=f"beyond the range of its value dtype {value_dtype.name}"):
            v.upsert([1], rows)
    else:
        rows = rows if tf.is_tensor(rows) else tf.constant(np.asarray(rows))  # float64, as given
        with pytest.raises(tf.errors.InvalidArgumentError, match="beyond the range of its value dtype"):
            tf.function(lambda r: v.upsert([1], r) and None)(rows)
    assert int(v.size()) == 1
    v.upsert([1], [[float("nan"), 1.5]])  # NaN and infinities given as such are the caller's to store
    np.testing.assert_array_equal(v.lookup([1]).numpy(), [[np.nan, 1.5]])


def test_a_scalar_for_rows_is_refused_not_broadcast():
    v = int32_variable("scalar_rows")
    with pytest.raises(tfde.ShapeError, match=r"are a scalar; expected shape keys.shape \+ \[2\].* not broadcast"):
        v.upsert([1], 3.0)
    with pytest.raises(tfde.ShapeError, match="deltas for 'scalar_rows' are a scalar"):
        v.accum([5], 1.0)
    assert_only_key_5(v)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_rows_of_unknown_shape_are_checked_when_the_graph_runs(num_shards):
    v = tfde.Variable(f"unknown_rows_{num_shards}", dim=2, num_shards=num_shards, initializer=0.0)
    v.upsert([5], ROW)
    upsert = tf.function(
        lambda k, r: [v.upsert(k, r), None][1],
        input_signature=[tf.TensorSpec(None, tf.int64), tf.TensorSpec(None, tf.float32)],
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"must have shape keys.shape \+ \[2\]"):
        upsert(tf.zeros([0], tf.int64), tf.zeros([0, 3]))  # no keys, rows of width 3
    with pytest.raises(tf.errors.InvalidArgumentError, match="the number of keys and rows differ"):
        upsert(tf.zeros([0], tf.int64), tf.zeros([1, 2]))  # a row more than keys
    assert int(v.size()) == 1 and v.lookup([5]).numpy().tolist() == ROW


def test_numpy_integers_are_ints_and_bools_are_not():
    v = tfde.Variable(
        "np_ints",
        dim=np.int64(4),
        num_shards=np.int32(2),
        initializer=0.0,
        table_creator=tfde.CuckooTableCreator(expected_rows=np.int64(100)),
    )
    assert type(v.dim) is int and v.dim == 4 and type(v.num_shards) is int and v.num_shards == 2
    v.upsert([1], [[1.0] * 4])
    assert v.lookup([1]).numpy().tolist() == [[1.0] * 4]
    assert type(tfde.CuckooTableCreator(expected_rows=np.uint32(7)).expected_rows) is int
    for bad in (dict(dim=True), dict(dim=2.0), dict(dim=np.int64(0)), dict(num_shards=True)):
        with pytest.raises(tfde.ConfigError, match="must be an int"):
            tfde.Variable("np_bad", **bad)
    with pytest.raises(tfde.ConfigError, match="expected_rows must be an int"):
        tfde.CuckooTableCreator(expected_rows=True)


@pytest_keras
def test_keras_layer_takes_a_numpy_embedding_size_and_serializes_it():
    import json

    layer = tfde.keras.layers.Embedding(np.int64(3), name="np_size")
    assert layer(tf.constant([1], tf.int64)).shape == (1, 3)
    config = json.loads(json.dumps(layer.get_config()))
    assert config["embedding_size"] == 3 and "autocast" not in config


# ------------------------------------------------------------ point 13: capacity


def test_expected_rows_beyond_this_machine_is_a_capacity_error_naming_the_bytes():
    creator = tfde.CuckooTableCreator(expected_rows=2**36)
    with pytest.raises(
        tfde.CapacityError,
        match=r"expected_rows=68719476736 .* needs \d+ bytes \(.* GiB\) "
        r"allocated up front, but this machine has \d+ bytes",
    ) as info:
        tfde.Variable("huge", dim=4, table_creator=creator)
    assert isinstance(info.value, tf.errors.ResourceExhaustedError)
    with pytest.raises(tfde.CapacityError, match="more than one cuckoo table can hold"):
        tfde.Variable("huger", dim=4, table_creator=tfde.CuckooTableCreator(expected_rows=2**40))


def test_presized_bytes_matches_what_the_native_table_allocates():
    from tfde.tables.cuckoo import presized_bytes

    for key_dtype, dim, rows in ((tf.int64, 4, 10_000), (tf.int32, 16, 3_000), (tf.string, 1, 5_000)):
        table = tfde.CuckooTableCreator(expected_rows=rows).create(f"sized_{rows}", key_dtype, tf.float32, dim)
        native = int(table.memory_bytes())
        want = presized_bytes(key_dtype, tf.float32, dim, rows)
        # memory_bytes also counts small per-shard bookkeeping (row bitmaps)
        assert want <= native <= want + 64 * 4096, (key_dtype, native, want)


OUT_OF_MEMORY = textwrap.dedent("""
    import resource, sys
    import tensorflow as tf
    import tfde

    table = tfde.CuckooTableCreator().create("mem", tf.string, tf.float32, 1)
    n = 1_000_000
    keys = tf.constant([("k%07d" % i) * 40 for i in range(n)])  # a heap block per key
    rows = tf.zeros([n, 1])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string), tf.TensorSpec([None, 1], tf.float32)])
    def graph_insert(k, r):
        table.insert(k, r)

    graph_insert(keys[:1], rows[:1])  # traced, thread pools made: before the limit
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (32 << 20), resource.RLIM_INFINITY))
    try:
        graph_insert(keys, rows) if sys.argv[1] == "graph" else table.insert(keys, rows)
    except Exception as e:
        print("RAISED", type(e).__name__, isinstance(e, tfde.CapacityError),
              isinstance(e, tf.errors.ResourceExhaustedError), "tfde.CapacityError: insert: out of memory" in str(e),
              "|", str(e).splitlines()[0][:300])
    else:
        print("NO ERROR")
""")


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_table_out_of_memory_raises_capacity_error(mode, tmp_path):
    # A child process whose address space is capped just above what it holds:
    # the table's allocations fail (std::bad_alloc from a key's string, or the
    # core's own out-of-memory), which must surface as RESOURCE_EXHAUSTED /
    # tfde.CapacityError, not as InvalidArgument.
    script = tmp_path / "oom.py"
    script.write_text(OUT_OF_MEMORY)
    out = subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(("RAISED", "NO ERROR"))), out.stderr[-2000:])
    if mode == "eager":
        assert line.startswith(
            "RAISED CapacityError True True False | cuckoo table 'mem' (string -> float32[1]) "
            "cannot take more rows: insert: out of memory"
        ), line
    else:
        assert line.startswith("RAISED ResourceExhaustedError False True True"), line


# ------------------------------------------------------------ point 17: Keras files of the other Keras

SAVE_MODEL = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    import tfde

    model = tf.keras.Sequential([tf.keras.Input(shape=(2,), dtype="int64"), tfde.keras.layers.Embedding(4, name="e"),
                                 tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam()), loss="mse")
    model.fit(np.array([[1, 2], [3, 4]]), np.array([1.0, 2.0]), verbose=0)
    model.save(sys.argv[1])
""")


def saved_by_the_other_keras(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(SAVE_MODEL)
    path = tmp_path / "other.keras"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="0" if LEGACY_KERAS else "1")
    done = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return path


@pytest_keras
def test_a_keras_file_of_the_other_keras_is_named_by_load_model(tmp_path):
    path = saved_by_the_other_keras(tmp_path)
    other, this = ("Keras 3", "tf-keras") if LEGACY_KERAS else ("tf-keras", "Keras 3")
    fix = "run without TF_USE_LEGACY_KERAS=1" if LEGACY_KERAS else "set TF_USE_LEGACY_KERAS=1"
    with pytest.raises(
        tfde.CheckpointError, match=f"other.keras was saved by {other}.*this process runs {this}.*{fix}"
    ):
        tfde.keras.load_model(path)
    if not LEGACY_KERAS:
        # Keras 3 gets as far as the compile config: tfde's optimizer class
        # reads it and names tf-keras (Keras said "Argument(s) not recognized").
        with pytest.raises(
            tfde.ConfigError, match="written by tf-keras .*is_legacy_optimizer.*set TF_USE_LEGACY_KERAS=1"
        ):
            tf.keras.models.load_model(path)


@pytest_keras
def test_load_model_of_this_keras_still_loads(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(SAVE_MODEL)
    path = tmp_path / "same.keras"
    done = subprocess.run(
        [sys.executable, str(script), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    model = tfde.keras.load_model(path)
    assert isinstance(model.layers[0], tfde.keras.layers.Embedding) and int(model.layers[0].params.size()) == 4
    assert isinstance(model.optimizer, tfde.optimizer.DynamicEmbeddingMixin)
