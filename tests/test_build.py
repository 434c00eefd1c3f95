"""The op library is compiled against the installed TensorFlow and cached;
failures say what to do."""

import os
import subprocess
import sys
import textwrap


def run_py(code, env):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_missing_compiler_is_a_clear_error(tmp_path):
    proc = run_py(
        """
        import tfde
        from tfde import _native
        try:
            _native.load()
        except tfde.errors.BuildError as e:
            print("BUILD-ERROR:", e)
    """,
        {"TFDE_CACHE_DIR": str(tmp_path), "CXX": "", "PATH": "/nonexistent"},
    )
    assert "BUILD-ERROR" in proc.stdout, proc.stdout + proc.stderr
    assert "needs a C++17 compiler" in proc.stdout and "apt-get install g++" in proc.stdout


def test_library_from_another_build_is_rebuilt(tmp_path):
    proc = run_py(
        """
        from tfde import _native
        path = _native.library_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not a library built for this TensorFlow")
        ops = _native.load()
        import tensorflow as tf
        print("OK", hasattr(ops, "tfde_table_find"), path.stat().st_size > 1000)
    """,
        {"TFDE_CACHE_DIR": str(tmp_path)},
    )
    assert "OK True True" in proc.stdout, proc.stdout + proc.stderr


def test_a_unit_that_fails_to_compile_is_named_and_nothing_is_left(tmp_path, monkeypatch):
    """The units compile at once, then link.  One failing unit: BuildError
    names it and carries the compiler's message, after the other units
    finished; no library and no work directory is left in the cache, so
    the next start builds again."""
    import pytest

    import tfde
    from tfde import _native

    log = tmp_path / "calls.log"
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'case "$*" in *step_ops.cc*) echo "step_ops.cc:1:1: error: made up" >&2; exit 1;; esac\n'
        'while [ "$1" != "-o" ]; do shift; done; touch "$2"\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("TFDE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(tfde.errors.BuildError, match=r"(?s)compiling tfde's cuckoo/step_ops\.cc .*failed.*made up"):
        _native.build(force=True)
    calls = log.read_text().splitlines()
    assert sorted(c.split()[-1].split("/backends/")[-1] for c in calls) == sorted(_native._UNITS), calls
    assert all(" -c " in f" {c} " for c in calls), "linked after a unit failed"
    assert [p.name for p in (tmp_path / "cache" / "ops").iterdir()] == [".build.lock"]


def test_a_cxx_that_names_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    """$CXX naming a missing file used to end in subprocess's FileNotFoundError."""
    import pytest

    import tfde
    from tfde import _native

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("TFDE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(
        tfde.errors.BuildError, match=r"\$CXX is '.*no-such-g\+\+', which is not an executable compiler"
    ):
        _native.build(force=True)
    assert not list((tmp_path / "cache" / "ops").glob("*.so"))


def test_cache_key_names_the_tensorflow_version():
    import tensorflow as tf

    from tfde import _native

    assert f"tf{tf.__version__}" in _native.library_path().name


def test_the_sources_beside_the_imported_package_are_built(tmp_path, monkeypatch):
    """A checkout's ops are built from its own backends/, even when the
    installed tfde._backends (an editable install of another checkout)
    points elsewhere: the Python code and the native code of one tree."""
    import importlib.util
    from pathlib import Path

    import tfde
    from tfde import _native

    other = tmp_path / "other-checkout" / "backends"
    (other / "cuckoo").mkdir(parents=True)
    (other / "cuckoo" / "ops.cc").write_text("// another tree's sources\n")
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "tfde._backends":
            return importlib.util.spec_from_file_location(
                name, other / "__init__.py", submodule_search_locations=[str(other)]
            )
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert _native.source_dir() == Path(tfde.__file__).resolve().parent.parent / "backends"
