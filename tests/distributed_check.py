"""Helpers of the distributed tests: run tests/distributed_job.py as N real
worker processes and compare what they stored with a 1-worker run.

Tolerance: atol 1e-6, rtol 1e-5.  Two workers sum their float32 partial
gradients in another order than one worker summing the whole batch (an
all-reduce or all-to-all adds per-worker sums), which changes the last bits of
each step's update (~1e-8 on rows of magnitude ~1, measured); over the few
steps here the differences stay far below 1e-6, while any real error (a lost,
doubled or misrouted gradient) moves rows by ~1e-2."""

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from redis_servers import free_port

JOB = Path(__file__).with_name("distributed_job.py")
TIMEOUT_S = 300


def run_job(tmp_path, workers, engine, optimizer, layout, tag, extra=None, load_out=True):
    """Runs the job with `workers` processes (MultiWorkerMirroredStrategy on
    loopback, or horovodrun for engine 'hvd'); returns load() of its files
    (None with load_out=False)."""
    return run_together(start_job(tmp_path, workers, engine, optimizer, layout, tag, extra), load_out=load_out)[0]


def start_job(tmp_path, workers, engine, optimizer, layout, tag, extra=None):
    """Starts the job (run_job's arguments) and returns it unfinished, for
    run_together.  Its files, config and log are named after its "out"
    (default out{workers}), so jobs of one test that name different outs
    can run at once; its Redis tag is "{tag}-{workers}" unless extra's
    "redis" names another."""
    ports = [free_port() for _ in range(workers)]
    cfg = {
        "workers": workers,
        "ports": ports,
        "engine": engine,
        "optimizer": optimizer,
        "layout": layout,
        "redis": {"model_tag_runtime": f"{tag}-{workers}"},
        "steps": 6,
        "global_batch": 32,
        "out": str(tmp_path / f"out{workers}"),
        **(extra or {}),
    }
    name = Path(cfg["out"]).name
    path = tmp_path / f"cfg-{name}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(JOB.parent.parent)}
    if engine == "hvd" and workers > 1:
        horovodrun = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or "horovodrun"
        commands = [
            [
                horovodrun,
                "-np",
                str(workers),
                "-H",
                f"localhost:{workers}",
                "--gloo",
                sys.executable,
                str(JOB),
                str(path),
            ]
        ]
    else:
        commands = [[sys.executable, str(JOB), str(path), str(i)] for i in range(workers)]
    logs = [tmp_path / f"{name}-w{i}.log" for i in range(len(commands))]
    return _Job(cfg, [start_logged(command, log, env=env) for command, log in zip(commands, logs)], logs)


def start_logged(command, log, **popen):
    """A process whose stdout and stderr go to the file `log`: to a file, not
    a pipe, since a process (or one beside it) that writes more than a pipe
    holds while nobody reads it would stall."""
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, **popen)


def wait_all(procs, timeout_s):
    """Waits for every process, all within one deadline; kills whatever is
    left when that fails (subprocess.TimeoutExpired) or is interrupted."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            p.kill()


def run_one_and_two(tmp_path, engine, optimizer, layout, tag, extra=None):
    """The job with 1 worker (the reference) and with 2, at once; returns
    (load() of one, load() of two)."""
    jobs = [start_job(tmp_path, n, engine, optimizer, layout, tag, extra) for n in (1, 2)]
    return tuple(run_together(*jobs))


def check_restores_into_other_worker_counts(tmp_path, job):
    """The checkpoint tests' protocol: 1 and 2 workers train and save (ck1,
    ck2; each worker writes its own files), then 1 -> 1 (the reference),
    2 -> 1 and 1 -> 2 workers restore and train on: the same rows, slots
    and dense weights, so every key reached its new owner with its
    optimizer state.  `job(workers, name, **dirs)` starts the test's job
    (start_job) with out tmp_path/name; each phase's jobs run at once."""
    run_together(
        job(1, "first1", save_dir=str(tmp_path / "ck1")),
        job(2, "first2", save_dir=str(tmp_path / "ck2")),
        load_out=False,
    )
    saved = sorted(p.name for p in (tmp_path / "ck2").glob("ckpt-*/*.index"))
    assert saved == ["worker-00000-of-00002.index", "worker-00001-of-00002.index"], saved
    reference, two_to_one, one_to_two = run_together(
        job(1, "ref", restore_dir=str(tmp_path / "ck1")),
        job(1, "two_to_one", restore_dir=str(tmp_path / "ck2")),
        job(2, "one_to_two", restore_dir=str(tmp_path / "ck1")),
    )
    check_equal(reference, two_to_one)
    check_equal(reference, one_to_two)


class _Job:
    def __init__(self, cfg, procs, logs):
        self.cfg, self.procs, self.logs = cfg, procs, logs


def run_together(*jobs, load_out=True):
    """Waits for jobs from start_job, which run at once (a 1-worker
    reference beside its 2-worker run: most of a job is one process's
    TensorFlow import and tracing, so two jobs on two cores take little more
    than the longer one); returns load() of each one's files, in order.  A
    job that fails raises JobFailed and stops the others."""
    wait_all([p for job in jobs for p in job.procs], TIMEOUT_S)
    for job in jobs:
        outputs = [log.read_text(errors="replace") for log in job.logs]
        workers = job.cfg["workers"]
        for i, (p, out) in enumerate(zip(job.procs, outputs)):
            if p.returncode != 0:
                every = "\n".join(
                    f"--- worker {j} (exit {q.returncode}):\n{o}" for j, (q, o) in enumerate(zip(job.procs, outputs))
                )
                raise JobFailed(f"worker {i} of {workers} failed (exit {p.returncode}):\n{out[-4000:]}", out, every)
    return [load(job.cfg["out"]) if load_out else None for job in jobs]


class JobFailed(AssertionError):
    """A job failed: .output is the first failing worker's output, .every
    every worker's (the first to fail need not be the one that says why: a
    worker can crash at exit while its partner's collective times out)."""

    def __init__(self, message, output, every):
        super().__init__(message)
        self.output, self.every = output, every


def dump(var):
    """(keys, rows) of every key a tfde Variable stores here, as numpy arrays
    (string keys as bytes): the "NAME/keys", "NAME/rows" pair of a job's
    files that load() reads."""
    keys, rows = [], []
    for k, r in var.export():
        k = k.numpy()
        keys.append(k.astype("S") if k.dtype == object else k)
        rows.append(r.numpy())
    if not keys:
        empty = np.zeros([0], "S1" if var.key_dtype.name == "string" else var.key_dtype.as_numpy_dtype)
        return empty, np.zeros([0, var.dim], np.float32)
    return np.concatenate(keys), np.concatenate(rows)


def load(prefix):
    """({table: {key: row}} over all workers' files, {dense weight: array});
    fails if two workers store the same key (every key has one owner) or
    hold different dense weights."""
    tables, dense = {}, {}
    for f in sorted(glob.glob(prefix + "-w*.npz")):
        part = dict(np.load(f))
        for name, value in part.items():
            if name.endswith("/keys"):
                table = tables.setdefault(name[:-5], {})
                for key, row in zip(value.tolist(), part[name[:-5] + "/rows"]):
                    assert key not in table, f"key {key!r} of {name[:-5]} is stored by two workers"
                    table[key] = row
            elif name.startswith("dense/"):
                if name in dense:  # every worker holds the same dense weights
                    np.testing.assert_allclose(
                        value, dense[name], rtol=1e-6, atol=1e-7, err_msg=f"{name} differs between workers ({f})"
                    )
                dense[name] = value
    return tables, dense


def check_equal(one, two):
    (t1, d1), (t2, d2) = one, two
    assert set(t1) == set(t2), f"tables differ: {sorted(t1)} vs {sorted(t2)}"
    for name in t1:
        assert set(t1[name]) == set(t2[name]), f"{name}: key sets differ"
        keys = sorted(t1[name])
        assert len(keys) >= 10
        np.testing.assert_allclose(
            np.stack([t2[name][k] for k in keys]),
            np.stack([t1[name][k] for k in keys]),
            rtol=1e-5,
            atol=1e-6,
            err_msg=name,
        )
    for name in d1:
        np.testing.assert_allclose(d2[name], d1[name], rtol=1e-5, atol=1e-6, err_msg=name)


def check_sharded(tmp_path, workers, prefix=None):
    """Sharded layout: every worker stores some keys of each table (load()
    already checked that no key is stored twice)."""
    prefix = prefix or f"out{workers}"
    parts = [dict(np.load(f)) for f in sorted(glob.glob(str(tmp_path / f"{prefix}-w*.npz")))]
    assert len(parts) == workers
    for name in ("user_emb", "item_emb"):
        assert all(len(p[f"{name}/keys"]) > 0 for p in parts), name


@contextlib.contextmanager
def redis_tag(port=6379):
    """A fresh model tag; its keys are deleted from the server afterwards."""
    import redis

    tag = f"tfde-dist-{uuid.uuid4().hex[:10]}"
    try:
        yield tag
    finally:
        client = redis.Redis(port=port)
        stale = [k for pattern in (f"{tag}*", f"tfde-*:{tag}*") for k in client.scan_iter(match=pattern)]
        if stale:
            client.delete(*stale)


# The many-feature model's plans (tests/distributed_job.py, model "many"):
# (placement, column_slice_threshold).
PLAN_CASES = [
    ("rows", None),
    ("round_robin", None),
    ("memory_balanced", None),
    ("auto", None),
    ("round_robin", 3),
]


def start_plans(tmp_path, workers, engine, tag, plans, layout="cuckoo", extra=None):
    """Starts the many-feature model trained on every (placement, threshold)
    of `plans` in one job of `workers` processes (one model after the
    other); plans_of() loads each plan's files once it is done."""
    extra = {"model": "many", "plans": [list(p) for p in plans], **(extra or {})}
    return start_job(tmp_path, workers, engine, "adam", layout, tag, extra=extra)


def plans_of(tmp_path, workers, count):
    """load() of each plan's files of a start_plans job, in order."""
    return [load(str(tmp_path / f"out{workers}-plan{i}")) for i in range(count)]


def check_plans_like_one_worker(tmp_path, engine, tag):
    """Every plan of PLAN_CASES (column slices too): 2 workers store what 1
    worker does, each table slice where the plan put it.  One worker's
    result depends only on the column slicing (every placement puts
    everything on worker 0), so it runs once per slicing."""
    thresholds = sorted({t for _, t in PLAN_CASES}, key=str)
    run_together(
        start_plans(tmp_path, 1, engine, tag, [("rows", t) for t in thresholds]),
        start_plans(tmp_path, 2, engine, tag, PLAN_CASES),
        load_out=False,
    )
    ones = dict(zip(thresholds, plans_of(tmp_path, 1, len(thresholds))))
    twos = plans_of(tmp_path, 2, len(PLAN_CASES))
    for number, ((placement, threshold), two) in enumerate(zip(PLAN_CASES, twos)):
        try:
            check_equal(ones[threshold], two)
            check_many_tables(two, threshold)
            check_plan(tmp_path, 2, placement, prefix=f"out2-plan{number}")
        except AssertionError as e:
            raise AssertionError(f"plan {placement!r}, column_slice_threshold={threshold}: {e}") from None


def check_plan(tmp_path, workers, placement, prefix=None):
    """Every table slice the plan put on one worker is stored by that
    worker alone (load() already checked that no key is stored twice);
    `prefix`: the job's "out" name (default out{workers})."""
    prefix = prefix or f"out{workers}"
    plan = json.loads((tmp_path / f"{prefix}-plan.json").read_text())
    parts = [dict(np.load(tmp_path / f"{prefix}-w{w}.npz")) for w in range(workers)]
    placed = {name: w for name, w in plan["plan"].items() if w >= 0}
    if placement in ("round_robin", "memory_balanced"):
        assert len(placed) == len(plan["plan"]), plan
        assert set(placed.values()) == set(range(workers)), f"a worker holds no table: {plan}"
    if placement == "rows":
        assert not placed, plan
    for name, w in placed.items():
        for other in range(workers):
            count = len(parts[other][f"{name}/keys"])
            assert (count > 0) == (other == w), f"{name} is planned on worker {w}, worker {other} has {count} keys"
    return plan


def check_many_tables(result, threshold):
    """The many-feature model's tables (each table, or its column slices)
    and their Adam slots are all in `result` (load())."""
    slices = [""] if threshold is None else ["-cols0_3", "-cols3_6", "-cols6_8"]
    names = {f"emb-{t}{s}" for t in ("user", "item", "cat") for s in slices}
    assert set(result[0]) == names | {f"{n}/{s}" for n in names for s in ("m", "v")}, sorted(result[0])
