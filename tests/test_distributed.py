"""Synchronous training over real worker processes on loopback
(MultiWorkerMirroredStrategy, TF_CONFIG), checked against one worker trained
on the combined batches; tolerance and method: tests/distributed_check.py.
Horovod's tests are in tests/horovod/ (they run in the Horovod environment)."""

import os
import re
import time

import numpy as np
import pytest
from distributed_check import (
    JobFailed,
    check_equal,
    check_plan,
    check_plans_like_one_worker,
    check_restores_into_other_worker_counts,
    check_sharded,
    redis_tag,
    run_job,
    run_one_and_two,
    start_job,
)

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"


@pytest.fixture
def tag():
    with redis_tag() as t:
        yield t


# model.fit under MultiWorkerMirroredStrategy works with tf-keras only (Keras
# 3.15 fails inside Keras even for a plain Dense model, see docs/distributed.md); the
# custom loop works with both.
CASES = (
    ([("fit", opt, layout) for opt in ("sgd", "adam") for layout in ("cuckoo", "redis")] + [("loop", "adam", "cuckoo")])
    if LEGACY
    else [("loop", opt, layout) for opt in ("sgd", "adam") for layout in ("cuckoo", "redis")]
)


@pytest.mark.keras
@pytest.mark.parametrize("engine,optimizer,layout", CASES)
def test_two_workers_equal_one_worker_on_the_combined_batch(tmp_path, tag, engine, optimizer, layout):
    one, two = run_one_and_two(tmp_path, engine, optimizer, layout, tag)
    check_equal(one, two)
    expected = {"user_emb", "item_emb"} | (
        {"user_emb/m", "user_emb/v", "item_emb/m", "item_emb/v"} if optimizer == "adam" else set()
    )
    assert set(one[0]) == expected
    if layout == "cuckoo":
        check_sharded(tmp_path, 2)


def test_a_killed_worker_makes_the_others_fail_not_hang(tmp_path, tag):
    """Worker 1 dies (SIGKILL) after step 3 of a long job; worker 0 must stop
    with TF's error naming the unhealthy task well within the collective
    timeout set in the job (20 s) rather than wait forever."""
    start = time.monotonic()
    with pytest.raises(JobFailed) as failed:
        run_job(
            tmp_path,
            2,
            "loop",
            "sgd",
            "cuckoo",
            tag,
            extra={"repeat": 50, "die_worker": 1, "die_after_step": 3, "timeout_s": 20},
        )
    elapsed = time.monotonic() - start
    out = failed.value.output
    assert str(failed.value).startswith("worker 0 of 2 failed"), str(failed.value)[:300]
    assert elapsed < 120, f"took {elapsed:.0f} s"
    assert re.search(r"unhealthy|crashed|Unavailable|DeadlineExceeded", out), out[-3000:]


# On Redis one layer has no admission filter: its policy's state is written
# by the fused step (TfdeRedisApply), the other's by the Python path.
RESTRICT_CASES = (
    [("fit", "adam", "cuckoo", "counter"), ("fit", "sgd", "redis", {"user_emb": "probability"})]
    if LEGACY
    else [("loop", "sgd", "cuckoo", "probability"), ("loop", "adam", "redis", {"item_emb": "counter"})]
)


@pytest.mark.keras
@pytest.mark.parametrize("engine,optimizer,layout,admission", RESTRICT_CASES, ids=str)
def test_restriction_and_admission_decide_as_one_worker(tmp_path, tag, engine, optimizer, layout, admission):
    """Frequency restriction to 15 keys every 2 steps (AutoRestrictor in the
    loop, RestrictCallback in fit) and an admission filter (CounterFilter(2)
    or ProbabilityFilter(0.5); on Redis on one layer only, so the other one's
    counts come from the fused step), while training: both workers together keep
    exactly the keys one worker keeps, and train on to the same rows, slots
    and policy state."""
    extra = {"restrict": 15, "admission": admission}
    one, two = run_one_and_two(tmp_path, engine, optimizer, layout, tag, extra)
    check_equal(one, two)
    tables = one[0]
    assert "user_emb/policy-frequency" in tables and "item_emb/policy-frequency" in tables, sorted(tables)
    for name in ("user_emb", "item_emb"):
        assert 10 <= len(tables[name]) < 40, (name, len(tables[name]))  # unrestricted: ~60 and ~90


@pytest.mark.keras
def test_mirrored_strategy_on_one_cpu_trains_like_no_strategy():
    """MirroredStrategy on this process's CPU (one replica): model.fit trains
    exactly as without a strategy."""
    import numpy as np
    import tensorflow as tf

    import tfde

    rng = np.random.default_rng(3)
    x = rng.integers(0, 50, size=256).astype(np.int64)
    y = rng.random(256).astype(np.float32)

    def train(strategy):
        with strategy.scope():
            model = tf.keras.Sequential(
                [
                    tf.keras.Input(shape=(), dtype=tf.int64),
                    tfde.keras.layers.Embedding(4, key_dtype=tf.int64, initializer=0.1, name="emb"),
                    tf.keras.layers.Dense(1, kernel_initializer="ones"),
                ]
            )
            model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05)), loss="mse")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=2, verbose=0)
        var = model.layers[0].params
        keys = np.arange(50, dtype=np.int64)
        return var.lookup(tf.constant(keys)).numpy(), int(var.size())

    rows, size = train(tf.distribute.MirroredStrategy(["/cpu:0"]))
    expected_rows, expected_size = train(tf.distribute.get_strategy())
    assert size == expected_size == len(np.unique(x))
    np.testing.assert_allclose(rows, expected_rows, rtol=1e-6, atol=1e-7)


RESHARD_CASES = (
    [("fit", "adam", "cuckoo"), ("fit", "sgd", "redis")]
    if LEGACY
    else [("loop", "adam", "cuckoo"), ("loop", "sgd", "redis")]
)


@pytest.mark.keras
@pytest.mark.parametrize("engine,optimizer,layout", RESHARD_CASES)
def test_a_checkpoint_of_n_workers_restores_into_m(tmp_path, tag, engine, optimizer, layout):
    """tfde.saving.CheckpointManager: 1 and 2 workers train and save (each
    worker writes its own files); then 1 -> 1 (the reference), 2 -> 1 and
    1 -> 2 workers restore and train on: the same rows, slots and dense
    weights, so every key reached its new owner with its optimizer state."""

    def job(workers, name, **extra):
        # Redis: table_store_mode 0, rows in the checkpoints (mode 2 keeps
        # Redis as the source of truth, with nothing to restore); a tag per
        # job, since the jobs of one phase run at once.
        redis_config = {"model_tag_runtime": f"{tag}-{name}", "table_store_mode": 0}
        return start_job(
            tmp_path,
            workers,
            engine,
            optimizer,
            layout,
            tag,
            extra={"out": str(tmp_path / name), "redis": redis_config, **extra},
        )

    check_restores_into_other_worker_counts(tmp_path, job)
    if layout == "cuckoo":
        check_sharded(tmp_path, 2, prefix="one_to_two")


@pytest.mark.keras
def test_a_model_compiled_without_the_tfde_optimizer_gets_an_error_naming_it(tmp_path, tag):
    """The mistake of TFRA's MWMS two-tower program (model.compile() without
    the optimizer it built): the first step fails on every worker naming
    tfde.DynamicEmbeddingOptimizer, not TFRA #365's colocate_vars_with error."""
    engine = "fit" if LEGACY else "loop"
    with pytest.raises(JobFailed) as failed:
        run_job(tmp_path, 2, engine, "adam", "cuckoo", tag, extra={"plain_optimizer": True, "timeout_s": 60})
    out = failed.value.output
    assert "not wrapped by tfde.DynamicEmbeddingOptimizer" in out, out[-3000:]
    assert "colocate_vars_with" not in out


@pytest.mark.parametrize("layout", ["cuckoo", "redis"])
def test_a_read_in_a_tf_data_function_sees_every_workers_keys(tmp_path, tag, layout):
    """Under MultiWorkerMirroredStrategy a tf.data function (as a tfrs
    metric's candidates.map(item_model)), iterated by every worker: with a
    shared store (Redis) it reads the store; with each worker's own tables
    it reads through the strategy's collectives and returns the owner's row
    of every key, not the initial rows of the keys the other worker owns."""
    engine = "fit" if LEGACY else "loop"
    tables, dense = run_job(tmp_path, 2, engine, "sgd", layout, tag, extra={"tfdata_read": True})
    stored = [(i, k) for i, k in enumerate(dense["dense/tfdata_ids"].tolist()) if k in tables["item_emb"]]
    assert len(stored) >= 10
    for i, k in stored:
        np.testing.assert_array_equal(dense["dense/tfdata_rows"][i], tables["item_emb"][k])
    if layout == "cuckoo":  # keys of both workers were read
        held = [set(np.load(tmp_path / f"out2-w{w}.npz")["item_emb/keys"].tolist()) for w in range(2)]
        assert all(any(k in keys for _, k in stored) for keys in held)


def test_a_read_in_a_tf_data_function_that_one_worker_runs_more_often_fails(tmp_path, tag):
    """Each worker's own tables: a tf.data read that worker 1 runs once more
    than worker 0 waits for a partner that never comes; with the strategy's
    collective timeout it fails instead of hanging."""
    engine = "fit" if LEGACY else "loop"
    with pytest.raises(JobFailed) as failed:
        run_job(tmp_path, 2, engine, "sgd", "cuckoo", tag, extra={"tfdata_read": "unequal", "timeout_s": 20})
    assert re.search(r"[Tt]imeout|timed out|DeadlineExceeded|Collective ops is aborted", failed.value.every), (
        failed.value.every[-3000:]
    )


def test_an_eager_read_outside_strategy_run_sees_every_workers_keys(tmp_path, tag):
    """Each worker's own tables: an eager lookup outside strategy.run (every
    worker makes it, as when a Keras 3 custom loop builds its model on a
    first batch) goes through the exchange and returns the owner's rows."""
    engine = "fit" if LEGACY else "loop"
    tables, dense = run_job(tmp_path, 2, engine, "sgd", "cuckoo", tag, extra={"eager_read": True})
    stored = [(i, k) for i, k in enumerate(dense["dense/eager_ids"].tolist()) if k in tables["item_emb"]]
    assert len(stored) >= 10
    for i, k in stored:
        np.testing.assert_array_equal(dense["dense/eager_rows"][i], tables["item_emb"][k])


if LEGACY:  # tfrs needs tf-keras: defined in the tf-keras run of scripts/test.sh only

    @pytest.mark.keras
    def test_a_tfrs_model_trains_two_workers_like_one(tmp_path, tag):
        """tfrs.Model.train_step (tape.gradient, then apply_gradients) under
        MultiWorkerMirroredStrategy with model.fit: 2 workers equal 1 worker."""
        one, two = run_one_and_two(tmp_path, "fit", "adam", "redis", tag, {"model": "tfrs"})
        check_equal(one, two)

    @pytest.mark.keras
    @pytest.mark.parametrize("layout", ["cuckoo", "redis"])
    def test_a_factorized_top_k_metric_over_mapped_candidates_trains_two_workers_like_one(tmp_path, tag, layout):
        """The TFRA programs' metric as they write it,
        FactorizedTopK(candidates.map(item_model)), in a tfrs.Model under
        MultiWorkerMirroredStrategy and model.fit: 2 workers train like 1
        worker with the metric.  With each worker's own tables the metric's
        reads go through the strategy's collectives and see the owner's
        rows as of before the step's update, so its values equal 1 worker's
        too; with a shared store the metric reads the store as it is, which
        another worker may already have updated (docs/lookups.md)."""
        extra = {"model": "tfrs", "topk_metric": True}
        one, two = run_one_and_two(tmp_path, "fit", "adam", layout, tag, extra)
        metric_one, metric_two = one[1].pop("dense/topk"), two[1].pop("dense/topk")
        check_equal(one, two)
        assert metric_one[-1] > 0  # top-10 of ~200 candidates: some hits
        if layout == "cuckoo":
            np.testing.assert_allclose(metric_two, metric_one, rtol=1e-6)


# The many-feature layer: every plan, and column slices, under MWMS; with
# tf-keras through model.fit, with Keras 3 through the custom loop.
@pytest.mark.keras
def test_many_features_in_one_layer_train_two_workers_like_one(tmp_path, tag):
    """Every plan of PLAN_CASES and column slices (distributed_check.py)."""
    check_plans_like_one_worker(tmp_path, "fit" if LEGACY else "loop", tag)


def test_a_many_feature_checkpoint_restores_into_another_worker_count_and_plan(tmp_path, tag):
    """tfde.saving.CheckpointManager with the many-feature layer (column
    slices of threshold 3): 2 workers on the round_robin plan save; 1 worker
    (rows) and 2 workers on memory_balanced restore and train on exactly as
    the 1-worker reference does, so each table's keys reached the workers the
    new plan gives them, with their optimizer state.  Keras 3's custom loop
    (the Keras 3 run only: tf-keras fit saves through the same manager,
    test_a_checkpoint_of_n_workers_restores_into_m[fit-*])."""
    engine = "loop"

    placements = {"first1": "rows", "first2": "round_robin", "one_to_two": "memory_balanced"}

    def job(workers, name, **dirs):
        extra = {"model": "many", "placement": placements.get(name, "rows"), "column_slice_threshold": 3}
        return start_job(
            tmp_path, workers, engine, "adam", "cuckoo", tag, extra={**extra, "out": str(tmp_path / name), **dirs}
        )

    check_restores_into_other_worker_counts(tmp_path, job)
    check_plan(tmp_path, 2, "memory_balanced", prefix="one_to_two")
