"""Saving across processes: a save killed with SIGKILL leaves the previous
checkpoint loadable; a fresh process restores and trains on exactly as the
saving process does; the serving export answers in a plain TensorFlow
process (tfde not imported) like the trained model, and takes incremental
exports."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from distributed_check import redis_tag
from saving_model import KEYS, assert_same, build, data, layer, snapshot, train

import tfde

JOB = Path(__file__).with_name("saving_job.py")
ENV = {**os.environ, "PYTHONPATH": str(JOB.parent.parent), "TF_CPP_MIN_LOG_LEVEL": "3"}


def _saving_dir(directory, kind):
    """The directory a save in progress writes to (None while there is none)."""
    if kind == "tfde":
        found = [e for e in os.listdir(directory) if e.endswith(".partial")] if os.path.isdir(directory) else []
    else:
        found = [e for e in os.listdir(directory) if e.endswith("_temp")] if os.path.isdir(directory) else []
    return found[0] if found else None


def _stop(proc):
    """SIGSTOP, returning once the process is stopped (state T in /proc)."""
    proc.send_signal(signal.SIGSTOP)
    for _ in range(2000):
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise AssertionError(f"process {proc.pid} did not stop")


@pytest.mark.parametrize("kind", ["tfde", "tf"])
def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path, kind):
    directory = str(tmp_path / "ck")
    proc = subprocess.Popen(
        [sys.executable, str(JOB), "save-forever", directory, kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    try:
        lines = []
        deadline = time.monotonic() + 240
        while not (lines and lines[-1].startswith("saving 2")):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)[-3000:]
            lines.append(line)
        while True:
            while _saving_dir(directory, kind) is None:  # a save has started writing
                assert proc.poll() is None and time.monotonic() < deadline, "the job stopped before saving again"
                time.sleep(0.002)
            # Frozen, then looked at again: the kill must land inside a
            # save, and a save that finished between the look and the
            # signal is let go for the next one (no race with the poll).
            _stop(proc)
            if _saving_dir(directory, kind) is not None:
                break
            proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert _saving_dir(directory, kind) is not None, "killed after the save completed: nothing tested"

    var = tfde.Variable("big", dim=32, initializer=-1.0)
    if kind == "tfde":
        restored = tfde.saving.CheckpointManager(directory, var=var).restore()
        assert restored.endswith("ckpt-000000001"), restored
    else:
        latest = tf.train.latest_checkpoint(directory)
        assert latest.endswith("ckpt-1"), latest
        tf.train.Checkpoint(var=var).restore(latest)
    keys = tf.constant([0, 1, 199_999, 399_999], tf.int64)
    assert int(var.size()) == 400_000
    np.testing.assert_array_equal(var.lookup(keys).numpy(), np.ones([4, 32], np.float32))  # the first version


@pytest.mark.parametrize("kind,backend", [("tfde", "cuckoo"), ("tf", "cuckoo"), ("tf", "redis")])
def test_a_fresh_process_continues_training_exactly(tmp_path, kind, backend):
    """Save after 12 steps; train 10 more here; a fresh process restores and
    trains the same 10 steps: the same rows, slots, policy state, dense
    weights, step and predictions.  (Redis: table_store_mode 0, the rows in
    the checkpoint; the restore puts them back into the shared tables.)"""
    with redis_tag() as tag:
        model = build(backend, tag)
        train(model, 0, epochs=2)
        directory = str(tmp_path / "ck")
        if kind == "tfde":
            tfde.saving.CheckpointManager(directory, model=model, optimizer=model.optimizer).save()
        else:
            tf.train.CheckpointManager(
                tf.train.Checkpoint(model=model, optimizer=model.optimizer), directory, max_to_keep=1
            ).save()
        train(model, 1, steps=10)
        expected = snapshot(model)
        out = tmp_path / "continued.npz"
        proc = subprocess.run(
            [sys.executable, str(JOB), "continue", directory, str(out), kind, backend, tag],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert expected["iterations"] == 22
        assert_same(dict(np.load(out)), expected)


# ------------------------------------------------------------ serving

SERVE = """
import json, sys
import numpy as np, tensorflow as tf
tf.load_op_library(sys.argv[1])
model = tf.saved_model.load(sys.argv[2])
x = np.load(sys.argv[3])
out = model.signatures["serving_default"](items=tf.constant(x["items"]), user=tf.constant(x["user"]))
np.save(sys.argv[4], list(out.values())[0].numpy())
assert "tfde" not in sys.modules, "the serving process imported tfde"
print(json.dumps([v["name"] for v in json.loads(model.tfde_variables().numpy())]))
"""


def _serve(tmp_path, saved_model, x, name):
    from tfde import _native

    np.savez(tmp_path / "x.npz", items=x[0].numpy(), user=x[1].numpy().astype("S"))
    out = tmp_path / f"{name}.npy"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, str(_native.build()), str(saved_model), str(tmp_path / "x.npz"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return np.load(out), json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.keras
def test_serving_export_answers_like_the_trained_model(tmp_path):
    model = build("cuckoo", None)
    train(model, 0, epochs=2)
    summary = tfde.export_for_serving(model, str(tmp_path / "serving"))
    assert [v["name"] for v in summary["variables"]] == ["item_emb", "user_emb"]
    assert summary["variables"][0]["rows"] == int(layer(model, "item_emb").params.size()) > 50
    held_out = data(7, n=64)[0]  # ids the model saw and ids it never saw (missing keys)
    expected = model.predict(held_out, verbose=0)
    got, names = _serve(tmp_path, tmp_path / "serving", held_out, "served")
    assert names == ["item_emb", "user_emb"]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.keras
def test_incremental_export_updates_a_serving_copy(tmp_path):
    """Export for serving at step 12, train on (new rows) and restrict (keys
    evicted), export the changes since step 12 and apply them to the loaded
    serving copy: its tables then hold exactly the model's rows."""
    model = build("cuckoo", None)
    train(model, 0, epochs=2)
    tfde.export_for_serving(model, str(tmp_path / "serving"))
    since = int(model.optimizer.iterations.numpy())
    train(model, 1)
    var = layer(model, "item_emb").params
    removed = var.restrict(num_reserved=40)
    assert removed > 0
    info = tfde.export_changes([var, layer(model, "user_emb").params], since, str(tmp_path / "delta"))
    assert info["variables"][0]["removed"] >= removed and info["variables"][0]["changed"] > 0

    serving = tf.saved_model.load(str(tmp_path / "serving"))
    users = tf.constant([f"u{i}" for i in range(40)])
    items = tf.constant(KEYS)
    assert np.abs(serving.tfde_lookup_0(items).numpy() - var.lookup(items).numpy()).max() > 1e-3
    tfde.saving.apply_changes(serving, str(tmp_path / "delta"))
    # Every row, evicted keys included (they read their initial value again).
    np.testing.assert_array_equal(serving.tfde_lookup_0(items).numpy(), var.lookup(items).numpy())
    np.testing.assert_array_equal(
        serving.tfde_lookup_1(users).numpy(), layer(model, "user_emb").params.lookup(users).numpy()
    )
    kept = var.lookup(items, return_exists=True)[1].numpy()
    assert int(serving.tfde_remove_0(tf.constant(KEYS[~kept]))) == 0  # the evicted keys are gone there too
    assert int(serving.tfde_remove_0(tf.constant(KEYS[kept]))) == kept.sum()  # and the kept ones are there


LOOKUP = """
import sys
import numpy as np, tensorflow as tf
tf.load_op_library(sys.argv[1])
model = tf.saved_model.load(sys.argv[2])
x = np.load(sys.argv[3])
out = model.signatures["serving_default"](items=tf.constant(x["items"]), user=tf.constant(x["user"]))
np.savez(sys.argv[4], predict=list(out.values())[0].numpy(), items=model.tfde_lookup_0(tf.constant(x["keys"])).numpy())
assert "tfde" not in sys.modules, "the serving process imported tfde"
"""


@pytest.mark.keras
def test_serving_export_can_keep_reading_redis(tmp_path):
    """rows="store": the SavedModel reads the Redis tables live (native op,
    no Python): it answers like the model, and sees rows written later."""
    from tfde import _native

    with redis_tag() as tag:
        model = build("redis", tag)
        train(model, 0, epochs=2)
        summary = tfde.export_for_serving(model, str(tmp_path / "serving"), rows="store")
        assert [v["source"] for v in summary["variables"]] == ["store", "store"]
        held_out = data(7, n=64)[0]
        np.savez(tmp_path / "x.npz", items=held_out[0].numpy(), user=held_out[1].numpy().astype("S"), keys=KEYS)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

        def serve(name):
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    LOOKUP,
                    str(_native.build()),
                    str(tmp_path / "serving"),
                    str(tmp_path / "x.npz"),
                    str(tmp_path / name),
                ],
                capture_output=True,
                text=True,
                env=env,
                cwd="/",
                timeout=300,
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
            return dict(np.load(tmp_path / name))

        first = serve("first.npz")
        np.testing.assert_allclose(first["predict"], model.predict(held_out, verbose=0), rtol=1e-6, atol=1e-6)
        var = layer(model, "item_emb").params
        np.testing.assert_array_equal(first["items"], var.lookup(tf.constant(KEYS)).numpy())
        var.upsert(tf.constant(KEYS[:5]), tf.fill([5, 4], 7.5))  # the training side writes on
        second = serve("second.npz")
        np.testing.assert_array_equal(second["items"][:5], np.full([5, 4], 7.5, np.float32))
        np.testing.assert_array_equal(second["items"], var.lookup(tf.constant(KEYS)).numpy())
