"""The fused training step (tfde/step_kernels.py, backends/cuckoo/step_ops.cc)
against the optimizer's Python path, which stays the reference: for every
optimizer and option of tests/test_optimizer.py, weight decay, a learning
rate schedule, float64 and float16 tables, int and string keys, a Variable
looked up twice in one step and NaN gradients, both paths store the same
rows and slots (rtol 1e-6), on in-process cuckoo tables and on Redis
(TfdeRedisApply, which reads and writes the tables of one Variable in one
op).  Each run checks which path it took, so the comparison cannot pass by
comparing a path with itself."""

import time
import uuid

import numpy as np
import pytest
import redis
import tensorflow as tf
from test_optimizer import CASES

import tfde
from tfde import step_kernels
from tfde.compat.tfra import dynamic_embedding as tfra_compat
from tfde.initializers import InitSpec

pytestmark = pytest.mark.keras
K = tf.keras.optimizers
STEPS, BATCH, DIM = 6, 24, 5
BACKENDS = ["cuckoo", "redis"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _creator(backend):
    """None (the default cuckoo tables) or a Redis creator under a fresh tag:
    2 buckets, 7 keys per command (several commands per bucket)."""
    if backend == "cuckoo":
        return None
    tag = f"tfde-step-kernels-{uuid.uuid4().hex[:10]}"
    _TAGS.append(tag)
    return tfde.RedisTableCreator({"model_tag_runtime": tag, "storage_slice": 2, "keys_sending_size": 7})


_TAGS = []


@pytest.fixture(autouse=True)
def _redis_keys_go():
    yield
    if _TAGS:
        client = redis.Redis()
        for tag in _TAGS:
            keys = [k for pattern in (f"{tag}:*", f"tfde-*{tag}:*") for k in client.scan_iter(match=pattern)]
            if keys:
                client.delete(*keys)
        _TAGS.clear()


class Calls:
    """Counts the fused ops traced: writes (step_kernels.apply) and lookups
    (step_kernels.fused_lookup, as tfde.variable calls it)."""

    def __init__(self, monkeypatch):
        self.count = self.lookups = 0
        apply, lookup = step_kernels.apply, tfde.variable.fused_lookup

        def counted_apply(*args, **kwargs):
            self.count += 1
            return apply(*args, **kwargs)

        def counted_lookup(*args, **kwargs):
            self.lookups += 1
            return lookup(*args, **kwargs)

        monkeypatch.setattr(step_kernels, "apply", counted_apply)
        monkeypatch.setattr(tfde.variable, "fused_lookup", counted_lookup)


def train(make_opt, value_dtype=tf.float32, nan_at=None, graph=True, stored=0, backend="cuckoo", policy=None):
    """STEPS steps of two Variables (int64 and string keys); the item
    Variable is looked up twice per step (its step buffer then holds keys
    twice).  `stored`: item keys 0..stored-1 hold rows before training (and
    no optimizer slots yet).  `policy`: a callable making each Variable's
    restrict policy.  Returns {table: {key: row}} of rows and slots (policy
    state included)."""
    init = tf.keras.initializers.RandomUniform(-1, 1, seed=3)
    creator = _creator(backend)
    policies = {} if policy is None else {"item": policy(), "user": policy()}
    item = tfde.Variable(
        "item",
        dim=DIM,
        value_dtype=value_dtype,
        initializer=init,
        table_creator=creator,
        restrict_policy=policies.get("item"),
    )
    user = tfde.Variable(
        "user",
        key_dtype=tf.string,
        dim=DIM,
        value_dtype=value_dtype,
        initializer=init,
        table_creator=creator,
        restrict_policy=policies.get("user"),
    )
    if stored:
        rows = np.random.default_rng(9).standard_normal((stored, DIM))
        item.upsert(tf.range(stored, dtype=tf.int64), tf.constant(rows, value_dtype))
    opt = make_opt()
    rng = np.random.default_rng(5)
    variables = [item.step_buffer, user.step_buffer]

    def step(items, history, users, c):
        with tf.GradientTape() as tape:
            a = tfde.embedding_lookup(item, items, training=True)
            b = tfde.embedding_lookup(item, history, training=True)
            u = tfde.embedding_lookup(user, users, training=True)
            loss = tf.reduce_sum(tf.cast(a * c + b * b + u * a, tf.float32))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    fn = tf.function(step) if graph else step
    for number in range(STEPS):
        c = rng.standard_normal((BATCH, DIM))
        if nan_at is not None and number == nan_at:
            c[3] = np.nan  # the gradient of items[3] is NaN this step: its row must stay as it is
        fn(
            tf.constant(rng.integers(0, 30, BATCH), tf.int64),
            tf.constant(rng.integers(0, 30, BATCH), tf.int64),
            tf.constant([f"u{i}" for i in rng.integers(0, 12, BATCH)]),
            tf.constant(c, value_dtype),
        )
    out = {}
    for var in (item, user):
        latest = getattr(var.restrict_policy, "_latest_step", None)  # a TTL policy's
        if latest is not None:
            out[f"{var.name}/ttl-latest"] = {0: np.array([latest.numpy()])}
        for name, v in [("rows", var)] + sorted(var.slots.items()):
            table = {}
            for keys, rows in v.export():
                table.update(zip(keys.numpy().tolist(), rows.numpy().astype(np.float64)))
            out[f"{var.name}/{name}"] = table
    return out


def both_paths(monkeypatch, make_opt, **kwargs):
    calls = Calls(monkeypatch)
    fused = train(make_opt, **kwargs)
    # On Redis the lookups are the table's own (the fused lookup is cuckoo's).
    on_redis = kwargs.get("backend") == "redis"
    assert calls.count > 0 and (calls.lookups > 0 or on_redis), "the fused step was not taken"
    monkeypatch.setattr(step_kernels, "enabled", False)
    count, lookups = calls.count, calls.lookups
    python = train(make_opt, **kwargs)
    assert (calls.count, calls.lookups) == (count, lookups), "the Python path took the fused step"
    return fused, python


def assert_same(fused, python, rtol=1e-6, atol=1e-7):
    assert set(fused) == set(python)
    for name in python:
        assert set(fused[name]) == set(python[name]), name
        keys = sorted(python[name])
        assert keys, name
        np.testing.assert_allclose(
            np.stack([fused[name][k] for k in keys]),
            np.stack([python[name][k] for k in keys]),
            rtol=rtol,
            atol=atol,
            err_msg=name,
        )


@pytest.mark.parametrize("kind,cfg", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_the_fused_step_stores_what_the_python_path_stores(monkeypatch, kind, cfg, backend):
    fused, python = both_paths(
        monkeypatch, lambda: tfde.DynamicEmbeddingOptimizer(getattr(K, kind)(**cfg)), backend=backend
    )
    assert_same(fused, python)


@pytest.mark.parametrize(
    "make",
    [
        lambda: K.RMSprop(0.01, momentum=0.3),
        lambda: K.Adam(0.01, weight_decay=0.05),
        lambda: K.SGD(K.schedules.ExponentialDecay(0.05, 2, 0.5), momentum=0.5),
        lambda: K.Adagrad(0.1, weight_decay=0.02),
    ],
    ids=["rmsprop-momentum", "adam-weight-decay", "sgd-schedule", "adagrad-weight-decay"],
)
def test_options_beyond_the_rule_are_the_same(monkeypatch, make, backend):
    fused, python = both_paths(monkeypatch, lambda: tfde.DynamicEmbeddingOptimizer(make()), backend=backend)
    assert_same(fused, python)


@pytest.mark.parametrize(
    "dtype,rtol,backend",
    [
        (tf.float64, 1e-12, "cuckoo"),
        (tf.float16, 1e-3, "cuckoo"),
        (tf.bfloat16, 8e-3, "cuckoo"),
        (tf.float64, 1e-12, "redis"),
        (tf.float16, 1e-3, "redis"),
        (tf.bfloat16, 8e-3, "redis"),
    ],
)
def test_other_value_dtypes(monkeypatch, dtype, rtol, backend):
    # float16 and bfloat16 tables: both paths compute in float32 and round to
    # the table's dtype, so they differ by at most a rounding of that dtype.
    fused, python = both_paths(
        monkeypatch,
        lambda: tfde.DynamicEmbeddingOptimizer(K.Adam(0.01, amsgrad=True)),
        value_dtype=dtype,
        backend=backend,
    )
    assert_same(fused, python, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_half_tables_train_alike_on_redis_and_in_process(monkeypatch, dtype):
    """The fused step of a float16 / bfloat16 table is the same rule in the
    same float32 operations on both backends: Redis stores exactly the rows
    and slots the cuckoo kernel stores."""
    calls = Calls(monkeypatch)
    make = lambda: tfde.DynamicEmbeddingOptimizer(K.Adam(0.01, amsgrad=True))  # noqa: E731
    on_redis = train(make, value_dtype=dtype, backend="redis")
    assert calls.count > 0, "the fused step was not taken on Redis"
    in_process = train(make, value_dtype=dtype, backend="cuckoo")
    assert_same(on_redis, in_process, rtol=0, atol=0)


def test_a_nan_gradient_leaves_its_row_and_slots_as_they_were(monkeypatch, backend):
    make = lambda: tfde.DynamicEmbeddingOptimizer(K.Adam(0.01))  # noqa: E731
    fused, python = both_paths(monkeypatch, make, nan_at=2, backend=backend)
    assert_same(fused, python)
    for table in fused.values():
        assert all(np.isfinite(row).all() for row in table.values())


def test_rows_stored_before_training_start_with_fresh_slots(monkeypatch, backend):
    # A warm start from rows alone: half the keys trained have a row and no
    # slot, the others neither, and the fused step inserts what is missing.
    make = lambda: tfde.DynamicEmbeddingOptimizer(K.Adam(0.01))  # noqa: E731
    fused, python = both_paths(monkeypatch, make, stored=15, backend=backend)
    assert_same(fused, python)
    assert len(fused["item/rows"]) == 30


def test_eager_steps_take_it_too(monkeypatch, backend):
    fused, python = both_paths(
        monkeypatch, lambda: tfde.DynamicEmbeddingOptimizer(K.Ftrl(0.1)), graph=False, backend=backend
    )
    assert_same(fused, python)


def test_what_the_kernel_does_not_cover_takes_the_python_path(monkeypatch, backend):
    """Ftrl with another learning_rate_power, clipping, a restrict policy of
    the user's own (a subclass may count otherwise): the Python path."""

    class Twice(tfde.FrequencyRestrictPolicy):
        def step_values(self, keys, step):
            return {self.scores: self.scores._find(keys, for_update=True)[0] + 2.0}

    adam = lambda: K.Adam(0.01)  # noqa: E731
    cases = [
        (lambda: K.Ftrl(0.1, learning_rate_power=-0.7), None),
        (lambda: K.Adam(0.01, clipnorm=1.0), None),
        (adam, Twice),
    ]
    for make, policy in cases:
        calls = Calls(monkeypatch)
        out = train(lambda: tfde.DynamicEmbeddingOptimizer(make()), backend=backend, policy=policy)
        assert calls.count == 0
        if policy is Twice:  # its own rule was applied
            counts = {float(c[0]) for c in out["item/policy-frequency"].values()}
            assert all(c % 2 == 0 for c in counts) and max(counts) > STEPS, counts  # 2 a step, not 1


class _Float32Counts(tfde.FrequencyRestrictPolicy):
    """Counts kept in a float32 slot: the kernels write float64 ones."""

    def bind(self, variable):
        tfde.policy.RestrictPolicy.bind(self, variable)
        self.scores = variable.slot("policy-frequency", 0.0, dim=1, value_dtype=tf.float32)


class _CountsFromFive(tfde.FrequencyRestrictPolicy):
    """Counts that start at 5 for a key never counted."""

    def bind(self, variable):
        tfde.policy.RestrictPolicy.bind(self, variable)
        self.scores = variable.slot("policy-frequency", 5.0, dim=1, value_dtype=tf.float64)


def test_a_policy_binding_other_scores_is_written_as_its_slot_says(monkeypatch, backend):
    """A subclass that binds its own score slot: float32 counts take the
    Python path (the kernels write float64 ones; they used to fail the
    step), counts starting at 5 take the fused step from 5 (they used to
    start from 0)."""
    calls = Calls(monkeypatch)
    out = train(lambda: tfde.DynamicEmbeddingOptimizer(K.Adam(0.01)), backend=backend, policy=_Float32Counts)
    assert calls.count == 0
    assert max(c[0] for c in out["item/policy-frequency"].values()) > 1.0
    make = lambda: tfde.DynamicEmbeddingOptimizer(K.Adam(0.01))  # noqa: E731
    fused, python = both_paths(monkeypatch, make, policy=_CountsFromFive, backend=backend)
    assert_same(fused, python, rtol=0, atol=0)
    assert min(c[0] for c in fused["item/policy-frequency"].values()) >= 6.0


POLICIES = {
    "frequency": tfde.FrequencyRestrictPolicy,
    "timestamp": tfde.TimestampRestrictPolicy,
    "ttl": lambda: tfde.TTLPolicy(ttl_steps=3),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_tfde_restrict_policies_take_it_and_write_what_the_python_path_writes(monkeypatch, policy, graph, backend):
    """tfde's frequency, timestamp (step clock) and TTL policies, on cuckoo
    tables and on Redis: the fused step writes each key's count or step with
    its row and slots, as the Python path does (a NaN gradient's key is not
    counted: its row is not written), and a TTL policy records the latest
    step."""
    make = lambda: tfde.DynamicEmbeddingOptimizer(K.Adam(0.01))  # noqa: E731
    fused, python = both_paths(monkeypatch, make, policy=POLICIES[policy], nan_at=2, graph=graph, backend=backend)
    assert_same(fused, python, rtol=0, atol=0)
    state = "frequency" if policy == "frequency" else "timestamp"
    assert max(fused[f"item/policy-{state}"].values()) > 1.0  # counted over several steps (or stepped on)
    if policy == "ttl":
        assert fused["item/ttl-latest"][0].tolist() == [STEPS - 1]


@pytest.mark.parametrize(
    "policy",
    [lambda: tfde.TimestampRestrictPolicy(clock="wall"), lambda: tfra_compat.TimestampRestrictPolicy()],
    ids=["tfde", "tfde.compat.tfra"],
)
def test_a_wall_clock_timestamp_takes_it_and_stamps_the_step_s_time(monkeypatch, policy, backend):
    """Also the TFRA-compatible policy (a subclass on the wall clock)."""
    calls = Calls(monkeypatch)
    before = time.time()
    out = train(lambda: tfde.DynamicEmbeddingOptimizer(K.Adam(0.01)), policy=policy, backend=backend)
    after = time.time()
    assert calls.count > 0
    stamps = np.array([v[0] for v in out["item/policy-timestamp"].values()])
    assert len(stamps) > 0 and (stamps >= before).all() and (stamps <= after).all(), (before, stamps, after)


# ---------------------------------------------------------------- the ops refuse bad inputs, changing nothing

OPS = None


def ops():
    global OPS
    if OPS is None:
        from tfde import _native

        OPS = _native.load()
    return OPS


def adam_apply(tables, slots, keys, indices, grads, defaults, hyper, **overrides):
    attrs = dict(
        rule="adam",
        slot_init=[0.0, 0.0],
        decay=[False] * len(tables),
        init_kind=["constant"] * len(tables),
        init_p0=[0.5] * len(tables),
        init_p1=[0.0] * len(tables),
        init_seed=[0] * len(tables),
    )
    states = {k: overrides.pop(k) for k in ("state_tables", "state_values") if k in overrides}
    attrs.update(overrides)
    return ops().tfde_table_apply(
        tables=tables,
        slot_tables=slots,
        keys=keys,
        indices=indices,
        grads=grads,
        defaults=defaults,
        hyper=hyper,
        state_tables=states.get("state_tables", []),
        state_values=states.get("state_values", tf.zeros([0], tf.float64)),
        **attrs,
    )


def _handle(var):
    return var._tables[0].resource_handle


def _good_adam_inputs(rows, m, v):
    """adam_apply's inputs for one part: Variable `rows` (dim 4) with slots
    `m` and `v`, keys 1, 2, 3 and gradient rows for keys 1 and 3."""
    return dict(
        tables=[_handle(rows)],
        slots=[_handle(m), _handle(v)],
        keys=[tf.constant([1, 2, 3], tf.int64)],
        indices=[tf.constant([0, 2], tf.int32)],
        grads=[tf.ones([2, 4])],
        defaults=[tf.zeros([0, 4])],
        hyper=tf.constant([0.1, 0.0, 0.1, 0.1, 0.001, 1e-7]),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        ({"indices": [tf.constant([0, 3], tf.int32)]}, r"indices\[1\] = 3 is outside the 3 keys"),
        ({"indices": [tf.constant([0, -1], tf.int32)]}, r"indices\[1\] = -1 is outside"),
        ({"grads": [tf.ones([2, 3])]}, r"grads must have shape \[2, 4\]"),
        ({"defaults": [tf.ones([2, 4])]}, r"defaults must have shape \[3, 4\] or \[0, 4\]"),
        ({"hyper": tf.ones([3])}, "hyper must be a vector of at least 6 values"),
        ({"keys": [tf.constant([[1, 2, 3]], tf.int64)]}, "keys must be a vector"),
        ({"slot_init": [0.0]}, r"slot_init needs one value per slot \(2\)"),
        ({"init_kind": ["defaults"]}, "init_kind 'defaults' needs a defaults row per key"),
    ],
)
def test_the_apply_op_refuses_bad_inputs_and_writes_nothing(change, match):
    rows = tfde.Variable("rows", dim=4)
    m, v = tfde.Variable("m", dim=4), tfde.Variable("v", dim=4)
    other = tfde.Variable("other", dim=3)
    good = _good_adam_inputs(rows, m, v)
    attrs = {k: change.pop(k) for k in list(change) if k in ("slot_init", "init_kind")}
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        adam_apply(**{**good, **change}, **attrs)
    assert [int(t.size()) for t in (rows, m, v)] == [0, 0, 0]
    with pytest.raises(tf.errors.InvalidArgumentError, match="this apply takes int64 -> float tables of dim 4"):
        adam_apply(**{**good, "slots": [_handle(m), _handle(other)]})
    assert [int(t.size()) for t in (rows, m, v, other)] == [0, 0, 0, 0]
    written = adam_apply(**good)
    assert [int(w) for w in written] == [2] and int(rows.size()) == 2  # keys 1 and 3: the gradient rows' keys


@pytest.mark.parametrize(
    "change,match",
    [
        ({"state_part": [1]}, r"state_part\[0\] = 1 must name a part \(0..0\)"),
        ({"state_mode": ["max"]}, r"state_mode\[0\] must be 'add' or 'set', got 'max'"),
        ({"state_init": []}, r"state_mode and state_init need one entry per state table \(S = 1\), got 1 and 0"),
        ({"state_part": []}, r"state_part needs one entry per state table \(S = 1\), got 0"),
        ({"state_values": tf.ones([2], tf.float64)}, "state_values must be a vector of 1 values"),
        ({"state_table": "float32"}, "a policy state table holds int64 -> float64 rows of dim 1"),
        ({"state_table": "dim2"}, "a policy state table holds int64 -> float64 rows of dim 1"),
    ],
)
def test_the_apply_op_refuses_bad_policy_state_and_writes_nothing(change, match):
    rows = tfde.Variable("rows", dim=4)
    m, v = tfde.Variable("m", dim=4), tfde.Variable("v", dim=4)
    tables = {
        "good": tfde.Variable("state", dim=1, value_dtype=tf.float64),
        "float32": tfde.Variable("state32", dim=1),
        "dim2": tfde.Variable("state2", dim=2, value_dtype=tf.float64),
    }
    good = _good_adam_inputs(rows, m, v)
    state = dict(state_part=[0], state_mode=["add"], state_init=[0.0], state_values=tf.constant([1.0], tf.float64))
    state["state_tables"] = [_handle(tables["good"])]
    if "state_table" in change:
        change["state_tables"] = [_handle(tables[change.pop("state_table")])]
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        adam_apply(**good, **{**state, **change})
    assert [int(t.size()) for t in [rows, m, v, *tables.values()]] == [0] * 6
    adam_apply(**good, **{**state, "state_mode": ["set"], "state_values": tf.constant([7.0], tf.float64)})
    adam_apply(**good, **state)  # adds 1 to what was set
    found = tables["good"].lookup(tf.constant([1, 2, 3], tf.int64), return_exists=True)
    assert found[1].numpy().tolist() == [True, False, True]  # keys 1 and 3: the gradient rows' keys
    assert found[0].numpy()[[0, 2], 0].tolist() == [8.0, 8.0]


def test_the_lookup_op_refuses_a_table_of_another_dim():
    var = tfde.Variable("rows", dim=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"this lookup takes int64 -> float\[5\]"):
        ops().tfde_table_lookup(
            tables=[var._tables[0].resource_handle],
            keys=[tf.constant([1, 2], tf.int64)],
            dims=[5],
            Tvalue=tf.float32,
            init_kind=["constant"],
            init_p0=[0.0],
            init_p1=[0.0],
            init_seed=[0],
        )
    unique, positions, rows = ops().tfde_table_lookup(
        tables=[var._tables[0].resource_handle],
        keys=[tf.constant([7, 5, 7], tf.int64)],
        dims=[4],
        Tvalue=tf.float32,
        init_kind=["constant"],
        init_p0=[0.25],
        init_p1=[0.0],
        init_seed=[0],
    )
    assert unique[0].numpy().tolist() == [7, 5] and positions[0].numpy().tolist() == [0, 1, 0]
    np.testing.assert_array_equal(rows[0].numpy(), np.full([2, 4], 0.25, np.float32))
    assert int(var.size()) == 0  # a lookup never inserts


@pytest.mark.parametrize(
    "change,match",
    [
        ({"keys": tf.constant([1, 2, 1], tf.int64)}, "keys must be distinct .* key 2 repeats an earlier one"),
        ({"grads": tf.ones([3, 3])}, r"grads must be float\[3, 4\] for 3 keys"),
        ({"grads": tf.ones([4, 4])}, r"grads must be float\[3, 4\] for 3 keys"),
        ({"grads": tf.ones([3, 4], tf.float64)}, "expected to be a (double|float) tensor"),
        ({"hyper": tf.ones([3])}, "hyper must be a float vector of at least 6 values"),
        ({"step": None}, "the fused step needs the training step's number, got -1"),
        ({"slot_init": [0.0]}, r"rule 'adam' keeps 2 slot\(s\)"),
        ({"missing": tf.ones([2, 4])}, r"defaults must have shape \[3, 4\] or \[1, 4\]"),
    ],
)
def test_the_redis_apply_op_refuses_bad_inputs_and_writes_nothing(change, match):
    """TfdeRedisApply (RedisTable.apply_step) checks every input before it
    reads or sends anything: the tables stay empty, and the same call with
    good inputs writes."""
    creator = _creator("redis")
    rows, m, v = (tfde.Variable(name, dim=4, table_creator=creator) for name in ("rows", "m", "v"))
    good = dict(
        keys=tf.constant([1, 2, 3], tf.int64),
        grads=tf.ones([3, 4]),
        missing=InitSpec("constant", 0.5, 0.0, 0),
        slots=[m._tables[0], v._tables[0]],
        step=tf.constant(7, tf.int64),
        hyper=tf.constant([0.1, 0.0, 0.1, 0.1, 0.001, 1e-7]),
    )
    rule = dict(rule="adam", slot_init=[0.0, 0.0])
    rule.update({k: change.pop(k) for k in list(change) if k == "slot_init"})
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        rows._tables[0].apply_step(**{**good, **change}, **rule)
    assert [int(t.size()) for t in (rows, m, v)] == [0, 0, 0]
    assert int(rows._tables[0].apply_step(**good, rule="adam", slot_init=[0.0, 0.0])) == 3
    assert [int(t.size()) for t in (rows, m, v)] == [3, 3, 3]
    nan = tf.constant([[1.0] * 4, [np.nan] * 4, [1.0] * 4])  # key 2's gradient is not finite: left as it is
    before = rows.lookup(tf.constant([2], tf.int64)).numpy()
    again = {**good, "grads": nan, "step": tf.constant(8, tf.int64)}
    assert int(rows._tables[0].apply_step(**again, rule="adam", slot_init=[0.0, 0.0])) == 2
    np.testing.assert_array_equal(rows.lookup(tf.constant([2], tf.int64)).numpy(), before)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"mode": "mul"}, r"state_mode\[0\] must be 'add' or 'set', got 'mul'"),
        ({"state_dim": 2}, r"the policy state table '.*' must be double\[1\], got double\[2\]"),
        ({"state_dtype": tf.float32}, r"the policy state table '.*' must be double\[1\], got float\[1\]"),
        ({"value": tf.constant([1.0, 2.0], tf.float64)}, r"state_value must be a scalar, got shape \[2\]"),
        ({"corrupt": True}, "a row in .* has 12 bytes, expected 8: the table holds another dim or dtype"),
    ],
)
def test_the_redis_apply_op_refuses_bad_policy_state_and_writes_nothing(change, match):
    """TfdeRedisApply with a restrict policy's state table: a bad mode,
    table or value is refused before anything is sent, and a stored state of
    another size fails the step before its transactions; rows, slots and
    state stay as they were.  Good inputs count each written key once
    ("add") and leave a NaN gradient's key uncounted."""
    creator = _creator("redis")
    rows, m, v = (tfde.Variable(name, dim=4, table_creator=creator) for name in ("rows", "m", "v"))
    shape = (change.pop("state_dim", 1), change.pop("state_dtype", tf.float64))
    state_var = tfde.Variable("state", dim=shape[0], value_dtype=shape[1], table_creator=creator)
    args = dict(
        keys=tf.constant([1, 2, 3], tf.int64),
        grads=tf.ones([3, 4]),
        missing=InitSpec("constant", 0.5, 0.0, 0),
        slots=[m._tables[0], v._tables[0]],
        rule="adam",
        slot_init=[0.0, 0.0],
        hyper=tf.constant([0.1, 0.0, 0.1, 0.1, 0.001, 1e-7]),
    )
    good = (state_var._tables[0], "add", 0.0, tf.constant(1.0, tf.float64))
    client = redis.Redis()
    corrupt = change.pop("corrupt", False)
    if corrupt:  # one stored count of 12 bytes
        rows._tables[0].apply_step(state=good, step=tf.constant(5, tf.int64), **args)
        bucket = next(b for b in state_var._tables[0]._buckets if client.hlen(b))
        client.hset(bucket, next(iter(client.hkeys(bucket))), b"x" * 12)
    state = (state_var._tables[0], change.pop("mode", "add"), 0.0, change.pop("value", good[3]))

    def stored():
        return {b: client.hgetall(b) for var in (rows, m, v, state_var) for b in var._tables[0]._buckets}

    before = stored()
    # The attrs are refused by TensorFlow; a stored row, by the op (tfde.ShapeError).
    with pytest.raises((tf.errors.InvalidArgumentError, tfde.errors.ShapeError), match=match):
        rows._tables[0].apply_step(state=state, step=tf.constant(7, tf.int64), **args)
    assert stored() == before
    if corrupt or shape != (1, tf.float64):
        return
    assert int(rows._tables[0].apply_step(state=good, step=tf.constant(7, tf.int64), **args)) == 3
    nan = tf.constant([[1.0] * 4, [np.nan] * 4, [1.0] * 4])
    again = {**args, "grads": nan}
    assert int(rows._tables[0].apply_step(state=good, step=tf.constant(8, tf.int64), **again)) == 2
    counts = state_var.lookup(tf.constant([1, 2, 3], tf.int64)).numpy()[:, 0].tolist()
    assert counts == [2.0, 1.0, 2.0]


def test_the_redis_apply_op_refuses_half_gradients_for_a_half_table():
    """A float16 table's rule runs in float32: gradients and scalars in
    float16 are refused (the op's Tgrad is float or double), and nothing is
    written; float32 ones train it."""
    creator = _creator("redis")
    rows, m, v = (tfde.Variable(name, dim=4, value_dtype=tf.float16, table_creator=creator) for name in ("r", "m", "v"))
    args = dict(
        keys=tf.constant([1, 2, 3], tf.int64),
        missing=InitSpec("constant", 0.5, 0.0, 0),
        slots=[m._tables[0], v._tables[0]],
        step=tf.constant(7, tf.int64),
        rule="adam",
        slot_init=[0.0, 0.0],
    )
    hyper = [0.1, 0.0, 0.1, 0.1, 0.001, 1e-7]
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="attr 'Tgrad' of half is not in the list of allowed values: float, double"
    ):
        rows._tables[0].apply_step(grads=tf.ones([3, 4], tf.float16), hyper=tf.constant(hyper, tf.float16), **args)
    assert [int(t.size()) for t in (rows, m, v)] == [0, 0, 0]
    written = rows._tables[0].apply_step(grads=tf.ones([3, 4]), hyper=tf.constant(hyper), **args)
    assert int(written) == 3
    # Adam's first step from 0.5 with gradient 1: 0.5 - 0.1 * 0.1 / (sqrt(0.001) + 1e-7), in float16.
    expected = np.float16(0.5 - 0.1 * 0.1 / (np.sqrt(np.float32(0.001)) + np.float32(1e-7)))
    np.testing.assert_allclose(
        rows.lookup(tf.constant([1, 2, 3], tf.int64)).numpy(), np.full((3, 4), expected), rtol=1e-3
    )
