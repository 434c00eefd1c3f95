"""Horovod for tfde Variables: sharded tables with an all-to-all exchange.

  import tfde.distributed.horovod as tfde_hvd
  hvd = tfde_hvd.init()                          # instead of hvd.init()
  model = build_model()                          # tfde Keras layers as usual
  opt = hvd.DistributedOptimizer(tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam()))
  model.compile(optimizer=opt, loss=...)
  model.fit(data, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

Each worker stores the keys whose stable hash routes to it (tfde.exchange.
owner); a lookup sends ids to their owners and gets rows back through
hvd.alltoall, and the gradients of every worker return to the owners the same
way (tfde.exchange.AllToAllExchange).  Dense weights are averaged over the
workers whatever the training step calls: by hvd.DistributedOptimizer when
Keras's default train_step reaches its compute_gradients (the tfde optimizer
registers its step buffers as Horovod local variables so Horovod leaves them
to the exchange), and by tfde otherwise (tfrs.Model.train_step and custom
steps calling apply_gradients; a plain tfde.DynamicEmbeddingOptimizer
without hvd.DistributedOptimizer).
Everything runs on CPU unless you place it elsewhere: no devices= argument.

Order of wrapping: hvd.DistributedOptimizer(tfde.DynamicEmbeddingOptimizer(opt)).
The reverse order raises an error naming this one (Horovod's optimizer class
calls super(self.__class__, ...) and cannot be subclassed again).
"""

from __future__ import annotations

import tensorflow as tf

from tfde import exchange
from tfde.errors import ConfigError


def _import_horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise ImportError(
            "tfde.distributed.horovod needs Horovod built with TensorFlow: HOROVOD_WITH_TENSORFLOW=1 "
            "HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 pip install --no-build-isolation horovod==0.28.1 "
            f"(Horovod 0.28.1 builds against TF <= 2.16); import failed: {e}") from e
    return hvd


class HorovodExchange(exchange.AllToAllExchange):
    """AllToAllExchange over hvd.alltoall.  Horovod's convention is to
    average gradients over workers (each worker's loss is its local mean):
    the rows' summed gradients are divided by the number of workers, and the
    dense gradients averaged, unless Horovod's DistributedOptimizer did both
    already in this step (its compute_gradients, which Keras's default
    train_step reaches through minimize; tfrs.Model.train_step and custom
    steps call apply_gradients directly, and tfde averages then).

    Reads in tf.data functions (e.g. a tfrs FactorizedTopK metric over
    mapped candidates) use the all-to-all too: Horovod matches collectives
    by name, and every worker iterates the same candidates in the same
    order."""

    collectives_in_tf_data = True

    def __init__(self, hvd):
        self._hvd = hvd
        super().__init__(
            rank=hvd.rank(), size=hvd.size(),
            alltoall=lambda t, splits: hvd.alltoall(t, splits=splits),
            max_over_workers=lambda x: hvd.allreduce(x, op=hvd.Max),
            gradient_scale=1.0 / hvd.size(), all_gather=hvd.allgather)

    def gradient_scale(self, optimizer) -> float:
        # Horovod's DistributedOptimizer divides the gradients of its local
        # variables (tfde registers the step buffers as such) by size, when
        # its compute_gradients ran in this step (DynamicEmbeddingMixin
        # records that as _tfde_engine_scaled).
        if getattr(optimizer, "_tfde_engine_scaled", False):
            return 1.0
        return super().gradient_scale(optimizer)

    def average_dense(self, grads: list) -> list:
        hvd, out = self._hvd, list(grads)
        tensors = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        if tensors:
            for i, g in zip(tensors, hvd.grouped_allreduce([grads[i] for i in tensors], op=hvd.Average)):
                out[i] = g
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):  # e.g. a Keras Embedding's gradient: Horovod gathers them
                out[i] = hvd.allreduce(g, op=hvd.Average)
        return out


def init(*args, **kwargs):
    """hvd.init(*args, **kwargs), then installs the exchange; returns the
    horovod.tensorflow module."""
    hvd = _import_horovod()
    hvd.init(*args, **kwargs)
    return install()


def install():
    """Installs tfde's exchange for the Horovod job this process already
    joined (hvd.init() called); returns the horovod.tensorflow module.
    Calling it again changes nothing.  For programs that call hvd.init()
    themselves (tfde.compat.tfra's HvdAllToAllEmbedding calls this)."""
    hvd = _import_horovod()
    if not hvd.is_initialized():
        raise ConfigError("Horovod is not initialised: call hvd.init() (or tfde.distributed.horovod.init(), which "
                          "also installs tfde's exchange) before building tfde layers")
    current = exchange.installed()
    if isinstance(current, HorovodExchange) and current.size == hvd.size() and current.rank == hvd.rank():
        return hvd
    exchange.install(HorovodExchange(hvd))
    return hvd
