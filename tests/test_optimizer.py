"""DynamicEmbeddingOptimizer: for every supported optimizer, 20 training
steps of a tfde embedding give the same touched rows (rtol 1e-5, atol 2e-5)
as a float64 numpy implementation of that optimizer's lazy update; and, as a
reference written by others, the same rows as Keras's own optimizer on a
dense table when every row is in every batch (a deliberate error in
tfde/optimizer_rules.py's amsgrad fails that test)."""

import math

import numpy as np
import pytest
import tensorflow as tf

import tfde

pytestmark = pytest.mark.keras
K = tf.keras.optimizers
STEPS, DIM, VOCAB, BATCH = 20, 4, 15, 8


# ------------------------------------------------------------- numpy reference


def np_update(kind, cfg, w, g, s, lr, t):
    """One lazy step on touched rows, float64; s: dict of slot arrays (in place)."""
    if kind == "SGD":
        mom = cfg.get("momentum", 0.0)
        if mom == 0.0:
            return w - lr * g
        s["momentum"] = mom * s["momentum"] - lr * g
        return w + mom * s["momentum"] - lr * g if cfg.get("nesterov") else w + s["momentum"]
    if kind == "Adagrad":
        s["accumulator"] = s["accumulator"] + g * g
        return w - lr * g / np.sqrt(s["accumulator"] + cfg.get("epsilon", 1e-7))
    if kind in ("Adam", "AdamW"):
        b1, b2, eps = cfg.get("beta_1", 0.9), cfg.get("beta_2", 0.999), cfg.get("epsilon", 1e-7)
        if kind == "AdamW":
            w = w - w * cfg.get("weight_decay", 0.004) * lr
        s["m"] = s["m"] + (g - s["m"]) * (1 - b1)
        s["v"] = s["v"] + (g * g - s["v"]) * (1 - b2)
        v = s["v"]
        if cfg.get("amsgrad"):
            s["vhat"] = np.maximum(s["vhat"], s["v"])
            v = s["vhat"]
        alpha = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        return w - s["m"] * alpha / (np.sqrt(v) + eps)
    if kind == "RMSprop":
        rho, eps, mom = cfg.get("rho", 0.9), cfg.get("epsilon", 1e-7), cfg.get("momentum", 0.0)
        s["velocity"] = rho * s["velocity"] + (1 - rho) * g * g
        if cfg.get("centered"):
            s["average_gradient"] = rho * s["average_gradient"] + (1 - rho) * g
            denom = s["velocity"] - s["average_gradient"] ** 2 + eps
        else:
            denom = s["velocity"] + eps
        inc = lr * g / np.sqrt(denom)
        if mom > 0:
            s["momentum"] = mom * s["momentum"] + inc
            return w - s["momentum"]
        return w - inc
    if kind == "Ftrl":
        p = cfg.get("learning_rate_power", -0.5)
        l1, l2 = cfg.get("l1_regularization_strength", 0.0), cfg.get("l2_regularization_strength", 0.0)
        l2 = l2 + cfg.get("beta", 0.0) / (2 * lr)
        shrink = cfg.get("l2_shrinkage_regularization_strength", 0.0)
        acc = s["accumulator"]
        new_acc = acc + g * g
        s["linear"] = s["linear"] + (g + 2 * shrink * w) - (new_acc**-p - acc**-p) / lr * w
        quad = new_acc**-p / lr + 2 * l2
        s["accumulator"] = new_acc
        return (np.clip(s["linear"], -l1, l1) - s["linear"]) / quad
    raise AssertionError(kind)


def initial_slots(kind, cfg):
    zero = {
        "SGD": ["momentum"],
        "Adam": ["m", "v", "vhat"],
        "AdamW": ["m", "v", "vhat"],
        "RMSprop": ["velocity", "momentum", "average_gradient"],
        "Adagrad": [],
        "Ftrl": ["linear"],
    }[kind]
    out = {n: 0.0 for n in zero}
    if kind in ("Adagrad", "Ftrl"):
        out["accumulator"] = cfg.get("initial_accumulator_value", 0.1)
    return out


CASES = [
    ("SGD", {"learning_rate": 0.1}),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ("Adagrad", {"learning_rate": 0.1}),
    ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.5, "epsilon": 1e-5}),
    ("Adam", {"learning_rate": 0.01}),
    ("Adam", {"learning_rate": 0.01, "amsgrad": True, "beta_1": 0.8}),
    ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1}),
    ("RMSprop", {"learning_rate": 0.01}),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.5, "centered": True}),
    ("Ftrl", {"learning_rate": 0.1}),
    (
        "Ftrl",
        {
            "learning_rate": 0.1,
            "l1_regularization_strength": 0.01,
            "l2_regularization_strength": 0.02,
            "beta": 0.1,
            "l2_shrinkage_regularization_strength": 0.01,
        },
    ),
]


def schedule_lr(step):  # ExponentialDecay(0.05, decay_steps=5, decay_rate=0.5)
    return 0.05 * 0.5 ** (step / 5)


def run_tfde(opt, graph: bool, clip=None):
    var = tfde.Variable("opt", dim=DIM, initializer=tf.keras.initializers.RandomUniform(-1, 1, seed=1))
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, VOCAB, BATCH), rng.standard_normal((BATCH, DIM))) for _ in range(STEPS)]
    initial = var.lookup(tf.range(VOCAB, dtype=tf.int64)).numpy().astype(np.float64)

    def step(ids, c):
        with tf.GradientTape() as tape:
            emb = tfde.embedding_lookup(var, ids, training=True)
            loss = tf.reduce_sum(emb * c)
        grads = tape.gradient(loss, [var.step_buffer])
        opt.apply_gradients(zip(grads, [var.step_buffer]))

    fn = tf.function(step) if graph else step
    for ids, c in batches:
        fn(tf.constant(ids, tf.int64), tf.constant(c, tf.float32))
    return var, batches, initial


def run_numpy(kind, cfg, batches, initial, lr_of_step=None, clipnorm=None):
    rows = {k: initial[k].copy() for k in range(VOCAB)}
    slots = {}
    for t, (ids, c) in enumerate(batches):
        g_by_key = {}
        for k, row in zip(ids, c):
            g_by_key[int(k)] = g_by_key.get(int(k), 0.0) + row
        keys = sorted(g_by_key)
        g = np.stack([g_by_key[k] for k in keys])
        if clipnorm is not None:
            norm = np.linalg.norm(g)
            g = g * min(1.0, clipnorm / norm)
        lr = lr_of_step(t) if lr_of_step else cfg["learning_rate"]
        for i, k in enumerate(keys):
            s = slots.setdefault(k, {n: np.full(DIM, v) for n, v in initial_slots(kind, cfg).items()})
            rows[k] = np_update(kind, cfg, rows[k], g[i], s, lr, t + 1)
    return rows


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("kind,cfg", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_lazy_update_matches_numpy(kind, cfg, graph):
    opt = tfde.DynamicEmbeddingOptimizer(getattr(K, kind)(**cfg))
    var, batches, initial = run_tfde(opt, graph)
    want = run_numpy(kind, cfg, batches, initial)
    touched = sorted({int(k) for ids, _ in batches for k in ids})
    got = var.lookup(tf.constant(touched, tf.int64)).numpy()
    np.testing.assert_allclose(got, np.stack([want[k] for k in touched]), rtol=1e-5, atol=2e-5)
    assert int(var.size()) == len(touched)
    for slot in var.slots.values():  # slots hold exactly the touched keys
        assert sorted(np.concatenate([k.numpy() for k, _ in slot.export()]).tolist()) == touched
    assert int(opt.iterations) == STEPS


def test_learning_rate_schedule_is_honoured():
    opt = tfde.DynamicEmbeddingOptimizer(K.SGD(K.schedules.ExponentialDecay(0.05, 5, 0.5)))
    var, batches, initial = run_tfde(opt, graph=True)
    want = run_numpy("SGD", {}, batches, initial, lr_of_step=schedule_lr)
    touched = sorted(want)
    got = var.lookup(tf.constant(touched, tf.int64)).numpy()
    np.testing.assert_allclose(got, np.stack([want[k] for k in touched]), rtol=1e-5, atol=2e-5)


def test_clipnorm_is_honoured():
    opt = tfde.DynamicEmbeddingOptimizer(K.SGD(0.1, clipnorm=0.5))
    var, batches, initial = run_tfde(opt, graph=False)
    want = run_numpy("SGD", {"learning_rate": 0.1}, batches, initial, clipnorm=0.5)
    got = var.lookup(tf.range(VOCAB, dtype=tf.int64)).numpy()
    np.testing.assert_allclose(got, np.stack([want[k] for k in range(VOCAB)]), rtol=1e-5, atol=2e-5)


def test_unsupported_optimizer_lists_the_supported_ones():
    with pytest.raises(tfde.UnsupportedOptimizerError, match="SGD, Adagrad, Adam, AdamW, RMSprop, Ftrl"):
        tfde.DynamicEmbeddingOptimizer(K.Nadam())


def test_wrapping_keeps_the_optimizer_object():
    adam = K.Adam(0.02)
    opt = tfde.DynamicEmbeddingOptimizer(adam)
    assert opt is adam and isinstance(opt, K.Adam) and tfde.DynamicEmbeddingOptimizer(opt) is opt
    assert float(opt.learning_rate) == pytest.approx(0.02)


def test_nan_gradients_leave_their_rows_untouched():
    var = tfde.Variable("nan", dim=2, initializer=1.0)
    opt = tfde.DynamicEmbeddingOptimizer(K.Adam(0.1))
    with tf.GradientTape() as tape:
        emb = tfde.embedding_lookup(var, tf.constant([1, 2], tf.int64), training=True)
        loss = tf.reduce_sum(emb * tf.constant([[float("nan"), 1.0], [1.0, 1.0]]))
    opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))
    rows = var.lookup(tf.constant([1, 2], tf.int64)).numpy()
    assert np.all(np.isfinite(rows)) and rows[0].tolist() == [1.0, 1.0] and np.all(rows[1] < 1.0)
    assert int(var.size()) == 1 and all(int(s.size()) == 1 for s in var.slots.values())


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("kind", ["SGD", "Adam"])  # Adam: the fused kernel; SGD with momentum 0.5: Python rule
@pytest.mark.parametrize("wrong", ["rows", "indices", "values"])
def test_a_gradient_that_does_not_fit_the_step_changes_nothing_and_the_right_one_still_applies(kind, wrong, graph):
    # It failed inside the native apply ("indices[2] = 2 is outside the 2 keys") after the step buffer was
    # emptied, so the right gradients then failed too: the step's lookups were lost.
    var = tfde.Variable(f"fit-{kind}-{wrong}-{graph}", dim=2, initializer=1.0)
    opt = tfde.DynamicEmbeddingOptimizer(K.SGD(0.5, momentum=0.5) if kind == "SGD" else K.Adam(0.5))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tfde.embedding_lookup(var, tf.constant([1, 2], tf.int64), training=True))
    (right,) = tape.gradient(loss, [var.step_buffer])

    def bad():  # made where it is applied: a tf.function cannot take an IndexedSlices of mismatched parts
        return {
            "rows": lambda: tf.ones([5, 2]),
            "indices": lambda: tf.IndexedSlices(tf.ones([2, 2]), tf.constant([0, 7]), tf.constant([2, 2])),
            "values": lambda: tf.IndexedSlices(tf.ones([3, 2]), tf.constant([0, 1]), tf.constant([2, 2])),
        }[wrong]()

    def run(step):
        return tf.function(step)() if graph else step()

    error = tf.errors.InvalidArgumentError if graph else tfde.ShapeError
    with pytest.raises(error, match="step buffer has .* the keys this step looked up"):
        run(lambda: opt.apply_gradients([(bad(), var.step_buffer)]))
    assert int(var.size()) == 0 and int(var._step_size()) == 2
    run(lambda: opt.apply_gradients([(right, var.step_buffer)]))
    rows = var.lookup(tf.constant([1, 2], tf.int64)).numpy()
    np.testing.assert_allclose(rows, [[0.5, 0.5]] * 2, rtol=1e-5)  # one step of 0.5 (Adam's first: lr * sign)


def test_same_variable_twice_in_one_step_applies_both_gradients():
    var = tfde.Variable("twice", dim=2, initializer=0.0)
    opt = tfde.DynamicEmbeddingOptimizer(K.SGD(1.0))
    with tf.GradientTape() as tape:
        a = tfde.embedding_lookup(var, tf.constant([1, 2], tf.int64), training=True)
        b = tfde.embedding_lookup(var, tf.constant([2, 3], tf.int64), training=True)
        loss = tf.reduce_sum(a * tf.constant([1.0, 1.0])) + tf.reduce_sum(b * tf.constant([10.0, 10.0]))
    opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))
    rows = var.lookup(tf.constant([1, 2, 3], tf.int64)).numpy()
    assert rows.tolist() == [[-1.0, -1.0], [-11.0, -11.0], [-10.0, -10.0]]


def test_model_without_dense_weights_still_counts_iterations():
    var = tfde.Variable("only", dim=2)
    opt = tfde.DynamicEmbeddingOptimizer(K.Adam(0.1))
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tfde.embedding_lookup(var, tf.constant([1], tf.int64), training=True))
        opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))
    assert int(opt.iterations) == 3


# ------------------------------------------- clipping with a non-finite row (issue 15, point 3)

CLIP_IDS = [1, 2, 3, 4, 2, 5]  # key 2 twice: its gradients add up
NAN_KEY = 3


def clip_step(kind, clip_arg, clip, graph, dense_grad=(0.3, -0.4)):
    """One training step of a dim-3 embedding (plus one dense weight [2])
    whose gradient row of NAN_KEY holds a NaN.  Returns (rows before, rows
    after, dense weight after, the Variable)."""
    cfg = {"learning_rate": 0.1 if kind == "SGD" else 0.01, clip_arg: clip}
    opt = tfde.DynamicEmbeddingOptimizer(getattr(K, kind)(**cfg))
    var = tfde.Variable(
        f"clip_{kind}_{clip_arg}_{graph}", dim=3, initializer=tf.keras.initializers.RandomUniform(-1, 1, seed=3)
    )
    w = tf.Variable([1.0, 2.0])
    coeff = np.arange(1.0, 1.0 + 3 * len(CLIP_IDS)).reshape(-1, 3) / 10.0
    coeff[CLIP_IDS.index(NAN_KEY), 1] = np.nan
    ids = tf.constant(CLIP_IDS, tf.int64)
    keys = sorted(set(CLIP_IDS))
    before = var.lookup(tf.constant(keys, tf.int64)).numpy().astype(np.float64)

    def step():
        with tf.GradientTape() as tape:
            emb = tfde.embedding_lookup(var, ids, training=True)
            loss = tf.reduce_sum(emb * tf.constant(coeff, tf.float32)) + tf.reduce_sum(w * tf.constant(dense_grad))
        grads = tape.gradient(loss, [var.step_buffer, w])
        opt.apply_gradients(zip(grads, [var.step_buffer, w]))

    (tf.function(step) if graph else step)()
    after = var.lookup(tf.constant(keys, tf.int64)).numpy().astype(np.float64)
    return cfg, coeff, before, after, w.numpy().astype(np.float64), var


def reference_clipped(coeff, clip_arg, clip, dense_grad):
    """numpy: per-key summed gradients, clipped over the finite rows only;
    (keys, their gradient or None for the non-finite one, dense gradient)."""
    summed = {}
    for k, row in zip(CLIP_IDS, coeff):
        summed[k] = summed.get(k, 0.0) + row
    finite = {k: g for k, g in summed.items() if np.all(np.isfinite(g))}
    sq = sum(float(np.sum(g * g)) for g in finite.values())
    d = np.asarray(dense_grad, np.float64)
    if clip_arg == "clipnorm":
        scale, dense_scale = min(1.0, clip / math.sqrt(sq)), None
    else:
        dense_sq = float(np.sum(d * d))
        finite_dense_sq = dense_sq if math.isfinite(dense_sq) else 0.0
        scale = min(1.0, clip / math.sqrt(sq + finite_dense_sq))
        dense_scale = scale if math.isfinite(dense_sq) else float("nan")  # one global norm when all is finite
    grads = {k: (finite[k] * scale if k in finite else None) for k in summed}
    return grads, (d if dense_scale is None else d * dense_scale)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("clip_arg,clip", [("clipnorm", 0.5), ("global_clipnorm", 0.7)])
@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_one_nan_row_skips_only_that_row_under_clipping(kind, clip_arg, clip, graph):
    dense_grad = (0.3, -0.4)
    cfg, coeff, before, after, w, var = clip_step(kind, clip_arg, clip, graph, dense_grad)
    grads, dense = reference_clipped(coeff, clip_arg, clip, dense_grad)
    keys = sorted(grads)
    for i, k in enumerate(keys):
        if grads[k] is None:  # the NaN row: unchanged, and no slot written for it
            np.testing.assert_array_equal(after[i], before[i])
            continue
        slots = {n: np.full(3, v) for n, v in initial_slots(kind, cfg).items()}
        np.testing.assert_allclose(
            after[i],
            np_update(kind, cfg, before[i], grads[k], slots, cfg["learning_rate"], 1),
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"key {k}",
        )
    assert int(var.size()) == len(keys) - 1
    for slot in var.slots.values():
        assert sorted(np.concatenate([k.numpy() for k, _ in slot.export()]).tolist()) == [
            k for k in keys if k != NAN_KEY
        ]
    dense_slots = {n: np.full(2, v) for n, v in initial_slots(kind, cfg).items()}
    np.testing.assert_allclose(
        w, np_update(kind, cfg, np.array([1.0, 2.0]), dense, dense_slots, cfg["learning_rate"], 1), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_global_clipnorm_with_a_nan_dense_gradient_clips_rows_over_the_finite_part(kind):
    # The dense part does what Keras does with a NaN gradient under
    # global_clipnorm (its weights become NaN); the rows are clipped by the
    # norm of the finite gradients, and still trained.
    dense_grad = (float("nan"), 1.0)
    cfg, coeff, before, after, w, _ = clip_step(kind, "global_clipnorm", 0.7, False, dense_grad)
    grads, _ = reference_clipped(coeff, "global_clipnorm", 0.7, dense_grad)
    for i, k in enumerate(sorted(grads)):
        if grads[k] is None:
            np.testing.assert_array_equal(after[i], before[i])
            continue
        slots = {n: np.full(3, v) for n, v in initial_slots(kind, cfg).items()}
        np.testing.assert_allclose(
            after[i],
            np_update(kind, cfg, before[i], grads[k], slots, cfg["learning_rate"], 1),
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"key {k}",
        )
    plain = tf.Variable([1.0, 2.0])
    getattr(K, kind)(**cfg).apply_gradients([(tf.constant(dense_grad), plain)])
    np.testing.assert_array_equal(w, plain.numpy())


# ------------------------------------------- an independent reference: Keras

ALL_TOUCHED_STEPS = 12


@pytest.mark.parametrize("kind,cfg", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_rows_touched_every_step_train_as_keras_trains_a_dense_table(kind, cfg):
    """The reference is not tfde's formulas (nor the numpy ones above, which
    were written beside them): Keras's own optimizer, of the same class and
    config, on a dense tf.Variable holding the same initial rows.  Every row
    of the vocabulary is in every batch (some twice), so the lazy update and
    the dense one are the same update."""
    var = tfde.Variable("keras-ref", dim=DIM, initializer=tf.keras.initializers.RandomUniform(-1, 1, seed=3))
    initial = var.lookup(tf.range(VOCAB, dtype=tf.int64)).numpy()
    dense = tf.Variable(initial)
    mine = tfde.DynamicEmbeddingOptimizer(getattr(K, kind)(**cfg))
    keras_opt = getattr(K, kind)(**cfg)
    rng = np.random.default_rng(7)
    for _ in range(ALL_TOUCHED_STEPS):
        ids = np.concatenate([rng.permutation(VOCAB), rng.integers(0, VOCAB, 5)])
        c = tf.constant(rng.standard_normal((len(ids), DIM)), tf.float32)
        ids = tf.constant(ids, tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tfde.embedding_lookup(var, ids, training=True) * c)
        mine.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(dense, ids) * c)
        keras_opt.apply_gradients([(tf.convert_to_tensor(tape.gradient(loss, dense)), dense)])
    got = var.lookup(tf.range(VOCAB, dtype=tf.int64)).numpy()
    assert np.abs(got - initial).max() > 1e-3  # the rows moved
    np.testing.assert_allclose(got, dense.numpy(), rtol=1e-5, atol=2e-6)
