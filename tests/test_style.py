"""The style the tree keeps, checked with the tools pinned in
scripts/requirements-test.txt: ruff's lint and format rules for Python
(pyproject.toml, [tool.ruff]) and clang-format for the native sources
(.clang-format).  Fix a failure with `ruff check --fix . && ruff format .`
and `clang-format -i backends/*/*.h backends/*/*.cc`."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NATIVE = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "backends").rglob("*") if p.suffix in (".h", ".cc"))


def _run(*cmd):
    tool = BIN / cmd[0]
    assert tool.exists(), f"{cmd[0]} is not installed in {BIN}: pip install -r scripts/requirements-test.txt"
    return subprocess.run([str(tool), *cmd[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_python_passes_the_lint_rules():
    out = _run("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_python_is_formatted():
    out = _run("ruff", "format", "--no-cache", "--check", ".")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_native_sources_are_formatted():
    assert len(NATIVE) >= 7, NATIVE
    out = _run("clang-format", "--dry-run", "-Werror", *NATIVE)
    assert out.returncode == 0, out.stderr[-6000:]
