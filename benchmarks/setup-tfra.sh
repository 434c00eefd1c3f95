#!/usr/bin/env bash
# The reference system of the benchmarks: TensorFlow Recommenders Addons
# (TFRA) 0.8.1 in a virtualenv of its own.  Its compiled ops load only on
# TensorFlow 2.16.2, and it trains with tf-keras, so it cannot share tfde's
# environment.
#
#   bash benchmarks/setup-tfra.sh                  # the venv (a minute or two)
#   WITH_HOROVOD=1 bash benchmarks/setup-tfra.sh   # also Horovod 0.28.1 with gloo (builds: ~5 minutes)
#
# The venv goes to $TFRA_VENV (default ~/.cache/tfde-anchors/tfra), which is
# where the benchmarks look for it (or set TFRA_PYTHON to its python).
# Running it again only adds what is missing.
set -euo pipefail
VENV=${TFRA_VENV:-$HOME/.cache/tfde-anchors/tfra}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q tensorflow-cpu==2.16.2 tf-keras==2.16.0 tensorflow-recommenders-addons==0.8.1 \
  redis msgpack

if [ "${WITH_HOROVOD:-0}" = 1 ] && ! "$VENV/bin/python" -c "import horovod.tensorflow" 2>/dev/null; then
  if ! dpkg -s cmake libhighwayhash-dev libfarmhash-dev >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq cmake libhighwayhash-dev libfarmhash-dev >/dev/null
  fi
  "$VENV/bin/pip" install -q cmake setuptools wheel
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS=-j2 \
    "$VENV/bin/pip" install -q --no-cache-dir --no-build-isolation horovod==0.28.1
fi
"$VENV/bin/python" -c "import tensorflow_recommenders_addons as tfra; print('TFRA', tfra.__version__, 'ready:', '$VENV')"
