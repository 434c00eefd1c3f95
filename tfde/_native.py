"""Compiles tfde's op library against the installed TensorFlow and loads it.

docs/design.md, decision 1: the native code is built for the TensorFlow the user has,
on first use (or ahead of time with ``tfde build``), and cached under
``$TFDE_CACHE_DIR`` (default ``~/.cache/tfde``) by TensorFlow version, compile
flags and a hash of the sources.  Several processes starting together (workers
of a distributed job) build it once: the build holds a file lock and the
result is moved into place atomically.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tfde.errors import BuildError

_SOURCES = (
    "cuckoo/hash.h",
    "cuckoo/init_rows.h",
    "cuckoo/row_copy.h",
    "cuckoo/cuckoo_table.h",
    "cuckoo/op_support.h",
    "cuckoo/table_resource.h",
    "cuckoo/rules.h",
    "cuckoo/ops.cc",
    "cuckoo/step_ops.cc",
    "redis/resp_client.h",
    "redis/ops.cc",
)
_UNITS = ("cuckoo/ops.cc", "cuckoo/step_ops.cc", "redis/ops.cc")  # compiled into the one library
_lock = threading.Lock()
_ops = None
_loaded_path = None  # the file _ops was loaded from (see loaded_path)


def source_dir() -> Path:
    """Directory holding the backend sources: ``backends/`` beside the
    imported package when it is a checkout (so the Python code and the ops
    always come from one tree, even when an editable install of another
    checkout is on the path), else the installed ``tfde._backends``."""
    here = Path(__file__).resolve().parent.parent / "backends"
    if (here / "cuckoo" / "ops.cc").is_file():
        return here
    spec = importlib.util.find_spec("tfde._backends")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / "cuckoo" / "ops.cc").is_file():
                return Path(loc)
    raise BuildError(
        "tfde's native sources (backends/cuckoo/ops.cc) are missing from this installation; "
        "reinstall tfde with `pip install --force-reinstall tfde`"
    )


def cache_dir() -> Path:
    return Path(os.environ.get("TFDE_CACHE_DIR", Path.home() / ".cache" / "tfde"))


def _compiler() -> str:
    named = os.environ.get("CXX")
    if named and not shutil.which(named):
        raise BuildError(
            f"$CXX is {named!r}, which is not an executable compiler (no such file, or not executable). "
            "Point $CXX at a C++17 compiler (e.g. `export CXX=g++`), or unset it to use g++, c++ or clang++."
        )
    cxx = named or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise BuildError(
            "tfde compiles its ops against your TensorFlow on first use and needs a C++17 compiler, "
            "but none was found (looked for $CXX, g++, c++, clang++). Install one, e.g. "
            "`apt-get install g++` (Debian/Ubuntu) or `dnf install gcc-c++`, then retry."
        )
    return cxx


def _compile_commands(cxx: str, objects: Path) -> list[tuple[str, Path, list[str]]]:
    """(unit, object file, command) compiling each unit into `objects`."""
    import tensorflow as tf

    flags = ["-fPIC", "-O3", "-Wno-deprecated-declarations", *tf.sysconfig.get_compile_flags()]
    out = []
    for unit in _UNITS:
        obj = objects / (unit.replace("/", "_") + ".o")
        out.append((unit, obj, [cxx, "-c", *flags, "-o", str(obj), str(source_dir() / unit)]))
    return out


def _link_command(cxx: str, objs: list[Path], out: Path) -> list[str]:
    import tensorflow as tf

    return [cxx, "-shared", "-o", str(out), *map(str, objs), *tf.sysconfig.get_link_flags()]


def _run_build_step(what: str, cmd: list[str], verbose: bool) -> None:
    if verbose:
        print(f"tfde: {what}:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            f"{what} with {cmd[0]} failed (exit {proc.returncode}).\n"
            f"command: {' '.join(cmd)}\n{proc.stderr[-4000:]}\n"
            "Check that the compiler supports C++17 and that TensorFlow's headers are installed "
            "(they ship with the tensorflow wheel)."
        )


def library_path() -> Path:
    """Where the library for this TensorFlow and these sources lives."""
    import tensorflow as tf

    h = hashlib.sha256()
    root = source_dir()
    for rel in _SOURCES:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    h.update(" ".join(tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()).encode())
    return cache_dir() / "ops" / f"libtfde_ops-tf{tf.__version__}-{h.hexdigest()[:16]}.so"


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compiles the op library unless a matching one is cached; returns its path."""
    path = library_path()
    if path.is_file() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        if path.is_file() and not force:
            return path  # another process built it while we waited
        cxx = _compiler()
        if not verbose:
            print("tfde: compiling native ops for this TensorFlow (once, ~30 s) ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as work:
            # The units compile at once, one per core (each spends seconds on
            # TensorFlow's headers), then link into the library.
            steps = _compile_commands(cxx, Path(work))
            with ThreadPoolExecutor(max_workers=max(1, min(len(steps), os.cpu_count() or 1))) as pool:
                compiled = [
                    pool.submit(_run_build_step, f"compiling tfde's {unit}", cmd, verbose) for unit, _, cmd in steps
                ]
                for future in compiled:
                    future.result()  # the first failed unit's BuildError, once every unit finished
            tmp = Path(work) / path.name
            _run_build_step("linking tfde's ops", _link_command(cxx, [obj for _, obj, _ in steps], tmp), verbose)
            os.replace(tmp, path)
    return path


def load():
    """The loaded op module (tf.load_op_library), building it if needed."""
    global _ops, _loaded_path
    if _ops is not None:
        return _ops
    with _lock:
        if _ops is None:
            import tensorflow as tf

            path = build()
            try:
                ops = tf.load_op_library(str(path))
            except tf.errors.NotFoundError as e:
                # A library left from another TF build (same version string,
                # different ABI): rebuild once, then give up with the cause.
                path = build(force=True)
                try:
                    ops = tf.load_op_library(str(path))
                except tf.errors.NotFoundError:
                    raise BuildError(
                        f"the tfde op library {path} does not load into TensorFlow {tf.__version__}: {e}. "
                        "Delete the cache directory and retry, or run `tfde build --force`."
                    ) from e
            _loaded_path = path  # before _ops: a reader that sees _ops sees the path
            _ops = ops
    return _ops


def loaded_path() -> Path:
    """The file the op library was loaded from (loading it if needed): the
    library this process uses, even when the sources changed since, so that
    its plain C entry points can be called through ctypes (see
    tfde/tables/redis_table.py, which hands passwords over that way)."""
    load()
    return _loaded_path
