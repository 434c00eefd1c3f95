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
way (tfde.exchange.AllToAllExchange).  Dense weights are averaged by
hvd.DistributedOptimizer as usual; the tfde optimizer registers its step
buffers as Horovod local variables so Horovod leaves them to the exchange.
Everything runs on CPU unless you place it elsewhere: no devices= argument.

Order of wrapping: hvd.DistributedOptimizer(tfde.DynamicEmbeddingOptimizer(opt)).
The reverse order raises an error naming this one (Horovod's optimizer class
calls super(self.__class__, ...) and cannot be subclassed again).
"""

from __future__ import annotations

from tfde import exchange


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
    """AllToAllExchange over hvd.alltoall; gradients are averaged over
    workers, Horovod's convention (each worker's loss is its local mean)."""

    def __init__(self, hvd):
        super().__init__(
            rank=hvd.rank(), size=hvd.size(),
            alltoall=lambda t, splits: hvd.alltoall(t, splits=splits),
            max_over_workers=lambda x: hvd.allreduce(x, op=hvd.Max),
            gradient_scale=1.0 / hvd.size(), all_gather=hvd.allgather)

    def gradient_scale(self, optimizer) -> float:
        # Horovod's DistributedOptimizer divides the gradients of its local
        # variables (tfde registers the step buffers as such) by size already.
        if hasattr(optimizer, "register_local_var") and getattr(optimizer, "scale_local_gradients", False):
            return 1.0
        return super().gradient_scale(optimizer)


def init(*args, **kwargs):
    """hvd.init(*args, **kwargs), then installs the exchange; returns the
    horovod.tensorflow module."""
    hvd = _import_horovod()
    hvd.init(*args, **kwargs)
    exchange.install(HorovodExchange(hvd))
    return hvd
