"""The programs of examples/, run as a user runs them (and as CI does): real
processes on a small MovieLens CSV written by tfde.demo.data.
write_movielens_csv (3,000 ratings, 300 users, 300 movies), one epoch or two.

mwms_two_tower.py: two TF_CONFIG workers on loopback ports, tables on the
real redis-server at 127.0.0.1:6379 under a fresh model tag.
tfra_two_tower.py: one process, through tfde.compat.tfra.
(horovod_two_tower.py: tests/horovod/test_examples_horovod.py.)
Two quick checks besides: the errors of their shared reader
(examples/movielens.py) and the launch commands in examples/README.md.

The programs choose tf-keras themselves (TensorFlow Recommenders needs it),
so these tests run in subprocesses and are not `keras`-marked: they run once,
whichever Keras this pytest process uses."""

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed_check import redis_tag

from tfde.demo.data import write_movielens_csv
from tfde.distributed.launch import free_ports, tf_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT_S = 240
TRAIN, BATCH = 2_700, 128  # 3,000 ratings less the 10% the examples hold out; the batch the tests use
MAX_ROWS = 200  # below the 300 users and 300 movies, so the restrict policy has work to do


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("movielens")
    write_movielens_csv(directory, num_ratings=3_000, num_users=300, num_movies=300, seed=0)
    return str(directory)


def env(**extra):
    # The programs set TF_USE_LEGACY_KERAS=1 themselves; it is set here too, as CI sets it.
    return {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", **extra}


def run_all(commands, envs):
    """Runs the commands side by side; returns their outputs once all exit 0.
    When one fails (or the time runs out) the others are stopped and the
    failure is reported with the outputs."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e, cwd=EXAMPLES.parent)
        for c, e in zip(commands, envs)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate()[0] for p in procs]
    report = "\n".join(
        f"--- process {i} (exit {p.returncode}) ---\n{out[-5000:]}" for i, (p, out) in enumerate(zip(procs, outputs))
    )
    assert all(p.returncode == 0 for p in procs), report
    return outputs


def printed(output, pattern):
    found = re.findall(pattern, output)
    assert len(found) == 1, f"expected one line matching {pattern!r} in:\n{output[-5000:]}"
    return found[0]


def top_k(output):
    value = float(printed(output, r"validation top-100 categorical accuracy: ([0-9.]+)"))
    assert 0 < value <= 1, output[-3000:]
    return value


def rows_stored(output):
    return ast.literal_eval(printed(output, r"rows stored[^:]*: (\{[^}]*\})"))


@pytest.mark.slow
def test_mwms_example_two_workers_redis(data):
    """Two TF_CONFIG workers train the tfrs model with its FactorizedTopK
    metric over mapped candidates, on shared Redis tables, restricting them
    to MAX_ROWS; both print the same (global) validation metric."""
    ports = free_ports(2)
    with redis_tag() as tag:
        command = [
            sys.executable,
            str(EXAMPLES / "mwms_two_tower.py"),
            data,
            "--epochs",
            "1",
            "--batch-size",
            str(BATCH),
            "--max-rows",
            str(MAX_ROWS),
        ]
        outputs = run_all(
            [command, command], [env(TF_CONFIG=tf_config(ports, i), REDIS_MODEL_TAG=tag) for i in range(2)]
        )
        import redis

        client = redis.Redis(port=6379)
        # The rows are in Redis: storage_slice 2 hashes per table, {tag}:{table}:{0}
        # and :{1} (docs/formats.md, "Redis: the key/value layout").
        in_redis = {
            name: sum(client.hlen(f"{tag}:{name}/shard_0_of_1:{{{b}}}") for b in (0, 1))
            for name in ("user-embedding", "movie-embedding")
        }
    for i, out in enumerate(outputs):
        assert f"[worker {i}/2]" in out, out[-3000:]
        assert int(printed(out, r"optimizer steps: (\d+)")) == TRAIN // BATCH  # drop_remainder batches
        sizes = rows_stored(out)
        assert set(sizes) == {"user-embedding", "movie-embedding"}
        assert all(0 < n <= MAX_ROWS for n in sizes.values()), sizes
    assert top_k(outputs[0]) == top_k(outputs[1])
    removed = sum(int(printed(out, r"; ([\d,]+) keys removed").replace(",", "")) for out in outputs)
    assert removed > 0
    assert in_redis == rows_stored(outputs[0]) == rows_stored(outputs[1])


@pytest.mark.slow
def test_tfra_example_one_process(data):
    """The TFRA-style program, through tfde.compat.tfra: trains two epochs,
    restricts with Variable.restrict after each, evaluates."""
    (out,) = run_all(
        [
            [
                sys.executable,
                str(EXAMPLES / "tfra_two_tower.py"),
                data,
                "--epochs",
                "2",
                "--batch-size",
                str(BATCH),
                "--max-rows",
                str(MAX_ROWS),
            ]
        ],
        [env()],
    )
    top_k(out)
    assert int(printed(out, r"optimizer steps: (\d+)")) == 2 * -(-TRAIN // BATCH)  # last batch partial
    sizes = rows_stored(out)
    assert set(sizes) == {"user-embedding", "movie-embedding"}
    assert all(0 < n <= MAX_ROWS for n in sizes.values()), sizes
    assert int(printed(out, r"; ([\d,]+) keys removed").replace(",", "")) > 0


def test_the_examples_reader_names_the_fix(tmp_path, monkeypatch):
    """examples/movielens.py: a missing directory names `tfde make-data`;
    files that do not fit say where and why."""
    spec = importlib.util.spec_from_file_location("examples_movielens", EXAMPLES / "movielens.py")
    movielens = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(movielens)
    monkeypatch.delenv(movielens.DATA_ENV, raising=False)
    with pytest.raises(SystemExit, match=f"write one with `tfde make-data {re.escape(str(tmp_path / 'none'))}`"):
        movielens.data_dir(str(tmp_path / "none"))
    monkeypatch.setenv(movielens.DATA_ENV, str(tmp_path / "from-env"))
    with pytest.raises(SystemExit, match="from-env: no ratings.csv or movies.csv there"):
        movielens.data_dir()

    write_movielens_csv(tmp_path / "d", num_ratings=50, num_users=5, num_movies=8)
    assert movielens.data_dir(str(tmp_path / "d")) == str(tmp_path / "d")
    ratings = movielens.load(str(tmp_path / "d"))
    assert len(ratings["movie_id"]) == 50 and len(ratings["all_movie_titles"]) == 8
    for movie_id, title in zip(ratings["movie_id"], ratings["movie_title"]):  # each rating has its movie's title
        assert title == ratings["all_movie_titles"][movie_id - 1]
    assert ratings["all_movie_titles"][2].startswith("Movie 3, The (")  # the quoted title, read whole
    train, validation = movielens.split(ratings)
    assert len(train["movie_id"]) == 45 and len(validation["movie_id"]) == 5

    (tmp_path / "d" / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,99,4.0,0\n")
    with pytest.raises(SystemExit, match=r"ratings.csv:2: movieId 99 is not in .*movies.csv"):
        movielens.load(str(tmp_path / "d"))
    (tmp_path / "d" / "movies.csv").write_text("id,name\n")
    with pytest.raises(SystemExit, match="header starts with movieId,title, got"):
        movielens.load(str(tmp_path / "d"))


def test_every_example_says_how_to_launch_it():
    """examples/README.md has one line per program with its command, and the
    program's docstring gives the same launch command."""
    readme = (EXAMPLES / "README.md").read_text()
    programs = sorted(p for p in EXAMPLES.glob("*.py") if p.name != "movielens.py")
    assert [p.name for p in programs] == ["horovod_two_tower.py", "mwms_two_tower.py", "tfra_two_tower.py"]
    for program in programs:
        lines = [line for line in readme.splitlines() if line.startswith(f"- `{program.name}`")]
        assert len(lines) == 1, (program.name, readme)
        launch = re.search(r"`((?:horovodrun [^`]*|TF_CONFIG=[^`]*|)python examples/[^`]*)`", lines[0])
        assert launch and program.name in launch.group(1), lines[0]
        docstring = ast.get_docstring(ast.parse(program.read_text()))
        assert f"python examples/{program.name}" in docstring, program.name
        if launch.group(1).startswith("horovodrun"):
            assert launch.group(1) in docstring, (launch.group(1), docstring)
