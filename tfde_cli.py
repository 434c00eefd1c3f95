"""The `tfde` command (docs/install.md).

This module sits outside the tfde package on purpose: importing anything
from tfde imports TensorFlow (seconds), so the arguments are parsed, --help
answered and the environment TensorFlow reads at import set (its log level;
TF_USE_LEGACY_KERAS for --keras tf-keras) before tfde.cli runs the command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import threading

USAGE = """\
  tfde train [--data ratings.csv] [--epochs N] ...   train the demo two-tower model
  tfde train --workers 2 [--engine mwms|horovod]     ... with 2 synchronous worker processes
  tfde train --model dlrm [--placement auto] ...     train the DLRM click model (26 sparse features)
  tfde make-data DIR [--ratings N] [--seed S]        write synthetic MovieLens CSVs (ratings.csv, movies.csv)
  tfde build [--force]                               compile the op library now (for images)

TensorFlow's informational and warning log lines are off unless --tf-logs
is given or TF_CPP_MIN_LOG_LEVEL is set; its errors are always shown.
"""


def _at_least(low, kind=int):
    """An argparse type: a number of `kind` >= low, else a usage error
    naming the value seen (before any data is made or table touched)."""

    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an int' if kind is int else 'a number'}, got {text!r}")
        if not low <= value < float("inf"):  # NaN too
            raise argparse.ArgumentTypeError(f"must be >= {low} and finite, got {text}")
        return value

    return convert


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfde",
        description=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    logs = argparse.ArgumentParser(add_help=False)  # --tf-logs before or after the command
    logs.add_argument(
        "--tf-logs", action="store_true", default=argparse.SUPPRESS, help="show TensorFlow's log lines and warnings"
    )
    p.add_argument("--tf-logs", action="store_true", default=False, help="show TensorFlow's log lines and warnings")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the demo two-tower model (or --model dlrm)", parents=[logs])
    t.add_argument(
        "--model",
        choices=["two-tower", "dlrm"],
        default="two-tower",
        help="two-tower retrieval on MovieLens-like data, or DLRM click prediction on a Criteo-like log",
    )
    t.add_argument(
        "--data",
        help="two-tower: MovieLens ratings CSV (userId,movieId,rating,timestamp); dlrm: Criteo TSV (label, "
        "13 integers, 26 hex strings); default: synthetic",
    )
    t.add_argument("--interactions", type=_at_least(1), default=1_000_000, help="two-tower: synthetic interactions")
    t.add_argument("--users", type=_at_least(1), default=50_000)
    t.add_argument("--items", type=_at_least(1), default=20_000)
    t.add_argument(
        "--examples",
        type=_at_least(100),
        default=1_000_000,
        help="dlrm: synthetic examples (or at most this many of --data)",
    )
    t.add_argument(
        "--max-cardinality",
        type=_at_least(10),
        default=10_000_000,
        help="dlrm: the largest synthetic feature's distinct ids",
    )
    t.add_argument(
        "--placement",
        choices=["auto", "rows", "round_robin", "memory_balanced"],
        default="auto",
        help="dlrm: the placement plan of the 26 tables over the workers",
    )
    t.add_argument(
        "--features", type=int, default=26, help="dlrm: use the first N of the 26 categorical features (1..26)"
    )
    t.add_argument(
        "--layers",
        choices=["collection", "per-feature"],
        default="collection",
        help="dlrm: one DistributedEmbedding layer, or one Embedding layer per feature",
    )
    t.add_argument("--epochs", type=_at_least(1), help="default: 2 (two-tower), 1 (dlrm)")
    t.add_argument(
        "--batch-size", type=_at_least(1), help="examples per worker and step; default: 1024 (two-tower), 4096 (dlrm)"
    )
    t.add_argument("--dim", type=_at_least(1), help="embedding dim; default: 64 (two-tower), 16 (dlrm)")
    t.add_argument("--learning-rate", type=_at_least(0.0, float), help="default: 0.01 (two-tower), 0.002 (dlrm)")
    t.add_argument("--optimizer", default="adam", help="adam, adagrad, sgd, rmsprop, adamw or ftrl")
    t.add_argument("--k", type=_at_least(1), default=100, help="recall@k")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--keras", choices=["keras3", "tf-keras"], default="keras3")
    t.add_argument("--backend", choices=["cuckoo", "redis"], default="cuckoo", help="where the tables live")
    t.add_argument("--policy", choices=["frequency", "timestamp"], help="restrict policy of the tables")
    t.add_argument(
        "--max-rows",
        type=_at_least(1),
        help="keep each table at most this many rows (restricted after "
        "every batch; implies --policy frequency if none is given)",
    )
    t.add_argument(
        "--min-count",
        type=_at_least(1),
        help="admit a key only in the step it is seen for the min-count-th time (tfde.CounterFilter)",
    )
    t.add_argument(
        "--redis-config",
        help="Redis JSON config (TFRA format) for --backend redis; default: the file named by $TFDE_REDIS_CONFIG",
    )
    t.add_argument("--progress", action="store_true", help="progress bar even when stdout is not a terminal")
    t.add_argument(
        "--workers",
        type=_at_least(1),
        default=1,
        help="train with this many worker processes on this machine (synchronous; each owns a shard of every table)",
    )
    t.add_argument(
        "--engine",
        choices=["mwms", "horovod"],
        default="mwms",
        help="with --workers: MultiWorkerMirroredStrategy (TF_CONFIG) or Horovod (horovodrun)",
    )
    t.add_argument(
        "--as-worker",
        action="store_true",
        help="run as one worker of a job started elsewhere (TF_CONFIG or horovodrun); the launcher "
        "of --workers sets it",
    )
    t.add_argument(
        "--sync-every",
        type=_at_least(1),
        default=1,
        metavar="K",
        help="semi-synchronous training: workers train apart and sync every K steps (1: exact; docs/semi-sync.md)",
    )
    t.add_argument(
        "--sync-replicate",
        action="store_true",
        help="with --sync-every K > 1 and --workers: each worker keeps a copy of the sharded tables between syncs, "
        "so lookups between syncs run no collective (memory: every table on every worker; docs/semi-sync.md)",
    )
    t.add_argument(
        "--sync-local-slots",
        action="store_true",
        help="with --sync-replicate: each worker keeps its own optimizer slots across syncs, and a sync sends the "
        "rows' changes only (docs/semi-sync.md)",
    )
    t.add_argument(
        "--exchange-stats",
        action="store_true",
        help="measure the multi-worker exchange (bytes and time in collectives per step)",
    )
    d = sub.add_parser(
        "make-data", parents=[logs], help="write the synthetic data as MovieLens CSV files (what examples/ read)"
    )
    d.add_argument("directory", help="where ratings.csv and movies.csv go (made if missing; files there are replaced)")
    d.add_argument("--ratings", type=int, default=100_000, help="ratings to write")
    d.add_argument("--users", type=int, default=1_000)
    d.add_argument("--movies", type=int, default=1_700, help="movies in the catalogue (movies.csv)")
    d.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("build", parents=[logs], help="compile the native op library for the installed TensorFlow")
    b.add_argument("--force", action="store_true")
    return p


# Set beside TF_CPP_MIN_LOG_LEVEL by quiet_tensorflow: the worker processes
# of `tfde train --workers N` inherit both, and filter as their launcher did.
_QUIETED = "TFDE_QUIETED_TF_LOGS"


def quiet_tensorflow() -> None:
    """TensorFlow's informational and warning log lines (oneDNN, CUDA
    probing) and the Python warnings of TensorFlow and Keras stay off the
    terminal; its errors still show.  The caller decides when (main: not
    with --tf-logs, nor when the user set TF_CPP_MIN_LOG_LEVEL, nor once
    TensorFlow is imported, when it is too late and the program's own)."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"  # the --workers processes inherit it,
    os.environ[_QUIETED] = "1"  # and this says it was not the user who set it
    import warnings

    for package in ("tensorflow", "keras", "tf_keras", "tensorflow_recommenders", "absl"):
        warnings.filterwarnings("ignore", module=rf"{package}(\.|$)")


# What TensorFlow writes to the terminal when it is imported, straight to
# file descriptor 2 (C++ and absl, before absl's logging is set up, so
# TF_CPP_MIN_LOG_LEVEL does not reach it): absl-format lines ("I0000
# 00:00:1796157516.247052 17143 cudart_stub.cc:31] ...", with absl's notice
# before them; the seconds are not yet a time of day then) and
# TensorFlow's own ("2026-12-01 20:32:12.543713: E external/...").
# Only informational and warning lines: errors and fatal lines pass.
_TF_IMPORT_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] "
)


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # pragma: no cover - no C library to ask
        pass


@contextlib.contextmanager
def _tensorflow_lines_dropped():
    """Within: what is written to fd 2 passes through a filter that drops
    TensorFlow's informational import-time lines and forwards every other
    line as it comes (so a crash inside loses nothing it wrote).  Where fd 2
    cannot be redirected (closed, not a file), nothing is filtered."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, AttributeError, ValueError):
        yield
        return

    def forward():
        with os.fdopen(read_end, "rb") as lines, os.fdopen(saved, "wb", buffering=0, closefd=False) as out:
            for line in lines:
                if not _TF_IMPORT_NOISE.match(line.decode(errors="replace")):
                    out.write(line)

    reader = threading.Thread(target=forward, name="tfde-stderr-filter", daemon=True)
    reader.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        _flush_c_stdio()  # absl writes through C's buffered stderr
        os.dup2(saved, 2)  # closes the pipe's last write end: the reader drains and stops
        reader.join(timeout=10)
        os.close(saved)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "data", None) and not os.path.isfile(args.data):
        p.error(f"--data {args.data}: no such file (give a ratings CSV or a Criteo TSV, or leave --data out)")
    args.argv = argv
    # Only the `tfde` script sets up the process: a program that calls
    # main() has imported TensorFlow already, and its settings stand.
    fresh = "tensorflow" not in sys.modules
    if fresh and getattr(args, "keras", None) == "tf-keras":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # read when TensorFlow is imported, which is next
    user_level = "TF_CPP_MIN_LOG_LEVEL" in os.environ and os.environ.get(_QUIETED) != "1"
    quiet = fresh and not args.tf_logs and not user_level
    if quiet:
        quiet_tensorflow()
    with _tensorflow_lines_dropped() if quiet else contextlib.nullcontext():
        from tfde import cli
    from tfde.errors import ConfigError

    try:
        return cli.run(args)
    except ConfigError as e:  # a combination of flags tfde refuses: one line, as a usage error
        print(f"tfde: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
