"""Redis backend benchmark: tfde's RedisTable beside a plain redis-py pipeline.

Both sides do the same work on the same layout (the buckets, fields and
values tfde uses, see docs/formats.md): training-sized batches of keys are looked up
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

from benchmarks import common

HERE = Path(__file__).resolve().parent
TFRA_PYTHON = common.TFRA_PYTHON


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


def measure(
    n: int = 200_000, dim: int = 64, batch: int = 4096, port: int = 6379, buckets: int = 2, with_tfra: bool = True
) -> dict:
    """keys/s of tfde's RedisTable, a plain redis-py pipeline and TFRA's Redis table."""
    import redis
    import tensorflow as tf

    import tfde

    tag = f"tfde-bench-{uuid.uuid4().hex[:8]}"
    creator = tfde.RedisTableCreator(
        {"redis_host_port": port, "model_tag_runtime": tag, "storage_slice": buckets, "keys_sending_size": 1024}
    )
    table = creator.create("bench", tf.int64, tf.float32, dim)
    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 62, size=n, replace=False).astype(np.int64)
    vals = rng.standard_normal((n, dim), dtype=np.float32)
    batches = [slice(s, s + batch) for s in range(0, n, batch)]
    kt = [tf.constant(keys[b]) for b in batches]
    vt = [tf.constant(vals[b]) for b in batches]
    zeros = tf.zeros([1, dim])

    def tfde_insert():
        for k, v in zip(kt, vt):
            table.insert(k, v)

    def tfde_find():
        for k in kt:
            table.find(k, zeros)[0].numpy()

    # The plain pipeline: same buckets, fields and bytes, precomputed.
    client = redis.Redis(port=port)
    hashes = tfde.hashing.stable_hash(tf.constant(keys)).numpy()
    plans = []
    for b in batches:
        fields = table._fields(keys[b])
        plan = list(table._plan(hashes[b]))
        rows = [vals[b][i].tobytes() for i in range(len(fields))]
        plans.append([(table._buckets[bk], [fields[i] for i in chunk], [rows[i] for i in chunk]) for bk, chunk in plan])

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
        results = alternate({"plain_insert": plain_insert, "tfde_insert": tfde_insert}, n)
        results.update(alternate({"plain_find": plain_find, "tfde_find": tfde_find}, n))
    finally:
        stale = list(client.scan_iter(match=f"{tag}:*"))
        if stale:
            client.delete(*stale)

    tfra = {}
    if with_tfra:
        proc = subprocess.run(
            [TFRA_PYTHON, str(HERE / "tfra_redis_side.py"), str(n), str(dim), str(batch), str(port), str(buckets), "7"],
            capture_output=True,
            text=True,
            env={**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"},
            timeout=1800,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"TFRA Redis side failed:\n{proc.stderr[-3000:]}")
        tfra = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"n": n, "dim": dim, "batch": batch, "buckets": buckets, "port": port, **results, "tfra": tfra}


def report(r: dict) -> list:
    lines = [
        f"Redis (127.0.0.1:{r['port']}): {r['n']:,} int64 keys, float32 rows of dim {r['dim']}, batches of "
        f"{r['batch']}, {r['buckets']} buckets; median of 7 alternating rounds",
        f"{'redis op':<14}{'tfde keys/s':>14}{'TFRA keys/s':>14}{'tfde/TFRA':>11}{'plain pipeline':>16}"
        f"{'tfde/plain':>12}",
    ]
    for op in ("find", "insert"):
        ours, plain, theirs = r[f"tfde_{op}"], r[f"plain_{op}"], r["tfra"].get(op)
        lines.append(
            f"{op:<14}{ours:>14,.0f}"
            + (f"{theirs:>14,.0f}{ours / theirs:>10.2f}x" if theirs else f"{'-':>14}{'-':>11}")
            + f"{plain:>16,.0f}{ours / plain:>11.0%}"
        )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--buckets", type=int, default=2)
    p.add_argument("--no-tfra", action="store_true", help="skip TFRA's Redis table")
    args = p.parse_args(argv)
    from benchmarks.table_bench import machine, write_results

    if not args.no_tfra and not Path(TFRA_PYTHON).exists():
        print(f"TFRA venv missing ({TFRA_PYTHON}); run benchmarks/setup-tfra.sh or pass --no-tfra", file=sys.stderr)
        return 2
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; TF {info['tf']}, tfde git {info['git']}")
    r = measure(args.n, args.dim, args.batch, args.port, args.buckets, not args.no_tfra)
    print("\n".join(report(r)))
    path = write_results("redis", {"machine": info, **r})
    print(f"\nwritten: {path.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
