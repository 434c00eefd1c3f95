"""tensorflow_recommenders_addons.dynamic_embedding, spelled in tfde.

  from tfde.compat.tfra import dynamic_embedding as de

Every name here returns tfde's own object (a tfde.Variable, a tfde
TableCreator, a tfde.keras.layers.Embedding, the optimizer upgraded by
tfde.DynamicEmbeddingOptimizer): this module translates TFRA's arguments and
adds no behaviour.  TFRA options tfde does not have raise tfde.ConfigError
naming them; where tfde behaves differently from TFRA (lookups never insert,
for one) docs/migrating-from-tfra.md says so.

isinstance checks against these names do not work (most are functions that
return tfde objects): check against tfde's classes (tfde.Variable,
tfde.keras.layers.Embedding, ...).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Optional

import tensorflow as tf

import tfde
from tfde.compat.tfra import _args
from tfde.errors import ConfigError
from tfde.tables.base import int_arg

# ------------------------------------------------------------ restrict policies

RestrictPolicy = tfde.RestrictPolicy
FrequencyRestrictPolicy = tfde.FrequencyRestrictPolicy


class TimestampRestrictPolicy(tfde.TimestampRestrictPolicy):
    """tfde.TimestampRestrictPolicy on TFRA's clock: a key's timestamp is the
    wall-clock second of its last update (tfde's own default counts
    optimizer steps).  Saved layer configs name tfde's class with
    clock='wall', so they load without this module."""

    def __init__(self, variable=None, clock: str = "wall"):
        super().__init__(variable, clock=clock)


# ------------------------------------------------------------ savers and stores


@dataclasses.dataclass(frozen=True)
class FileSystemSaver:
    """TFRA's FileSystemSaver, accepted so that creators built with it work.

    tfde writes no separate KV files: every table is saved, per worker, in
    the checkpoints of tfde.CheckpointManager (or
    tfde.keras.callbacks.ModelCheckpoint, or tf.train.Checkpoint), and a
    checkpoint restores into another number of workers.  proc_size and
    proc_rank are checked and otherwise unused (tfde learns the workers from
    Horovod or the tf.distribute strategy); save_path is refused, since
    nothing would be written there.
    """

    proc_size: Optional[int] = None
    proc_rank: Optional[int] = None
    save_path: Optional[str] = None
    buffer_size: int = 4096

    def __post_init__(self):
        where = "de.FileSystemSaver"
        if (self.proc_size is None) != (self.proc_rank is None):
            raise ConfigError(
                f"{where}: give both proc_size and proc_rank or neither, got proc_size="
                f"{self.proc_size!r}, proc_rank={self.proc_rank!r}"
            )
        if self.proc_size is not None:
            size, rank = int_arg(self.proc_size), int_arg(self.proc_rank)
            if size is None or size < 1 or rank is None or not 0 <= rank < size:
                raise ConfigError(
                    f"{where}: expected ints proc_size >= 1 and 0 <= proc_rank < proc_size, got "
                    f"proc_size={self.proc_size!r}, proc_rank={self.proc_rank!r}"
                )
        buffer_size = int_arg(self.buffer_size)
        if buffer_size is None or buffer_size < 1:
            raise ConfigError(f"{where}: buffer_size must be an int >= 1, got {self.buffer_size!r}")
        if self.save_path is not None:
            raise ConfigError(
                f"{where}: save_path={self.save_path!r} is not supported: tfde writes no separate KV files; tables "
                "are saved in the model's checkpoints: give the directory to tfde.keras.callbacks.ModelCheckpoint "
                f"or tfde.CheckpointManager instead (see {_args.GUIDE})"
            )


def _check_saver(where: str, saver) -> None:
    if saver is not None and not isinstance(saver, FileSystemSaver):
        raise ConfigError(f"{where}: saver must be de.FileSystemSaver(...) or None, got {type(saver).__name__}")


class CuckooHashTableConfig:
    """TFRA's (empty) cuckoo table config; accepted by CuckooHashTableCreator."""


def CuckooHashTableCreator(config=None, saver=None) -> tfde.CuckooTableCreator:
    """tfde.CuckooTableCreator(): tfde's in-process cuckoo table.  A layer's
    init_capacity presizes it (CuckooTableCreator(expected_rows=))."""
    where = "de.CuckooHashTableCreator"
    if config is not None and not isinstance(config, CuckooHashTableConfig):
        raise ConfigError(f"{where}: config must be de.CuckooHashTableConfig() or None, got {type(config).__name__}")
    _check_saver(where, saver)
    return tfde.CuckooTableCreator()


# The environment variable TFRA reads a Redis config path from when a
# RedisTableConfig names no environment variable of its own.
TFRA_CONFIG_ENV = "TFRA_REDIS_CONFIG_PATH"


def RedisTableConfig(
    redis_config_abs_dir=None, redis_config_abs_dir_env: Optional[str] = None, **fields
) -> tfde.RedisTableConfig:
    """A tfde.RedisTableConfig from TFRA's arguments, found as TFRA finds it:
    the file named by the environment variable `redis_config_abs_dir_env`
    when given; else the file named by $TFRA_REDIS_CONFIG_PATH when that is
    set (TFRA lets it override the path, with a warning); else the file
    `redis_config_abs_dir` (also positional); else tfde's defaults
    (standalone 127.0.0.1:6379; TFRA's built-in defaults ask for sentinel
    mode).  Field keyword arguments (redis_host_port=6380, ...) then
    override single fields.  The file is TFRA's JSON, read unchanged."""
    where = "de.RedisTableConfig"
    if redis_config_abs_dir_env is not None:
        config = tfde.RedisTableConfig.from_env(redis_config_abs_dir_env)
    elif os.environ.get(TFRA_CONFIG_ENV):
        if redis_config_abs_dir is not None:
            warnings.warn(
                f"{where}: ${TFRA_CONFIG_ENV} is set, so its file {os.environ[TFRA_CONFIG_ENV]!r} is used "
                f"instead of redis_config_abs_dir={redis_config_abs_dir!r} (as TFRA does)",
                stacklevel=2,
            )
        config = tfde.RedisTableConfig.from_env(TFRA_CONFIG_ENV)
    elif redis_config_abs_dir is not None:
        config = tfde.RedisTableConfig.from_path(_args.fspath(where, "redis_config_abs_dir", redis_config_abs_dir))
    else:
        config = tfde.RedisTableConfig()
    if fields:
        known = {f.name for f in dataclasses.fields(tfde.RedisTableConfig)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown Redis config field(s) {unknown}; expected redis_config_abs_dir, "
                f"redis_config_abs_dir_env or fields of TFRA's redis.config: {sorted(known)}"
            )
        config = tfde.RedisTableConfig.from_dict({**dataclasses.asdict(config), **fields}, source=where)
    return config


def RedisTableCreator(config=None, saver=None) -> tfde.RedisTableCreator:
    """tfde.RedisTableCreator over `config` (a RedisTableConfig, or None:
    RedisTableConfig() as TFRA finds it).  A layer's init_capacity has no
    effect on Redis tables (they take no size)."""
    _check_saver("de.RedisTableCreator", saver)
    return tfde.RedisTableCreator(RedisTableConfig() if config is None else config)


# ------------------------------------------------------------ variables and lookups


def Variable(
    key_dtype=tf.int64,
    value_dtype=tf.float32,
    dim=1,
    devices=None,
    partitioner=None,
    shared_name=None,
    name="DynamicEmbedding_Variable",
    initializer=None,
    trainable=True,
    checkpoint=True,
    init_size=0,
    kv_creator=None,
    restrict_policy=None,
    bp_v2=False,
    short_file_name=False,
) -> tfde.Variable:
    """A tfde.Variable from TFRA's Variable arguments.  As in TFRA, a missing
    key reads zeros when no initializer is given (tfde's own default is
    uniform); shared_name and short_file_name are accepted and unused."""
    where = "de.Variable"
    kwargs = _args.variable_kwargs(
        where,
        devices=devices,
        partitioner=partitioner,
        initializer=0.0 if initializer is None else initializer,
        trainable=trainable,
        checkpoint=checkpoint,
        init_size=init_size,
        kv_creator=kv_creator,
        restrict_policy=restrict_policy,
        bp_v2=bp_v2,
    )
    return tfde.Variable(name, key_dtype=key_dtype, value_dtype=value_dtype, dim=dim, **kwargs)


def get_variable(
    name,
    key_dtype=tf.int64,
    value_dtype=tf.float32,
    dim=1,
    devices=None,
    partitioner=None,
    shared_name="get_variable",
    initializer=None,
    trainable=True,
    checkpoint=True,
    init_size=0,
    kv_creator=None,
    restrict_policy=None,
    bp_v2=False,
    short_file_name=False,
) -> tfde.Variable:
    """A new tfde.Variable (as Variable above).  Unlike TFRA's, it does not
    return an earlier Variable of the same name from a variable scope: keep
    the object you made."""
    return Variable(
        key_dtype=key_dtype,
        value_dtype=value_dtype,
        dim=dim,
        devices=devices,
        partitioner=partitioner,
        shared_name=shared_name,
        name=name,
        initializer=initializer,
        trainable=trainable,
        checkpoint=checkpoint,
        init_size=init_size,
        kv_creator=kv_creator,
        restrict_policy=restrict_policy,
        bp_v2=bp_v2,
        short_file_name=short_file_name,
    )


def _params(params):
    # TFRA takes a Variable or a list holding one.
    if isinstance(params, (list, tuple)) and len(params) == 1:
        return params[0]
    return params


def _with_trainable(rows, params, return_trainable: bool):
    # TFRA's trainable wrapper is what a custom loop differentiates and
    # hands to the optimizer; in tfde that is the Variable's step buffer.
    return (rows, params.step_buffer) if return_trainable else rows


def embedding_lookup(
    params, ids, partition_strategy=None, name=None, validate_indices=None, max_norm=None, return_trainable=False
):
    """tfde.embedding_lookup: rows ``ids.shape + [dim]``; never inserts.
    return_trainable=True also returns the Variable's step buffer, the
    tensor to differentiate and to give the optimizer (TFRA's
    TrainableWrapper).  partition_strategy and validate_indices are unused,
    as in TFRA."""
    where = "de.embedding_lookup"
    _args.require(where, "max_norm", max_norm, None, "tfde does not clip looked-up rows")
    params = _params(params)
    return _with_trainable(tfde.embedding_lookup(params, ids, name=name), params, return_trainable)


def embedding_lookup_unique(
    params, ids, partition_strategy=None, name=None, validate_indices=None, max_norm=None, return_trainable=False
):
    """embedding_lookup: tfde deduplicates the ids of every lookup."""
    return embedding_lookup(params, ids, partition_strategy, name, validate_indices, max_norm, return_trainable)


def embedding_lookup_sparse(
    params,
    sp_ids,
    sp_weights,
    partition_strategy=None,
    name="embedding_lookup_sparse",
    combiner="mean",
    max_norm=None,
    return_trainable=False,
):
    """tfde.embedding_lookup_sparse: ``[batch, dim]`` rows combined per row
    of a 2-D SparseTensor ('sum', 'mean' or 'sqrtn')."""
    where = "de.embedding_lookup_sparse"
    _args.require(where, "max_norm", max_norm, None, "tfde does not clip looked-up rows")
    params = _params(params)
    rows = tfde.embedding_lookup_sparse(params, sp_ids, sp_weights, combiner=combiner or "mean", name=name)
    return _with_trainable(rows, params, return_trainable)


# ------------------------------------------------------------ training


def DynamicEmbeddingOptimizer(optimizer, bp_v2=False, synchronous=None, **kwargs):
    """tfde.DynamicEmbeddingOptimizer(optimizer): the optimizer itself,
    upgraded in place to train tfde Variables.

    synchronous: None (not given) or True.  tfde always averages dense
      gradients over Horovod workers (and exchanges the embedding
      gradients), so training is synchronous and exact whatever TFRA's flag
      would have chosen; False, which in TFRA leaves dense gradients to the
      program, is refused.
    bp_v2: False; True is refused (tfde's steps are synchronous and write each
      key once, so there is no race to add deltas for).
    """
    where = "de.DynamicEmbeddingOptimizer"
    _args.refuse_unknown(where, kwargs, ["optimizer", "bp_v2=False", "synchronous=None/True"])
    if synchronous is not None and synchronous is not True:
        raise ConfigError(
            f"{where}: synchronous={synchronous!r} is not supported: tfde always averages dense gradients over "
            "Horovod workers and exchanges the embedding gradients, so training is always synchronous and exact "
            f"(N workers train like one on the combined batch). Drop synchronous= (see {_args.GUIDE})"
        )
    _args.require(
        where,
        "bp_v2",
        bp_v2,
        False,
        "tfde's training steps are synchronous and write each key once per step, so there is no race "
        "between workers to add deltas for",
    )
    return tfde.DynamicEmbeddingOptimizer(optimizer)


def enable_inference_mode() -> None:
    """Does nothing: in tfde a lookup outside a training step never touches
    training state (docs/migrating-from-tfra.md), so inference needs no mode."""


def enable_train_mode() -> None:
    """Does nothing (see enable_inference_mode)."""


# Last: the Keras layers use the names above.
from tfde.compat.tfra import keras  # noqa: E402

# TFRA names tfde does not provide, with what to use instead.
_NOT_PROVIDED = {
    "HkvHashTableCreator": "a GPU table; tfde's tables live on the CPU: use CuckooHashTableCreator",
    "HkvHashTableConfig": "a GPU table's config; tfde's tables live on the CPU: use CuckooHashTableCreator",
    "HkvEvictStrategy": "a GPU table's eviction; use a restrict policy (FrequencyRestrictPolicy, ...)",
    "HkvHashTable": "a GPU table; tfde's tables live on the CPU: use CuckooHashTableCreator",
    "CuckooHashTable": "tables are made by creators here: pass kv_creator=CuckooHashTableCreator()",
    "RedisTable": "tables are made by creators here: pass kv_creator=RedisTableCreator(config)",
    "KVCreator": "creators are tfde TableCreators (tfde.tables.TableCreator)",
    "TrainableWrapper": "tfde has no trainable wrapper: a Variable's trainable tensor is var.step_buffer "
    "(embedding_lookup(..., return_trainable=True) returns it)",
    "DistributedVariableWrapper": "tfde has no trainable wrapper: a Variable's trainable tensor is var.step_buffer",
    "DEResourceVariable": "tfde has no trainable wrapper: a Variable's trainable tensor is var.step_buffer",
    "shadow_ops": "tfde has no shadow variables: use embedding_lookup or the Keras layers",
    "safe_embedding_lookup_sparse": "drop invalid ids yourself and use embedding_lookup_sparse",
    "ModelMode": "tfde has no model mode: lookups outside a training step never touch training state",
    "get_model_mode": "tfde has no model mode: lookups outside a training step never touch training state",
    "trainable_wrapper_filter": "tfde has no trainable wrapper; its optimizer finds its Variables itself",
    "GraphKeys": "tfde keeps no graph collections",
    "train": "save with tfde.CheckpointManager or tfde.keras.callbacks.ModelCheckpoint",
    "warm_start": "restore a tfde checkpoint (tfde.CheckpointManager.restore)",
    "WarmStartHook": "restore a tfde checkpoint (tfde.CheckpointManager.restore)",
    "math": "use TensorFlow's math ops on looked-up rows",
    "data_flow": "use TensorFlow's ops on looked-up rows",
}


def _not_provided(module: str, table: dict):
    def __getattr__(name):
        if name in table:
            raise AttributeError(f"{module}.{name} (TFRA) has no tfde counterpart: {table[name]} (see {_args.GUIDE})")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = _not_provided(__name__, _NOT_PROVIDED)

__all__ = [
    "CuckooHashTableConfig",
    "CuckooHashTableCreator",
    "DynamicEmbeddingOptimizer",
    "FileSystemSaver",
    "FrequencyRestrictPolicy",
    "RedisTableConfig",
    "RedisTableCreator",
    "RestrictPolicy",
    "TimestampRestrictPolicy",
    "Variable",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "embedding_lookup_unique",
    "enable_inference_mode",
    "enable_train_mode",
    "get_variable",
    "keras",
]
