"""Processes of tests/test_saving_processes.py.

python tests/saving_job.py save-forever DIR KIND    (KIND: tfde | tf)
    fills a 400K-row table, saves it (prints "saved 1"), changes every
    row, then saves again and again (prints "saving N") until killed.
python tests/saving_job.py continue DIR OUT.npz KIND BACKEND TAG
    restores the latest checkpoint in DIR (KIND tfde: tfde.CheckpointManager,
    tf: tf.train.CheckpointManager) into a fresh model on BACKEND (cuckoo,
    or redis under model tag TAG), trains 10 steps and writes
    saving_model.snapshot() to OUT.npz.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfde  # noqa: E402

ROWS, DIM = 400_000, 32


def table_rows(version):
    return tf.fill([ROWS, DIM], float(version))


def save_forever(directory, kind):
    var = tfde.Variable("big", dim=DIM, initializer=0.0)
    keys = tf.range(ROWS, dtype=tf.int64)
    var.upsert(keys, table_rows(1))
    if kind == "tfde":
        manager = tfde.saving.CheckpointManager(directory, var=var)
        save = manager.save
    else:
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(var=var), directory, max_to_keep=3)
        save = lambda step: manager.save(checkpoint_number=step)  # noqa: E731
    save(1)
    print("saved 1", flush=True)
    var.upsert(keys, table_rows(2))
    step = 2
    while True:
        print(f"saving {step}", flush=True)
        save(step)
        step += 1


def continue_training(directory, out, kind, backend, tag):
    sys.path.insert(0, os.path.dirname(__file__))
    from saving_model import build, snapshot, train

    model = build(backend, tag if backend == "redis" else None)
    if kind == "tfde":
        assert tfde.saving.CheckpointManager(directory, model=model, optimizer=model.optimizer).restore()
    else:
        latest = tf.train.latest_checkpoint(directory)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(latest).expect_partial()
    train(model, 1, steps=10)
    np.savez(out, **snapshot(model))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "save-forever":
        save_forever(sys.argv[2], sys.argv[3])
    elif mode == "continue":
        continue_training(*sys.argv[2:7])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
