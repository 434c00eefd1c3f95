"""Semi-synchronous training under Horovod (2 workers by horovodrun on
loopback): model.fit through hvd.DistributedOptimizer's compute_gradients
(Keras's train_step) and through apply_gradients alone (tfrs.Model's
train_step).  The checks are tests/test_semi_sync.py's."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distributed_check import redis_tag, run_job  # noqa: E402
from test_semi_sync import (  # noqa: E402
    STATE,
    check_an_owner_stores_its_slots_when_only_they_changed,
    check_copies_keep_each_worker_s_slots,
    check_copies_store_what_fetching_stores,
    check_every_1_is_exact,
    check_every_k_pushes,
)

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "Horovod's Keras support needs tf-keras: TF_USE_LEGACY_KERAS=1"

CASES = [("keras", "redis"), ("keras", "cuckoo"), ("tfrs", "cuckoo")]


@pytest.fixture
def tag():
    with redis_tag() as t:
        yield t


@pytest.mark.parametrize("model,layout", CASES)
def test_every_1_is_exact_training_under_horovod(tmp_path, tag, model, layout):
    check_every_1_is_exact(tmp_path, tag, "hvd", layout, {"model": model})


@pytest.mark.parametrize("model,layout", CASES)
def test_every_k_stores_initial_rows_plus_every_workers_deltas_under_horovod(tmp_path, tag, model, layout):
    check_every_k_pushes(tmp_path, tag, "hvd", layout, {"model": model})


def test_every_k_merges_policy_state_change_labels_and_admitted_keys_under_horovod(tmp_path, tag):
    """As tests/test_semi_sync.py's, with the owners on the all-to-all exchange."""
    tables, _ = check_every_k_pushes(tmp_path, tag, "hvd", "cuckoo", {"model": "keras", **STATE})
    assert tables["user_emb/policy-frequency"] and tables["item_emb/policy-timestamp"]


def test_steps_where_no_worker_fetches_a_new_key_under_horovod(tmp_path, tag):
    """As tests/test_semi_sync.py's: lookups between syncs that fetch nothing
    on any worker, and a last sync with nothing to push."""
    tables, _ = run_job(tmp_path, 2, "hvd", "adam", "cuckoo", tag, {"sync_every": 4, "steps": 2, "repeat": 4})
    assert len(tables["item_emb"]) > 0


def test_copies_of_sharded_tables_store_what_fetching_stores_under_horovod(tmp_path, tag):
    """As tests/test_semi_sync.py's, with the copies' sums gathered by Horovod's all-gather."""
    check_copies_store_what_fetching_stores(tmp_path, tag, "hvd")


def test_copies_keep_each_worker_s_slots_under_horovod(tmp_path, tag):
    """As tests/test_semi_sync.py's (slots="local"), through Horovod's all-gather."""
    check_copies_keep_each_worker_s_slots(tmp_path, tag, "hvd")


def test_an_owner_stores_its_slots_when_only_they_changed_under_horovod(tmp_path, tag):
    """As tests/test_semi_sync.py's, with the owners decided by the all-to-all exchange."""
    check_an_owner_stores_its_slots_when_only_they_changed(tmp_path, tag, "hvd")
