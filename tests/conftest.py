"""Shared fixtures.  Tests run against real parts: the compiled op library,
real TF graphs (eager, tf.function, model.fit) and, for Redis, a real server."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfde  # noqa: E402
from tfde.tables import CuckooTableCreator, ReferenceTableCreator  # noqa: E402

LEGACY_KERAS = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
BACKENDS = {"cuckoo": CuckooTableCreator, "reference": ReferenceTableCreator}


@pytest.fixture(params=sorted(BACKENDS))
def creator(request):
    """Every backend, the reference included (its own tests then check the spec)."""
    return BACKENDS[request.param]()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def rows_of(var, keys):
    """Current rows of `keys` as float64 numpy."""
    return var.lookup(tf.constant(keys, dtype=var.key_dtype)).numpy().astype(np.float64)
