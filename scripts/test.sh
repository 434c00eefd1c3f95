#!/usr/bin/env bash
# Installs everything the tests need, starts what they need, runs the whole
# suite: once under Keras 3 (TF 2.21's default), the Keras-facing tests again
# under tf-keras (TF_USE_LEGACY_KERAS=1), and the Horovod tests in a TF 2.16
# environment with Horovod (it does not build against TF 2.21).  Exit status:
# non-zero if any run failed.
#
# The virtualenvs are cached outside the clone, keyed by a hash of their
# dependency specs, in $TFDE_VENV_ROOT (default ~/.cache/tfde/venvs).
#
#   bash scripts/test.sh            everything (what CI runs)
#   bash scripts/test.sh --fast     the fast tier: Keras 3 only, no test that starts a process
#                                   (worker jobs, redis-server instances, compilers: marked
#                                   "slow" by tests/conftest.py), no Horovod environment
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
FAST=0
if [ "${1:-}" = "--fast" ]; then
  FAST=1
  shift
fi

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
KEY=$(cat pyproject.toml scripts/requirements-test.txt | sha256sum | cut -c1-16)
VENV=${TFDE_VENV:-${TFDE_VENV_ROOT:-$HOME/.cache/tfde/venvs}/test-$KEY}

if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  echo "installing a C++ compiler (tfde compiles its ops against the installed TensorFlow)"
  apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi
# The sanitizer runtimes (libtsan, libasan, libubsan) for tests/test_sanitizers.py,
# which builds the cuckoo core's stress test with -fsanitize=thread and with
# -fsanitize=address,undefined.  They come with the compiler's libgcc-N-dev.
CXX_BIN=$(command -v g++ || command -v c++)
links_with() { echo 'int main() { return 0; }' | "$CXX_BIN" -x c++ -fsanitize="$1" -o /dev/null - 2>/dev/null; }
if ! links_with thread || ! links_with address,undefined; then
  echo "installing the sanitizer runtimes for $CXX_BIN"
  apt-get update -qq && apt-get install -y -qq "libgcc-$("$CXX_BIN" -dumpversion | cut -d. -f1)-dev" >/dev/null
  links_with thread && links_with address,undefined || { echo "sanitizer runtimes still missing" >&2; exit 1; }
fi

if [ ! -f "$VENV/.complete" ]; then
  echo "creating test venv $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -r scripts/requirements-test.txt
  touch "$VENV/.complete"
fi
# The package itself, editable, pointing at this checkout (fast: deps are there).
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . >/dev/null

# Redis on 127.0.0.1:6379 for the Redis backend's tests.
if ! command -v redis-server >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
if ! "$VENV/bin/python" -c "import redis,sys; redis.Redis(port=6379, socket_connect_timeout=1).ping()" 2>/dev/null; then
  echo "starting redis-server on 127.0.0.1:6379"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  sleep 1
fi

export TFDE_CACHE_DIR=${TFDE_CACHE_DIR:-$HOME/.cache/tfde}
export TF_CPP_MIN_LOG_LEVEL=2
# The tests that start no process (in-process TF, Redis on 6379 under their
# own tags, their own temporary directories) run JOBS at once (pytest-xdist):
# one pytest worker keeps about one core busy.  The tests that start
# processes (worker jobs, redis-server instances, compilers: marked "slow" by
# tests/conftest.py) already use every core, and some time their processes:
# they run one at a time, except the benchmark commands' quick runs (below).
JOBS=$(nproc)
[ "$JOBS" -gt 4 ] && JOBS=4
if [ "$FAST" = 1 ]; then
  "$VENV/bin/tfde" build
  echo "=== fast tier: Keras 3 (TF 2.21), no test that starts a process"
  exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 --ignore=tests/horovod -m "not slow" \
    -n "$JOBS" "$@"
fi

# The Horovod environment (TF 2.16.2 + tf-keras + Horovod 0.28.1 with gloo),
# cached like the main one.
HKEY=$(cat pyproject.toml scripts/requirements-horovod.txt | sha256sum | cut -c1-16)
HVENV=${TFDE_HOROVOD_VENV:-${TFDE_VENV_ROOT:-$HOME/.cache/tfde/venvs}/horovod-$HKEY}
if [ ! -f "$HVENV/.complete" ]; then
  echo "creating Horovod test venv $HVENV (builds Horovod: ~5 minutes)"
  if ! dpkg -s cmake libhighwayhash-dev libfarmhash-dev >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq cmake libhighwayhash-dev libfarmhash-dev >/dev/null
  fi
  rm -rf "$HVENV"
  "$PY" -m venv "$HVENV"
  "$HVENV/bin/pip" install -q --upgrade pip
  "$HVENV/bin/pip" install -q -r scripts/requirements-horovod.txt
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS=-j2 \
    "$HVENV/bin/pip" install -q --no-cache-dir --no-build-isolation horovod==0.28.1
  "$HVENV/bin/python" -c "import horovod.tensorflow.keras"
  touch "$HVENV/.complete"
fi
"$HVENV/bin/pip" install -q --no-deps --no-build-isolation -e . >/dev/null
export TFDE_HOROVOD_PYTHON="$HVENV/bin/python"

# The benchmarks' reference system, TFRA 0.8.1 (TF 2.16.2), with Horovod
# (its HvdAllToAllEmbedding is the many-feature benchmark's reference), for
# tests/test_benchmarks.py, which runs every documented benchmark command in
# a quick form; cached likewise, keyed by the script that builds it.
TKEY=$( (cat benchmarks/setup-tfra.sh; echo WITH_HOROVOD=1) | sha256sum | cut -c1-16)
export TFRA_VENV=${TFDE_TFRA_VENV:-${TFDE_VENV_ROOT:-$HOME/.cache/tfde/venvs}/tfra-$TKEY}
if [ ! -f "$TFRA_VENV/.complete" ]; then
  echo "creating the TFRA reference venv $TFRA_VENV (builds Horovod: ~5 minutes)"
  rm -rf "$TFRA_VENV"
  WITH_HOROVOD=1 PYTHON="$PY" bash benchmarks/setup-tfra.sh
  touch "$TFRA_VENV/.complete"
fi
export TFRA_PYTHON="$TFRA_VENV/bin/python"

"$VENV/bin/tfde" build
"$HVENV/bin/tfde" build

status=0
# One run in three passes: `in_passes "MARKER EXPRESSION" ARGS...` runs the
# selected tests that start no process JOBS at once, then those that start
# processes one at a time, then the benchmark commands' quick runs
# (tests/test_benchmarks.py, marked "bench") JOBS at once: they time their
# processes but check no figure, and one of them keeps only a core and a bit
# busy.  A pass that selects nothing (pytest's exit 5, e.g. for a path of fast
# tests only) is no failure; all selecting nothing is.
in_passes() {
  local select=$1 empty=0 rc
  shift
  for pass in "not slow" "slow and not bench" "slow and bench"; do
    local workers=() what="start processes, one at a time"
    [ "$pass" = "slow and not bench" ] || workers=(-n "$JOBS")
    [ "$pass" = "not slow" ] && what="start no process, $JOBS at once"
    [ "$pass" = "slow and bench" ] && what="run the benchmark commands, $JOBS at once"
    echo "--- tests that $what"
    rc=0
    "$@" -m "$select${select:+ and }$pass" "${workers[@]}" || rc=$?
    if [ "$rc" = 5 ]; then
      empty=$((empty + 1))
    elif [ "$rc" != 0 ]; then
      status=$rc
    fi
  done
  if [ "$empty" = 3 ]; then
    echo "no test selected" >&2
    status=5
  fi
}
PYTEST=(-m pytest -q -p no:cacheprovider --durations=15 --ignore=tests/horovod)
echo "=== Keras 3 (TF 2.21)"
in_passes "" "$VENV/bin/python" "${PYTEST[@]}" "$@"
echo "=== tf-keras (TF_USE_LEGACY_KERAS=1): Keras-facing tests"
in_passes "keras" env TF_USE_LEGACY_KERAS=1 "$VENV/bin/python" "${PYTEST[@]}" "$@"
echo "=== Horovod (TF 2.16.2, tf-keras, horovodrun on loopback)"
PATH="$HVENV/bin:$PATH" TF_USE_LEGACY_KERAS=1 "$HVENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests/horovod "$@" \
  || status=$?
exit $status
