"""Restrict policies against a pure-Python reference model: random sequences
of training steps and restrictions leave exactly the keys the reference
keeps (ties: smaller stable hash kept), and every slot table (optimizer and
policy state) always holds exactly the rows' key set."""

import numpy as np
import pytest
import tensorflow as tf

import tfde
from backends import BACKENDS
from tfde.hashing import stable_hash_py

pytestmark = pytest.mark.keras  # trains through the Keras optimizer wrapper


def creators():
    """(name, creator, cleanup) of the Variable backends that store (tests/backends.py)."""
    for name in ("cuckoo", "redis"):
        made = BACKENDS[name]()
        yield name, made.creator, made.cleanup


class Reference:
    """What a Variable with a frequency or timestamp policy must hold."""

    def __init__(self, kind):
        self.kind, self.score = kind, {}

    def step(self, t, keys):
        for k in set(keys):
            self.score[k] = self.score.get(k, 0) + 1 if self.kind == "frequency" else t

    def restrict(self, num_reserved, trigger):
        if len(self.score) <= trigger:
            return
        ranked = sorted(self.score, key=lambda k: (-self.score[k], stable_hash_py(k)))
        self.score = {k: self.score[k] for k in ranked[:num_reserved]}


def stored(var):
    keys = [k.numpy() for k, _ in var.export()]
    return set(np.concatenate(keys).tolist()) if keys else set()


def train_step(var, opt, keys):
    """One training step on `keys`: a list, or an int64 tensor (inside tf.function)."""
    ids = keys if tf.is_tensor(keys) else tf.constant(keys, tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tfde.embedding_lookup(var, ids, training=True))
    opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))


@pytest.mark.parametrize(
    "kind,policy", [("frequency", tfde.FrequencyRestrictPolicy), ("timestamp", tfde.TimestampRestrictPolicy)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_steps_and_restrictions_match_reference(kind, policy, seed):
    for backend, creator, cleanup in creators():
        try:
            rng = np.random.default_rng(seed)
            var = tfde.Variable(f"pol-{kind}-{seed}", dim=2, table_creator=creator, restrict_policy=policy)
            opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01))
            ref = Reference(kind)
            for t in range(25):
                # a skewed vocabulary with duplicates inside a batch
                keys = np.minimum(rng.zipf(1.5, 12), 60).tolist()
                train_step(var, opt, keys)
                ref.step(t, keys)
                if t % 5 == 4:
                    num_reserved, trigger = int(rng.integers(3, 12)), int(rng.integers(5, 15))
                    var.restrict(num_reserved, trigger=trigger)
                    ref.restrict(num_reserved, trigger)
                keys_now = stored(var)
                assert keys_now == set(ref.score), (backend, t)
                for name, slot in var.slots.items():
                    assert stored(slot) == keys_now, (backend, t, name)
            scores = var.slots[f"policy-{kind}"].lookup(tf.constant(sorted(keys_now), tf.int64)).numpy()[:, 0]
            assert scores.tolist() == [float(ref.score[k]) for k in sorted(keys_now)], backend
        finally:
            cleanup()


def test_restriction_during_training_leaves_every_key_in_all_tables_or_none():
    """restrict() runs in a second thread while training steps (tf.function,
    Adam: two optimizer slots plus the policy state) write the same keys:
    after each round, every slot holds exactly the rows' key set."""
    import threading

    for backend, creator, cleanup in creators():
        try:
            var = tfde.Variable(
                f"pol-conc-{backend}", dim=4, table_creator=creator, restrict_policy=tfde.FrequencyRestrictPolicy
            )
            opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01))
            step = tf.function(lambda ids: train_step(var, opt, ids))

            rng = np.random.default_rng(0)
            step(tf.constant(rng.integers(0, 4000, 512), tf.int64))
            for round_ in range(6):
                batches = [tf.constant(rng.integers(0, 4000, 512), tf.int64) for _ in range(30)]
                trainer = threading.Thread(target=lambda: [step(b) for b in batches])
                restrictions = removed = 0
                trainer.start()
                while trainer.is_alive():
                    removed += var.restrict(300)
                    restrictions += 1
                trainer.join()
                assert restrictions > 0 and removed > 0, (backend, round_)
                keys_now = stored(var)
                assert len(keys_now) > 0
                for name, slot in var.slots.items():
                    assert stored(slot) == keys_now, (backend, round_, name, len(stored(slot) ^ keys_now))
        finally:
            cleanup()


def test_inference_does_not_count():
    var = tfde.Variable("pol-inf", dim=2, restrict_policy=tfde.FrequencyRestrictPolicy)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
    train_step(var, opt, [1, 1, 2])
    tfde.embedding_lookup(var, tf.constant([1, 2, 3], tf.int64), training=False)
    counts = var.slots["policy-frequency"].lookup(tf.constant([1, 2, 3], tf.int64)).numpy()[:, 0]
    assert counts.tolist() == [1.0, 1.0, 0.0]


class _WorkerZeroOfTwo:
    """The host collectives worker 0 of a 2-worker job sees when worker 1
    stores none of the Variable's keys (a table that a DistributedEmbedding
    plan places whole on worker 0): totals and gathers are its own."""

    rank, size = 0, 2

    def total(self, n):
        return n

    def gather(self, values):
        return values


def test_a_worker_holding_every_key_restricts_them(monkeypatch):
    """Both workers gave their best num_reserved keys and, all together,
    there were no more than num_reserved of them: that happens when one
    worker holds every key, and that worker must still drop all but its
    best (it used to remove nothing: a table placed whole on one worker of
    a job never shrank)."""
    var = tfde.Variable("pol-one-of-two", dim=2, restrict_policy=tfde.FrequencyRestrictPolicy)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
    for t in range(6):
        train_step(var, opt, list(range(20)) if t == 0 else list(range(t)))  # key k counted 1 + (5 - k) times
    monkeypatch.setattr(tfde.policy.exchange, "host_collectives", lambda strategy=None: _WorkerZeroOfTwo())
    assert int(var.restrict(3)) == 17
    assert stored(var) == {0, 1, 2} and stored(var.slots["policy-frequency"]) == {0, 1, 2}


def test_ttl_steps_evicts_keys_not_updated_recently():
    var = tfde.Variable("pol-ttl", dim=2, restrict_policy=tfde.TTLPolicy(ttl_steps=3))
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
    for t in range(8):
        train_step(var, opt, [100] if t == 0 else [t])  # key 100 only in step 0
    # latest step 7, TTL 3: keys last updated before step 4 (older than 3 steps) go
    assert int(var.restrict()) == 4
    assert stored(var) == {4, 5, 6, 7} and stored(var.slots["policy-timestamp"]) == {4, 5, 6, 7}


def test_auto_restrictor_in_a_custom_loop():
    var = tfde.Variable("pol-auto", dim=2, restrict_policy=tfde.FrequencyRestrictPolicy)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
    auto = tfde.AutoRestrictor([var], max_size=20, num_reserved=10)
    for t in range(30):
        train_step(var, opt, [t * 3, t * 3 + 1, 1])
        auto.after_step(t + 1)
        assert int(var.size()) <= 20
    assert auto.removed > 0 and 1 in stored(var)  # the key seen in every step is always kept


def test_restrict_callback_under_model_fit():
    layer = tfde.keras.layers.Embedding(4, restrict_policy=tfde.FrequencyRestrictPolicy, name="pol_fit")
    model = tf.keras.Sequential([layer, tf.keras.layers.Dense(1)])
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), loss="mse")
    sizes = []

    class Sizes(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            sizes.append(int(layer.params.size()))

    x = np.arange(400, dtype=np.int64)
    model.fit(
        x,
        np.zeros((400, 1), np.float32),
        batch_size=40,
        epochs=1,
        verbose=0,
        callbacks=[tfde.keras.callbacks.RestrictCallback(max_size=100, num_reserved=60), Sizes()],
    )
    assert max(sizes) <= 100 and int(layer.params.size()) <= 100


def test_restrict_callback_without_policies_says_so():
    model = tf.keras.Sequential([tfde.keras.layers.Embedding(4, name="pol_none"), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1)), loss="mse")
    with pytest.raises(tfde.ConfigError, match="found no tfde layer with a restrict_policy"):
        model.fit(
            np.arange(4), np.zeros((4, 1)), verbose=0, callbacks=[tfde.keras.callbacks.RestrictCallback(max_size=2)]
        )


def test_bad_arguments():
    var = tfde.Variable("pol-bad", dim=2)
    with pytest.raises(tfde.ConfigError, match="has no restrict_policy"):
        var.restrict(10)
    with pytest.raises(tfde.ConfigError, match="exactly one of ttl_steps= or ttl_s="):
        tfde.TTLPolicy()
    with pytest.raises(tfde.ConfigError, match="needs every_n_steps=, max_size= or both"):
        tfde.AutoRestrictor([tfde.Variable("p2", dim=2, restrict_policy=tfde.FrequencyRestrictPolicy)])
    with pytest.raises(tfde.ConfigError, match="num_reserved must be an int >= 0"):
        tfde.Variable("p3", dim=2, restrict_policy=tfde.FrequencyRestrictPolicy).restrict(-1)


# ------------------------------------------------------------ admission


@pytest.mark.parametrize("default", ["initializer", "zeros"])
def test_counter_filter_admits_on_the_min_count_th_step(default):
    var = tfde.Variable("adm-counter", dim=2, initializer=1.0, admission_filter=tfde.CounterFilter(3, default=default))
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.5))
    for t in range(3):
        train_step(var, opt, [7, 7, 8] if t < 2 else [7])
        if t < 2:
            assert stored(var) == set() and all(int(s.size()) == 0 for s in var.slots.values())
            expected = 1.0 if default == "initializer" else 0.0
            assert var.lookup(tf.constant([7], tf.int64)).numpy().tolist() == [[expected, expected]]
    assert stored(var) == {7}  # third sighting: admitted, its update applied from the initial row
    assert var.lookup(tf.constant([7], tf.int64)).numpy().tolist() == [[0.5, 0.5]]
    assert var.lookup(tf.constant([8], tf.int64), return_exists=True)[1].numpy().tolist() == [False]


def test_probability_filter_is_deterministic_per_key():
    a = tfde.Variable("adm-p-a", dim=2, admission_filter=tfde.ProbabilityFilter(0.3, seed=4))
    b = tfde.Variable("adm-p-b", dim=2, admission_filter=tfde.ProbabilityFilter(0.3, seed=4))
    for var in (a, b):
        opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
        for _ in range(3):
            train_step(var, opt, list(range(1000)))
    assert stored(a) == stored(b) and 230 < len(stored(a)) < 370  # ~30% of 1000, same keys on both


@pytest.mark.parametrize("backend", ["cuckoo", "redis"])
def test_policy_and_admission_inside_tf_function(backend, tmp_path):
    creator, cleanup = tfde.CuckooTableCreator(), lambda: None
    if backend == "redis":
        name, creator, cleanup = next(c for c in creators() if c[0] == "redis")
    try:
        var = tfde.Variable(
            f"pol-fn-{backend}",
            dim=2,
            table_creator=creator,
            restrict_policy=tfde.FrequencyRestrictPolicy,
            admission_filter=tfde.CounterFilter(2),
        )
        opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
        step = tf.function(lambda ids: train_step(var, opt, ids))

        step(tf.constant([1, 2], tf.int64))
        assert stored(var) == set()  # seen once: not admitted
        step(tf.constant([1, 3], tf.int64))
        step(tf.constant([1, 3], tf.int64))
        assert stored(var) == {1, 3}
        counts = var.slots["policy-frequency"].lookup(tf.constant([1, 3], tf.int64)).numpy()[:, 0]
        assert counts.tolist() == [2.0, 1.0]  # counted from admission on
        assert var.restrict(1) == 1 and stored(var) == {1}
    finally:
        cleanup()


def test_one_filter_or_policy_instance_per_variable():
    shared = tfde.CounterFilter(2)
    tfde.Variable("adm-a", dim=2, admission_filter=shared)
    with pytest.raises(tfde.ConfigError, match="one per Variable"):
        tfde.Variable("adm-b", dim=2, admission_filter=shared)
    policy = tfde.FrequencyRestrictPolicy()
    tfde.Variable("pol-a", dim=2, restrict_policy=policy)
    with pytest.raises(tfde.ConfigError, match="restrict_policy=tfde.FrequencyRestrictPolicy"):
        tfde.Variable("pol-b", dim=2, restrict_policy=policy)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: tfde.keras.callbacks.RestrictCallback(max_size=10, num_reserved=100),
            "num_reserved \\(100\\) is above",
        ),
        (lambda: tfde.keras.callbacks.RestrictCallback(every_n_steps=0), "every_n_steps must be an int >= 1, got 0"),
        (lambda: tfde.keras.callbacks.RestrictCallback(), "RestrictCallback needs every_n_steps=, max_size= or both"),
        (lambda: tfde.TTLPolicy(ttl_s=float("nan")), "the TTL must be a positive, finite number, got nan"),
        (lambda: tfde.TTLPolicy(ttl_s=float("inf")), "the TTL must be a positive, finite number, got inf"),
        (lambda: tfde.TTLPolicy(ttl_steps=1.5), "ttl_steps counts optimizer steps: a whole number, got 1.5"),
        (lambda: tfde.AutoRestrictor([3], max_size=3), "AutoRestrictor restricts tfde Variables .* got 3"),
    ],
    ids=["reserved-above-max", "every-0", "no-trigger", "ttl-nan", "ttl-inf", "ttl-steps-1.5", "not-a-variable"],
)
def test_restriction_arguments_that_make_no_schedule_are_refused_when_given(make, message):
    # They were accepted (a NaN TTL never evicted; 100 reserved of max 10 left 50 rows) or refused only
    # when model.fit started.
    with pytest.raises(tfde.ConfigError, match=message):
        make()


def test_a_trigger_below_num_reserved_is_refused_and_changes_nothing():
    var = tfde.Variable("trigger", dim=2, initializer=0.0, restrict_policy=tfde.FrequencyRestrictPolicy)
    var.upsert(tf.constant(np.arange(10), tf.int64), tf.ones([10, 2]))
    with pytest.raises(tfde.ConfigError, match="trigger must be None or an int >= 0 .*got -1"):
        var.restrict(3, trigger=-1)
    assert int(var.size()) == 10
    assert var.restrict(3, trigger=5) == 7 and int(var.size()) == 3


def test_numpy_integers_are_counts_like_ints():
    var = tfde.Variable("np-counts", dim=2, initializer=0.0, restrict_policy=tfde.FrequencyRestrictPolicy)
    var.upsert(tf.constant(np.arange(10), tf.int64), tf.ones([10, 2]))
    assert var.restrict(np.int64(3), trigger=np.int32(5)) == 7 and int(var.size()) == 3
    callback = tfde.keras.callbacks.RestrictCallback(max_size=np.int64(10), num_reserved=np.int64(9))
    assert callback._args["max_size"] == 10
    assert tfde.AutoRestrictor([var], every_n_steps=np.int64(2), max_size=np.int64(2)).after_step(2) == 1
