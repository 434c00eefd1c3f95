"""Keras layers over tfde Variables, for Keras 3 and tf-keras alike.

``tf.keras`` is whichever Keras TensorFlow is configured for (Keras 3 by
default, tf-keras with TF_USE_LEGACY_KERAS=1); these layers subclass its
Layer, so import tfde after setting that variable.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tfde import initializers as _init
from tfde.admission import CounterFilter, ProbabilityFilter
from tfde.errors import ConfigError
from tfde.flavour import IS_KERAS3
from tfde.keras.store import StoreReader, StoreWriter
from tfde.lookup import COMBINERS, _combine, embedding_lookup, embedding_lookup_ragged, embedding_lookup_sparse
from tfde.policy import FrequencyRestrictPolicy, TimestampRestrictPolicy, TTLPolicy
from tfde.saving import state
from tfde.tables.base import TableCreator, cast_keys, creator_config, creator_from_config, exact_key_array, key_tensor
from tfde.types import DTypeLike, InitializerLike
from tfde.variable import Variable, is_step_buffer

_keras = tf.keras


def _keras3_counts_skip_step_buffers():
    """Keras 3 counts parameters with math.prod(weight.shape), which fails on
    a step buffer's unknown first dimension (model.summary() would raise).
    Its rows live in a tfde table, not in Keras parameters, so the counting
    helpers are wrapped to leave step buffers out.  tf-keras needs nothing."""
    try:
        from keras.src.utils import summary_utils
    except ImportError:  # a Keras 3 layout without this module: nothing to wrap
        return
    for name in ("count_params", "weight_memory_size"):
        original = getattr(summary_utils, name, None)
        if original is None or getattr(original, "_tfde_wrapped", False):
            continue

        def wrapped(weights, _original=original):
            return _original([w for w in weights if not is_step_buffer(w)])

        wrapped._tfde_wrapped = True
        setattr(summary_utils, name, wrapped)


if IS_KERAS3:
    _keras3_counts_skip_step_buffers()


def _serialize_initializer(init):
    if init is None or isinstance(init, (int, float, str)):
        return init
    if isinstance(init, _init.InitSpec):
        return {"tfde_init_spec": {"kind": init.kind, "p0": init.p0, "p1": init.p1, "seed": init.seed}}
    try:
        return _keras.initializers.serialize(init)
    except Exception:
        raise ConfigError(f"initializer {init!r} cannot be serialized in a layer config") from None


def _deserialize_initializer(cfg):
    if cfg is None or isinstance(cfg, (int, float, str)):
        return cfg
    if isinstance(cfg, dict) and "tfde_init_spec" in cfg:
        return _init.InitSpec(**cfg["tfde_init_spec"])
    return _keras.initializers.deserialize(cfg)


def _component_config(component):
    """{"class_name", "config"} of a restrict policy or admission filter."""
    if component is None:
        return None
    return {"class_name": type(component).__name__, "config": component.get_config()}


# The restrict policies and admission filters a layer config may name.
_COMPONENTS = {
    cls.__name__: cls
    for cls in (FrequencyRestrictPolicy, TimestampRestrictPolicy, TTLPolicy, CounterFilter, ProbabilityFilter)
}


def _component_from_config(cfg):
    if cfg is None:
        return None
    cls = _COMPONENTS.get(cfg.get("class_name", ""))
    if cls is None:
        raise ConfigError(
            f"unknown restrict policy or admission filter {cfg.get('class_name')!r} in a layer "
            f"config; expected one of tfde's: {', '.join(_COMPONENTS)}"
        )
    return cls(**cfg.get("config", {}))


def objects_from_config(config: dict) -> dict:
    """A copy of a layer or table config with its initializer, table creator,
    restrict policy and admission filter made again from their configs."""
    config = dict(config)
    config["initializer"] = _deserialize_initializer(config.get("initializer"))
    config["table_creator"] = creator_from_config(config.get("table_creator"))
    for name in ("restrict_policy", "admission_filter"):
        config[name] = _component_from_config(config.get(name))
    return config


# Keyword arguments of TFRA's dynamic_embedding Embedding layers that tfde's
# layers do not take, each with what to write instead.  Without this screen
# Keras would answer them with its generic "Keyword argument not understood";
# tfde.compat.tfra translates all of them (docs/migrating-from-tfra.md).
_TFRA_ONLY_KWARGS = {
    "kv_creator": "tfde spells it table_creator= (a tfde.CuckooTableCreator or tfde.RedisTableCreator)",
    "init_capacity": "presize the table with table_creator=tfde.CuckooTableCreator(expected_rows=N)",
    "devices": "tfde tables live in this process on the CPU; drop devices=",
    "distribute_strategy": "tfde uses the tf.distribute strategy in scope when the layer is made; drop "
    "distribute_strategy=",
    "with_unique": "tfde always deduplicates ids before they reach the store; drop with_unique=",
    "with_secondary_unique": "tfde always deduplicates ids before they reach the store; drop with_secondary_unique=",
    "mpi_size": "tfde takes the number of workers from the distributed engine that runs the job "
    "(docs/distributed.md); drop mpi_size=",
    "partitioner": "tfde routes keys to its num_shards= tables by its stable hash; drop partitioner=",
    "bp_v2": "tfde's training steps are synchronous and write each key once per step; drop bp_v2=",
    "max_norm": "tfde does not clip looked-up rows; drop max_norm= (clip in the model if you need to)",
    "keep_distribution": "a tfde layer's config always holds its table creator; drop keep_distribution=",
    "short_file_name": "tfde writes no per-table files (tables are saved in checkpoints); drop short_file_name=",
    "checkpoint": "tfde always saves a layer's table with the model; drop checkpoint=",
}


def _refuse_tfra_kwargs(layer_class: str, kwargs: dict) -> None:
    """ConfigError for TFRA-only keyword arguments (_TFRA_ONLY_KWARGS) given
    to one of tfde's own layers."""
    found = [name for name in _TFRA_ONLY_KWARGS if name in kwargs]
    if found:
        fixes = "; ".join(f"{name}: {_TFRA_ONLY_KWARGS[name]}" for name in found)
        raise ConfigError(
            f"tfde layer {layer_class} got TFRA keyword argument(s) {found}, which it does not take. {fixes}. "
            "Or keep the TFRA spelling and build the layer with tfde.compat.tfra "
            "(from tfde.compat.tfra import dynamic_embedding as de; de.keras.layers.Embedding(...)), which "
            "translates it (docs/migrating-from-tfra.md)"
        )


@_keras.utils.register_keras_serializable(package="tfde")
class Embedding(_keras.layers.Layer):
    """Dynamic embedding layer: ids of any shape -> ``ids.shape + [dim]``.

    Args:
      embedding_size: row width (dim).
      key_dtype: tf.int64 (default), tf.int32 or tf.string.
      value_dtype: float dtype of rows (tf.float32 default).
      initializer: initial rows of unseen keys (tfde.initializers).
      combiner: None, or 'sum' / 'mean' / 'sqrtn' to reduce the last axis of
        the ids: ``[batch, n]`` ids give ``[batch, dim]``.
      num_shards, table_creator, restrict_policy, admission_filter, seed,
        track_changes, placement: as tfde.Variable (placement is not part
        of the layer's config: it depends on the job; DistributedEmbedding
        sets it from its plan).
      Inputs may also be a tf.SparseTensor or tf.RaggedTensor of ids
        (combined per row with `combiner`, 'mean' if None).  Int tables take
        ids of any int or float dtype, each checked to be a whole number in
        the key dtype's range (never wrapped or truncated; see _ids).

    The layer's only trainable weight is its Variable's step buffer; train it
    with an optimizer wrapped by tfde.DynamicEmbeddingOptimizer.

    Example:
      >>> layer = tfde.keras.layers.Embedding(8, key_dtype=tf.string, initializer=0.0)
      >>> layer(tf.constant([["a", "b"]])).shape
      TensorShape([1, 2, 8])
    """

    def __init__(
        self,
        embedding_size: int,
        key_dtype: DTypeLike = tf.int64,
        value_dtype: DTypeLike = tf.float32,
        initializer: InitializerLike = None,
        combiner: Optional[str] = None,
        num_shards: int = 1,
        table_creator: Optional[TableCreator] = None,
        restrict_policy: Optional[Any] = None,
        admission_filter: Optional[Any] = None,
        seed: Optional[int] = None,
        name: Optional[str] = None,
        track_changes: bool = False,
        placement: Optional[Any] = None,
        **kwargs: Any,
    ) -> None:
        _refuse_tfra_kwargs(type(self).__name__, kwargs)
        kwargs.pop("dtype", None)
        kwargs.pop("autocast", None)
        # Keras 3's Sequential gives its implicit InputLayer the first layer's
        # compute dtype, and a policy whose compute and variable dtypes agree
        # opens no autocast scope: so the policy is the key dtype, and string
        # or int ids are never cast to float.  (Rows are not Keras variables.)
        # autocast=False: Keras would otherwise cast float ids to the
        # policy's dtype itself (Keras 3: 1.7 -> 1 as int32; tf-keras:
        # float64 -> float32, which rounds ids above 2**24) before call()
        # can check them (_ids).
        # Integer tables take int64 (Keras casts to it exactly from any
        # narrower int; an int32 policy would wrap 2**40 + 1 to key 1, where
        # _ids refuses it).  Float ids in a Sequential without an Input are
        # still cast (truncated) by Keras before call(): docs/guide.md.
        key_policy = tf.int64 if tf.as_dtype(key_dtype).is_integer else key_dtype
        policy_dtype = tf.as_dtype(key_policy if IS_KERAS3 else value_dtype).name
        super().__init__(name=name, dtype=policy_dtype, autocast=False, **kwargs)
        if combiner is not None and combiner not in COMBINERS:
            raise ConfigError(f"combiner must be None or one of {COMBINERS}, got {combiner!r}")
        self.embedding_size = embedding_size
        self.key_dtype = tf.as_dtype(key_dtype)
        self.value_dtype = tf.as_dtype(value_dtype)
        self.combiner = combiner
        self.num_shards = num_shards
        self.seed = seed
        self._initializer_arg = initializer
        self._creator_arg = table_creator
        self.supports_jit = False  # custom ops: no XLA
        self.params = Variable(
            self.name,
            key_dtype=self.key_dtype,
            value_dtype=self.value_dtype,
            dim=embedding_size,
            initializer=initializer,
            seed=seed,
            num_shards=num_shards,
            table_creator=table_creator,
            restrict_policy=restrict_policy,
            admission_filter=admission_filter,
            trainable=self.trainable,
            track_changes=track_changes,
            placement=placement,
        )
        self.embedding_size = self.params.dim  # an int (embedding_size may be a numpy integer)
        if self.params.trainable:
            self._track_step_buffer(self.params.step_buffer)

    def _track_step_buffer(self, buffer):
        if IS_KERAS3:
            # Keras 3 reads these Keras-variable attributes off tracked weights.
            for attr, value in (("regularizer", None), ("constraint", None), ("overwrite_with_gradient", False)):
                if not hasattr(buffer, attr):
                    setattr(buffer, attr, value)
            if not hasattr(buffer, "path"):
                buffer.path = f"{self.name}/step_rows"
            self._track_variable(buffer)
        else:
            self._tfde_step_buffer = buffer  # tf-keras tracks tf.Variable attributes

    def build(self, input_shape: Any = None) -> None:
        self.built = True

    if IS_KERAS3:
        # The layer's dtype policy is the key dtype (see __init__), so outputs
        # are declared with the value dtype here.
        def compute_output_spec(self, inputs: Any, training: Optional[bool] = None) -> Any:
            shape = tf.TensorShape(inputs.shape)
            return _keras.KerasTensor(self.compute_output_shape(shape), dtype=self.value_dtype.name)

    def _ids(self, ids):
        """`ids` (a tensor, SparseTensor, RaggedTensor, numpy array or list)
        with the key dtype.  Like keras.layers.Embedding, ids of another int
        or float dtype are accepted: Keras builds models on float
        placeholders unless told otherwise, and data often arrives as int64.
        Unlike it, the cast is exact: an id that is not a whole number in
        the key dtype's range (2**32 + 1 or 1.7 for an int32 table) is
        refused, not wrapped or truncated to another key: a ShapeError
        eagerly, an InvalidArgumentError naming the table when a graph
        (model.fit, tf.function) runs (tfde.tables.base.cast_keys).  String
        tables take string ids only."""
        name = self.params.name
        if isinstance(ids, tf.SparseTensor):
            return tf.SparseTensor(ids.indices, cast_keys(ids.values, self.key_dtype, name), ids.dense_shape)
        if isinstance(ids, tf.RaggedTensor):
            return ids.with_flat_values(cast_keys(ids.flat_values, self.key_dtype, name))
        if tf.is_tensor(ids):
            return cast_keys(ids, self.key_dtype, name)
        if self.key_dtype.is_integer:
            return tf.constant(exact_key_array(ids, self.key_dtype, name, whole_floats=True))
        return key_tensor(ids, self.key_dtype, name)

    def _lookup(self, ids, training, combiner):
        ids = self._ids(ids)
        if isinstance(ids, tf.SparseTensor):
            return embedding_lookup_sparse(self.params, ids, combiner=combiner or "mean", training=training)
        if isinstance(ids, tf.RaggedTensor):
            return embedding_lookup_ragged(self.params, ids, combiner=combiner or "mean", training=training)
        rows = embedding_lookup(self.params, ids, training=training)
        if combiner is None:
            return rows
        if ids.shape.rank == 0:
            raise ConfigError(f"combiner {combiner!r} needs ids of rank >= 1, got a scalar")
        flat = tf.reshape(rows, [-1, tf.shape(ids)[-1], self.embedding_size])
        n = tf.shape(flat)[0]
        segments = tf.repeat(tf.range(n), tf.shape(ids)[-1])
        combined = _combine(tf.reshape(flat, [-1, self.embedding_size]), segments, n, None, combiner)
        out = tf.reshape(combined, tf.concat([tf.shape(ids)[:-1], [self.embedding_size]], 0))
        if ids.shape.rank is not None:
            out.set_shape(ids.shape[:-1].concatenate([self.embedding_size]))
        return out

    def call(self, inputs: Any, training: Optional[bool] = None) -> tf.Tensor:
        return self._lookup(inputs, training, self.combiner)

    def compute_output_shape(self, input_shape: Any) -> tuple:
        shape = tf.TensorShape(input_shape)
        if self.combiner is not None:
            shape = shape[:-1]
        return tuple(shape.concatenate([self.embedding_size]).as_list())

    # ------------------------------------------------------------ saving
    # model.save (.keras) and save_weights (.weights.h5), Keras 3 and
    # tf-keras: the layer's state is its Variable's (rows, optimizer slots,
    # policy and admission state; tfde/keras/store.py), not its step buffer,
    # which is empty between steps.

    def save_own_variables(self, store: Any) -> None:
        state.save_variable(self.params, StoreWriter(store))

    def load_own_variables(self, store: Any) -> None:
        state.restore_variable(self.params, [StoreReader(store, f"the weights of layer {self.name!r}")])

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("dtype", None)
        config.pop("autocast", None)  # always False (see __init__)
        config.update(
            {
                "embedding_size": self.embedding_size,
                "key_dtype": self.key_dtype.name,
                "value_dtype": self.value_dtype.name,
                "initializer": _serialize_initializer(self._initializer_arg),
                "combiner": self.combiner,
                "num_shards": self.num_shards,
                "seed": self.seed,
                "table_creator": creator_config(self._creator_arg),
                "restrict_policy": _component_config(self.params.restrict_policy),
                "admission_filter": _component_config(self.params.admission_filter),
                "track_changes": self.params.changes is not None,
            }
        )
        return config

    @classmethod
    def from_config(cls, config: dict) -> "Embedding":
        return cls(**objects_from_config(config))


@_keras.utils.register_keras_serializable(package="tfde")
class SquashedEmbedding(Embedding):
    """Embedding that reduces every non-batch axis of the ids:
    ``[batch, d1, ..., dk]`` ids -> ``[batch, dim]`` (combiner 'sum' by default).

    Example:
      >>> layer = tfde.keras.layers.SquashedEmbedding(4, initializer=1.0)
      >>> layer(tf.constant([[1, 2, 3]])).numpy().tolist()
      [[3.0, 3.0, 3.0, 3.0]]
    """

    def __init__(self, embedding_size: int, combiner: str = "sum", **kwargs: Any) -> None:
        if combiner is None:
            raise ConfigError("SquashedEmbedding needs a combiner: 'sum', 'mean' or 'sqrtn'")
        super().__init__(embedding_size, combiner=combiner, **kwargs)

    def call(self, inputs: Any, training: Optional[bool] = None) -> tf.Tensor:
        if isinstance(inputs, (tf.SparseTensor, tf.RaggedTensor)):
            return self._lookup(inputs, training, self.combiner)
        ids = self._ids(inputs)
        if ids.shape.rank == 1:
            ids = ids[:, None]
        batch = tf.shape(ids)[0]
        return self._lookup(tf.reshape(ids, [batch, -1]), training, self.combiner)

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return (tf.TensorShape(input_shape)[0], self.embedding_size)
