"""Semi-synchronous training in one process: what a user can get wrong, and
what a process training alone must get right (local steps then equal exact
steps; a checkpoint syncs first).  Several workers: tests/test_semi_sync.py."""

import numpy as np
import pytest
import tensorflow as tf

import tfde
from tfde.errors import ConfigError


class Model(tf.keras.Model):
    def __init__(self, **emb):
        super().__init__()
        self.emb = tfde.keras.layers.Embedding(4, name="ids", initializer="uniform", **emb)
        self.dense = tf.keras.layers.Dense(1, kernel_initializer="ones")

    def call(self, x, training=None):
        return self.dense(self.emb(x, training=training))


def data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 40, size=(n, 1))
    return x, (x % 3 == 0).astype("float32")


def trained(every, optimizer="Adam", epochs=1, **emb):
    model = Model(**emb)
    opt = tfde.DynamicEmbeddingOptimizer(getattr(tf.keras.optimizers, optimizer)(0.05))
    model.compile(optimizer=opt, loss="mse")
    x, y = data()
    callbacks = [] if every is None else [tfde.keras.callbacks.PeriodicSync(every)]
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return model


def sgd_step(var, opt, offset=0.0):
    """A custom loop's training step (a tf.function, traced on first call):
    the loss is the sum of the looked-up rows minus `offset`."""

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tfde.embedding_lookup(var, ids) - offset)
        opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))

    return step


def rows_and_slots(model):
    keys = np.arange(40)
    var = model.emb.params
    return [var.lookup(keys).numpy()] + [s.lookup(keys).numpy() for _, s in sorted(var.slots.items())]


@pytest.mark.keras
@pytest.mark.parametrize("optimizer", ["SGD", "Adam", "Adagrad"])
@pytest.mark.parametrize("every", [2, 5, 100])
def test_alone_local_steps_train_what_exact_steps_train(optimizer, every):
    """A process training alone: its local tables hold exactly the rows the
    store would, and each sync adds them back (up to float rounding of
    base + (local - base)); 100 > the 12 steps: one sync, at the end."""
    exact = trained(None, optimizer, epochs=2)
    local = trained(every, optimizer, epochs=2)
    for a, b in zip(rows_and_slots(exact), rows_and_slots(local)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(exact.dense.kernel.numpy(), local.dense.kernel.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.keras
def test_a_later_fit_without_the_callback_is_exact_again():
    model = trained(4)
    assert not tfde.semi_sync.local_steps_on()
    x, y = data(seed=1)
    before = model.emb.params.size().numpy()
    model.fit(x, y, batch_size=16, verbose=0)
    assert model.emb.params.size().numpy() >= before
    assert model.emb.params._local is None


@pytest.mark.parametrize("every", [0, -3, True, 2.5, "4", None])
def test_a_bad_every_is_refused(every):
    with pytest.raises(ConfigError, match="every must be an int >= 1"):
        tfde.keras.callbacks.PeriodicSync(every)
    var = tfde.Variable("semi_bad_every", dim=2)
    with pytest.raises(ConfigError, match="every must be an int >= 1"):
        tfde.semi_sync.PeriodicSync(every, [var], tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD()))


def trained_with(every, callbacks=(), **emb):
    model = Model(**emb)
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), loss="mse")
    x, y = data()
    sync = [] if every is None else [tfde.keras.callbacks.PeriodicSync(every)]
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks) + sync)
    return model


def stored_state(model):
    """Every key's row and state (optimizer slots, policy state, change
    labels) and which keys are stored, over the keys the data can hold."""
    keys = np.arange(40)
    var = model.emb.params
    _, stored = var.lookup(keys, return_exists=True)
    state = {"stored": stored.numpy(), "rows": var.lookup(keys).numpy()}
    for name, slot in sorted(var.slots.items()):
        state[name] = slot.lookup(keys).numpy()
    counts = getattr(var.admission_filter, "counts", None)
    if counts is not None:  # a CounterFilter's counts of the keys not admitted yet
        state["admission"] = counts.lookup(keys, return_exists=True)[1].numpy() * counts.lookup(keys).numpy()[:, 0]
    return state


@pytest.mark.keras
@pytest.mark.parametrize(
    "make",
    [
        lambda: {"restrict_policy": tfde.FrequencyRestrictPolicy},
        lambda: {"restrict_policy": tfde.TimestampRestrictPolicy},
        lambda: {"restrict_policy": tfde.TTLPolicy(ttl_steps=3)},
        lambda: {"track_changes": True},
        lambda: {"admission_filter": tfde.ProbabilityFilter(0.5, seed=3, default="zeros")},
        lambda: {"admission_filter": tfde.ProbabilityFilter(0.5, seed=3)},
        lambda: {"admission_filter": tfde.CounterFilter(3)},
        lambda: {"admission_filter": tfde.CounterFilter(2, default="zeros")},
    ],
    ids=[
        "frequency",
        "timestamp",
        "ttl",
        "changes",
        "admission-zeros",
        "admission-initializer",
        "counter",
        "counter-zeros",
    ],
)
def test_alone_local_steps_keep_policy_state_change_labels_and_admission_as_exact_steps(make):
    """Policy state, change labels and admission follow the local steps: a
    process training alone ends with exactly the keys, rows and state that
    exact training gives (a sync merges counts by sum, timestamps and labels
    by max; keys the filter has not admitted are never written)."""
    emb = make()
    exact, local = trained_with(None, **emb), trained_with(4, **make())
    a, b = stored_state(exact), stored_state(local)
    assert sorted(a) == sorted(b)
    assert 0 < a["stored"].sum() <= 40
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    if "track_changes" in emb:
        for var in (exact.emb.params, local.emb.params):
            var.remove(np.arange(0, 40, 5))
        tombstones = [
            dict(zip(*[t.numpy().ravel() for t in next(v.changes.evicted.export())]))
            for v in (exact.emb.params, local.emb.params)
        ]
        assert tombstones[0] == tombstones[1] and tombstones[0]


class RestrictMidCycle(tf.keras.callbacks.Callback):
    """Restricts after steps 3, 7, 11, ...: between the syncs of every=4."""

    def on_train_batch_end(self, batch, logs=None):
        if batch % 4 == 2:
            self.model.emb.params.restrict(12)


@pytest.mark.keras
def test_a_restriction_between_syncs_syncs_first_and_keeps_what_exact_training_keeps():
    emb = {"restrict_policy": tfde.FrequencyRestrictPolicy}
    exact = trained_with(None, [RestrictMidCycle()], **emb)
    local = trained_with(4, [RestrictMidCycle()], **emb)
    a, b = stored_state(exact), stored_state(local)
    assert a["stored"].sum() < 40  # restriction removed keys
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


class KeepsState(tfde.ProbabilityFilter):
    """A filter of a user's that says it keeps state, and no merge rule."""

    stateless = False


class NoMergeRule(tfde.FrequencyRestrictPolicy):
    def sync_merges(self):
        return None


@pytest.mark.keras
@pytest.mark.parametrize(
    "emb,what",
    [
        ({"restrict_policy": NoMergeRule}, "has no rule to merge"),
        ({"admission_filter": KeepsState(0.5)}, "KeepsState keeps per-key state with no rule"),
    ],
)
def test_state_without_a_merge_rule_is_refused_before_training(emb, what):
    model = Model(**emb)
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), loss="mse")
    x, y = data()
    with pytest.raises(ConfigError, match=what):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[tfde.keras.callbacks.PeriodicSync(4)])
    assert not tfde.semi_sync.local_steps_on()
    assert int(model.emb.params.size()) == 0  # nothing trained


def test_one_periodic_sync_at_a_time_and_every_variable_must_be_given():
    a = tfde.Variable("semi_a", dim=2, initializer=0.5)
    b = tfde.Variable("semi_b", dim=2, initializer=0.5)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
    first = tfde.semi_sync.PeriodicSync(3, [a], opt)
    first.start()
    try:
        with pytest.raises(ConfigError, match="one PeriodicSync at a time"):
            tfde.semi_sync.PeriodicSync(3, [b], opt).start()
        with pytest.raises(ConfigError, match="was not given it"):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tfde.embedding_lookup(b, tf.constant([1, 2], tf.int64)))
            opt.apply_gradients(zip(tape.gradient(loss, [b.step_buffer]), [b.step_buffer]))
    finally:
        first.stop()
    assert not tfde.semi_sync.local_steps_on() and a._local is None


def three_local_steps(name, **var_args):
    """(Variable, optimizer, started PeriodicSync) after 3 local steps of a
    custom loop (tf.function step traced after start(); every=1000, so no
    sync yet: the store is still empty).  The caller stops the sync."""
    var = tfde.Variable(name, dim=3, initializer=0.0, **var_args)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.5))
    sync = tfde.semi_sync.PeriodicSync(1000, [var], opt)
    sync.start()
    try:
        step = sgd_step(var, opt, offset=1.0)
        for _ in range(3):
            step(tf.constant([1, 2, 2], tf.int64))
            sync.after_step()
        assert int(var.size()) == 0, "the store changed before a sync"
    except BaseException:
        sync.abort()
        raise
    return var, opt, sync


def test_a_custom_loop_with_local_steps_and_a_checkpoint_that_syncs_first(tmp_path):
    """A custom loop (tf.function step traced after start()): a checkpoint
    saved between syncs holds every step's updates, because the save syncs
    first; without that it would hold the initial rows."""
    var, opt, sync = three_local_steps("semi_loop")
    try:
        pending = {v.name: dict(zip(k.tolist(), d.tolist())) for v, k, d, _ in sync.pending()}
        assert pending == {"semi_loop": {1: [-1.5] * 3, 2: [-3.0] * 3}}
        manager = tfde.saving.CheckpointManager(str(tmp_path), variables=[var], optimizer=opt)
        manager.save(3)
        assert all(len(k) == 0 for _, k, _, _ in sync.pending())
    finally:
        sync.stop()
    np.testing.assert_allclose(var.lookup([1, 2]).numpy(), [[-1.5] * 3, [-3.0] * 3])
    fresh = tfde.Variable("semi_loop", dim=3, initializer=0.0)
    tfde.saving.CheckpointManager(str(tmp_path), variables=[fresh]).restore()
    np.testing.assert_allclose(fresh.lookup([1, 2]).numpy(), [[-1.5] * 3, [-3.0] * 3])


class Lookups(tf.Module):
    """A callable tf.Module serving one Variable's rows."""

    def __init__(self, var):
        super().__init__()
        self.table = var

    def __call__(self, ids, training=False):
        return tfde.embedding_lookup(self.table, ids)


@pytest.mark.parametrize("export", ["tf.train.Checkpoint", "export_for_serving", "export_changes"])
def test_a_plain_checkpoint_or_export_between_syncs_of_a_process_alone_syncs_first(tmp_path, export):
    """tf.train.Checkpoint.save, export_for_serving and export_changes read
    the stores: a process training alone syncs before them, so they hold
    every local step (in a job they are refused instead: a sync is a
    collective, and an export may run on one worker only)."""
    var, _, sync = three_local_steps(f"semi_export_{export.replace('.', '_')}", track_changes=True)
    try:
        if export == "tf.train.Checkpoint":
            tf.train.Checkpoint(table=var).save(str(tmp_path / "ckpt"))
        elif export == "export_for_serving":
            tfde.saving.export_for_serving(Lookups(var), str(tmp_path / "served"), tf.TensorSpec([None], tf.int64))
        else:
            summary = tfde.saving.export_changes([var], 0, str(tmp_path / "changes"))
            assert summary["variables"][0]["changed"] == 2, summary
        assert not sync._dirty()
        np.testing.assert_allclose(var.lookup([1, 2]).numpy(), [[-1.5] * 3, [-3.0] * 3])
    finally:
        sync.stop()


@pytest.mark.keras
def test_validation_during_fit_reads_synced_rows():
    """every=1000 never syncs during the 6 steps of an epoch, but the
    validation at the epoch's end syncs first: it scores the trained rows,
    as exact training's validation does."""
    x, y = data()
    losses = []
    for callbacks in ([], [tfde.keras.callbacks.PeriodicSync(1000)]):
        model = Model()
        model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.5)), loss="mse")
        history = model.fit(
            x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, validation_data=(x, y), callbacks=callbacks
        )
        losses.append(history.history["val_loss"][0])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_a_step_traced_during_local_steps_fails_once_they_stop_and_a_restart_works():
    """A custom loop's step traced between start() and stop() would train
    local tables nobody syncs if run afterwards: it fails, naming the fix.
    The same PeriodicSync started again syncs into the store."""
    var = tfde.Variable("semi_restart", dim=2, initializer=0.0)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(1.0))
    sync = tfde.semi_sync.PeriodicSync(2, [var], opt)
    for round_ in range(2):
        sync.start()
        step = sgd_step(var, opt)
        for _ in range(3):
            step(tf.constant([7], tf.int64))
            sync.after_step()
        sync.stop()
        np.testing.assert_allclose(var.lookup([7]).numpy(), [[-3.0 * (round_ + 1)] * 2])
        with pytest.raises(tf.errors.InvalidArgumentError, match="trace it again"):
            step(tf.constant([7], tf.int64))
        assert not tfde.semi_sync.local_steps_on()


def test_a_write_to_the_store_between_syncs_replaces_the_local_rows():
    var = tfde.Variable("semi_write", dim=2, initializer=0.0)
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(1.0))
    sync = tfde.semi_sync.PeriodicSync(100, [var], opt)
    sync.start()
    step = sgd_step(var, opt)
    try:
        step(tf.constant([1, 2], tf.int64))
        sync.after_step()
        var.upsert([1], [[5.0, 5.0]])  # key 1's local training is dropped; key 2's stays
        step(tf.constant([1, 2], tf.int64))
        sync.after_step()
    finally:
        sync.stop()
    np.testing.assert_allclose(var.lookup([1, 2]).numpy(), [[4.0, 4.0], [-2.0, -2.0]])


class FirstOfTwo(tfde.exchange.Exchange):
    """Worker 0 of a job of 2, as far as what runs before a training step
    goes (start() makes its copies through sum_everywhere: with one process,
    its own keys)."""

    size = 2


@pytest.fixture
def in_a_job():
    tfde.exchange.install(FirstOfTwo())
    try:
        yield
    finally:
        tfde.semi_sync.abort()
        tfde.exchange.install(None)


def test_copies_refuse_an_admission_filter_and_writes_between_syncs(in_a_job):
    opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.SGD(0.1))
    admits = tfde.Variable("copies_admits", dim=2, admission_filter=tfde.CounterFilter(2))
    with pytest.raises(ConfigError, match="admission filter CounterFilter decides per worker"):
        tfde.semi_sync.PeriodicSync(4, [admits], opt, replicate=True).start()
    assert not tfde.semi_sync.local_steps_on()
    with pytest.raises(ConfigError, match="replicate must be True or False, got 'yes'"):
        tfde.semi_sync.PeriodicSync(4, [admits], opt, replicate="yes")
    with pytest.raises(ConfigError, match="replicate must be True or False"):
        tfde.keras.callbacks.PeriodicSync(4, replicate=1)
    for make in (
        lambda **kw: tfde.semi_sync.PeriodicSync(4, [admits], opt, **kw),
        lambda **kw: tfde.keras.callbacks.PeriodicSync(4, **kw),
    ):
        with pytest.raises(ConfigError, match=r"slots=\"local\" keeps .* pass replicate=True too"):
            make(slots="local")
        with pytest.raises(ConfigError, match=r"slots must be one of \('merged', 'local'\), got 'mean'"):
            make(replicate=True, slots="mean")

    var = tfde.Variable("copies_writes", dim=2, initializer=0.0)
    var.upsert(tf.constant([2, 4], tf.int64), tf.ones([2, 2]))  # worker 0 owns 4 of them: hashed
    sync = tfde.semi_sync.PeriodicSync(4, [var], opt, replicate=True)
    sync.start()
    copied = {int(k) for k in var._local.base.export_chunk(0, 100)[0].numpy()}
    owned = tfde.exchange.owner(tf.constant([2, 4], tf.int64), 2).numpy() == 0
    assert copied == {k for k, mine in zip([2, 4], owned) if mine}  # its own keys, the only ones it has
    for write in (
        lambda: var.upsert(tf.constant([3], tf.int64), tf.ones([1, 2])),
        lambda: var.accum(tf.constant([2], tf.int64), tf.ones([1, 2])),
        lambda: var.remove(tf.constant([2], tf.int64)),
    ):
        with pytest.raises(ConfigError, match="other workers' copies would not see the write"):
            write()
    sync.abort()
    np.testing.assert_array_equal(var.lookup(tf.constant([2, 4, 3], tf.int64)).numpy(), [[1, 1], [1, 1], [0, 0]])
    var.upsert(tf.constant([3], tf.int64), tf.ones([1, 2]))  # after the local steps: a plain write
