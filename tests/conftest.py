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

# TensorFlow Recommenders needs tf-keras: its tests run in the tf-keras run of
# scripts/test.sh and are left out of the Keras 3 run (said in the header).
TF_KERAS_ONLY = ["test_tfrs.py"]
collect_ignore = [] if LEGACY_KERAS else list(TF_KERAS_ONLY)


def pytest_report_header(config):
    if not LEGACY_KERAS:
        return f"Keras 3 run: {', '.join(TF_KERAS_ONLY)} (tfrs, tf-keras only) run in the tf-keras run"
    return None
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
