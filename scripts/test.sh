#!/usr/bin/env bash
# Installs everything the tests need, starts what they need, runs the whole
# suite: once under Keras 3 (TF 2.21's default) and the Keras-facing tests
# again under tf-keras (TF_USE_LEGACY_KERAS=1).  Exit status: pytest's.
#
# The virtualenv is cached outside the clone, keyed by a hash of the
# dependency spec, in $TFDE_VENV_ROOT (default ~/.cache/tfde/venvs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
KEY=$(cat pyproject.toml scripts/requirements-test.txt | sha256sum | cut -c1-16)
VENV=${TFDE_VENV:-${TFDE_VENV_ROOT:-$HOME/.cache/tfde/venvs}/test-$KEY}

if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  echo "installing a C++ compiler (tfde compiles its ops against the installed TensorFlow)"
  apt-get update -qq && apt-get install -y -qq g++ >/dev/null
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
"$VENV/bin/tfde" build

status=0
echo "=== Keras 3"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" || status=$?
echo "=== tf-keras (TF_USE_LEGACY_KERAS=1): Keras-facing tests"
TF_USE_LEGACY_KERAS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m keras "$@" || status=$?
exit $status
