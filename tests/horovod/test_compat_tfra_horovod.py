"""tfde.compat.tfra's Horovod names in the Horovod environment: a
one-worker Horovod job in this process (multi-worker jobs: test_horovod.py
and the examples' tests).  The rest of the module's tests:
tests/test_compat_tfra.py."""

import os

import pytest
import tensorflow as tf

import tfde
from tfde.compat.tfra import dynamic_embedding as de

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
