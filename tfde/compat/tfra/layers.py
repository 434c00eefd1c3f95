"""TFRA's dynamic_embedding.keras.layers: functions with TFRA's signatures
that return tfde's own layers (tfde.keras.layers.Embedding and
SquashedEmbedding), so models save, load and train as tfde models.

TFRA's Embedding keyword arguments and what they mean here
(docs/migrating-from-tfra.md has the full table):

  kv_creator            -> table_creator (None: tfde's cuckoo table)
  init_capacity         -> a cuckoo table presized for that many rows
                           (CuckooTableCreator(expected_rows=)); no effect on Redis
  devices               CPU devices only (a no-op: tfde's tables live on the CPU)
  distribute_strategy   must be the strategy in scope (tfde uses that one)
  with_unique           accepted (tfde always deduplicates ids)
  restrict_policy, trainable, initializer, key_dtype, value_dtype, name: the same
  bp_v2=True, partitioner, max_norm, checkpoint=False: refused (ConfigError)
"""

from __future__ import annotations

import tensorflow as tf

import tfde
from tfde.compat.tfra import _args
from tfde.distributed import horovod
from tfde.errors import ConfigError
from tfde.lookup import COMBINERS

# Keyword arguments tfde's layers take that TFRA's do not (passed through),
# and Keras's own layer arguments.
_PASSED_THROUGH = (
    "seed",
    "num_shards",
    "admission_filter",
    "track_changes",
    "input_shape",
    "batch_input_shape",
    "batch_size",
)
_TFRA_KWARGS = (
    "trainable",
    "restrict_policy",
    "init_capacity",
    "kv_creator",
    "distribute_strategy",
    "bp_v2",
    "partitioner",
    "max_norm",
    "keep_distribution",
    "checkpoint",
)


def _embedding(
    cls,
    where: str,
    embedding_size,
    key_dtype=tf.int64,
    value_dtype=tf.float32,
    combiner="sum",
    initializer=None,
    devices=None,
    name=None,
    with_unique=True,
    short_file_name=False,
    **kwargs,
):
    """A `cls` layer from TFRA's Embedding arguments (in TFRA's order)."""
    tfra = {k: kwargs.pop(k) for k in _TFRA_KWARGS if k in kwargs}
    passed = {k: kwargs.pop(k) for k in _PASSED_THROUGH if k in kwargs}
    _args.refuse_unknown(
        where,
        kwargs,
        [
            "embedding_size",
            "key_dtype",
            "value_dtype",
            "combiner",
            "initializer",
            "devices",
            "name",
            "with_unique",
            "short_file_name",
            *_TFRA_KWARGS,
            *_PASSED_THROUGH,
        ],
    )
    _args.check_strategy(where, tfra.get("distribute_strategy"))
    _args.require(
        where,
        "max_norm",
        tfra.get("max_norm"),
        None,
        "tfde does not clip looked-up rows (clip them in the model if you need to)",
    )
    if initializer is None:
        # TFRA's layers' default, RandomNormal(): mean 0, stddev 0.05, which
        # is tfde's "normal" (seeded by the layer's name, so every worker
        # agrees).
        initializer = "normal"
    table = _args.variable_kwargs(
        where,
        devices=devices,
        partitioner=tfra.get("partitioner"),
        initializer=initializer,
        trainable=tfra.get("trainable", True),
        checkpoint=tfra.get("checkpoint", True),
        init_size=tfra.get("init_capacity", 0),
        kv_creator=tfra.get("kv_creator"),
        restrict_policy=tfra.get("restrict_policy"),
        bp_v2=tfra.get("bp_v2", False),
    )
    if cls is tfde.keras.layers.SquashedEmbedding:
        if combiner not in COMBINERS:
            raise ConfigError(
                f"{where}: combiner={combiner!r} is not supported; tfde combines with one of "
                f"{COMBINERS} (TFRA's other tf.math.reduce_* combiners, such as 'max', are not "
                "available)"
            )
        passed["combiner"] = combiner
    return cls(embedding_size, key_dtype=key_dtype, value_dtype=value_dtype, name=name, **table, **passed)


def Embedding(embedding_size, *args, **kwargs):
    """tfde.keras.layers.Embedding from TFRA's Embedding arguments
    (embedding_size, key_dtype=tf.int64, value_dtype=tf.float32,
    combiner='sum', initializer=None, devices=None, name=None,
    with_unique=True, short_file_name=False, **kwargs): ids of any shape ->
    ``ids.shape + [embedding_size]``.

    combiner is accepted and unused, as in TFRA's Embedding (SquashedEmbedding
    combines).  The default initializer is TFRA's, RandomNormal (stddev 0.05).
    name=None lets Keras name the layer (TFRA's fixed default would give two
    unnamed layers one name, and so one seed and one set of Redis tables).
    with_unique and short_file_name are accepted and unused.
    """
    return _embedding(tfde.keras.layers.Embedding, "de.keras.layers.Embedding", embedding_size, *args, **kwargs)


BasicEmbedding = Embedding


def SquashedEmbedding(embedding_size, *args, **kwargs):
    """tfde.keras.layers.SquashedEmbedding: ``[batch, ...]`` ids ->
    ``[batch, embedding_size]``, combined with combiner 'sum' (the default)
    or 'mean' (or tfde's 'sqrtn').  Arguments as Embedding.  Unlike TFRA's,
    1-D ids are a batch of one id each (``[batch]`` -> ``[batch,
    embedding_size]``); TFRA combined them into one ``[embedding_size]`` row."""
    return _embedding(
        tfde.keras.layers.SquashedEmbedding, "de.keras.layers.SquashedEmbedding", embedding_size, *args, **kwargs
    )


def HvdAllToAllEmbedding(with_unique=True, with_secondary_unique=True, mpi_size=None, batch_size=None, *args, **kwargs):
    """tfde.keras.layers.Embedding with tfde's Horovod exchange installed
    (tfde.distributed.horovod.install(); call hvd.init() first).  Every
    worker stores the keys that hash to it, ids and rows go through
    Horovod's all-to-all and dense gradients are averaged over the workers,
    on the CPU without devices=.  Other arguments as Embedding, after TFRA's
    four leading ones (so pass them as keywords); mpi_size, when given, must
    be the number of Horovod workers; with_secondary_unique and batch_size
    are accepted and unused."""
    hvd = horovod.install()
    if mpi_size is not None and mpi_size != hvd.size():
        raise ConfigError(
            f"de.keras.layers.HvdAllToAllEmbedding: mpi_size={mpi_size!r}, but Horovod runs "
            f"{hvd.size()} workers; drop mpi_size= (tfde takes the number from Horovod)"
        )
    return _embedding(
        tfde.keras.layers.Embedding, "de.keras.layers.HvdAllToAllEmbedding", *args, with_unique=with_unique, **kwargs
    )


# TFRA layers tfde does not provide.
_NOT_PROVIDED = {
    "FieldWiseEmbedding": "combine per field with tfde.keras.layers.Embedding and your own pooling, or use "
    "SquashedEmbedding per field",
    "LayerNormalization": "use tf.keras.layers.LayerNormalization",
}


def __getattr__(name):
    if name in _NOT_PROVIDED:
        raise AttributeError(
            f"{__name__}.{name} (TFRA) has no tfde counterpart: {_NOT_PROVIDED[name]} (see {_args.GUIDE})"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
