"""tfde: dynamic embedding tables for TensorFlow recommender models.

Key -> row stores that grow as new ids appear (an in-process cuckoo hash
table by default), Keras layers over them, and an optimizer wrapper that
updates only the rows a batch touched.  See README.md.
"""

import tensorflow as _tf

_major, _minor = (int(x) for x in _tf.__version__.split(".")[:2])
if (_major, _minor) < (2, 16):
    raise ImportError(f"tfde needs TensorFlow >= 2.16, found {_tf.__version__}; "
                      "upgrade with `pip install -U 'tensorflow-cpu>=2.16'` (or tensorflow)")

from tfde import errors, exchange, hashing, initializers, tables  # noqa: E402
from tfde.admission import AdmissionFilter, CounterFilter, ProbabilityFilter  # noqa: E402
from tfde.errors import (BackendUnavailableError, CapacityError, ConfigError, ShapeError, TfdeError,  # noqa: E402
                         UnsupportedOptimizerError)
from tfde.lookup import embedding_lookup, embedding_lookup_ragged, embedding_lookup_sparse  # noqa: E402
from tfde.optimizer import DynamicEmbeddingOptimizer  # noqa: E402
from tfde.policy import (AutoRestrictor, FrequencyRestrictPolicy, RestrictPolicy,  # noqa: E402
                         TimestampRestrictPolicy, TTLPolicy)
from tfde.tables import (CuckooTableCreator, RedisTableConfig, RedisTableCreator, Table,  # noqa: E402
                         TableCreator)
from tfde.variable import Variable, get_variable  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):
    # tfde.keras subclasses tf.keras classes: import it lazily so that
    # TF_USE_LEGACY_KERAS set after `import tfde` still takes effect.
    if name == "keras":
        import importlib

        return importlib.import_module("tfde.keras")
    raise AttributeError(f"module 'tfde' has no attribute {name!r}")


__all__ = [
    "Variable", "get_variable", "embedding_lookup", "embedding_lookup_sparse", "embedding_lookup_ragged",
    "DynamicEmbeddingOptimizer", "CuckooTableCreator", "RedisTableConfig", "RedisTableCreator", "Table", "TableCreator", "RestrictPolicy", "FrequencyRestrictPolicy", "TimestampRestrictPolicy", "TTLPolicy", "AutoRestrictor", "AdmissionFilter", "CounterFilter", "ProbabilityFilter",
    "TfdeError", "ConfigError", "ShapeError", "CapacityError", "BackendUnavailableError",
    "UnsupportedOptimizerError", "errors", "hashing", "initializers", "tables",
]
