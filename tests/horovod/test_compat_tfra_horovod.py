"""tfde.compat.tfra's Horovod names in the Horovod environment: a
one-worker Horovod job in this process, and a TFRA user's program
(tests/horovod/tfra_program.py) under horovodrun with two workers.  The
rest of the module's tests: tests/test_compat_tfra.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distributed_check import load  # noqa: E402

import tfde  # noqa: E402
from tfde.compat.tfra import dynamic_embedding as de  # noqa: E402

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "Horovod's Keras support needs tf-keras: TF_USE_LEGACY_KERAS=1"


@pytest.mark.keras
def test_hvd_all_to_all_embedding_in_a_one_worker_horovod_job(monkeypatch):
    import horovod.tensorflow as hvd

    from tfde.distributed.horovod import HorovodExchange

    monkeypatch.setattr(tfde.exchange, "_installed", tfde.exchange.installed())  # put back after the test
    if not hvd.is_initialized():
        with pytest.raises(tfde.ConfigError, match="Horovod is not initialised: call hvd.init\\(\\)"):
            de.keras.layers.HvdAllToAllEmbedding(embedding_size=4)
        hvd.init()
    layer = de.keras.layers.HvdAllToAllEmbedding(
        embedding_size=4, key_dtype=tf.int64, devices=["CPU"], name="hvd-a2a", mpi_size=hvd.size()
    )
    assert isinstance(tfde.exchange.installed(), HorovodExchange)
    assert type(layer) is tfde.keras.layers.Embedding
    assert layer(tf.constant([1, 2], tf.int64)).shape == (2, 4)


def test_broadcast_callback_is_horovods():
    import horovod.tensorflow.keras as hvd_keras

    callback = de.keras.callbacks.DEHvdBroadcastGlobalVariablesCallback(root_rank=0)
    assert isinstance(callback, hvd_keras.callbacks.BroadcastGlobalVariablesCallback)
    assert callback.root_rank == 0


PROGRAM = Path(__file__).with_name("tfra_program.py")


def _launch(tmp_path, phase):
    horovodrun = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or "horovodrun"
    command = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(PROGRAM)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(PROGRAM.parents[2])}
    proc = subprocess.run(
        [*command, str(tmp_path / "out"), phase],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def test_a_tfra_horovod_program_trains_on_two_workers_and_its_per_rank_checkpoints_restore(tmp_path):
    """The program users run under horovodrun, with only its imports changed:
    it trains with its callbacks, every key lives on one rank, each rank's
    DEHvdModelCheckpoint directory holds that rank's part, and the same
    program restores from them exactly: rows, Adam's slots, the restrict
    policy's counts, dense weights and the optimizer's step."""
    _launch(tmp_path, "train")
    tables, dense = load(str(tmp_path / "out-train"))  # fails if two ranks store one key
    names = {f"{t}{s}" for t in ("user-embedding", "movie-embedding") for s in ("", "/m", "/v", "/policy-frequency")}
    assert set(tables) == names, sorted(tables)
    assert int(dense["dense/step"]) == 16  # 2 epochs of 8 steps
    for rank in (0, 1):
        part = np.load(tmp_path / f"out-train-w{rank}.npz")
        assert all(len(part[f"{t}/keys"]) > 0 for t in names), f"rank {rank} stores no key of some table"
        # Retrieval's loss sums the batch's (64 examples) cross-entropies over
        # its 64 candidates: 64 ln 64 at chance.  The data has a pattern to learn.
        assert np.isfinite(part["loss"]).all() and part["loss"][1] < part["loss"][0], part["loss"]
        assert part["loss"][1] < 0.95 * 64 * np.log(64), part["loss"]
        directory = tmp_path / f"model_dir_{rank}"
        assert json.loads((directory / "checkpoint.json").read_text())["latest"] == "ckpt-000000016"
        assert sorted(p.name for p in directory.glob("ckpt-000000016/*.index")) == [f"worker-0000{rank}-of-00002.index"]
        assert list((directory / "train").glob("events.out.tfevents.*")), "TensorBoard wrote no events"

    out = _launch(tmp_path, "restore")
    assert "restored" in out, out[-3000:]
    restored_tables, restored_dense = load(str(tmp_path / "out-restore"))
    assert set(restored_tables) == names
    for name in names:
        keys = sorted(tables[name])
        assert sorted(restored_tables[name]) == keys, f"{name}: the restored keys differ"
        np.testing.assert_array_equal(
            np.stack([restored_tables[name][k] for k in keys]), np.stack([tables[name][k] for k in keys]), name
        )
    assert set(restored_dense) == set(dense)
    for name, value in dense.items():
        np.testing.assert_array_equal(restored_dense[name], value, name)
