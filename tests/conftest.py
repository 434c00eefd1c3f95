"""Shared fixtures.  Tests run against real parts: the compiled op library,
real TF graphs (eager, tf.function, model.fit) and, for Redis, a real server."""

import inspect
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from backends import BACKENDS, VARIABLE_BACKENDS  # noqa: E402

LEGACY_KERAS = os.environ.get("TF_USE_LEGACY_KERAS") == "1"

# TensorFlow Recommenders needs tf-keras: its tests run in the tf-keras run of
# scripts/test.sh and are left out of the Keras 3 run (said in the header).
TF_KERAS_ONLY = ["test_tfrs.py"]
collect_ignore = [] if LEGACY_KERAS else list(TF_KERAS_ONLY)


# The fast tier (`bash scripts/test.sh --fast`) leaves out every test that
# starts a process: worker jobs, redis-server instances (standalone,
# cluster, sentinel), compilers, a fresh Python.  They are marked "slow"
# here, from their code: the test function, the fixtures it uses and every
# helper of the tests directory they call, followed through the helpers'
# own calls (distributed_check.run_one_and_two -> start_job -> Popen), so a
# new test is classified as it is written.
_STARTS_A_PROCESS = re.compile(
    r"\bsubprocess\b|\bPopen\b|\bsys\.executable\b|\brun_job\(|horovodrun|"
    r"\bstandalone\(|\bRestartable\(|\bcluster\(\)|\bsentinel\(\)|\b_server\("
)
_TESTS = os.path.dirname(os.path.abspath(__file__))


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _of_the_tests(obj) -> bool:
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return False
    return path is not None and os.path.abspath(path).startswith(_TESTS + os.sep)


def _names(code) -> set:
    """The global names a code object and the functions defined in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def _called(obj) -> list:
    """The functions and classes of the tests directory that obj names:
    globals of its module (start_job) and attributes of the tests
    directory's modules it imports (redis_servers.FailoverGroup)."""
    if inspect.isclass(obj):
        return [f for f in vars(obj).values() if inspect.isfunction(f)]
    code, module = getattr(obj, "__code__", None), inspect.getmodule(obj)
    if code is None or module is None:
        return []
    names = _names(code)
    found = [getattr(module, name, None) for name in names]
    for helper_module in [m for m in found if inspect.ismodule(m) and _of_the_tests(m)]:
        found += [getattr(helper_module, name, None) for name in names]
    return [h for h in found if (inspect.isfunction(h) or inspect.isclass(h)) and _of_the_tests(h)]


def _starts_a_process(item) -> bool:
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    todo = [fn] + [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    seen = set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        if _STARTS_A_PROCESS.search(_source(f)):
            return True
        todo += _called(f)
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _starts_a_process(item):
            item.add_marker(pytest.mark.slow)


def pytest_report_header(config):
    if not LEGACY_KERAS:
        return f"Keras 3 run: {', '.join(TF_KERAS_ONLY)} (tfrs, tf-keras only) run in the tf-keras run"
    return None


@pytest.fixture(params=VARIABLE_BACKENDS)
def creator(request):
    """A TableCreator of every backend Variable-level tests run on
    (tests/backends.py): cuckoo, the reference (whose own tests then check
    the spec) and Redis; what a Redis one stored is deleted afterwards."""
    made = BACKENDS[request.param]()
    yield made.creator
    made.cleanup()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def rows_of(var, keys):
    """Current rows of `keys` as float64 numpy."""
    return var.lookup(tf.constant(keys, dtype=var.key_dtype)).numpy().astype(np.float64)
