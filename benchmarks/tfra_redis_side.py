"""TFRA's side of benchmarks/redis_bench.py: run with the interpreter of the
TFRA venv (benchmarks/setup-tfra.sh).  Same keys, rows, batches and
method as tfde's side; prints one JSON line of keys/s.

  TF_USE_LEGACY_KERAS=1 $TFRA_PYTHON benchmarks/tfra_redis_side.py N DIM BATCH PORT BUCKETS ROUNDS
"""

import json
import statistics
import sys
import time
import uuid

import numpy as np
import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

n, dim, batch, port, buckets, rounds = (int(x) for x in sys.argv[1:7])
tag = f"tfra-bench-{uuid.uuid4().hex[:8]}"
path = f"/tmp/{tag}.json"
tags = [f"{{{i}}}" for i in range(buckets)]
with open(path, "w") as f:
    json.dump(
        {
            "redis_connection_mode": 2,
            "redis_host_ip": ["127.0.0.1"],
            "redis_host_port": [port],
            "model_tag_runtime": tag,
            "model_tag_import": tag,
            "storage_slice": buckets,
            "storage_slice_import": buckets,
            "redis_hash_tags_runtime": tags,
            "redis_hash_tags_import": tags,
            "keys_sending_size": 1024,
        },
        f,
    )
creator = de.RedisTableCreator(de.RedisTableConfig(redis_config_abs_dir=path))
var = de.get_variable("bench", key_dtype=tf.int64, value_dtype=tf.float32, dim=dim, initializer=0.0, kv_creator=creator)
rng = np.random.default_rng(0)  # the same inputs as tfde's side
keys = rng.choice(1 << 62, size=n, replace=False).astype(np.int64)
vals = rng.standard_normal((n, dim), dtype=np.float32)
kt = [tf.constant(keys[s : s + batch]) for s in range(0, n, batch)]
vt = [tf.constant(vals[s : s + batch]) for s in range(0, n, batch)]


def insert():
    for k, v in zip(kt, vt):
        var.upsert(k, v)


def find():
    for k in kt:
        var.lookup(k).numpy()


out = {}
for name, fn in (("insert", insert), ("find", find)):
    fn()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    out[name] = n / statistics.median(ts)
var.clear()
print(json.dumps({"system": "tfra-0.8.1-redis", **out}))
