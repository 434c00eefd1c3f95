"""Redis backend benchmark: tfde's RedisTable beside a plain redis-py pipeline.

Both sides do the same work on the same layout (the buckets, fields and
values tfde uses, see README): training-sized batches of keys are looked up
with one pipeline of HMGET per bucket chunk, and written with HSET.  The plain
side gets its fields, buckets and value bytes precomputed outside the timed
region (the strictest baseline); tfde's side is timed from tensors in to
tensors out, as a model uses it.  The two sides alternate, 7 rounds.

  python -m benchmarks.redis_bench [--n 200000] [--dim 64] [--batch 4096] [--port 6379]

Needs a Redis server (default 127.0.0.1:6379); uses its own model tag and
deletes its keys afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def alternate(fns: dict, keys_per_call: int, repeats: int = 7) -> dict:
    """keys/s of each function, median over `repeats` rounds in which the
    functions run one after another (so host drift hits all alike)."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: keys_per_call / statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--buckets", type=int, default=2)
    p.add_argument("--tfra-python", default=str(Path.home() / ".cache/tfde-anchors/tfra/bin/python"))
    p.add_argument("--no-tfra", action="store_true", help="skip TFRA's Redis table")
    args = p.parse_args(argv)

    import redis
    import tensorflow as tf

    import tfde
    from benchmarks.table_bench import machine

    tag = f"tfde-bench-{uuid.uuid4().hex[:8]}"
    creator = tfde.RedisTableCreator({"redis_host_port": args.port, "model_tag_runtime": tag,
                                      "storage_slice": args.buckets, "keys_sending_size": 1024})
    table = creator.create("bench", tf.int64, tf.float32, args.dim)
    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 62, size=args.n, replace=False).astype(np.int64)
    vals = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    batches = [slice(s, s + args.batch) for s in range(0, args.n, args.batch)]
    kt = [tf.constant(keys[b]) for b in batches]
    vt = [tf.constant(vals[b]) for b in batches]
    zeros = tf.zeros([1, args.dim])

    def tfde_insert():
        for k, v in zip(kt, vt):
            table.insert(k, v)

    def tfde_find():
        for k in kt:
            table.find(k, zeros)[0].numpy()

    # The plain pipeline: same buckets, fields and bytes, precomputed.
    client = redis.Redis(port=args.port)
    hashes = tfde.hashing.stable_hash(tf.constant(keys)).numpy()
    plans = []
    for b in batches:
        fields = table._fields(keys[b])
        plan = list(table._plan(hashes[b]))
        rows = [vals[b][i].tobytes() for i in range(len(fields))]
        plans.append([(table._buckets[bk], [fields[i] for i in chunk], [rows[i] for i in chunk])
                      for bk, chunk in plan])

    def plain_insert():
        for plan in plans:
            pipe = client.pipeline(transaction=False)
            for name, fields, rows in plan:
                pipe.hset(name, mapping=dict(zip(fields, rows)))
            pipe.execute()

    def plain_find():
        for plan in plans:
            pipe = client.pipeline(transaction=False)
            for name, fields, _ in plan:
                pipe.hmget(name, fields)
            for values in pipe.execute():
                np.frombuffer(b"".join(values), np.float32)

    try:
        results = alternate({"plain_insert": plain_insert, "tfde_insert": tfde_insert}, args.n)
        results.update(alternate({"plain_find": plain_find, "tfde_find": tfde_find}, args.n))
    finally:
        stale = list(client.scan_iter(match=f"{tag}:*"))
        if stale:
            client.delete(*stale)

    tfra = {}
    if not args.no_tfra:
        if not Path(args.tfra_python).exists():
            print(f"TFRA venv missing ({args.tfra_python}); run ../shared/anchors/setup-tfra.sh or pass --no-tfra",
                  file=sys.stderr)
            return 2
        proc = subprocess.run([args.tfra_python, str(HERE / "tfra_redis_side.py"), str(args.n), str(args.dim),
                               str(args.batch), str(args.port), str(args.buckets), "7"], capture_output=True,
                              text=True, env={**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"},
                              timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"TFRA Redis side failed:\n{proc.stderr[-3000:]}")
        tfra = json.loads(proc.stdout.strip().splitlines()[-1])

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; TF {info['tf']}, tfde git {info['git']}; "
          f"redis-server on 127.0.0.1:{args.port}")
    print(f"{args.n:,} int64 keys, float32 rows of dim {args.dim}, batches of {args.batch}, {args.buckets} buckets;"
          " median of 7 alternating rounds")
    print(f"\n{'operation':<10}{'tfde keys/s':>14}{'plain pipeline keys/s':>24}{'tfde/plain':>12}"
          f"{'TFRA Redis keys/s':>20}{'tfde/TFRA':>11}")
    for op in ("find", "insert"):
        ours, plain = results[f"tfde_{op}"], results[f"plain_{op}"]
        theirs = tfra.get(op)
        print(f"{op:<10}{ours:>14,.0f}{plain:>24,.0f}{ours / plain:>11.0%}"
              + (f"{theirs:>20,.0f}{ours / theirs:>10.2f}x" if theirs else f"{'-':>20}{'-':>11}"))
    out = HERE / "results" / f"redis-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": info, "n": args.n, "dim": args.dim, "batch": args.batch,
                               "buckets": args.buckets, **results, "tfra": tfra}, indent=1))
    print(f"\nwritten: {out.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
