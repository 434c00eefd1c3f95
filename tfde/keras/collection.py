"""DistributedEmbedding: the embeddings of many sparse features in one
layer (docs/distributed.md).

The layer is made of FeatureConfigs (tfde/keras/configs.py) naming
TableConfigs; each table, or each column slice of a wide one, is a tfde
Embedding sublayer whose Variable is placed by the layer's plan
(tfde/plans.py).  A call looks up every feature at once:

* the ids of the features that share a table are deduplicated together;
* in a training step, the rows of every table come through one call of the
  exchange (tfde.variable.trainable_lookups_of: the collectives of one table,
  whatever the number of tables), and the optimizer sends every table's
  gradients back in one call too (Exchange.owner_gradients_many);
* each feature's rows are then combined (or kept as a sequence) and
  returned under its name.

Saving: the sublayers are saved like single Embedding layers (Keras weight
files, tf.train checkpoints, CheckpointManager, serving exports), each under
its own name, so a layer restores into a job of another size with another
plan; the column slicing (column_slice_threshold) is part of the layer's
structure and must match.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Union

import tensorflow as tf
from tensorflow.python.trackable import base as _trackable_base

from tfde import exchange
from tfde.errors import CheckpointError, ConfigError, ShapeError
from tfde.flavour import IS_KERAS3
from tfde.keras.configs import FeatureConfig, TableConfig
from tfde.keras.layers import Embedding
from tfde.lookup import _combine, _use_buffer
from tfde.plans import PLANS, make_plan
from tfde.variable import trainable_lookups_of, write_section

_keras = tf.keras


def _feature_dict(features) -> Dict[str, FeatureConfig]:
    """name -> FeatureConfig of a dict, or of a list / tuple of named
    FeatureConfigs (the order of either is the order of list inputs)."""
    if isinstance(features, FeatureConfig):
        features = [features]
    if isinstance(features, dict):
        out = {}
        for name, f in features.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"feature names must be non-empty strings, got {name!r}")
            if not isinstance(f, FeatureConfig):
                raise ConfigError(f"feature {name!r} must be a tfde.FeatureConfig, got {type(f).__name__}")
            if f.name is not None and f.name != name:
                raise ConfigError(f"feature {name!r} is given a FeatureConfig named {f.name!r}; use one name")
            out[name] = f
        return out
    if isinstance(features, (list, tuple)):
        out = {}
        for i, f in enumerate(features):
            if not isinstance(f, FeatureConfig):
                raise ConfigError(f"feature {i} must be a tfde.FeatureConfig, got {type(f).__name__}")
            name = f.name or f.table.name
            if name in out:
                raise ConfigError(
                    f"two features are named {name!r} (a FeatureConfig without a name takes its table's): give "
                    "each FeatureConfig a name=, or pass a dict of features"
                )
            out[name] = f
        return out
    raise ConfigError(f"features must be a dict or list of tfde.FeatureConfig, got {type(features).__name__}")


def _tables_of(features: Dict[str, FeatureConfig]) -> List[TableConfig]:
    """The distinct TableConfig objects, in the order features first name
    them; two different objects of one name are refused."""
    tables: List[TableConfig] = []
    for f in features.values():
        same = [t for t in tables if t.name == f.table.name]
        if same and same[0] is not f.table:
            raise ConfigError(
                f"two different TableConfigs are named {f.table.name!r}; features share a table by referring "
                "to the same TableConfig object, and tables of one layer need distinct names"
            )
        if not same:
            tables.append(f.table)
    return tables


def _slicing_of(plan) -> Dict[str, List[List[int]]]:
    """table name -> its column slices [[start, stop], ...]."""
    out: Dict[str, List[List[int]]] = {}
    for s in plan.slices:
        out.setdefault(s.table.name, []).append([s.start, s.stop])
    return out


class _Slicing(_trackable_base.Trackable):
    """A DistributedEmbedding's column slicing, saved in its tf.train
    checkpoints: a checkpoint restores only into a layer whose tables (those
    of both) are sliced the same way, since a table's rows are saved per
    slice (docs/distributed.md, "Placement plans")."""

    def __init__(self, layer_name: str, slicing: Dict[str, List[List[int]]]):
        self._layer_name = layer_name
        self._slicing = slicing

    def _serialize_to_tensors(self):
        return {"slices": tf.constant(json.dumps(self._slicing, sort_keys=True))}

    def _restore_from_tensors(self, restored_tensors):
        saved = json.loads(restored_tensors["slices"].numpy().decode())
        differ = {t: (saved[t], mine) for t, mine in self._slicing.items() if t in saved and saved[t] != mine}
        if differ:
            detail = "; ".join(f"table {t!r}: saved as columns {a}, this layer has {b}" for t, (a, b) in differ.items())
            raise CheckpointError(
                f"DistributedEmbedding {self._layer_name!r}: the checkpoint's column slices differ from this "
                f"layer's ({detail}). column_slice_threshold is part of the layer's structure: restore with the "
                "column_slice_threshold the checkpoint was saved with"
            )
        return tf.no_op()


@_keras.utils.register_keras_serializable(package="tfde")
class DistributedEmbedding(_keras.layers.Layer):
    """Dynamic embedding tables of many features, looked up and trained
    together (docs/distributed.md).

    Args:
      features: a dict name -> tfde.FeatureConfig (inputs and outputs are
        dicts with these keys), or a list of FeatureConfigs (inputs and
        outputs are lists in this order; a feature is named by its
        FeatureConfig's name, else its table's).
      placement: the plan placing tables on workers: 'auto' (default),
        'rows', 'round_robin' or 'memory_balanced' (tfde/plans.py;
        `layer.plan` shows it).
      column_slice_threshold: tables wider than this are split into column
        slices, each placed on its own (None: no slicing).

    Inputs: per feature, ids as a dense tensor ([batch] or [batch, n]), a
    tf.SparseTensor or a tf.RaggedTensor ([batch, (n)]), of the table's key
    dtype (int tables also take whole numbers of other dtypes, checked
    exactly as tfde.keras.layers.Embedding does).  Outputs: [batch, dim]
    per feature ([batch, n, dim] / ragged for sequence features).

    Train with an optimizer wrapped by tfde.DynamicEmbeddingOptimizer.

    Example:
      >>> item = tfde.TableConfig("item", embedding_dim=4, initializer=0.0)
      >>> emb = tfde.keras.layers.DistributedEmbedding(
      ...     {"item": tfde.FeatureConfig(item), "history": tfde.FeatureConfig(item, combiner="sum")})
      >>> out = emb({"item": tf.constant([1, 2]), "history": tf.constant([[1, 2], [3, 4]])})
      >>> out["history"].shape
      TensorShape([2, 4])
    """

    def __init__(
        self,
        features: Union[Dict[str, FeatureConfig], List[FeatureConfig]],
        placement: str = "auto",
        column_slice_threshold: Optional[int] = None,
        name: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("dtype", None)
        super().__init__(name=name, **kwargs)
        self._dict_io = isinstance(features, dict)
        self.features = _feature_dict(features)
        if not self.features:
            raise ConfigError("a DistributedEmbedding needs at least one feature")
        if placement not in PLANS:
            raise ConfigError(f"placement must be one of {PLANS}, got {placement!r}")
        self.placement = placement
        self.column_slice_threshold = column_slice_threshold
        self.tables = _tables_of(self.features)
        self.plan = make_plan(self.tables, exchange.workers(), placement, column_slice_threshold)
        self.supports_jit = False
        # One tfde Embedding per table slice, in plan order (a list: Keras
        # tracks, saves and restores each under its own name).
        self.table_layers = []
        for s in self.plan.slices:
            kwargs = s.table.variable_kwargs()
            if not s.whole and (kwargs["restrict_policy"] is not None or kwargs["admission_filter"] is not None):
                raise ConfigError(
                    f"table {s.table.name!r} is split into column slices (column_slice_threshold="
                    f"{column_slice_threshold}), and its restrict policy / admission filter would decide for each "
                    "slice apart, which could keep a key in one slice and drop it from another. Raise "
                    "column_slice_threshold above its embedding_dim, or drop the policy or filter"
                )
            self.table_layers.append(
                Embedding(
                    s.width,
                    name=f"{self.name}-{s.table.name}{s.suffix}",
                    placement=s.placement,
                    **kwargs,
                )
            )
            self.table_layers[-1].params._column_slice = None if s.whole else (s.start, s.stop)
        self._slices_of = {t.name: [i for i, s in enumerate(self.plan.slices) if s.table is t] for t in self.tables}
        # One write section for every table: the optimizer writes the whole
        # layer's step in one entry of it (one fused op, tfde/step_kernels.py).
        section = write_section(self.name)
        for layer in self.table_layers:
            layer.params._write_section = section

    def build(self, input_shape: Any = None) -> None:
        self.built = True

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> Dict[str, Any]:
        # Each table layer is a checkpoint dependency under its table's name
        # (and slice): Keras 3 does not make the layers of a list attribute
        # dependencies of tf.train.Checkpoint, so without this a checkpoint
        # would hold no row of this layer and restore without a complaint.
        children = super()._trackable_children(save_type, **kwargs)
        for layer, s in zip(self.table_layers, self.plan.slices):
            children[f"table-{s.table.name}{s.suffix}"] = layer
        if save_type == "checkpoint":
            if getattr(self, "_slicing_record", None) is None:
                with tf.init_scope():
                    self._slicing_record = _Slicing(self.name, _slicing_of(self.plan))
            children["column_slicing"] = self._slicing_record
        return children

    @property
    def variables_by_table(self) -> Dict[str, list]:
        """table name -> its Variables (one, or one per column slice)."""
        return {name: [self.table_layers[i].params for i in idx] for name, idx in self._slices_of.items()}

    # ------------------------------------------------------------ inputs

    def _by_feature(self, inputs) -> Dict[str, Any]:
        names = list(self.features)
        if isinstance(inputs, dict):
            missing = [n for n in names if n not in inputs]
            extra = [k for k in inputs if k not in self.features]
            if missing or extra:
                raise ConfigError(
                    f"DistributedEmbedding {self.name!r} takes the features {names}; the inputs "
                    + (f"lack {missing}" if missing else "")
                    + ("; " if missing and extra else "")
                    + (f"have unknown {extra}" if extra else "")
                )
            return {n: inputs[n] for n in names}
        if isinstance(inputs, (list, tuple)):
            if len(inputs) != len(names):
                raise ConfigError(
                    f"DistributedEmbedding {self.name!r} takes {len(names)} features ({names}), got a list of "
                    f"{len(inputs)} inputs"
                )
            return dict(zip(names, inputs))
        if len(names) == 1:
            return {names[0]: inputs}
        raise ConfigError(
            f"DistributedEmbedding {self.name!r} takes a dict (or list) of its features {names}, got "
            f"{type(inputs).__name__}"
        )

    def _outputs(self, by_name: Dict[str, Any], inputs) -> Any:
        if isinstance(inputs, dict) or (not isinstance(inputs, (list, tuple)) and self._dict_io):
            return by_name
        if isinstance(inputs, (list, tuple)):
            return [by_name[n] for n in self.features]
        return by_name[next(iter(self.features))]

    # ------------------------------------------------------------ lookup

    def call(self, inputs: Any, training: Optional[bool] = None) -> Any:
        by_feature = self._by_feature(inputs)
        ids, flat = {}, {}
        for name, f in self.features.items():
            layer = self.table_layers[self._slices_of[f.table.name][0]]
            ids[name] = layer._ids(by_feature[name])
            flat[name] = self._flat_ids(name, f, ids[name])
        first = self.table_layers[0].params
        train = _use_buffer(first, training)
        rows = self._rows(flat, train)
        out = {name: self._shape(name, f, ids[name], rows[name]) for name, f in self.features.items()}
        return self._outputs(out, inputs)

    def _flat_ids(self, name, f, ids):
        if isinstance(ids, tf.SparseTensor):
            if f.sequence:
                raise ShapeError(f"feature {name!r} is a sequence feature: give dense or ragged ids, not sparse")
            if ids.shape.rank is not None and ids.shape.rank != 2:
                raise ShapeError(f"feature {name!r}: sparse ids must be 2-D [batch, ids], got rank {ids.shape.rank}")
            return ids.values
        if isinstance(ids, tf.RaggedTensor):
            if not f.sequence and ids.ragged_rank != 1:
                raise ShapeError(
                    f"feature {name!r}: combining needs 2-D ragged ids [batch, (ids)], got ragged_rank "
                    f"{ids.ragged_rank}"
                )
            return ids.flat_values
        if ids.shape.rank == 0:
            raise ShapeError(f"feature {name!r}: ids must have a batch axis, got a scalar")
        return tf.reshape(ids, [-1])

    def _rows(self, flat: Dict[str, tf.Tensor], train: bool) -> Dict[str, tf.Tensor]:
        """Rows [n, dim] of every feature's flat ids: per table, the ids of
        all its features deduplicated together; in a training step every
        table's rows through one exchange, or alone one native op
        (trainable_lookups_of)."""
        per_table = {}
        for t in self.tables:
            names = [n for n, f in self.features.items() if f.table is t]
            per_table[t.name] = (names, flat[names[0]] if len(names) == 1 else tf.concat([flat[n] for n in names], 0))
        table_rows = {}
        if train:
            parts = [
                (self.table_layers[i].params, per_table[t.name][1])
                for t in self.tables
                for i in self._slices_of[t.name]
            ]
            found = iter(trainable_lookups_of(parts))
            for t in self.tables:
                table_rows[t.name] = _columns([next(found) for _ in self._slices_of[t.name]])
        else:
            for t in self.tables:
                unique, positions = tf.unique(per_table[t.name][1], out_idx=tf.int32)
                pieces = [self.table_layers[i].params._read_unique(unique) for i in self._slices_of[t.name]]
                table_rows[t.name] = tf.gather(_columns(pieces), positions)
        out = {}
        for t in self.tables:
            names = per_table[t.name][0]
            if len(names) == 1:
                out[names[0]] = table_rows[t.name]
                continue
            sizes = tf.stack([tf.shape(flat[n])[0] for n in names])
            for n, piece in zip(names, tf.split(table_rows[t.name], sizes, num=len(names))):
                out[n] = piece
        return out

    def _shape(self, name, f, ids, rows):
        dim = f.table.embedding_dim
        rows = tf.ensure_shape(rows, [None, dim])
        combiner = f.effective_combiner
        if isinstance(ids, tf.SparseTensor):
            segments = tf.cast(ids.indices[:, 0], tf.int32)
            return _combine(rows, segments, tf.cast(ids.dense_shape[0], tf.int32), None, combiner)
        if isinstance(ids, tf.RaggedTensor):
            if f.sequence:
                return ids.with_flat_values(rows)
            segments = tf.cast(ids.value_rowids(), tf.int32)
            return _combine(rows, segments, tf.cast(ids.nrows(), tf.int32), None, combiner)
        shape = tf.shape(ids)
        if f.sequence or ids.shape.rank == 1:
            out = tf.reshape(rows, tf.concat([shape, [dim]], 0))
            if ids.shape.rank is not None:
                out.set_shape(ids.shape.concatenate([dim]))
            return out
        per_example = shape[-1]
        n = tf.size(ids) // tf.maximum(per_example, 1)
        combined = _combine(rows, tf.repeat(tf.range(n), per_example), n, None, combiner)
        out = tf.reshape(combined, tf.concat([shape[:-1], [dim]], 0))
        if ids.shape.rank is not None:
            out.set_shape(ids.shape[:-1].concatenate([dim]))
        return out

    if IS_KERAS3:

        def compute_output_spec(self, inputs: Any, training: Optional[bool] = None) -> Any:
            by_feature = self._by_feature(inputs)
            out = {}
            for name, f in self.features.items():
                shape = list(by_feature[name].shape)
                dim = f.table.embedding_dim
                out_shape = shape + [dim] if f.sequence or len(shape) == 1 else shape[:-1] + [dim]
                out[name] = _keras.KerasTensor(tuple(out_shape), dtype=f.table.value_dtype.name)
            return self._outputs(out, inputs)

    # ------------------------------------------------------------ config

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("dtype", None)
        config.update(
            {
                "features": {name: f.get_config() for name, f in self.features.items()},
                "feature_order": list(self.features),
                "dict_io": self._dict_io,
                "placement": self.placement,
                "column_slice_threshold": self.column_slice_threshold,
            }
        )
        return config

    @classmethod
    def from_config(cls, config: dict) -> "DistributedEmbedding":
        config = dict(config)
        tables: Dict[str, TableConfig] = {}
        saved = config.pop("features")
        order = config.pop("feature_order", list(saved))
        dict_io = config.pop("dict_io", True)
        features = {name: FeatureConfig.from_config(saved[name], tables) for name in order}
        if not dict_io:
            for name, f in features.items():
                f.name = name
            features = list(features.values())
        return cls(features, **config)


def _columns(pieces):
    """The rows of a table from the rows of its column slices."""
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, 1)
