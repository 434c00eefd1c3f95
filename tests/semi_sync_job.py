"""One independent trainer against a shared Redis store, with
semi-synchronous training (tfde.semi_sync.PeriodicSync), for
tests/test_semi_sync.py: the scheme a TFRA user asked for (dense weights
per process, embeddings accumulated into Redis every k steps).

  python tests/semi_sync_job.py CONFIG.json

CONFIG: {"tag": Redis model tag, "seed": data seed, "steps": T, "every": k,
         "die_after_step": n or null (SIGKILL after that step), "out": prefix}

After each sync it writes OUT-syncN.npz: the keys, deltas and values it
pushed for the table and each of Adam's slots.  Several of these run at once on the
same tables (no engine: each process trains alone)."""

import json
import os
import signal
import sys

import numpy as np
import tensorflow as tf

import tfde

cfg = json.load(open(sys.argv[1]))
creator = tfde.RedisTableCreator({"model_tag_runtime": cfg["tag"]})
table = tfde.Variable("semi_items", dim=4, initializer="normal", seed=5, table_creator=creator)
dense = tf.Variable(tf.ones([4, 1]) * 0.1)
opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.05))

rng = np.random.default_rng(cfg["seed"])
ids = (rng.zipf(1.3, size=(cfg["steps"], 32)) % 50).astype(np.int64)
labels = (ids % 2).astype(np.float32)

sync = tfde.semi_sync.PeriodicSync(cfg["every"], [table], opt, [dense])
sync.start()


@tf.function
def step(batch_ids, y):
    with tf.GradientTape() as tape:
        pred = tf.squeeze(tf.matmul(tfde.embedding_lookup(table, batch_ids), dense), 1)
        loss = tf.reduce_mean(tf.square(pred - y))
    variables = [table.step_buffer, dense]
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))


def record(number, pending):
    names = {id(table): "table", **{id(s): name for name, s in table.slots.items()}}
    out = {}
    for var, keys, deltas, values in pending:
        name = names[id(var)]
        out[f"{name}/keys"], out[f"{name}/deltas"], out[f"{name}/values"] = keys, deltas, values
    np.savez(f"{cfg['out']}-sync{number}.npz", **out)


synced = 0
for number in range(cfg["steps"]):
    step(tf.constant(ids[number]), tf.constant(labels[number]))
    pending = sync.pending() if sync.steps + 1 >= sync.every else None
    if sync.after_step():
        record(synced, pending)  # written once the push is done
        synced += 1
    if number == cfg.get("die_after_step"):
        os.kill(os.getpid(), signal.SIGKILL)  # a trainer lost between syncs
pending = sync.pending()
sync.stop()
record(synced, pending)
print("done", flush=True)
