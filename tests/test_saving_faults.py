"""Faults while saving and restoring lose nothing (issue 15: 6, 8, 10, 11):

* a checkpoint of another optimizer (other slots) is refused before it
  changes anything (tf.train.Checkpoint and tfde.CheckpointManager, models
  built and not built yet; this file runs under both Keras flavours);
* a restore that finds a damaged chunk (rows or a slot, cuckoo and Redis
  table_store_mode 0) raises and leaves every live key as it was;
* import_(replace=True) of bad input raises and leaves the table as it was
  (every backend, eager and tf.function);
* a save killed (SIGKILL) at any point of its commit leaves a complete
  checkpoint, the previous or the new one (one process and two workers).
"""

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import LEGACY_KERAS
from distributed_check import redis_tag
from redis_servers import free_port
from saving_model import creator_for

import tfde
from backends import BACKENDS, VARIABLE_BACKENDS
from tfde.saving import format as fmt
from tfde.saving import manager as manager_module

K = tf.keras
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.fixture
def tag():
    with redis_tag() as t:
        yield t


def table_state(var):
    """{table family: {key: row}} of every stored key of `var` and its slots."""
    out = {}
    for name, v in [("rows", var)] + sorted(var.slots.items()):
        rows = {}
        for keys, values in v.export():
            for k, r in zip(keys.numpy().tolist(), values.numpy()):
                rows[k] = r.tolist()
        out[name] = rows
    return out


# ------------------------------------------------------------ 6: another optimizer's checkpoint

IDS = np.arange(60, dtype=np.int64).reshape(20, 3)
LABELS = np.ones((20, 1), np.float32)


def emb_model(optimizer, build):
    """A model not built until called (Sequential without an input shape),
    or built (`build`: called on a batch, optimizer not built), or trained
    (`build == "trained"`: one epoch, optimizer and its slots built)."""
    model = K.Sequential(
        [
            tfde.keras.layers.Embedding(4, name="emb", restrict_policy=tfde.FrequencyRestrictPolicy),
            K.layers.Flatten(),
            K.layers.Dense(1, kernel_initializer="zeros"),
        ]
    )
    model.compile(optimizer=tfde.DynamicEmbeddingOptimizer(optimizer), loss="mse")
    if build == "trained":
        model.fit(IDS[::-1].copy(), LABELS, batch_size=10, verbose=0)
    elif build == "built":
        model(IDS[:1])
    return model


def model_state(model):
    opt = model.optimizer
    out = {"lr": float(opt.learning_rate.numpy()), "iterations": int(opt.iterations.numpy())}
    if model.built:
        out["dense"] = [w.tolist() for w in model.layers[-1].get_weights()]
        out["tables"] = table_state(model.layers[0].params)
    return out


@pytest.mark.keras
@pytest.mark.parametrize("build", ["unbuilt", "built", "trained"])
@pytest.mark.parametrize("kind", ["tf_checkpoint", "tfde_manager"])
def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path, kind, build):
    """An Adam checkpoint (slots m, v) restored into a model compiled with
    SGD(momentum) (slot momentum): CheckpointError naming both slot sets,
    and the model, its optimizer and its tables are as before."""
    adam = emb_model(K.optimizers.Adam(0.01), "built")
    adam.fit(IDS, LABELS, batch_size=5, verbose=0)
    assert {"m", "v"} <= set(adam.layers[0].params.slots)
    if kind == "tf_checkpoint":
        path = tf.train.Checkpoint(model=adam, optimizer=adam.optimizer).save(str(tmp_path / "ck"))
    else:
        tfde.saving.CheckpointManager(str(tmp_path), model=adam, optimizer=adam.optimizer).save()

    sgd = emb_model(K.optimizers.SGD(0.1, momentum=0.9), build)
    before = model_state(sgd)
    expected = (
        tfde.ConfigError if kind == "tfde_manager" and build == "unbuilt" and not LEGACY_KERAS else tfde.CheckpointError
    )  # Keras 3 restores only into built models, and says so first
    with pytest.raises(expected) as refused:
        if kind == "tf_checkpoint":
            tf.train.Checkpoint(model=sgd, optimizer=sgd.optimizer).restore(path)
        else:
            tfde.saving.CheckpointManager(str(tmp_path), model=sgd, optimizer=sgd.optimizer).restore()
    if expected is tfde.CheckpointError:
        assert "(Adam) keeps the slots [m, v]" in str(refused.value)
        assert "(SGD) keeps [momentum]" in str(refused.value)
        assert "Restore into a model compiled with the optimizer the checkpoint was written with" in str(refused.value)
    assert model_state(sgd) == before
    if build == "unbuilt":  # a model built after the refusal gets nothing of the refused checkpoint
        sgd(IDS[:1])
        var = sgd.layers[0].params
        assert int(var.size()) == 0 and sorted(var.slots) == ["policy-frequency"]
        if kind == "tfde_manager":  # checked before TensorFlow's restore starts: no deferred restore either
            assert not np.any(sgd.layers[-1].get_weights()[0])
    sgd.fit(IDS, LABELS, batch_size=5, verbose=0)  # and it trains on with its own optimizer
    assert sorted(sgd.layers[0].params.slots) == ["momentum", "policy-frequency"]


@pytest.mark.keras
def test_the_slot_record_accepts_the_same_optimizer(tmp_path):
    """The record is checked, not merely present: Adam restores into Adam
    (another instance, another learning rate is the checkpoint's business)."""
    adam = emb_model(K.optimizers.Adam(0.01), "built")
    adam.fit(IDS, LABELS, batch_size=5, verbose=0)
    manager = tfde.saving.CheckpointManager(str(tmp_path), model=adam, optimizer=adam.optimizer)
    manager.save()
    again = emb_model(K.optimizers.Adam(0.5), "built")
    tfde.saving.CheckpointManager(str(tmp_path), model=again, optimizer=again.optimizer).restore()
    assert model_state(again) == model_state(adam)


# ------------------------------------------------------------ 8: a damaged checkpoint changes nothing


def _flip_a_byte_of(directory, value: np.ndarray):
    """Flips one byte inside the bytes of `value` in the data file holding them."""
    marker = np.ascontiguousarray(value).tobytes()
    for root, _, files in os.walk(directory):
        for f in sorted(files):
            if ".data-" not in f:
                continue
            path = os.path.join(root, f)
            data = open(path, "rb").read()
            at = data.find(marker)
            if at >= 0:
                with open(path, "r+b") as fh:
                    fh.seek(at + len(marker) // 2)
                    b = fh.read(1)
                    fh.seek(at + len(marker) // 2)
                    fh.write(bytes([b[0] ^ 0x5A]))
                return path
    raise AssertionError("no data file holds the chunk")


@pytest.mark.parametrize("stream", ["rows", "slot:m"])
@pytest.mark.parametrize("kind", ["tf_checkpoint", "tfde_manager"])
@pytest.mark.parametrize("backend", ["cuckoo", "redis"])
def test_a_damaged_chunk_is_refused_before_the_tables_change(tmp_path, monkeypatch, tag, backend, kind, stream):
    """The last chunk of the rows (or of slot m) fails its checksum: the
    restore raises CheckpointError naming the file, and every key's row and
    slot is what it was before the restore (Redis: table_store_mode 0, whose
    restore replaces what Redis holds)."""
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 2048)  # 6 rows of dim 64 a chunk: the damage is part-way
    creator = creator_for("redis", tag, mode=0) if backend == "redis" else None
    var = tfde.Variable("damaged", dim=64, initializer=0.0, table_creator=creator)
    keys = tf.range(40, dtype=tf.int64)
    var.upsert(keys, tf.random.stateless_uniform([40, 64], seed=[1, 1]))
    var.slot("m", 0.0).upsert(keys, tf.random.stateless_uniform([40, 64], seed=[2, 2]))
    if kind == "tf_checkpoint":
        path = tf.train.Checkpoint(var=var).save(str(tmp_path / "ck"))
        prefix, where = path, "ck-1"
    else:
        manager = tfde.saving.CheckpointManager(str(tmp_path / "m"), var=var)
        saved = manager.save(step=1)
        prefix, where = os.path.join(saved, "worker-00000-of-00001"), "worker-00000-of-00001"
    # The live state moves on: some keys change, some go, some arrive.
    var.upsert(tf.range(30, 50, dtype=tf.int64), tf.fill([20, 64], 7.0))
    var.remove(tf.range(0, 10, dtype=tf.int64))
    var.slots["m"].upsert(tf.range(45, 50, dtype=tf.int64), tf.fill([5, 64], -3.0))
    before = table_state(var)

    names = sorted(n for n, _ in tf.train.list_variables(prefix) if f"/{stream}/rows/" in n)
    assert len(names) >= 5, names  # several chunks, the damaged one the last
    _flip_a_byte_of(str(tmp_path), tf.train.load_checkpoint(prefix).get_tensor(names[-1]))
    with pytest.raises(tfde.CheckpointError, match=f"{where}.*(corrupted|Checksum|checksum)"):
        if kind == "tf_checkpoint":
            tf.train.Checkpoint(var=var).restore(path)
        else:
            manager.restore()
    assert table_state(var) == before


def test_a_slot_of_another_dim_is_refused_before_the_tables_change(tmp_path):
    var = tfde.Variable("slotdim", dim=2, initializer=0.0)
    var.upsert(tf.constant([1, 2], tf.int64), tf.ones([2, 2]))
    var.slot("acc", 0.0, dim=1).upsert(tf.constant([1], tf.int64), tf.ones([1, 1]))
    path = tf.train.Checkpoint(var=var).save(str(tmp_path / "ck"))
    other = tfde.Variable("slotdim", dim=2, initializer=0.0)
    other.upsert(tf.constant([5], tf.int64), tf.ones([1, 2]))
    other.slot("acc", 0.0, dim=3)
    before = table_state(other)
    with pytest.raises(tfde.CheckpointError, match="'slot:acc'.*dim 1 .*dim 3"):
        tf.train.Checkpoint(var=other).restore(path)
    assert table_state(other) == before


# ------------------------------------------------------------ 10: import_ validates before it clears

IMPORT_BACKENDS = {name: BACKENDS[name] for name in VARIABLE_BACKENDS}
BAD_IMPORTS = {  # (keys, values) for a table of int64 keys and float32 rows of dim 2
    "more_keys_than_rows": (tf.constant([3, 4, 5], tf.int64), tf.ones([2, 2])),
    "more_rows_than_keys": (tf.constant([3], tf.int64), tf.ones([2, 2])),
    "wrong_dim": (tf.constant([3, 4], tf.int64), tf.ones([2, 3])),
    "wrong_value_dtype": (tf.constant([3, 4], tf.int64), tf.constant([["a", "b"], ["c", "d"]])),
    "wrong_key_dtype": (tf.constant(["a", "b"]), tf.ones([2, 2])),
}


@pytest.fixture(params=sorted(IMPORT_BACKENDS))
def import_backend(request):
    made = IMPORT_BACKENDS[request.param]()
    yield made
    made.cleanup()


@pytest.mark.parametrize("bad", sorted(BAD_IMPORTS))
def test_a_refused_table_import_changes_nothing(import_backend, bad):
    t = import_backend.creator.create("imp", tf.int64, tf.float32, 2)
    t.insert(tf.constant([1, 2], tf.int64), tf.constant([[1.0, 1.0], [2.0, 2.0]]))
    keys, values = BAD_IMPORTS[bad]
    with pytest.raises(tfde.ShapeError):
        t.import_(keys, values, replace=True)
    rows, exists = t.find(tf.constant([1, 2], tf.int64), tf.zeros([1, 2]))
    assert int(t.size()) == 2 and exists.numpy().all() and rows.numpy().tolist() == [[1, 1], [2, 2]]
    t.import_(tf.constant([3], tf.int64), tf.constant([[3.0, 3.0]]), replace=True)  # good input still replaces
    assert int(t.size()) == 1


@pytest.mark.parametrize("bad", sorted(BAD_IMPORTS))
def test_a_refused_variable_import_changes_nothing(import_backend, bad):
    var = tfde.Variable("vimp", dim=2, initializer=0.0, num_shards=2, table_creator=import_backend.creator)
    var.upsert(tf.constant([1, 2], tf.int64), tf.constant([[1.0, 1.0], [2.0, 2.0]]))
    var.slot("m", 0.0).upsert(tf.constant([1], tf.int64), tf.constant([[5.0, 5.0]]))
    before = table_state(var)
    keys, values = BAD_IMPORTS[bad]
    with pytest.raises(tfde.ShapeError):
        var.import_(keys, values, replace=True)
    assert table_state(var) == before


@pytest.mark.parametrize("backend", ["cuckoo", "redis"])
def test_import_in_a_graph_checks_the_counts_before_clearing(backend):
    """Inside tf.function, lengths known only when the graph runs: the
    check runs before the clear (the reference table is eager only)."""
    made = IMPORT_BACKENDS[backend]()
    try:
        t = made.creator.create("gimp", tf.int64, tf.float32, 2)
        var = tfde.Variable("gvimp", dim=2, initializer=0.0, table_creator=made.creator)
        spec = [tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, 2], tf.float32)]
        for target in (t, var):
            target.import_(tf.constant([1, 2], tf.int64), tf.ones([2, 2]))

            @tf.function(input_signature=spec)
            def replace(k, v, target=target):
                target.import_(k, v, replace=True)

            with pytest.raises(tf.errors.InvalidArgumentError, match="the number of keys and rows differ"):
                replace(tf.constant([3, 4, 5], tf.int64), tf.ones([2, 2]))
            assert int(target.size()) == 2
            replace(tf.constant([3], tf.int64), tf.ones([1, 2]))
            assert int(target.size()) == 1
    finally:
        made.cleanup()


# ------------------------------------------------------------ 11: a kill at every point of the commit

N_KEYS = 300


def versioned(version: float, keys=None):
    """A Variable whose every row and slot tells the version that wrote it."""
    var = tfde.Variable("ck", dim=4, initializer=0.0)
    keys = tf.range(N_KEYS, dtype=tf.int64) if keys is None else keys
    var.upsert(keys, version + tf.cast(tf.tile(keys[:, None], [1, 4]), tf.float32) / 1000.0)
    var.slot("m", 0.0).upsert(keys, tf.fill([tf.size(keys), 4], -version))
    return var


def version_of(var) -> float:
    """The version a restored Variable holds, after checking it holds that
    version whole: every key, its row and its slot."""
    keys = tf.range(N_KEYS, dtype=tf.int64)
    rows, slot = var.lookup(keys).numpy(), var.slots["m"].lookup(keys).numpy()
    version = float(-slot[0, 0])
    assert int(var.size()) == N_KEYS and int(var.slots["m"].size()) == N_KEYS
    np.testing.assert_array_equal(slot, np.full([N_KEYS, 4], -version, np.float32))
    expected = version + np.tile(np.arange(N_KEYS, dtype=np.float32)[:, None], [1, 4]) / np.float32(1000.0)
    np.testing.assert_array_equal(rows, expected.astype(np.float32))
    return version


SAVE = """
import os, sys
sys.path.insert(0, {tests!r})
import tfde
from test_saving_faults import versioned
directory, step, version, kill_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
var = versioned(version)
os.environ[{env!r}] = kill_at
tfde.saving.CheckpointManager(directory, var=var, max_to_keep=2).save(step=step)
print("committed", flush=True)
""".format(tests=str(Path(__file__).parent), env=manager_module.KILL_AT_COMMIT_POINT)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["same_step", "next_step"])
def test_a_kill_at_every_point_of_the_commit_leaves_a_complete_checkpoint(tmp_path, case):
    """Checkpoints of steps 1 and 2 (max_to_keep=2); a process saves version 3
    as step 2 again (same_step: it replaces ckpt-2) or as step 3 (next_step:
    ckpt-1 is dropped) and is killed at commit point k, for every k until the
    save completes.  Each time, a process that did not save restores the
    latest checkpoint and finds version 2 or 3 complete (old before the
    state file is replaced, new after), and its next save cleans up."""
    base = str(tmp_path / "base")
    for step, version in ((1, 1.0), (2, 2.0)):
        tfde.saving.CheckpointManager(base, var=versioned(version), max_to_keep=2).save(step=step)
    new_step = 2 if case == "same_step" else 3
    seen = []
    for k in itertools.count():
        directory = str(tmp_path / f"k{k}")
        shutil.copytree(base, directory)
        proc = subprocess.run(
            [sys.executable, "-c", SAVE, directory, str(new_step), "3", str(k)],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=300,
        )
        done = proc.returncode == 0
        assert done or proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        assert done == ("committed" in proc.stdout)

        var = tfde.Variable("ck", dim=4, initializer=0.0)
        manager = tfde.saving.CheckpointManager(directory, var=var, max_to_keep=2)
        path = manager.restore()
        version = version_of(var)
        seen.append(version)
        names = {2.0: "ckpt-000000002", 3.0: "ckpt-000000002-1" if case == "same_step" else "ckpt-000000003"}
        assert os.path.basename(path) == names[version], (k, path)
        for listed in manager.checkpoints:  # every checkpoint the state names is complete
            manager_module.read_manifest(listed)
        # The next save removes whatever the killed one left behind.
        manager.save(step=10)
        state = json.load(open(os.path.join(directory, manager_module.STATE_FILE)))
        assert sorted(os.listdir(directory)) == sorted(state["checkpoints"] + [manager_module.STATE_FILE]), k
        if done:
            break
        assert k < 50, "the commit never completed"
    # Old until the state file is replaced (point 5: before os.replace), new from then on.
    assert seen == [2.0] * 6 + [3.0] * (len(seen) - 6), seen
    assert len(seen) >= 8


MW_SAVE = """
import json, os, sys
cfg = json.loads(sys.argv[1]); index = int(sys.argv[2])
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in cfg["ports"]]},
                                      "task": {"type": "worker", "index": index}})
sys.path.insert(0, cfg["tests"])
import tensorflow as tf, tfde
strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any op runs (this module makes tensors)
from test_saving_faults import N_KEYS, versioned
keys = tf.range(N_KEYS, dtype=tf.int64)
mine = tf.boolean_mask(keys, tf.equal(tfde.exchange.owner(keys, 2), index))
with strategy.scope():
    first, second = versioned(1.0, mine), versioned(2.0, mine)  # each worker stores the keys it owns
tfde.saving.CheckpointManager(cfg["dir"], var=first, strategy=strategy).save(step=1)
os.environ[cfg["env"]] = str(cfg["kill_at"])
print("saving again", flush=True)
tfde.saving.CheckpointManager(cfg["dir"], var=second, strategy=strategy).save(step=1)
print("committed", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kill_at,expected", [(3, 1.0), (5, 1.0), (6, 2.0)])
def test_a_kill_of_the_committing_worker_leaves_a_complete_checkpoint(tmp_path, kill_at, expected):
    """Two workers (MultiWorkerMirroredStrategy), each with its shard, save
    step 1 and then step 1 again; the first worker, which commits, is killed
    before the rename (3), before the state file is replaced (5) and after
    (6).  A single process then restores both shards of one version."""
    directory = str(tmp_path / "ck")
    cfg = {
        "ports": [free_port(), free_port()],
        "tests": str(Path(__file__).parent),
        "dir": directory,
        "env": manager_module.KILL_AT_COMMIT_POINT,
        "kill_at": kill_at,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MW_SAVE, json.dumps(cfg), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
        )
        for i in range(2)
    ]
    try:
        out0 = procs[0].communicate(timeout=300)[0]
        assert procs[0].returncode == -signal.SIGKILL, out0[-3000:]
        assert "saving again" in out0, out0[-3000:]
    finally:
        for p in procs:  # the second worker waits for the first at the save's last barrier
            p.kill()
            p.wait()
    var = tfde.Variable("ck", dim=4, initializer=0.0)
    path = tfde.saving.CheckpointManager(directory, var=var).restore()
    assert os.path.basename(path) == ("ckpt-000000001" if expected == 1.0 else "ckpt-000000001-1")
    assert version_of(var) == expected
