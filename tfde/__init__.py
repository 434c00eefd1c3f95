"""tfde: dynamic embedding tables for TensorFlow recommender models.

Key -> row stores that grow as new ids appear (an in-process cuckoo hash
table by default), Keras layers over them, and an optimizer wrapper that
updates only the rows a batch touched.  See README.md and docs/guide.md.
"""

__version__ = "0.1.0"  # the one place it is written (pyproject.toml reads it)

from tfde import _install  # noqa: E402

_install.check_distributions(_install.installed_tf_distributions())
try:
    import tensorflow as _tf  # noqa: E402
except ImportError as _e:
    raise _install.missing_tensorflow(_e) from _e
_install.check_version(_tf.__version__)

# tfde.saving registers the checkpoint saver; tfde.distributed registers the
# engines with tfde.exchange.
from tfde import distributed, errors, exchange, hashing, initializers, saving, semi_sync, tables  # noqa: E402
from tfde.admission import AdmissionFilter, CounterFilter, ProbabilityFilter  # noqa: E402
from tfde.errors import (  # noqa: E402
    BackendError,
    BackendUnavailableError,
    BuildError,
    CapacityError,
    CheckpointError,
    ConfigError,
    CredentialsError,
    ShapeError,
    TfdeError,
    UnsupportedOptimizerError,
)
from tfde.lookup import embedding_lookup, embedding_lookup_ragged, embedding_lookup_sparse  # noqa: E402
from tfde.optimizer import DynamicEmbeddingOptimizer  # noqa: E402
from tfde.policy import AutoRestrictor, FrequencyRestrictPolicy, RestrictPolicy, TimestampRestrictPolicy, TTLPolicy  # noqa: E402
from tfde.saving import CheckpointManager, export_changes, export_for_serving  # noqa: E402
from tfde.tables import CuckooTableCreator, RedisTableConfig, RedisTableCreator, Table, TableCreator  # noqa: E402
from tfde.variable import Variable, get_variable  # noqa: E402

# isort: split
# Last: tfde.keras subclasses tf.keras classes and registers them (and the
# wrapped optimizers) with Keras, so keras.models.load_model finds them after
# a plain `import tfde`.  tf.keras is decided here: set TF_USE_LEGACY_KERAS=1
# before importing tfde to use tf-keras.
from tfde import keras, plans  # noqa: E402
from tfde.keras.configs import FeatureConfig, TableConfig  # noqa: E402

__all__ = [
    "Variable",
    "TableConfig",
    "FeatureConfig",
    "get_variable",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "embedding_lookup_ragged",
    "DynamicEmbeddingOptimizer",
    "CuckooTableCreator",
    "RedisTableConfig",
    "RedisTableCreator",
    "Table",
    "TableCreator",
    "RestrictPolicy",
    "FrequencyRestrictPolicy",
    "TimestampRestrictPolicy",
    "TTLPolicy",
    "AutoRestrictor",
    "AdmissionFilter",
    "CounterFilter",
    "ProbabilityFilter",
    "CheckpointManager",
    "export_for_serving",
    "export_changes",
    "TfdeError",
    "CheckpointError",
    "ConfigError",
    "ShapeError",
    "CapacityError",
    "BackendUnavailableError",
    "BackendError",
    "BuildError",
    "CredentialsError",
    "UnsupportedOptimizerError",
    "distributed",
    "errors",
    "exchange",
    "saving",
    "semi_sync",
    "hashing",
    "initializers",
    "tables",
    "keras",
    "plans",
]
