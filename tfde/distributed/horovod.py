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
way (tfde.distributed.alltoall.AllToAllExchange).  Dense weights are averaged over the
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

import os
import sys

import tensorflow as tf

from tfde import exchange
from tfde.distributed.alltoall import AllToAllExchange
from tfde.errors import ConfigError, UnsupportedOptimizerError
from tfde.variable import is_step_buffer


def import_horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise ImportError(
            "tfde.distributed.horovod needs Horovod built with TensorFlow: HOROVOD_WITH_TENSORFLOW=1 "
            "HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 pip install --no-build-isolation horovod==0.28.1 "
            f"(Horovod 0.28.1 builds against TF <= 2.16); import failed: {e}"
        ) from e
    return hvd


class HorovodExchange(AllToAllExchange):
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
            rank=hvd.rank(),
            size=hvd.size(),
            alltoall=lambda t, splits: hvd.alltoall(t, splits=splits),
            max_over_workers=lambda x: hvd.allreduce(x, op=hvd.Max),
            gradient_scale=1.0 / hvd.size(),
            all_gather=hvd.allgather,
            average=lambda tensors: hvd.grouped_allreduce(tensors, op=hvd.Average),
        )

    def gradient_scale(self, optimizer) -> float:
        # Horovod's DistributedOptimizer divides the gradients of its local
        # variables (tfde registers the step buffers as such) by size, when
        # its compute_gradients ran in this step (DynamicEmbeddingMixin
        # records that as _tfde_engine_scaled).
        if getattr(optimizer, "_tfde_engine_scaled", False):
            return 1.0
        return super().gradient_scale(optimizer)

    def register_step_buffers(self, optimizer, var_list) -> None:
        # Horovod's DistributedOptimizer (when it wraps the tfde optimizer)
        # averages every gradient of its compute_gradients but those of its
        # local variables: the step buffers' go through the exchange.
        if not hasattr(optimizer, "register_local_var"):
            return
        known = set(getattr(optimizer, "_local_vars", ()))  # Horovod keeps var.ref()s
        for v in var_list:
            if is_step_buffer(v) and v.ref() not in known:
                optimizer.register_local_var(v)

    def keep_gradients_local(self, optimizer, on: bool) -> None:
        # Horovod's DistributedOptimizer averages in compute_gradients
        # through its _allreduce method; semi-synchronous training's local
        # steps shadow it on the instance with one that leaves every
        # gradient as it is, and remove the shadow afterwards.
        if not hasattr(optimizer, "register_local_var"):
            return
        if on:
            optimizer._allreduce = lambda grads, variables: list(grads)
        else:
            optimizer.__dict__.pop("_allreduce", None)

    def prepare_gradients(self, optimizer, grads_and_vars) -> list:
        """Averages the dense gradients unless Horovod's DistributedOptimizer
        did in this step (its compute_gradients, which Keras's default
        train_step reaches through minimize; tfrs.Model.train_step and
        custom steps call apply_gradients directly).  Records in
        optimizer._tfde_engine_scaled whether Horovod also divided the step
        buffers' gradients by its size (gradient_scale)."""
        if getattr(optimizer, "_agg_helper", None) is not None:
            raise UnsupportedOptimizerError(
                "Horovod's DistributedOptimizer with backward_passes_per_step > 1 aggregates gradients locally, "
                "which tfde's step buffers cannot follow (they hold one step's rows); use "
                "backward_passes_per_step=1 and a larger batch"
            )
        # Set by Horovod's DistributedOptimizer when its compute_gradients
        # averaged this step's gradients (a Python flag: read while tracing),
        # and never reset by it: reset here, once per step.
        averaged = bool(getattr(optimizer, "_aggregated_gradients", False))
        if hasattr(optimizer, "_aggregated_gradients"):
            optimizer._aggregated_gradients = False
        optimizer._tfde_engine_scaled = averaged and bool(getattr(optimizer, "scale_local_gradients", False))
        if self.size <= 1 or averaged:
            return grads_and_vars
        positions = [i for i, (_, v) in enumerate(grads_and_vars) if not is_step_buffer(v)]
        averaged_grads = self._average_dense([grads_and_vars[i][0] for i in positions])
        out = list(grads_and_vars)
        for i, g in zip(positions, averaged_grads):
            out[i] = (g, grads_and_vars[i][1])
        return out

    def _average_dense(self, grads: list) -> list:
        """Gradients (tensors, IndexedSlices or None) averaged over the workers."""
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
    hvd = import_horovod()
    hvd.init(*args, **kwargs)
    return install()


def install():
    """Installs tfde's exchange for the Horovod job this process already
    joined (hvd.init() called); returns the horovod.tensorflow module.
    Calling it again changes nothing.  For programs that call hvd.init()
    themselves (tfde.compat.tfra's HvdAllToAllEmbedding calls this)."""
    hvd = import_horovod()
    if not hvd.is_initialized():
        raise ConfigError(
            "Horovod is not initialised: call hvd.init() (or tfde.distributed.horovod.init(), which "
            "also installs tfde's exchange) before building tfde layers"
        )
    current = exchange.installed()
    if isinstance(current, HorovodExchange) and current.size == hvd.size() and current.rank == hvd.rank():
        return hvd
    exchange.install(HorovodExchange(hvd))
    return hvd


class HorovodGuard(exchange.Engine):
    """What the core must know of Horovod even when this module's exchange
    is not installed: a job that runs Horovod without it, and the wrapping
    order of the optimizers."""

    def exchange(self):
        hvd = sys.modules.get("horovod.tensorflow")  # only when the program imported Horovod
        if hvd is None:
            return None
        try:
            running = hvd.is_initialized() and hvd.size() > 1
        except Exception:  # pragma: no cover - horovod half-imported
            return None
        if running:
            raise ConfigError(
                f"Horovod runs {hvd.size()} workers but tfde's exchange is not installed, so tfde Variables "
                "would train each worker's keys apart; call tfde.distributed.horovod.init() (it calls hvd.init()) "
                "before building the model"
            )
        return None

    def launched_workers(self):
        # horovodrun (Gloo) sets HOROVOD_SIZE; mpirun (Open MPI) OMPI_COMM_WORLD_SIZE.
        for variable in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE"):
            value = os.environ.get(variable, "")
            if value.isdigit() and int(value) > 1:
                return int(value), variable
        return None

    def check_optimizer(self, optimizer):
        if hasattr(optimizer, "register_local_var") and hasattr(optimizer, "_allreduce_grads"):
            raise UnsupportedOptimizerError(
                "this optimizer is already Horovod's DistributedOptimizer; wrap in the other order: "
                "hvd.DistributedOptimizer(tfde.DynamicEmbeddingOptimizer(opt)) (see tfde.distributed.horovod)"
            )

    def wrapping_hint(self):
        if "horovod.tensorflow" not in sys.modules:
            return None
        return "under Horovod, hvd.DistributedOptimizer(tfde.DynamicEmbeddingOptimizer(opt))"


exchange.register_engine(HorovodGuard())
