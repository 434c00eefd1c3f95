"""What both sides of a side-by-side benchmark share: inputs, timing and the
table operations themselves.

This module imports only numpy and the standard library (TensorFlow is passed
in), so the reference side can import it from TFRA's own venv (TF 2.16.2)
and run exactly the same measurement code as tfde's side:

    sys.path.insert(0, "<repo>/benchmarks"); import common

A side supplies a `TableAdapter`: five methods that call its system's API for
one op on the whole batch given.  `table_ops` then times every op the same way
for both systems.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

# The reference system's interpreter: the venv benchmarks/setup-tfra.sh builds.
TFRA_PYTHON = os.environ.get("TFRA_PYTHON", str(Path.home() / ".cache/tfde-anchors/tfra/bin/python"))

REPEATS = 5  # timed repeats per op, after one warm-up; the figure is their median
BATCHES = 200  # training-sized batches per repeat of a batch op
ZIPF_A = 1.2  # skew of the Zipf batches (a common choice for id popularity)
EXPORT_CHUNK = 1 << 18  # rows per export chunk where a system exports in chunks


def timeit(fn, repeats: int = REPEATS, setup=None) -> float:
    """Median seconds of `repeats` calls of fn() after one warm-up call;
    setup() runs untimed before every call (e.g. to re-insert removed keys)."""
    ts = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        if i:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def table_inputs(n: int, dim: int, batch: int, seed: int = 0) -> dict:
    """The inputs of the table benchmark, identical for both systems.

    keys  [n] int64, distinct, uniform over [0, 2**62)  (stored keys)
    vals  [n, dim] float32 standard normal
    miss  [n] int64, distinct, never stored (bit 62 set)
    batch_uniform / batch_zipf  [BATCHES, batch] int64: training-sized
        batches drawn from the stored keys uniformly / with Zipf(1.2) skew
        (rank r drawn with probability ~ r**-1.2, so a few keys dominate and
        batches hold many duplicates, as real id streams do).
    The first four arrays are drawn exactly as the anchor script draws them."""
    rng = np.random.default_rng(seed)
    keys = rng.choice(1 << 62, size=n, replace=False).astype(np.int64)
    vals = rng.standard_normal((n, dim), dtype=np.float32)
    miss = rng.choice(1 << 62, size=n, replace=False).astype(np.int64) | (1 << 62)
    zipf_idx = np.minimum(rng.zipf(ZIPF_A, size=(BATCHES, batch)) - 1, n - 1)
    uniform_idx = rng.integers(0, n, size=(BATCHES, batch))
    return {"keys": keys, "vals": vals, "miss": miss, "batch_zipf": keys[zipf_idx], "batch_uniform": keys[uniform_idx]}


class TableAdapter:
    """One system's API, op by op.  Every method acts on whole tensors and
    returns only when the op has finished (results materialized)."""

    def upsert(self, keys, vals): ...
    def find(self, keys): ...  # must materialize the rows (e.g. .numpy())
    def accum(self, keys, deltas): ...  # add deltas to existing rows
    def remove(self, keys): ...
    def export_rows(self) -> int: ...  # exports every row; returns the row count
    def batch_find_fn(self): ...  # a tf.function keys -> rows, traced once
    def batch_upsert_fn(self): ...  # a tf.function (keys, rows) -> None


def table_ops(tf, adapter: TableAdapter, inp: dict) -> dict:
    """keys/s of each op, measured identically for every system."""
    keys, vals, miss = (tf.constant(inp[k]) for k in ("keys", "vals", "miss"))
    n = int(keys.shape[0])
    out = {}
    t = time.perf_counter()
    adapter.upsert(keys, vals)  # into an empty table, like the anchor: timed once
    out["insert_new"] = n / (time.perf_counter() - t)
    out["insert_existing"] = n / timeit(lambda: adapter.upsert(keys, vals))
    out["find_hit"] = n / timeit(lambda: adapter.find(keys))
    out["find_miss"] = n / timeit(lambda: adapter.find(miss))
    out["accum_existing"] = n / timeit(lambda: adapter.accum(keys, vals))
    exported = []
    out["export_all"] = n / timeit(lambda: exported.append(adapter.export_rows()), repeats=3)
    if exported[-1] != n:
        raise RuntimeError(f"export returned {exported[-1]} rows, expected {n}")
    out["remove"] = n / timeit(lambda: adapter.remove(keys), repeats=3, setup=lambda: adapter.upsert(keys, vals))
    adapter.upsert(keys, vals)
    find_fn, upsert_fn = adapter.batch_find_fn(), adapter.batch_upsert_fn()
    rows = tf.constant(inp["vals"][: inp["batch_zipf"].shape[1]])
    for dist in ("uniform", "zipf"):
        batches = [tf.constant(b) for b in inp[f"batch_{dist}"]]
        keys_per_repeat = sum(int(b.shape[0]) for b in batches)

        def finds():
            for b in batches:
                find_fn(b)

        def upserts():
            for b in batches:
                upsert_fn(b, rows)

        out[f"find_batch_{dist}"] = keys_per_repeat / timeit(finds)
        out[f"upsert_batch_{dist}"] = keys_per_repeat / timeit(upserts)
    # The floor of any per-batch call: a tf.function that returns its input,
    # called on batches of the same size (the last distribution's: it does
    # not read them).  No table op can be faster than this.
    identity = tf.function(lambda k: tf.identity(k))

    def identities():
        for b in batches:
            identity(b)

    out["call_floor_batch_identity"] = keys_per_repeat / timeit(identities)
    return out


def memory_probe(tf, upsert, n: int, dim: int, chunk: int = 1 << 16) -> float:
    """RSS growth per stored row while `upsert(keys, rows)` inserts n fresh
    keys in chunks (no big temporaries to reuse; run in a fresh process)."""
    rng = np.random.default_rng(0)
    upsert(tf.constant([1 << 62], tf.int64), tf.zeros([1, dim]))  # warm up the ops and the allocator
    rows = tf.zeros([chunk, dim])
    before = rss_bytes()
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        upsert(tf.constant(rng.integers(0, 1 << 62, m), tf.int64), rows[:m])
    return (rss_bytes() - before) / n


# ---------------------------------------------------------------- end to end


def recall_at_k(user_vecs: np.ndarray, item_vecs: np.ndarray, target_pos: np.ndarray, k: int = 100) -> float:
    """Fraction of rows whose target item index is among the k items with the
    highest dot product.  user_vecs [u, d], item_vecs [m, d], target_pos [u]."""
    hits = 0
    for s in range(0, len(user_vecs), 2048):
        scores = user_vecs[s : s + 2048] @ item_vecs.T
        top = np.argpartition(-scores, min(k, scores.shape[1] - 1), axis=1)[:, :k]
        hits += int(np.sum(np.any(top == target_pos[s : s + 2048, None], axis=1)))
    return hits / len(user_vecs)


def steady_rate(batch_end_times: list, batch_size: int, skip: int = 20, window: int = 50) -> float:
    """Median examples/s over windows of `window` steps, skipping the first
    `skip` steps (tracing, warm-up)."""
    skip, window = min(skip, len(batch_end_times) // 5), min(window, len(batch_end_times) // 5)
    t = batch_end_times[skip:]
    rates = [window * batch_size / (t[i + window] - t[i]) for i in range(0, len(t) - window, window)]
    if not rates:
        raise ValueError(f"too few steps ({len(batch_end_times)}) for a rate over {window}-step windows")
    return statistics.median(rates)


def fit_and_evaluate(tf, model, cfg: dict, data, users, items, eval_users, eval_items) -> dict:
    """The end-to-end run both sides share once their compiled model is
    built: the tf.data pipeline (shuffle with cfg's seed, batches with in-batch
    labels), model.fit with a timestamp per step, and held-out recall@k from
    the model's user_vectors / item_vectors."""
    ds = tf.data.Dataset.from_tensor_slices({"user": users, "item": items, "item_logq": data["item_logq"]})
    ds = ds.shuffle(cfg["shuffle_buffer"], seed=cfg["seed"], reshuffle_each_iteration=True)
    ds = ds.batch(cfg["batch_size"], drop_remainder=True)
    ds = ds.map(lambda f: (f, tf.range(tf.shape(f["item"])[0])), num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)
    times = []
    stamp = tf.keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: times.append(time.perf_counter()))
    history = model.fit(ds, epochs=cfg["epochs"], verbose=0, callbacks=[stamp])
    item_vecs = np.concatenate(
        [model.item_vectors(tf.constant(eval_items[s : s + 8192])).numpy() for s in range(0, len(eval_items), 8192)]
    )
    user_vecs = np.concatenate(
        [model.user_vectors(tf.constant(eval_users[s : s + 4096])).numpy() for s in range(0, len(eval_users), 4096)]
    )
    return {
        "examples_per_s": steady_rate(times, cfg["batch_size"]),
        "recall": recall_at_k(user_vecs, item_vecs, data["test_target_pos"], cfg["k"]),
        "loss": float(history.history["loss"][-1]),
        "steps": len(times),
    }


# ---------------------------------------------------------------- checkpoints


def reset_peak_rss() -> None:
    """Resets the kernel's high-water mark of this process's RSS (VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def checkpoint_probe(
    tf, make, upsert, size, phase: str, n: int, dim: int, directory: str, chunk: int = 1 << 18
) -> dict:
    """One phase of the checkpoint benchmark, in a fresh process each:
    "save" fills a table (make(name) -> table) with n rows of dim `dim` and
    writes it with tf.train.Checkpoint; "restore" reads it into a new table.
    Seconds, and the memory each needs beyond what it holds: peak RSS over
    the RSS before the save, or over the RSS after the restore."""
    var = make("ckpt")
    ckpt = tf.train.Checkpoint(var=var)
    prefix = os.path.join(directory, "ck")
    if phase == "save":
        rng = np.random.default_rng(0)
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            upsert(var, tf.range(start, start + m, dtype=tf.int64), tf.constant(rng.random((m, dim), dtype=np.float32)))
        before = rss_bytes()
        reset_peak_rss()
        t0 = time.perf_counter()
        ckpt.write(prefix)
        seconds = time.perf_counter() - t0
        files = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        return {
            "rows": n,
            "dim": dim,
            "save_s": seconds,
            "save_extra_bytes": peak_rss_bytes() - before,
            "file_bytes": files,
        }
    before = rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    ckpt.read(prefix).expect_partial()
    restored = int(size(var))
    seconds = time.perf_counter() - t0
    assert restored == n, (restored, n)
    return {
        "restore_s": seconds,
        "restore_extra_bytes": peak_rss_bytes() - rss_bytes(),
        "table_bytes": rss_bytes() - before,
    }
