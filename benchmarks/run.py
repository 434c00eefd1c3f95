"""All benchmarks in one run: tfde beside TFRA 0.8.1 on this machine.

  python -m benchmarks.run                # everything (about 35 minutes on 2 cores)
  python -m benchmarks.run --quick        # smaller inputs, 1 round: a smoke run of every part (~3 minutes)
  python -m benchmarks.run --only table   # one part: table, redis or e2e

Parts (each also runs alone, see its module):
  table  benchmarks/table_bench.py  cuckoo table ops at dims 8, 64, 256; uniform and Zipf batches; memory
  redis  benchmarks/redis_bench.py  Redis backend find/insert vs TFRA's Redis table and a plain pipeline
  e2e    benchmarks/e2e_bench.py    the demo two-tower model trained by each system (cuckoo and Redis)

Needs the TFRA venv (benchmarks/setup-tfra.sh) and a redis-server on
--port.  Prints the machine, versions, git hash and one side-by-side table,
and writes benchmarks/results/run-<time>.json (and results/latest.json) so a
later run can be compared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import e2e_bench, redis_bench, table_bench

HERE = Path(__file__).resolve().parent
PARTS = ("table", "redis", "e2e")


def versions() -> dict:
    """Versions of both environments (TFRA's is asked through its interpreter)."""
    out = {}
    try:
        proc = subprocess.run(
            [
                table_bench.TFRA_PYTHON,
                "-c",
                "import tensorflow as tf, tensorflow_recommenders_addons as t, tf_keras as k;"
                "print(tf.__version__, t.__version__, k.__version__)",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={"TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        tf_v, tfra_v, keras_v = proc.stdout.split()[-3:]
        out["reference"] = f"TFRA {tfra_v} on TF {tf_v}, tf-keras {keras_v}"
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        out["reference"] = f"unavailable ({e})"
    import keras
    import tensorflow as tf

    out["tfde"] = f"TF {tf.__version__}, Keras {keras.__version__}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=PARTS, action="append", help="run only this part (repeatable)")
    p.add_argument("--quick", action="store_true", help="100K keys, dim 64 only, 1 round, small e2e")
    p.add_argument("--rounds", type=int, default=3, help="alternating fresh-process rounds of the table part")
    p.add_argument("--port", type=int, default=6379)
    args = p.parse_args(argv)
    parts = args.only or PARTS
    if not Path(table_bench.TFRA_PYTHON).exists():
        print(
            f"TFRA venv missing ({table_bench.TFRA_PYTHON}): run benchmarks/setup-tfra.sh (or set TFRA_PYTHON)",
            file=sys.stderr,
        )
        return 2
    n, dims, rounds = (100_000, [64], 1) if args.quick else (1_000_000, [8, 64, 256], args.rounds)
    info = {**table_bench.machine(), **versions()}
    header = [
        f"machine: {info['cpu']}, {info['cores']} cores, python {info['python']}; tfde git {info['git']}",
        f"tfde: {info['tfde']}; reference: {info['reference']}",
    ]
    print("\n".join(header), flush=True)
    results, lines = {"machine": info, "quick": args.quick}, []
    t0 = time.perf_counter()
    if "table" in parts:
        print(f"table ops: {n:,} keys, dims {dims}, {rounds} round(s)", flush=True)
        r = table_bench.measure(dims, n, 4096, rounds, True, log=lambda m: print(m, flush=True))
        results["table"] = {"n": n, "batch": 4096, "rounds": rounds, "dims": r}
        lines += table_bench.report(r, n, 4096) + [""]
    if "redis" in parts:
        print("redis ops", flush=True)
        r = redis_bench.measure(n=50_000 if args.quick else 200_000, port=args.port)
        results["redis"] = r
        lines += redis_bench.report(r) + [""]
    if "e2e" in parts:
        print("end to end", flush=True)
        r = e2e_bench.measure(
            ["cuckoo", "redis"],
            200_000 if args.quick else 1_000_000,
            1 if args.quick else 2,
            True,
            args.port,
            log=lambda m: print(m, flush=True),
            redis_interactions=50_000 if args.quick else 300_000,
            rounds=1 if args.quick else 3,
        )
        results["e2e"] = r
        lines += e2e_bench.report(r)
    print("\n" + "\n".join(header + [""] + lines))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    path = table_bench.write_results("run", results)
    if not args.quick and set(parts) == set(PARTS):
        (HERE / "results" / "latest.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"written: {path.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
