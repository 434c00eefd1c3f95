"""Horovod: 2 workers started by horovodrun (gloo, loopback) against 1 worker
on the combined batches; tfde's all-to-all exchange with sharded cuckoo tables
and with shared Redis tables.  Method and tolerance: tests/distributed_check.py.

Runs in the Horovod environment (Horovod 0.28.1 builds against TF 2.16 only):
scripts/test.sh makes it and runs this directory with TF_USE_LEGACY_KERAS=1."""

import os
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import horovod.tensorflow.keras as hvd_keras  # noqa: E402  (a missing Horovod fails here, loudly)
import tensorflow as tf  # noqa: E402
from distributed_check import (  # noqa: E402
    JobFailed,
    check_equal,
    check_plans_like_one_worker,
    check_restores_into_other_worker_counts,
    check_sharded,
    redis_tag,
    run_job,
    run_one_and_two,
    start_job,
)
from test_keras import fit_refused  # noqa: E402

import tfde  # noqa: E402

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "Horovod's Keras support needs tf-keras: TF_USE_LEGACY_KERAS=1"


@pytest.fixture
def tag():
    with redis_tag() as t:
        yield t


@pytest.mark.parametrize(
    "optimizer,layout", [("sgd", "cuckoo"), ("adam", "cuckoo"), ("sgd", "redis"), ("adam", "redis")]
)
def test_two_horovod_workers_equal_one_worker(tmp_path, tag, optimizer, layout):
    one, two = run_one_and_two(tmp_path, "hvd", optimizer, layout, tag)
    check_equal(one, two)
    if layout == "cuckoo":
        check_sharded(tmp_path, 2)


@pytest.mark.parametrize(
    "model,wrap,optimizer,layout",
    [
        ("tfrs", True, "adam", "cuckoo"),  # docs/distributed.md's recipe with a tfrs.Model
        ("tfrs", False, "sgd", "redis"),  # TFRA programs' way: the tfde optimizer alone
        ("custom_step", True, "sgd", "cuckoo"),  # a train_step of one's own calling apply_gradients
    ],
)
def test_any_train_step_is_exact(tmp_path, tag, model, wrap, optimizer, layout):
    """tfrs.Model.train_step and custom steps call tape.gradient and
    apply_gradients, not minimize, so Horovod's DistributedOptimizer averages
    nothing: tfde averages the dense gradients and divides the rows' by the
    number of workers itself.  2 ranks equal 1 rank on the combined batch:
    rows, slots and dense weights (before, rows moved twice as far and the
    dense weights differed between ranks)."""
    extra = {"model": model, "hvd_wrap": wrap}
    one, two = run_one_and_two(tmp_path, "hvd", optimizer, layout, tag, extra)
    check_equal(one, two)


def test_many_features_in_one_layer_train_two_workers_like_one(tmp_path, tag):
    """The many-feature layer (tests/distributed_job.py, model "many") with
    model.fit and hvd.DistributedOptimizer(tfde.DynamicEmbeddingOptimizer(
    Adam)): every plan of PLAN_CASES, column slices too, routed through the
    all-to-all."""
    check_plans_like_one_worker(tmp_path, "hvd", tag)


@pytest.mark.parametrize("layout", ["cuckoo", "redis"])
def test_many_features_with_a_tfrs_style_train_step_are_exact(tmp_path, tag, layout):
    """The many-feature layer under a train_step calling tape.gradient and
    apply_gradients (as tfrs.Model's does): tfde averages what Horovod's
    optimizer does not."""
    extra = {"model": "many", "custom_step": True, "placement": "memory_balanced"}
    one, two = run_one_and_two(tmp_path, "hvd", "adam", layout, tag, extra)
    check_equal(one, two)


def test_wrapping_order_is_named_when_reversed():
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(0.01))
    with pytest.raises(
        tfde.UnsupportedOptimizerError, match=r"hvd.DistributedOptimizer\(tfde.DynamicEmbeddingOptimizer\(opt\)\)"
    ):
        tfde.DynamicEmbeddingOptimizer(opt)


def test_an_unwrapped_optimizer_is_told_the_horovod_wrapping():
    """A program that imported Horovod and compiled a plain optimizer hears
    both fixes: the tfde wrapper, and where Horovod's goes (the hint comes
    from tfde/distributed/horovod.py; the core names no engine)."""
    _, message = fit_refused(optimizer=tf.keras.optimizers.Adam(0.1))
    assert re.search(
        r"not wrapped by tfde.DynamicEmbeddingOptimizer.*hvd.DistributedOptimizer\(tfde.DynamicEmbeddingOptimizer",
        message,
    ), message


def test_bare_hvd_init_is_refused_with_the_fix(tmp_path, tag):
    with pytest.raises(JobFailed) as failed:
        run_job(tmp_path, 2, "hvd", "sgd", "cuckoo", tag, extra={"bare_hvd_init": True})
    assert "tfde.distributed.horovod.init()" in failed.value.output


def test_a_killed_worker_stops_the_job(tmp_path, tag):
    """Rank 1 dies (SIGKILL) after step 3 of a long job: horovodrun stops the
    job with an error naming the failed process instead of hanging."""
    start = time.monotonic()
    with pytest.raises(JobFailed) as failed:
        run_job(tmp_path, 2, "hvd", "sgd", "cuckoo", tag, extra={"repeat": 50, "die_worker": 1, "die_after_step": 3})
    assert time.monotonic() - start < 120
    assert "exited with non-zero status" in failed.value.output, failed.value.output[-3000:]


@pytest.mark.parametrize("layout,admission", [("cuckoo", "counter"), ("redis", "probability")])
def test_restriction_and_admission_decide_as_one_worker(tmp_path, tag, layout, admission):
    extra = {"restrict": 15, "admission": admission}
    one, two = run_one_and_two(tmp_path, "hvd", "adam", layout, tag, extra)
    check_equal(one, two)
    for name in ("user_emb", "item_emb"):
        assert 10 <= len(one[0][name]) < 40, (name, len(one[0][name]))


def test_horovod_checkpoint_restores_into_another_worker_count(tmp_path, tag):
    """Each Horovod worker writes its own shard files (tfde.saving.CheckpointManager);
    2 -> 1 and 1 -> 2 workers restore and train on like 1 -> 1."""

    def job(workers, name, **extra):
        return start_job(tmp_path, workers, "hvd", "adam", "cuckoo", tag, extra={"out": str(tmp_path / name), **extra})

    check_restores_into_other_worker_counts(tmp_path, job)
    check_sharded(tmp_path, 2, prefix="one_to_two")


def test_per_worker_checkpoint_directories(tmp_path, tag):
    """The maintainer's program saves to model_dir_{rank}: each worker writes
    and restores its part in its own directory, and training resumes as from
    one shared directory; restoring such a part into another number of
    workers is refused, naming the shared directory as the fix."""

    def job(workers, name, **extra):
        return run_job(tmp_path, workers, "hvd", "adam", "cuckoo", tag, extra={"out": str(tmp_path / name), **extra})

    job(2, "first_own", save_dir=str(tmp_path / "model_dir_{rank}"))
    job(2, "first_shared", save_dir=str(tmp_path / "shared"))
    for rank in (0, 1):
        own = tmp_path / f"model_dir_{rank}"
        assert (own / "checkpoint.json").exists()
        assert [p.name for p in own.glob("ckpt-*/*.index")] == [f"worker-0000{rank}-of-00002.index"]
        assert not list(own.glob("*.partial"))
    check_equal(
        job(2, "from_shared", restore_dir=str(tmp_path / "shared")),
        job(2, "from_own", restore_dir=str(tmp_path / "model_dir_{rank}")),
    )
    with pytest.raises(JobFailed) as failed:
        job(1, "one", restore_dir=str(tmp_path / "model_dir_0"))
    assert "save to one directory all workers share" in failed.value.output, failed.value.output[-3000:]


def test_autograph_leaves_tf_keras_alone_on_tf_2_16():
    """TF 2.16.2 has no autograph rule for tf_keras, so tracing converted all
    of tf-keras anew (a tfrs metric's candidates.map(tower): 16-49 s instead
    of 0.2 s); tfde adds the rule TF 2.21 has."""
    from tensorflow.python.autograph.core import config

    assert any(
        isinstance(r, config.DoNotConvert) and r.matches("tf_keras.src.engine.training")
        for r in config.CONVERSION_RULES
    )
