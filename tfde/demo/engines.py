"""How the demo runs on one process or as one of several workers.

An Engine answers the few questions where distributed training differs:
where to build the model, which slice of the data this worker trains on,
how Keras gets the data, which callbacks are needed, and how to read rows
so that every worker sees every key (tfde/exchange.py).

  Engine(None)       one process
  Engine("mwms")     MultiWorkerMirroredStrategy from TF_CONFIG; tf-keras model.fit
  Engine("horovod")  Horovod (tfde.distributed.horovod); tf-keras model.fit
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import tensorflow as tf

from tfde.distributed import horovod as tfde_hvd
from tfde.errors import ConfigError


class Engine:
    def __init__(self, kind=None):
        self.kind = kind
        self.rank, self.size = 0, 1
        self.strategy = None
        if kind == "mwms":
            if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
                raise ConfigError(
                    "the demo trains with model.fit, which Keras 3 cannot run under MultiWorkerMirroredStrategy "
                    "(it fails inside Keras even for a Dense model); use tf-keras (--keras tf-keras) or a custom "
                    "loop (docs/distributed.md, 'MultiWorkerMirroredStrategy')"
                )
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
            resolver = self.strategy.cluster_resolver
            self.rank, self.size = resolver.task_id, self.strategy.num_replicas_in_sync
        elif kind == "horovod":
            self.hvd = tfde_hvd.init()
            import horovod.tensorflow.keras as hvd_keras

            self.hvd_keras = hvd_keras
            self.rank, self.size = self.hvd.rank(), self.hvd.size()
        elif kind is not None:
            raise ConfigError(f"engine must be None, 'mwms' or 'horovod', got {kind!r}")

    @property
    def chief(self) -> bool:
        return self.rank == 0

    def scope(self):
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    def optimizer(self, opt):
        return self.hvd_keras.DistributedOptimizer(opt) if self.kind == "horovod" else opt

    def shard(self, array: np.ndarray) -> np.ndarray:
        """This worker's examples: every size-th one, from its rank."""
        return array[self.rank :: self.size]

    def steps_per_epoch(self, num_examples: int, batch_size: int) -> int:
        """Full batches an epoch, the same on every worker (a synchronous
        job must not have one worker wait for a step the others never
        take).  Data that makes no full batch is refused: Keras would
        train no step and fail on its empty logs."""
        steps = (num_examples // self.size) // batch_size
        if steps < 1:
            share = f" ({num_examples // self.size:,} for each of {self.size} workers)" if self.size > 1 else ""
            raise ConfigError(
                f"{num_examples:,} training examples{share} make no full batch of {batch_size:,}: "
                "lower the batch size (tfde train --batch-size) or train on more data"
            )
        return steps

    def dataset(self, make):
        """What model.fit gets: make() builds this worker's tf.data pipeline."""
        if self.kind == "mwms":
            return tf.keras.utils.experimental.DatasetCreator(lambda ctx: make())
        return make()

    def callbacks(self):
        if self.kind == "horovod":
            return [self.hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)]
        return []

    def reader(self, fn):
        """fn(ids) -> tensor, run so that rows owned by other workers are
        visible: inside strategy.run under MultiWorkerMirroredStrategy; as is
        elsewhere (Horovod's exchange runs anywhere).  Every worker must call
        it with the same ids in the same order."""
        if self.strategy is None:
            return fn
        strategy = self.strategy

        @tf.function
        def run(ids):
            return strategy.run(fn, args=(ids,))

        return lambda ids: strategy.experimental_local_results(run(ids))[0]
