"""Semi-synchronous training (tfde.keras.callbacks.PeriodicSync,
tfde.semi_sync.PeriodicSync) in real worker processes on loopback: every=1
is exact training bit for bit; with every=k the stores hold the initial rows
plus every worker's pushed deltas (no update lost, none counted twice), and
the workers end with the same dense weights.  The job: tests/distributed_job.py."""

import glob
import os

import numpy as np
import pytest
from distributed_check import redis_tag, run_job

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
# model.fit under MultiWorkerMirroredStrategy works with tf-keras only
# (docs/distributed.md); the custom loop with both.
ENGINES = ("fit", "loop") if LEGACY else ("loop",)
# Every engine and layout under tf-keras (the loop too); the Keras 3 run
# adds the Keras 3 custom loop on one layout (the layouts share its code).
CASES = [(engine, layout) for engine in ENGINES for layout in ("redis", "cuckoo")] if LEGACY else [("loop", "redis")]


@pytest.fixture
def tag():
    with redis_tag() as t:
        yield t


def _identical(one, two):
    (t1, d1), (t2, d2) = one, two
    assert set(t1) == set(t2) and set(d1) == set(d2)
    for name in t1:
        assert set(t1[name]) == set(t2[name]), name
        for key in t1[name]:
            np.testing.assert_array_equal(t1[name][key], t2[name][key], err_msg=f"{name}[{key!r}]")
    for name in d1:
        np.testing.assert_array_equal(d1[name], d2[name], err_msg=name)


def check_every_1_is_exact(tmp_path, tag, engine, layout, extra=None):
    """Two workers with PeriodicSync(every=1) store bit for bit what exact training stores."""
    extra = extra or {}
    (tmp_path / "exact").mkdir()
    (tmp_path / "k1").mkdir()
    exact = run_job(
        tmp_path / "exact", 2, engine, "adam", layout, tag, {**extra, "redis": {"model_tag_runtime": f"{tag}-e"}}
    )
    synced = run_job(
        tmp_path / "k1",
        2,
        engine,
        "adam",
        layout,
        tag,
        {**extra, "sync_every": 1, "redis": {"model_tag_runtime": f"{tag}-1"}},
    )
    _identical(exact, synced)


# every=1 changes nothing whatever the layout (PeriodicSync.start returns
# at once): one layout per engine keeps the suite's time down.
EXACT_CASES = [("fit", "redis"), ("loop", "cuckoo")] if LEGACY else [("loop", "redis")]


@pytest.mark.keras
@pytest.mark.parametrize("engine,layout", EXACT_CASES)
def test_every_1_is_exact_training_bit_for_bit(tmp_path, tag, engine, layout):
    check_every_1_is_exact(tmp_path, tag, engine, layout)


def _pushed(prefix):
    """[{table: (keys, deltas, values, sync numbers)}] of each worker's pushes over the whole run."""
    out = []
    for f in sorted(glob.glob(prefix + "-pushed-w*.npz")):
        part = dict(np.load(f))
        names = [n[: -len("/keys")] for n in part if n.endswith("/keys")]
        out.append({n: (part[n + "/keys"], part[n + "/deltas"], part[n + "/values"], part[n + "/sync"]) for n in names})
    return out


def _key(k):
    return k.decode() if isinstance(k, bytes) else k


@pytest.mark.keras
@pytest.mark.parametrize("engine,layout", CASES)
def test_every_k_stores_initial_rows_plus_every_workers_deltas(tmp_path, tag, engine, layout):
    check_every_k_pushes(tmp_path, tag, engine, layout)


# How a sync merges each kind of state (docs/semi-sync.md): rows and
# frequency counts by the sum of the workers' deltas, optimizer slots by the
# mean of the deltas of the workers that changed the key, timestamps and
# change labels by the largest of the workers' values.
MERGES = {
    "": "sum",
    "m": "mean",
    "v": "mean",
    "policy-frequency": "sum",
    "policy-timestamp": "max",
    "changes-step": "max",
    "admission": "sum",  # a CounterFilter's counts; a key's count goes once the key is stored
}


def check_every_k_pushes(tmp_path, tag, engine, layout, extra=None):
    """10 steps with a sync every 4 (after steps 4 and 8, and at the end):
    every stored row and state is its initial value merged, at each sync,
    with what the workers that changed it recorded before that sync
    (MERGES), replayed here; the stored keys are exactly the pushed ones.
    With "sync_slots": "local" no optimizer slot is pushed, and only the rest
    is replayed (test_copies_keep_each_worker_s_slots checks the slots)."""
    extra = extra or {}
    tables, dense = run_job(tmp_path, 2, engine, "adam", layout, tag, {**extra, "sync_every": 4, "steps": 10})
    assert dense, "no dense weights"  # load() checked that both workers hold the same ones
    prefix = str(tmp_path / "out2")
    init = dict(np.load(prefix + "-init.npz"))
    pushed = _pushed(prefix)
    assert len(pushed) == 2
    local_slots = extra.get("sync_slots") == "local"
    replayed = {name for name in tables if not (local_slots and MERGES[name.partition("/")[2]] == "mean")}
    assert set(pushed[0]) == set(pushed[1]) == replayed, (sorted(pushed[0]), sorted(replayed))
    for kind in extra.get("policies", {}).values():
        assert f"user_emb/policy-{kind}" in tables or f"item_emb/policy-{kind}" in tables
    shared_keys = 0
    for name in sorted(replayed):
        layer, _, slot = name.partition("/")
        merge = MERGES[slot]
        start = {} if slot else {_key(k): r for k, r in zip(init[f"{layer}/keys"], init[f"{layer}/rows"])}
        by_sync = {}  # (sync, key) -> [(delta, value) of each worker that pushed it]
        for worker, p in enumerate(pushed):
            keys, deltas, values, syncs = p[name]
            assert len(keys) > 0, f"worker {worker} pushed nothing for {name}"
            for k, d, v, n in zip(keys.tolist(), deltas, values, syncs.tolist()):
                by_sync.setdefault((n, _key(k)), []).append((d.astype(np.float64), v.astype(np.float64)))
        expected = {}
        for (_, k), pushes in sorted(by_sync.items(), key=lambda item: item[0][0]):
            deltas = [d for d, _ in pushes]
            if merge == "max":
                latest = np.max([v for _, v in pushes], axis=0)
                expected[k] = np.maximum(expected[k], latest) if k in expected else latest
                continue
            step = np.mean(deltas, axis=0) if merge == "mean" else np.sum(deltas, axis=0)
            expected[k] = expected.get(k, start.get(k, np.zeros_like(deltas[0]))) + step
        if slot == "admission":  # the counts of keys admitted (stored) are dropped
            expected = {k: v for k, v in expected.items() if k not in {_key(x) for x in tables[layer]}}
        stored = {_key(k): v for k, v in tables[name].items()}
        assert set(stored) == set(expected), f"{name}: stored keys are not the pushed ones"
        for k, row in stored.items():
            np.testing.assert_allclose(row, expected[k], rtol=1e-5, atol=2e-6, err_msg=f"{name}[{k!r}]")
        shared_keys += sum(len(ds) == 2 for ds in by_sync.values())
    assert shared_keys > 0, "no key was pushed by both workers: the check above proves nothing about accumulation"
    # Between syncs each worker's dense weights took its own gradients only.
    kernels = [np.load(f)["kernels"] for f in sorted(glob.glob(prefix + "-pushed-w*.npz"))]
    assert kernels[0].shape == kernels[1].shape and len(kernels[0]) == 3, [k.shape for k in kernels]
    for before in range(3):
        assert not np.allclose(kernels[0][before], kernels[1][before], atol=1e-5), f"equal before sync {before}"
    return tables, pushed


STATE = {
    "policies": {"user_emb": "frequency", "item_emb": "timestamp"},
    "track_changes": True,
    "admission": {"user_emb": "counter", "item_emb": "probability"},
}


@pytest.mark.keras
# Both layouts' merges (a shared store's and in-process owners'), once each.
@pytest.mark.parametrize("engine,layout", [("fit", "redis"), ("loop", "cuckoo")] if LEGACY else [("loop", "cuckoo")])
def test_every_k_merges_policy_state_change_labels_and_admitted_keys(tmp_path, tag, engine, layout):
    """A frequency policy, a timestamp policy, change tracking, a counting
    and a probability admission filter under every=4: the stores hold each
    key's counts summed over the workers, its latest timestamp and change
    label, and only keys the filters admit (fewer than the data has); the
    counter holds the summed counts of the keys it has not admitted."""
    tables, pushed = check_every_k_pushes(tmp_path, tag, engine, layout, STATE)
    init = dict(np.load(str(tmp_path / "out2") + "-init.npz"))
    for layer in ("user_emb", "item_emb"):
        assert 0 < len(tables[layer]) < len(init[f"{layer}/keys"]), "the filter admitted every key, or none"
    counts = {_key(k): c[0] for k, c in tables["user_emb/policy-frequency"].items()}
    assert max(counts.values()) > 1
    # A key both workers updated in one cycle counts the steps of each.
    both = [
        k for k in counts if all(k in {_key(x) for x in p["user_emb/policy-frequency"][0].tolist()} for p in pushed)
    ]
    assert both, "no count was pushed by both workers"
    waiting = tables["user_emb/admission"]
    assert waiting and not set(waiting) & set(tables["user_emb"]), "no key waits, or an admitted key kept its count"


@pytest.mark.keras
@pytest.mark.parametrize("engine,layout", CASES[:1])
def test_every_k_is_not_exact_training(tmp_path, tag, engine, layout):
    """The local steps are really local: with every=4 the rows and dense
    weights differ from exact training's (which test_every_1 shows every=1
    reproduces)."""
    (tmp_path / "exact").mkdir()
    (tmp_path / "k4").mkdir()
    exact = run_job(tmp_path / "exact", 2, engine, "adam", layout, tag, {"redis": {"model_tag_runtime": f"{tag}-e"}})
    local = run_job(
        tmp_path / "k4", 2, engine, "adam", layout, tag, {"sync_every": 4, "redis": {"model_tag_runtime": f"{tag}-4"}}
    )
    assert not np.allclose(exact[1]["dense/kernel"], local[1]["dense/kernel"], atol=1e-4)


def test_independent_trainers_on_one_redis_lose_only_a_killed_ones_unsynced_steps(tmp_path, tag):
    """Two processes train the same Redis tables at once, each alone (no
    engine), syncing every 3 steps (tests/semi_sync_job.py).  The second is
    killed after its 8th step: it synced after steps 3 and 6, and steps 7
    and 8 were never pushed.  The tables hold the initial rows plus exactly
    the deltas both pushed (the survivor's 12 steps, the killed one's first
    6): concurrent pushes lose nothing, and a lost trainer costs only its
    unsynced steps."""
    import subprocess
    import sys
    from pathlib import Path

    import tensorflow as tf

    import tfde

    job = Path(__file__).with_name("semi_sync_job.py")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(job.parent.parent)}
    procs = []
    for name, seed, die in (("a", 1, None), ("b", 2, 7)):
        cfg = {"tag": tag, "seed": seed, "steps": 12, "every": 3, "die_after_step": die, "out": str(tmp_path / name)}
        (tmp_path / f"{name}.json").write_text(__import__("json").dumps(cfg))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(job), str(tmp_path / f"{name}.json")],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert procs[0].returncode == 0, outputs[0][-3000:]
    assert procs[1].returncode == -9, outputs[1][-3000:]
    assert len(glob.glob(str(tmp_path / "b-sync*.npz"))) == 2
    assert len(glob.glob(str(tmp_path / "a-sync*.npz"))) == 5  # after steps 3, 6, 9, 12, and stop()'s (empty)

    keys = np.arange(50, dtype=np.int64)
    initial = tfde.Variable("semi_items", dim=4, initializer="normal", seed=5).lookup(keys).numpy()
    stored = tfde.Variable(
        "semi_items",
        dim=4,
        initializer="normal",
        seed=5,
        table_creator=tfde.RedisTableCreator({"model_tag_runtime": tag}),
    )
    for name in ("table", "m", "v"):
        expected, pushed_by, values = initial.astype(np.float64), {}, {}
        for f in sorted(glob.glob(str(tmp_path / "*-sync*.npz"))):
            part = np.load(f)
            for k, d, v in zip(part[f"{name}/keys"].tolist(), part[f"{name}/deltas"], part[f"{name}/values"]):
                expected[k] += d
                pushed_by.setdefault(k, set()).add(os.path.basename(f)[0])
                values.setdefault(k, []).append(v)
        var = stored if name == "table" else stored.slot(name, 0.0)
        rows, exists = var.lookup(tf.constant(keys), return_exists=True)
        assert sorted(keys[exists.numpy()].tolist()) == sorted(pushed_by), name
        if name == "table":  # the rows: the initial rows plus every push, accumulated
            np.testing.assert_allclose(rows.numpy(), expected, rtol=1e-5, atol=2e-6, err_msg=name)
        else:  # the slots: as one of the pushes wrote them (the last to sync the key)
            for k in pushed_by:
                assert any(np.array_equal(rows.numpy()[k], v) for v in values[k]), (name, k)
        assert any(len(w) == 2 for w in pushed_by.values()), f"{name}: no key was pushed by both trainers"


@pytest.mark.keras
@pytest.mark.parametrize("engine", ENGINES[:1])
def test_steps_where_no_worker_fetches_a_new_key(tmp_path, tag, engine):
    """Two batches repeated: in each cycle of 4 steps the last 2 fetch no new
    key on any worker, so the lookup exchange gathers nothing from anyone
    (TensorFlow's all-gather crashed the process on that, SIGSEGV), and the
    run ends right after a sync, so the last sync has nothing to push."""
    tables, _ = run_job(tmp_path, 2, engine, "adam", "cuckoo", tag, {"sync_every": 4, "steps": 2, "repeat": 4})
    assert len(tables["item_emb"]) > 0


# Copies of the sharded tables (PeriodicSync(replicate=True)): a policy and
# change tracking too, so every merge rule goes through the copies' sync.
COPIES = {"replicate": True, "policies": {"user_emb": "frequency", "item_emb": "timestamp"}, "track_changes": True}


# Copies: model.fit under tf-keras, the custom loop under Keras 3 (the loop's
# copies code does not depend on the Keras flavour; the tf-keras custom loop
# runs in test_every_1 and test_every_k_stores).
COPIES_ENGINES = ("fit",) if LEGACY else ("loop",)


@pytest.mark.keras
@pytest.mark.parametrize("engine", COPIES_ENGINES)
def test_copies_of_sharded_tables_store_what_fetching_stores(tmp_path, tag, engine):
    check_copies_store_what_fetching_stores(tmp_path, tag, engine)


COPIES_RUNS = ("copies", "fetch")


def check_copies_store_what_fetching_stores(tmp_path, tag, engine):
    """replicate=True (no collective between syncs) pushes and stores what
    the default (each key fetched from its owner at its first lookup after
    a sync) does: the replay check holds, and both runs' stores are equal."""
    (tmp_path / "copies").mkdir()
    (tmp_path / "fetch").mkdir()
    copies, _ = check_every_k_pushes(tmp_path / "copies", tag, engine, "cuckoo", COPIES)
    fetched, _ = check_every_k_pushes(tmp_path / "fetch", tag, engine, "cuckoo", {**COPIES, "replicate": False})
    _same_stores(copies, fetched)
    if engine == "fit":
        # tf-keras's step under MultiWorkerMirroredStrategy reads its metrics and
        # reduces its logs across the workers (three collectives in this model's
        # step); local steps report each worker's own: with copies the traced
        # step waits for no other worker.  Fetching keeps the lookups' exchange.
        local = {run: np.load(str(tmp_path / run / "out2") + "-w0.npz") for run in COPIES_RUNS}
        local = {run: out["dense/local-step-collectives"] for run, out in local.items()}
        assert local["copies"].tolist() == [0], local
        assert min(local["fetch"]) > 0, local


@pytest.mark.keras
@pytest.mark.parametrize("engine", COPIES_ENGINES)
def test_copies_keep_each_worker_s_slots(tmp_path, tag, engine):
    check_copies_keep_each_worker_s_slots(tmp_path, tag, engine)


def check_copies_keep_each_worker_s_slots(tmp_path, tag, engine):
    """slots="local" with copies: a sync merges the rows and policy state as
    the default does (the replay check of the rows holds), and no optimizer
    slot: after the last sync both workers' copies of the rows equal the
    stores, each worker's copies of Adam's slots are its own (they differ
    between the workers for a key both trained), and each owner's store
    holds its own slots."""
    _, pushed = check_every_k_pushes(tmp_path, tag, engine, "cuckoo", {**COPIES, "sync_slots": "local"})
    prefix = str(tmp_path / "out2")
    copies = [_by_key(np.load(f"{prefix}-copies-w{w}.npz")) for w in (0, 1)]
    shards = [_by_key(np.load(f"{prefix}-w{w}.npz")) for w in (0, 1)]
    differ = 0
    for layer in ("user_emb", "item_emb"):
        stored = {**shards[0][layer], **shards[1][layer]}
        for w in (0, 1):
            assert set(copies[w][layer]) == set(stored), layer
            for key, row in stored.items():
                np.testing.assert_array_equal(copies[w][layer][key], row, err_msg=f"{layer}[{key!r}] worker {w}")
        for slot in ("m", "v"):
            name = f"{layer}/{slot}"
            for w in (0, 1):
                for key, row in shards[w][name].items():  # the owner's store: its own slots
                    # A key its copies lack (stored since they were made, by
                    # the other worker's training): their initial value, 0.
                    mine = copies[w][name].get(key, np.zeros_like(row))
                    np.testing.assert_array_equal(mine, row, err_msg=f"{name}[{key!r}] owner {w}")
            both = set(copies[0][name]) & set(copies[1][name])
            differ += sum(not np.array_equal(copies[0][name][k], copies[1][name][k]) for k in both)
    assert differ > 0, "every key's slots are equal on both workers: they were merged, not kept per worker"


@pytest.mark.keras
@pytest.mark.parametrize("engine", COPIES_ENGINES)
def test_an_owner_stores_its_slots_when_only_they_changed(tmp_path, tag, engine):
    check_an_owner_stores_its_slots_when_only_they_changed(tmp_path, tag, engine)


def check_an_owner_stores_its_slots_when_only_they_changed(tmp_path, tag, engine):
    """slots="local": a key whose row did not change (its update rounded
    away; here Adam's learning rate is 0, so no row changes at all) while
    its slots did is stored by its owner at the sync, with its unchanged
    row and its owner's slots, as an exact step stores it; a key only the
    other worker trained is not stored (its owner's slots are the initial
    ones).  No policy state, which changes at every lookup and so pushes
    every looked-up key anyway."""
    import tensorflow as tf

    from tfde.exchange import owner

    cfg = {"replicate": True, "sync_slots": "local", "sync_every": 4, "steps": 10, "learning_rate": 0.0}
    run_job(tmp_path, 2, engine, "adam", "cuckoo", tag, cfg)
    prefix = str(tmp_path / "out2")
    start = _by_key(np.load(prefix + "-init.npz"))  # every key's initial row
    copies = [np.load(f"{prefix}-copies-w{w}.npz") for w in (0, 1)]
    own = [_by_key(c) for c in copies]
    shards = [_by_key(np.load(f"{prefix}-w{w}.npz")) for w in (0, 1)]
    for layer in ("user_emb", "item_emb"):
        for w in (0, 1):
            raw = copies[w][f"{layer}/v/keys"]
            mine = owner(tf.constant(raw), 2).numpy() == w
            trained = np.any(copies[w][f"{layer}/v/rows"] != 0, axis=1)  # Adam's v: > 0 once a gradient came
            expected = {_key(k) for k in raw[mine & trained].tolist()}
            assert expected, f"worker {w} trained no key of {layer} it owns: the check proves nothing"
            stored = shards[w].get(layer, {})
            assert set(stored) == expected, (
                f"{layer}: worker {w} stores {len(stored)} keys, owns {len(expected)} trained"
            )
            for k in expected:
                np.testing.assert_array_equal(stored[k], start[layer][k], err_msg=f"{layer}[{k!r}] row, owner {w}")
                for slot in ("m", "v"):
                    name = f"{layer}/{slot}"
                    np.testing.assert_array_equal(
                        shards[w][name][k], own[w][name][k], err_msg=f"{name}[{k!r}] owner {w}"
                    )


def _by_key(npz) -> dict:
    """{table name: {key: row}} of a job's file of NAME/keys, NAME/rows pairs."""
    names = {f[: -len("/keys")] for f in npz.files if f.endswith("/keys")}
    return {n: {_key(k): r for k, r in zip(npz[f"{n}/keys"].tolist(), npz[f"{n}/rows"])} for n in names}


if LEGACY:  # tfrs needs tf-keras: defined in the tf-keras run of scripts/test.sh only

    @pytest.mark.keras
    def test_a_tfrs_model_s_local_steps_wait_for_no_worker_and_its_epoch_logs_are_every_worker_s(tmp_path, tag):
        """tfrs.Model's own train_step reports its metrics and its last
        step's losses.  Local steps with copies report each worker's own
        (no collective in the traced step); the epoch's logs are exact
        training's: every metric read over all workers and every value
        reduced across them, so every worker sees the same (a callback that
        stops or saves by them decides alike everywhere)."""
        cfg = {"model": "tfrs", "sync_every": 4, "steps": 10, "replicate": True}
        tables, dense = run_job(tmp_path, 2, "fit", "adam", "cuckoo", tag, cfg)  # load(): equal between workers
        assert dense["dense/local-step-collectives"].tolist() == [0], dense["dense/local-step-collectives"]
        logs = {name[len("dense/logs/") :] for name in dense if name.startswith("dense/logs/")}
        assert {"loss", "total_loss"} <= logs, logs
        assert len(tables["item_emb"]) > 0


# float16 tables: (workers, layout, replicate).  Two workers: the owners add
# the summed deltas in place (sharded cuckoo), merge them into copies, or
# merge them on the shared store (Redis); one process alone accumulates them
# into its store (cuckoo) or on the server (Redis's accum script).
HALF_RUNS = [(2, "cuckoo", False), (2, "cuckoo", True), (2, "redis", False), (1, "cuckoo", False), (1, "redis", False)]


@pytest.mark.keras
@pytest.mark.parametrize("workers,layout,replicate", HALF_RUNS)
def test_a_float16_table_s_syncs_round_each_sum_once(tmp_path, tag, workers, layout, replicate):
    """A sync of a float16 table stores, bit for bit, the stored row plus the
    workers' summed float32 deltas (Adam's slots: their mean, or alone the
    local value) rounded to float16 once, in every layout: the rows do not
    depend on the layout.  The owner's in-place accumulation and a process
    alone used to round the summed delta to float16 before adding it (rows
    up to 0.09 apart between layouts with Adam)."""
    cfg = {"sync_every": 4, "steps": 10, "value_dtype": "float16", "replicate": replicate}
    tables, _ = run_job(tmp_path, workers, "loop", "adam", layout, tag, cfg)
    prefix = str(tmp_path / f"out{workers}")
    init = dict(np.load(prefix + "-init.npz"))
    pushed = _pushed(prefix)
    assert len(pushed) == workers
    both = 0
    for name in sorted(tables):
        layer, _, slot = name.partition("/")
        assert MERGES[slot] in ("sum", "mean"), name
        by_sync = {}  # (sync, key) -> [(float32 delta, float16 local value) of each worker that pushed it]
        for p in pushed:
            keys, deltas, values, syncs = p[name]
            assert deltas.dtype == np.float32 and values.dtype == np.float16, (deltas.dtype, values.dtype)
            for k, d, v, n in zip(keys.tolist(), deltas, values, syncs.tolist()):
                by_sync.setdefault((n, _key(k)), []).append((d, v))
        start = {_key(k): r for k, r in zip(init[f"{layer}/keys"], init[f"{layer}/rows"])} if not slot else {}
        expected = {}
        for (_, k), pushes in sorted(by_sync.items(), key=lambda item: item[0][0]):
            both += len(pushes) == 2
            if slot and workers == 1:  # alone: optimizer slots are written as they are
                expected[k] = pushes[-1][1]
                continue
            summed = pushes[0][0] if len(pushes) == 1 else pushes[0][0] + pushes[1][0]  # float32, as the exchange
            if MERGES[slot] == "mean":
                summed = summed / np.float32(len(pushes))
            before = expected.get(k, start.get(k, np.zeros(summed.shape, np.float16)))
            assert before.dtype == np.float16
            expected[k] = (before.astype(np.float32) + summed).astype(np.float16)
        stored = {_key(k): v for k, v in tables[name].items()}
        assert set(stored) == set(expected), name
        for k, row in stored.items():
            assert row.dtype == np.float16, (name, row.dtype)
            np.testing.assert_array_equal(row, expected[k], err_msg=f"{name}[{k!r}] ({workers} workers, {layout})")
    assert workers == 1 or both > 0, "no key was pushed by both workers"


def _same_stores(one, two):
    assert set(one) == set(two)
    for name in one:
        assert set(one[name]) == set(two[name]), name
        for key, row in one[name].items():
            np.testing.assert_allclose(row, two[name][key], rtol=1e-6, atol=1e-7, err_msg=f"{name}[{key!r}]")


@pytest.mark.keras
@pytest.mark.parametrize("engine", COPIES_ENGINES)
def test_copies_are_made_anew_after_a_restriction(tmp_path, tag, engine):
    """A frequency restriction every 2 steps (between syncs, with every=4)
    removes keys from the owners' stores; the copies are made anew after
    it (a removed key reads its initial row again), so the run stores what
    the run fetching from the owners stores."""
    runs = {}
    for replicate in (True, False):
        (tmp_path / str(replicate)).mkdir()
        cfg = {"sync_every": 4, "steps": 10, "restrict": 20, "replicate": replicate}
        runs[replicate], _ = run_job(tmp_path / str(replicate), 2, engine, "adam", "cuckoo", tag, cfg)
    init = dict(np.load(str(tmp_path / "True" / "out2") + "-init.npz"))
    assert len(runs[True]["user_emb"]) < len(init["user_emb/keys"]), "the restriction removed nothing"
    _same_stores(runs[True], runs[False])
