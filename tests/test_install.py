"""First contact (docs/install.md): `import tfde` without TensorFlow, with
two TensorFlow distributions, and the `tfde` command's start-up, each in a
fresh Python as a user meets them."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfde import _install

ROOT = Path(__file__).resolve().parent.parent


def _python(code, tmp_path, extra_path=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, extra_path), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_import_without_tensorflow_names_the_install_command(tmp_path):
    blocker = (
        "import sys\n"
        "class NoTF:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorflow' or name.startswith('tensorflow.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'tensorflow'\")\n"
        "sys.meta_path.insert(0, NoTF())\n"
        "import tfde\n"
    )
    out = _python(blocker, tmp_path)
    assert out.returncode != 0
    # TensorFlow is installed here, so the message says so and names its reinstall (not a second distribution).
    found = _install.installed_tf_distributions()
    name, version = sorted(found.items())[0]
    assert f"ImportError: TensorFlow is installed ({name} {version}) but cannot be imported" in out.stderr, out.stderr[
        -2000:
    ]
    assert f"pip install --force-reinstall '{name}=={version}'" in out.stderr


def test_no_tensorflow_at_all_names_what_to_install(monkeypatch):
    monkeypatch.setattr(_install, "installed_tf_distributions", lambda: {})
    message = str(_install.missing_tensorflow(ModuleNotFoundError("No module named 'tensorflow'")))
    assert "which is not installed" in message
    assert "pip install 'tensorflow-cpu>=2.16'" in message and "pip install 'tensorflow>=2.16'" in message
    assert "pip install '.[cpu]'" in message


def test_two_tensorflow_distributions_of_different_versions_are_refused(tmp_path):
    """What `pip install tensorflow-cpu==A tensorflow==B` leaves: one package
    directory holding a mixture of two builds."""
    site = tmp_path / "site"
    present = _install.installed_tf_distributions()
    assert present, "the test environment has a TensorFlow distribution"
    other = "tensorflow-cpu" if "tensorflow" in present else "tensorflow"
    info = site / f"{other.replace('-', '_')}-2.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {other}\nVersion: 2.0.0\n")
    out = _python("import tfde", tmp_path, extra_path=[site])
    assert out.returncode != 0
    assert "this environment holds two distributions of TensorFlow" in out.stderr, out.stderr[-2000:]
    assert f"{other} 2.0.0" in out.stderr and "pip uninstall -y tensorflow tensorflow-cpu" in out.stderr


def test_one_distribution_or_two_of_one_version_pass():
    _install.check_distributions({"tensorflow": "2.21.0"})
    _install.check_distributions({"tensorflow": "2.21.0", "tensorflow-cpu": "2.21.0"})
    with pytest.raises(ImportError, match="tensorflow 2.21.0, tensorflow-cpu 2.16.2"):
        _install.check_distributions({"tensorflow": "2.21.0", "tensorflow-cpu": "2.16.2"})


def test_an_old_tensorflow_is_refused_with_the_upgrade():
    _install.check_version("2.16.0")
    name = sorted(_install.installed_tf_distributions())[0]
    with pytest.raises(ImportError, match=rf"found 2.15.1; upgrade it: pip install -U '{name}>=2.16'"):
        _install.check_version("2.15.1")


def test_the_command_answers_help_without_importing_tensorflow(tmp_path):
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, tfde_cli\n"
            "try:\n    tfde_cli.main(['--help'])\n"
            "except SystemExit:\n    pass\n"
            "assert 'tensorflow' not in sys.modules, 'TensorFlow imported'\n",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "tfde train" in out.stdout and "make-data" in out.stdout and out.stderr == ""
    assert time.monotonic() - start < 10


def test_the_command_prints_only_its_own_output(tmp_path):
    """`tfde make-data` (imports tfde and so TensorFlow): no TensorFlow log
    line or Python warning reaches the terminal unless --tf-logs asks (before
    or after the command)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "tfde_cli", "make-data", str(tmp_path / "d"), "--ratings", "50"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("wrote 50 ratings") and out.stderr == "", out.stderr[-3000:]
    loud = subprocess.run(
        cmd[:3] + ["--tf-logs"] + cmd[3:], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert loud.returncode == 0 and loud.stdout.startswith("wrote 50 ratings")


def test_worker_processes_stay_as_quiet_as_their_launcher(tmp_path):
    """`tfde train --workers N` starts `python -m tfde_cli` children with the
    launcher's environment, which holds the TF_CPP_MIN_LOG_LEVEL the launcher
    set: a child filters as the launcher did (it once took the level for the
    user's and printed TensorFlow's import lines)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    code = (
        "import subprocess, sys, tfde_cli\n"
        "tfde_cli.quiet_tensorflow()\n"
        f"r = subprocess.run([sys.executable, '-m', 'tfde_cli', 'make-data', {str(tmp_path / 'd')!r}, "
        "'--ratings', '50'], capture_output=True, text=True)\n"
        "sys.stdout.write(r.stdout)\n"
        "sys.stderr.write(r.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.stdout.startswith("wrote 50 ratings") and out.stderr == "", out.stderr[-3000:]
