"""examples/horovod_two_tower.py run as its docstring says, under
`horovodrun -np 2 -H localhost:2 --gloo`, twice with one checkpoint
directory: the second launch resumes from the first one's checkpoint (its
optimizer step continues from there) and both print the validation metric.

Runs in the Horovod environment (scripts/test.sh, with TF_USE_LEGACY_KERAS=1);
the data is a small MovieLens CSV from tfde.demo.data.write_movielens_csv."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tfde.demo.data import write_movielens_csv

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "horovod_two_tower.py"
TIMEOUT_S = 300
STEPS = 3


def launch(data, checkpoints):
    horovodrun = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or "horovodrun"
    command = [
        horovodrun,
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        str(EXAMPLE),
        data,
        checkpoints,
        "--epochs",
        "1",
        "--steps",
        str(STEPS),
        "--batch-size",
        "128",
        "--max-rows",
        "200",
    ]
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    try:
        proc = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            timeout=TIMEOUT_S,
            cwd=EXAMPLE.parents[1],
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"horovodrun did not finish in {TIMEOUT_S}s:\n{(e.output or '')[-5000:]}")
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def per_rank(output, pattern):
    """{rank: the group of `pattern`} over the lines each rank printed."""
    found = {int(r): v for r, v in re.findall(r"\[rank (\d)/2\] " + pattern, output)}
    assert set(found) == {0, 1}, f"expected {pattern!r} from both ranks in:\n{output[-5000:]}"
    return found


def test_horovod_example_trains_and_resumes_from_its_checkpoint(tmp_path):
    data = str(tmp_path / "movielens")
    write_movielens_csv(data, num_ratings=3_000, num_users=300, num_movies=300, seed=0)
    checkpoints = str(tmp_path / "checkpoints")

    first = launch(data, checkpoints)
    assert len(per_rank(first, r"(no checkpoint in .* trained from scratch)")) == 2
    assert per_rank(first, r"optimizer steps: (\d+)") == {0: str(STEPS), 1: str(STEPS)}
    saved = os.path.join(checkpoints, f"ckpt-{STEPS:09d}")
    manifest = json.loads(Path(saved, "manifest.json").read_text())
    assert manifest["workers"] == 2, manifest
    assert {f for f in os.listdir(saved) if f.startswith("worker-")} >= {
        f"worker-{r:05d}-of-00002.index" for r in (0, 1)
    }, os.listdir(saved)

    second = launch(data, checkpoints)
    assert per_rank(second, r"resumed from (\S+)") == {0: saved, 1: saved}
    assert per_rank(second, r"optimizer steps: (\d+)") == {0: str(2 * STEPS), 1: str(2 * STEPS)}
    for output in (first, second):
        mean = per_rank(output, r"validation top-100 categorical accuracy: ([0-9.]+)")
        assert mean[0] == mean[1] and 0 < float(mean[0]) <= 1, mean
