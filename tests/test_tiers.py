"""The fast tier (`bash scripts/test.sh --fast`, pytest -m "not slow") leaves
out every test that starts a process, including those that start it through
a helper of the tests directory that calls another (tests/conftest.py marks
them "slow" from their code)."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _fast_tier(*files) -> set:
    """The test ids pytest -m "not slow" collects from `files`."""
    return {t.split("[")[0] for t in _collected("-m", "not slow", *files)}


def _collected(*args) -> list:
    """The test ids pytest collects with `args`, in order."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *args],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=300,
    )
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]  # 5: every test deselected
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_worker_jobs_started_through_helpers_are_left_out():
    # run_one_and_two -> start_job -> Popen; check_plans_like_one_worker ->
    # start_plans -> start_job; check_copies_store_what_fetching_stores ->
    # check_every_k_pushes -> run_job; a nested job() calling start_job.
    fast = _fast_tier("tests/test_distributed.py", "tests/test_semi_sync.py")
    assert fast == {"tests/test_distributed.py::test_mirrored_strategy_on_one_cpu_trains_like_no_strategy"}, fast


def test_servers_started_through_a_helper_modules_class_are_left_out():
    # redis_servers.FailoverGroup() -> FailoverGroup.__init__ -> _server ->
    # subprocess.Popen: named as an attribute of a module of the tests
    # directory, not as a global of the test's own module.
    fast = _fast_tier("tests/test_redis.py")
    starting = {
        "test_training_rides_out_a_sentinel_failover",
        "test_training_rides_out_a_cluster_failover",
        "test_training_rides_out_a_slot_migration_with_a_long_ask_window",
        "test_read_access_slave_reads_a_replica",
        "test_a_training_step_computes_its_writes_from_the_master",
    }
    assert not {t.split("::")[1] for t in fast} & starting
    assert "tests/test_redis.py::test_cluster_mode_against_a_standalone_server" in fast  # one on 6379 stays


def test_two_collections_give_the_same_test_ids():
    # scripts/test.sh runs tests with pytest-xdist, whose workers each collect
    # the suite and must find the same ids in the same order: a parameter
    # drawn at random at collection (a seed) breaks the run of its pass.
    # The two collections run at once (one per core), as xdist's workers do.
    with ThreadPoolExecutor(max_workers=2) as pool:
        first, second = pool.map(_collected, ["--ignore=tests/horovod"] * 2)
    assert len(first) > 1000
    assert first == second, sorted(set(first) ^ set(second))[:10]
