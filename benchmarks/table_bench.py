"""Table benchmark: tfde's cuckoo table beside TFRA 0.8.1, in one run.

Both systems run the same measurement code (benchmarks/common.py: inputs from
seed 0, one warm-up then the median of 5 repeats per op) on identical inputs:
1M distinct int64 keys, float32 rows, and training-sized batches drawn from
the stored keys uniformly and Zipf-skewed.  TFRA runs in its own venv
(benchmarks/setup-tfra.sh) through benchmarks/tfra_side.py.  Also
measured: a reference for find_hit without any table - TensorFlow's own
gather of the same number of random rows from a dense array, with the same
`.numpy()` - and memory per stored row (RSS growth in a fresh process) against
the raw key+value bytes.

  python -m benchmarks.table_bench [--dims 8,64,256] [--n 1000000] [--batch 4096] [--rounds 3] [--no-tfra]

The two systems run alternately, each round in fresh processes (TFRA, then
tfde, then TFRA, ...), and each figure is the median over rounds: on a
shared VM the speed of the host drifts by tens of percent within minutes,
and alternating keeps that drift from favouring either side.
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

from benchmarks import common

HERE = Path(__file__).resolve().parent
TFRA_PYTHON = common.TFRA_PYTHON
OPS = (
    "insert_new",
    "insert_existing",
    "find_hit",
    "find_miss",
    "accum_existing",
    "remove",
    "export_all",
    "find_batch_uniform",
    "find_batch_zipf",
    "upsert_batch_uniform",
    "upsert_batch_zipf",
    "call_floor_batch_identity",  # a tf.function returning its input: the floor of the batch rows
)


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
        git = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        git = "unknown"
    import tensorflow as tf

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "tf": tf.__version__,
        "git": git or "unknown",
    }


class TfdeTable(common.TableAdapter):
    def __init__(self, n, dim):
        import tensorflow as tf

        import tfde

        self.tf = tf
        self.var = tfde.Variable(
            "bench", dim=dim, initializer=0.0, trainable=False, table_creator=tfde.CuckooTableCreator(expected_rows=n)
        )

    def upsert(self, keys, vals):
        self.var.upsert(keys, vals)

    def find(self, keys):
        self.var.lookup(keys).numpy()

    def accum(self, keys, deltas):
        self.var.accum(keys, deltas)

    def remove(self, keys):
        self.var.remove(keys)

    def export_rows(self):
        return sum(int(k.shape[0]) for k, _ in self.var.export(chunk_rows=common.EXPORT_CHUNK))

    def batch_find_fn(self):
        return self.tf.function(lambda k: self.var.lookup(k))

    def batch_upsert_fn(self):
        @self.tf.function
        def upsert(k, v):
            self.var.upsert(k, v)

        return upsert


def tfde_table(n: int, dim: int, batch: int) -> dict:
    import tensorflow as tf

    inp = common.table_inputs(n, dim, batch)
    out = common.table_ops(tf, TfdeTable(n, dim), inp)
    # find_hit without a table: TensorFlow's gather of the same number of
    # random rows from a dense array (indices known in advance), materialized
    # with the same .numpy() as find_hit.
    dense = tf.constant(inp["vals"])
    perm = tf.constant(np.random.default_rng(1).permutation(n))
    out["dense_gather"] = n / common.timeit(lambda: tf.gather(dense, perm).numpy())
    return out


def tfde_memory(n: int, dim: int) -> dict:
    import tensorflow as tf

    import tfde

    var = tfde.Variable("mem", dim=dim, initializer=0.0, trainable=False)
    return {"rss_bytes_per_row": common.memory_probe(tf, var.upsert, n, dim)}


def _json_line(proc, what) -> dict:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_tfra(mode: str, *args) -> dict:
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [TFRA_PYTHON, str(HERE / "tfra_side.py"), mode, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    return _json_line(proc, f"TFRA side ({mode} {' '.join(map(str, args))})")


def run_tfde(mode: str, *args) -> dict:
    """One tfde measurement in a fresh process, like the TFRA side."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.table_bench", "--side", mode, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
        env=env,
        timeout=3600,
    )
    return _json_line(proc, f"tfde side ({mode} {' '.join(map(str, args))})")


def medians(rounds: list) -> dict:
    if not rounds:
        return {}
    return {k: statistics.median(r[k] for r in rounds) for k, v in rounds[0].items() if isinstance(v, (int, float))}


def measure(dims, n: int, batch: int, rounds: int, with_tfra: bool, log=print) -> dict:
    """{dim: {"tfde": {...}, "tfra": {...}}} with medians over alternating rounds."""
    results = {}
    for dim in dims:
        ours, theirs = [], []
        for r in range(rounds):
            if with_tfra:
                theirs.append(run_tfra("table", n, dim, batch))
            ours.append(run_tfde("table", n, dim, batch))
            log(
                f"  dim {dim} round {r + 1}/{rounds}: find_hit tfde {ours[-1]['find_hit']:,.0f}"
                + (f", TFRA {theirs[-1]['find_hit']:,.0f}" if theirs else "")
                + " keys/s"
            )
        mine, ref = medians(ours), medians(theirs)
        mine.update(run_tfde("memory", n, dim))
        if with_tfra:
            ref.update(run_tfra("memory", n, dim))
        results[dim] = {"tfde": mine, "tfra": ref, "tfde_rounds": ours, "tfra_rounds": theirs}
    return results


def report(results: dict, n: int, batch: int) -> list:
    """Lines of the side-by-side table."""
    lines = [
        f"{'table op (' + format(n, ',') + ' int64 keys)':<34}{'dim':>5}{'tfde keys/s':>14}"
        f"{'TFRA keys/s':>14}{'tfde/TFRA':>11}"
    ]
    for dim, r in results.items():
        ours, theirs = r["tfde"], r["tfra"]
        for op in OPS:
            if op not in ours:  # results from before the op was measured
                continue
            label = op.replace("_batch_", f"_batch{batch}_")
            ref = theirs.get(op)
            lines.append(
                f"{label:<34}{dim:>5}{ours[op]:>14,.0f}"
                + (f"{ref:>14,.0f}{ours[op] / ref:>10.2f}x" if ref else f"{'-':>14}{'-':>11}")
            )
        gather = f"{'dense tf.gather (no table)':<34}{dim:>5}{ours['dense_gather']:>14,.0f}"
        if "find_hit" in theirs:
            gather += f"{'':>14}{ours['dense_gather'] / theirs['find_hit']:>10.2f}x"
        lines.append(gather + f"   find_hit = {ours['find_hit'] / ours['dense_gather']:.2f}x of it")
        raw = 8 + 4 * dim
        mem = f"{'memory B/row (raw ' + str(raw) + ' B)':<34}{dim:>5}{ours['rss_bytes_per_row']:>14,.0f}"
        if "rss_bytes_per_row" in theirs:
            ratio = theirs["rss_bytes_per_row"] / ours["rss_bytes_per_row"]
            mem += f"{theirs['rss_bytes_per_row']:>14,.0f}{ratio:>10.2f}x"
        lines.append(mem + f"   tfde {ours['rss_bytes_per_row'] / raw:.2f}x raw")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="8,64,256")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; figures are medians over them")
    p.add_argument("--no-tfra", action="store_true", help="measure tfde only")
    p.add_argument("--side", nargs="+", help=argparse.SUPPRESS)  # one tfde measurement in this process, JSON out
    args = p.parse_args(argv)
    if args.side:
        mode, *vals = args.side
        if mode == "checkpoint":
            from benchmarks.checkpoint_bench import tfde_checkpoint

            print(json.dumps(tfde_checkpoint(vals[0], int(vals[1]), int(vals[2]), vals[3])))
            return 0
        fn = {"table": tfde_table, "memory": tfde_memory}[mode]
        print(json.dumps(fn(*(int(v) for v in vals))))
        return 0
    if not args.no_tfra and not Path(TFRA_PYTHON).exists():
        print(f"TFRA venv missing ({TFRA_PYTHON}); run benchmarks/setup-tfra.sh or pass --no-tfra", file=sys.stderr)
        return 2
    info = machine()
    print(
        f"machine: {info['cpu']}, {info['cores']} cores; python {info['python']}, TF {info['tf']}, "
        f"tfde git {info['git']}"
    )
    dims = [int(d) for d in args.dims.split(",")]
    results = measure(dims, args.n, args.batch, args.rounds, not args.no_tfra)
    print("\n".join(report(results, args.n, args.batch)))
    path = write_results(
        "table", {"machine": info, "n": args.n, "batch": args.batch, "rounds": args.rounds, "dims": results}
    )
    print(f"\nwritten: {path.relative_to(HERE.parent)}")
    return 0


def write_results(kind: str, payload: dict) -> Path:
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    while True:  # two runs of one kind may end in the same second: neither overwrites the other
        path = results / (f"{kind}-{stamp}.json" if n == 1 else f"{kind}-{stamp}-{n}.json")
        try:
            with path.open("x") as f:
                f.write(json.dumps(payload, indent=1, default=str))
            return path
        except FileExistsError:
            n += 1


if __name__ == "__main__":
    sys.exit(main())
