"""TableConfig and FeatureConfig: what a DistributedEmbedding layer
(tfde/keras/collection.py) is made of (docs/distributed.md).

A TableConfig describes one dynamic table (its row width, key dtype,
initial rows, store, restrict policy, admission filter, expected size); a
FeatureConfig names the table one input feature is looked up in, and how
its ids are combined.  Features that refer to the same TableConfig object
share its table, as with keras-rs's and tf.tpu.experimental.embedding's
configs.  Both are plain data with get_config / from_config.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tfde.errors import ConfigError
from tfde.lookup import COMBINERS
from tfde.tables.base import TableCreator, creator_config, int_arg
from tfde.types import DTypeLike, InitializerLike


def _fresh(component):
    """A restrict policy or admission filter for one new Variable: classes as
    they are, an instance rebuilt from its config (an instance binds to the
    one Variable it serves; a TableConfig may make several: column slices, a
    model built again)."""
    if component is None or isinstance(component, type):
        return component
    return type(component)(**component.get_config())


class TableConfig:
    """One dynamic embedding table of a DistributedEmbedding layer.

    Args:
      name: the table's name (its Variable is named
        ``{layer name}/{name}``); required, unique within a layer.
      embedding_dim: row width.
      key_dtype: tf.int64 (default), tf.int32 or tf.string.
      value_dtype: float dtype of rows (tf.float32 default).
      initializer: initial rows of unseen keys (tfde.initializers).
      combiner: how the ids of one example are combined when a feature
        gives several (2-D dense ids, sparse or ragged ids): 'mean'
        (default), 'sum' or 'sqrtn'; a FeatureConfig may override it.
      expected_rows: about how many keys the table will hold (alias:
        vocabulary_size, as keras-rs and TPU configs call it); placement
        plans weigh tables by expected_rows * embedding_dim.  None: unknown
        (weighed as 1 row).  To presize a cuckoo store, give it
        table_creator=tfde.CuckooTableCreator(expected_rows=N).
      table_creator, num_shards, restrict_policy, admission_filter, seed,
        track_changes: as tfde.Variable.

    Example:
      >>> t = tfde.TableConfig("item", embedding_dim=16, initializer=0.0)
      >>> tfde.TableConfig.from_config(t.get_config()).embedding_dim
      16
    """

    def __init__(
        self,
        name: str,
        embedding_dim: int,
        key_dtype: DTypeLike = tf.int64,
        value_dtype: DTypeLike = tf.float32,
        initializer: InitializerLike = None,
        combiner: str = "mean",
        expected_rows: Optional[int] = None,
        vocabulary_size: Optional[int] = None,
        table_creator: Optional[TableCreator] = None,
        num_shards: int = 1,
        restrict_policy: Optional[Any] = None,
        admission_filter: Optional[Any] = None,
        seed: Optional[int] = None,
        track_changes: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"a TableConfig needs a non-empty name without '/', got {name!r}")
        dim = int_arg(embedding_dim)
        if dim is None or dim < 1:
            raise ConfigError(f"TableConfig {name!r}: embedding_dim must be an int >= 1, got {embedding_dim!r}")
        if combiner not in COMBINERS:
            raise ConfigError(f"TableConfig {name!r}: combiner must be one of {COMBINERS}, got {combiner!r}")
        if expected_rows is not None and vocabulary_size is not None and expected_rows != vocabulary_size:
            raise ConfigError(
                f"TableConfig {name!r}: expected_rows={expected_rows!r} and vocabulary_size={vocabulary_size!r} "
                "are two names of one number; give one"
            )
        rows = expected_rows if expected_rows is not None else vocabulary_size
        if rows is not None and (int_arg(rows) is None or int_arg(rows) < 1):
            raise ConfigError(f"TableConfig {name!r}: expected_rows must be an int >= 1 or None, got {rows!r}")
        if table_creator is not None and not isinstance(table_creator, TableCreator):
            raise ConfigError(
                f"TableConfig {name!r}: table_creator must be a tfde TableCreator, got {type(table_creator).__name__}"
            )
        self.name = name
        self.embedding_dim = dim
        self.key_dtype = tf.as_dtype(key_dtype)
        self.value_dtype = tf.as_dtype(value_dtype)
        self.initializer = initializer
        self.combiner = combiner
        self.expected_rows = None if rows is None else int_arg(rows)
        self.table_creator = table_creator
        self.num_shards = num_shards
        self.restrict_policy = restrict_policy
        self.admission_filter = admission_filter
        self.seed = seed
        self.track_changes = bool(track_changes)

    @property
    def weight(self) -> int:
        """What placement plans balance: expected_rows (1 if unknown) times
        embedding_dim."""
        return (self.expected_rows or 1) * self.embedding_dim

    def variable_kwargs(self) -> dict:
        """Keyword arguments of the tfde Embedding layer holding this table."""
        return {
            "key_dtype": self.key_dtype,
            "value_dtype": self.value_dtype,
            "initializer": self.initializer,
            "num_shards": self.num_shards,
            "table_creator": self.table_creator,
            "restrict_policy": _fresh(self.restrict_policy),
            "admission_filter": _fresh(self.admission_filter),
            "seed": self.seed,
            "track_changes": self.track_changes,
        }

    def get_config(self) -> dict:
        from tfde.keras.layers import _component_config, _serialize_initializer

        def component(c):
            if isinstance(c, type):
                return {"class_name": c.__name__, "config": {}}
            return _component_config(c)

        return {
            "name": self.name,
            "embedding_dim": self.embedding_dim,
            "key_dtype": self.key_dtype.name,
            "value_dtype": self.value_dtype.name,
            "initializer": _serialize_initializer(self.initializer),
            "combiner": self.combiner,
            "expected_rows": self.expected_rows,
            "table_creator": creator_config(self.table_creator),
            "num_shards": self.num_shards,
            "restrict_policy": component(self.restrict_policy),
            "admission_filter": component(self.admission_filter),
            "seed": self.seed,
            "track_changes": self.track_changes,
        }

    @classmethod
    def from_config(cls, config: dict) -> "TableConfig":
        from tfde.keras.layers import objects_from_config

        return cls(**objects_from_config(config))

    def __repr__(self):
        return (
            f"tfde.TableConfig({self.name!r}, embedding_dim={self.embedding_dim}, "
            f"key_dtype={self.key_dtype.name}, expected_rows={self.expected_rows})"
        )


class FeatureConfig:
    """One input feature of a DistributedEmbedding layer: the table its ids
    are looked up in.

    Args:
      table: the TableConfig; features given the same object share a table.
      name: the feature's name (default: its key in the layer's dict of
        features).
      combiner: 'sum', 'mean' or 'sqrtn' for this feature's ids, None: the
        table's combiner.
      sequence: False (default): ids of shape [batch] give [batch, dim] and
        ids with more axes (dense [batch, n], sparse or ragged) are
        combined over the last one into [batch, dim].  True: no combining,
        ids.shape + [dim] (ragged ids give ragged rows).

    Example:
      >>> item = tfde.TableConfig("item", embedding_dim=8)
      >>> tfde.FeatureConfig(item, combiner="sum").table is item
      True
    """

    def __init__(
        self, table: TableConfig, name: Optional[str] = None, combiner: Optional[str] = None, sequence: bool = False
    ) -> None:
        if not isinstance(table, TableConfig):
            raise ConfigError(
                f"FeatureConfig needs a tfde.TableConfig as its table, got {type(table).__name__}; "
                "e.g. tfde.FeatureConfig(table=tfde.TableConfig('item', embedding_dim=16))"
            )
        if combiner is not None and combiner not in COMBINERS:
            raise ConfigError(f"FeatureConfig {name!r}: combiner must be None or one of {COMBINERS}, got {combiner!r}")
        if sequence and combiner is not None:
            raise ConfigError(f"FeatureConfig {name!r}: a sequence feature is not combined; drop combiner=")
        self.table, self.name, self.combiner, self.sequence = table, name, combiner, bool(sequence)

    @property
    def effective_combiner(self) -> Optional[str]:
        """The combiner this feature's ids are combined with (None: a
        sequence feature)."""
        return None if self.sequence else (self.combiner or self.table.combiner)

    def get_config(self) -> dict:
        """The feature's config; its table is named (table_name) and its
        config kept beside, so that from_config of several features can
        make one TableConfig object per name again (DistributedEmbedding's
        config does)."""
        return {
            "name": self.name,
            "table": self.table.get_config(),
            "combiner": self.combiner,
            "sequence": self.sequence,
        }

    @classmethod
    def from_config(cls, config: dict, tables: Optional[dict] = None) -> "FeatureConfig":
        """`tables`: name -> TableConfig already made (features of one layer
        share them); a table config not in it is made and added."""
        config = dict(config)
        table = config.pop("table")
        if isinstance(table, dict):
            made = None if tables is None else tables.get(table["name"])
            if made is None:
                made = TableConfig.from_config(table)
                if tables is not None:
                    tables[made.name] = made
            table = made
        return cls(table=table, **config)

    def __repr__(self):
        return f"tfde.FeatureConfig(table={self.table.name!r}, combiner={self.effective_combiner!r})"
