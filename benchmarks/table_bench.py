"""Table benchmark: tfde's cuckoo table beside TFRA 0.8.1, in one run.

tfde is measured in this process exactly as ../shared/anchors/tfra_table_bench.py
measures TFRA (same N, DIM, BATCH, seed, ops, warm-up and median of 5), and
that script is run with the TFRA venv's interpreter (made by
../shared/anchors/setup-tfra.sh) as a subprocess.  Also measured: a numpy
gather of the same rows from a dense array (the memory-bandwidth ceiling of
find) and memory per stored row (RSS growth and the table's own count)
against the raw key+value bytes.

  python -m benchmarks.table_bench [--dim 64] [--n 1000000] [--batch 4096] [--rounds 3] [--no-tfra]

The two systems run alternately, each round in fresh processes (TFRA, then
tfde, then TFRA, ...), and each figure is the median over rounds: on a
shared VM the speed of the host drifts by tens of percent within minutes,
and alternating keeps that drift from favouring either side.  Prints the
machine, versions and git hash, a side-by-side table, and writes
benchmarks/results/table-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPEATS = 5


def timeit(fn, repeats=REPEATS):
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                             text=True).stdout.strip()
    except OSError:
        git = "unknown"
    import tensorflow as tf

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "tf": tf.__version__,
            "git": git or "unknown"}


def bench_tfde(n: int, dim: int, batch: int) -> dict:
    import tensorflow as tf

    import tfde

    rng = np.random.default_rng(0)  # same inputs as the TFRA anchor script
    keys = tf.constant(rng.choice(1 << 62, size=n, replace=False).astype(np.int64))
    vals = tf.constant(rng.standard_normal((n, dim), dtype=np.float32))
    miss = tf.constant(rng.choice(1 << 62, size=n, replace=False).astype(np.int64) | (1 << 62))
    var = tfde.Variable("bench", dim=dim, initializer=0.0, trainable=False,
                        table_creator=tfde.CuckooTableCreator(expected_rows=n))
    out = {}
    t = time.perf_counter()
    var.upsert(keys, vals)
    out["insert_new"] = n / (time.perf_counter() - t)
    out.update(memory_per_row(n, dim))
    out["insert_existing"] = n / timeit(lambda: var.upsert(keys, vals))
    out["find_hit"] = n / timeit(lambda: var.lookup(keys).numpy())
    out["find_miss"] = n / timeit(lambda: var.lookup(miss).numpy())
    idx = np.minimum(rng.zipf(1.2, size=(200, batch)) - 1, n - 1)
    batches = [tf.gather(keys, i) for i in idx]

    @tf.function
    def lookup_batch(k):
        return var.lookup(k)

    def run_batches():
        for b in batches:
            lookup_batch(b)

    out["find_batch4096"] = 200 * batch / timeit(run_batches, 3)
    # Not in the TFRA script: accum, remove and export, for the record.
    out["accum_existing"] = n / timeit(lambda: var.accum(keys, vals))
    out["export_all"] = n / timeit(lambda: [k for k, _ in var.export(chunk_rows=1 << 18)], 3)
    sub = keys[: n // 10]
    out["remove_then_reinsert"] = (n // 10) / timeit(lambda: (var.remove(sub), var.upsert(sub, vals[: n // 10])))
    # The ceiling: numpy gathers the same number of random rows from a dense array.
    dense = vals.numpy()
    perm = rng.permutation(n)
    out["numpy_gather_ceiling"] = n / timeit(lambda: dense[perm])
    return out


_MEMORY_PROBE = """
import os, sys, numpy as np, tensorflow as tf, tfde
n, dim = int(sys.argv[1]), int(sys.argv[2])
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
var = tfde.Variable("mem", dim=dim, initializer=0.0, trainable=False)
chunk = 1 << 16
rng = np.random.default_rng(0)
var.upsert(tf.constant([1 << 62], tf.int64), tf.zeros([1, dim]))   # warm up ops and allocator
rows = tf.zeros([chunk, dim])
before = rss()
for start in range(0, n, chunk):
    m = min(chunk, n - start)
    var.upsert(tf.constant(rng.integers(0, 1 << 62, m), tf.int64), rows[:m])
print(rss() - before, int(var.tables[0].memory_bytes()), int(var.size()))
"""


def memory_per_row(n: int, dim: int) -> dict:
    """RSS growth and the table's own byte count per stored row, measured in a
    fresh process that inserts in 64K-row chunks (no big temporaries to reuse)."""
    proc = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(n), str(dim)], capture_output=True, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{proc.stderr[-2000:]}")
    rss, table, rows = (int(x) for x in proc.stdout.split()[-3:])
    return {"rss_bytes_per_row": rss / rows, "table_bytes_per_row": table / rows}


def bench_tfra(n: int, dim: int, batch: int, python: str, script: Path) -> dict:
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "DIM": str(dim), "N": str(n), "BATCH": str(batch),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([python, str(script)], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"TFRA benchmark failed ({python} {script}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tfde_round(n: int, dim: int, batch: int) -> dict:
    """One tfde round in a fresh process, like the TFRA side."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.table_bench", "--tfde-round", "--n", str(n),
                           "--dim", str(dim), "--batch", str(batch)], capture_output=True, text=True,
                          cwd=HERE.parent, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"tfde round failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def medians(rounds: list) -> dict:
    if not rounds:
        return {}
    return {k: statistics.median(r[k] for r in rounds) for k, v in rounds[0].items()
            if isinstance(v, (int, float))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=int(os.environ.get("DIM", 64)))
    p.add_argument("--n", type=int, default=int(os.environ.get("N", 1_000_000)))
    p.add_argument("--batch", type=int, default=int(os.environ.get("BATCH", 4096)))
    p.add_argument("--tfra-python", default=os.environ.get(
        "TFRA_PYTHON", str(Path.home() / ".cache/tfde-anchors/tfra/bin/python")))
    p.add_argument("--tfra-script", default=str(HERE.parent.parent / "shared/anchors/tfra_table_bench.py"))
    p.add_argument("--no-tfra", action="store_true", help="measure tfde only")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; figures are medians over them")
    p.add_argument("--tfde-round", action="store_true", help=argparse.SUPPRESS)  # one tfde round, JSON out
    args = p.parse_args(argv)
    if args.tfde_round:
        print(json.dumps(bench_tfde(args.n, args.dim, args.batch)))
        return 0

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; python {info['python']}, TF {info['tf']}, "
          f"tfde git {info['git']}")
    print(f"table: int64 keys, float32 rows, dim {args.dim}, {args.n:,} keys, batch {args.batch}; "
          f"median of {REPEATS} after a warm-up, then median over {args.rounds} alternating rounds")
    if not args.no_tfra and not Path(args.tfra_python).exists():
        print(f"TFRA venv missing ({args.tfra_python}); run ../shared/anchors/setup-tfra.sh or pass --no-tfra",
              file=sys.stderr)
        return 2
    tfra_rounds, our_rounds = [], []
    for r in range(args.rounds):
        if not args.no_tfra:
            tfra_rounds.append(bench_tfra(args.n, args.dim, args.batch, args.tfra_python, Path(args.tfra_script)))
        our_rounds.append(tfde_round(args.n, args.dim, args.batch))
        print(f"round {r + 1}/{args.rounds}: find_hit tfde {our_rounds[-1]['find_hit']:,.0f}"
              + (f", TFRA {tfra_rounds[-1]['find_hit']:,.0f}" if tfra_rounds else "") + " keys/s", flush=True)
    ours, tfra = medians(our_rounds), medians(tfra_rounds)

    print(f"\n{'operation':<24}{'tfde keys/s':>16}{'TFRA keys/s':>16}{'ratio':>8}")
    for op in ("insert_new", "insert_existing", "find_hit", "find_miss", "find_batch4096", "accum_existing",
               "remove_then_reinsert", "export_all"):
        theirs = tfra.get(op)
        ratio = f"{ours[op] / theirs:.2f}x" if theirs else "-"
        print(f"{op:<24}{ours[op]:>16,.0f}{(f'{theirs:,.0f}' if theirs else '-'):>16}{ratio:>8}")
    print(f"{'numpy gather (ceiling)':<24}{ours['numpy_gather_ceiling']:>16,.0f}   find_hit = "
          f"{ours['find_hit'] / ours['numpy_gather_ceiling']:.2f} of the ceiling")
    raw = 8 + 4 * args.dim
    print(f"memory per stored row (fresh process, no presizing): RSS growth {ours['rss_bytes_per_row']:.0f} B, "
          f"table count "
          f"{ours['table_bytes_per_row']:.0f} B; raw key+value {raw} B -> "
          f"{ours['rss_bytes_per_row'] / raw:.2f}x / {ours['table_bytes_per_row'] / raw:.2f}x")

    results = HERE / "results"
    results.mkdir(exist_ok=True)
    path = results / f"table-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": info, "dim": args.dim, "n": args.n, "batch": args.batch,
                                "rounds": args.rounds, "tfde": ours, "tfra": tfra,
                                "tfde_rounds": our_rounds, "tfra_rounds": tfra_rounds}, indent=1))
    print(f"\nwritten: {path.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
