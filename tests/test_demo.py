"""The demo (the README's first command; docs/demo.md): data, model, CLI."""

import csv
import re
import time

import numpy as np
import pytest

import tfde
from tfde import cli
from tfde.demo import data as demo_data
from tfde.demo.two_tower import most_popular_recall, train


def test_synthetic_data_is_skewed_and_deterministic():
    a = demo_data.synthetic(50_000, 2_000, 1_000, seed=3)
    b = demo_data.synthetic(50_000, 2_000, 1_000, seed=3)
    np.testing.assert_array_equal(a.train_items, b.train_items)
    _, counts = np.unique(a.train_items, return_counts=True)
    counts = np.sort(counts)[::-1]
    assert counts[:10].sum() > 5 * counts[-10:].sum()  # power-law popularity
    assert a.all_items.min() > 1_000_000  # sparse, large ids


@pytest.mark.keras
def test_small_run_beats_most_popular():
    data = demo_data.synthetic(120_000, 3_000, 2_000, seed=1)
    result = train(data, epochs=3, batch_size=512, embedding_dim=32, learning_rate=0.02, verbose=0, k=50)
    assert result["recall@50"] > result["most_popular_recall@50"], result
    assert result["recall@50"] == pytest.approx(result["recall@50"])  # a number, not NaN
    assert result["examples_per_s"] > 0 and result["user_rows"] > 0


def test_movielens_csv(tmp_path):
    path = tmp_path / "ratings.csv"
    rows = ["userId,movieId,rating,timestamp"] + [
        f"{u},{m},4.0,964982703" for u in range(40) for m in range(u % 7, 60, 7)
    ]
    path.write_text("\n".join(rows) + "\n")
    data = demo_data.movielens_csv(str(path))
    assert data.num_train + len(data.test_items) == len(rows) - 1
    assert data.train_users[0].startswith("user_") and data.all_items.dtype == np.int64
    assert 0 <= most_popular_recall(data, 10) <= 1


def test_movielens_csv_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("user,item\n1,2\n")
    with pytest.raises(ValueError, match="header starts with userId,movieId"):
        demo_data.movielens_csv(str(bad))
    bad.write_text("userId,movieId,rating,timestamp\n1,abc,3,4\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: expected userId,movieId"):
        demo_data.movielens_csv(str(bad))


@pytest.mark.keras
def test_cli_train_on_a_csv(tmp_path, capsys):
    path = tmp_path / "ratings.csv"
    rng = np.random.default_rng(0)
    lines = ["userId,movieId,rating,timestamp"]
    for u in range(300):
        taste = u % 5
        for m in rng.choice(np.arange(taste, 400, 5), 20, replace=False):
            lines.append(f"{u},{m},5,0")
    path.write_text("\n".join(lines) + "\n")
    code = cli.main(
        [
            "train",
            "--data",
            str(path),
            "--epochs",
            "4",
            "--batch-size",
            "128",
            "--dim",
            "16",
            "--k",
            "20",
            "--learning-rate",
            "0.05",
        ]
    )
    out = capsys.readouterr().out
    assert "held-out recall@20" in out and "examples/s" in out
    assert code == 0, out


@pytest.mark.keras
def test_policies_and_admission_in_the_demo():
    data = demo_data.synthetic(40_000, 2_000, 1_000, seed=2)
    result = train(data, epochs=1, batch_size=512, embedding_dim=16, verbose=0, k=20, max_rows=500, min_count=2)
    assert result["user_rows"] <= 500 and result["item_rows"] <= 500
    model = result["model"]
    assert isinstance(model.user_embedding.params.restrict_policy, tfde.FrequencyRestrictPolicy)
    assert isinstance(model.item_embedding.params.admission_filter, tfde.CounterFilter)


def test_movielens_csv_writer_round_trips_through_the_reader(tmp_path):
    ratings_path, movies_path = demo_data.write_movielens_csv(
        tmp_path / "ml", num_ratings=3_000, num_users=200, num_movies=150, seed=4
    )
    source = demo_data.synthetic(3_000, 200, 150, seed=4)
    read = demo_data.movielens_csv(ratings_path)

    # The same interactions: user_{i} is userId i + 1, the j-th catalogue item movieId j + 1.
    movie_id = {item: j + 1 for j, item in enumerate(source.all_items.tolist())}
    expected = sorted(
        (f"user_{int(u[len('user_') :]) + 1}", movie_id[i])
        for u, i in zip(
            np.concatenate([source.train_users, source.test_users]).tolist(),
            np.concatenate([source.train_items, source.test_items]).tolist(),
        )
    )
    got = sorted(
        zip(
            np.concatenate([read.train_users, read.test_users]).tolist(),
            np.concatenate([read.train_items, read.test_items]).tolist(),
        )
    )
    assert got == expected

    with open(ratings_path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["userId", "movieId", "rating", "timestamp"]
    keys = [(int(r[0]), int(r[1])) for r in rows[1:]]
    assert keys == sorted(keys)  # MovieLens order: by userId, then movieId
    assert {float(r[2]) for r in rows[1:]} <= {x / 2 for x in range(1, 11)}
    assert all(demo_data.FIRST_TIMESTAMP_S <= int(r[3]) <= demo_data.LAST_TIMESTAMP_S for r in rows[1:])

    with open(movies_path, newline="") as f:
        movies = list(csv.DictReader(f))
    assert [int(m["movieId"]) for m in movies] == list(range(1, 151))  # the whole catalogue, rated or not
    for m in movies:
        match = re.fullmatch(r"Movie (\d+)(, The)? \((\d{4})\)", m["title"])
        assert match and int(match.group(1)) == int(m["movieId"]), m
        genres = m["genres"].split("|")
        assert genres == [demo_data.NO_GENRES] or set(genres) <= set(demo_data.MOVIELENS_GENRES), m
    raw = open(movies_path).read()
    assert '\n3,"Movie 3, The (' in raw  # a title with a comma is quoted, as in MovieLens

    first = (open(ratings_path, "rb").read(), raw)
    demo_data.write_movielens_csv(tmp_path / "ml", num_ratings=3_000, num_users=200, num_movies=150, seed=4)
    assert (open(ratings_path, "rb").read(), open(movies_path).read()) == first  # deterministic, replaced


def test_train_with_a_missing_data_file_says_so_before_any_work(tmp_path, capsys):
    """A mistyped --data path (either model) is a usage error naming the path,
    not a traceback from deep in the reader after TensorFlow started."""
    for model in ("two-tower", "dlrm"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["train", "--model", model, "--data", str(tmp_path / "ratings.csv")])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--data {tmp_path / 'ratings.csv'}: no such file" in err, err


def test_a_configuration_tfde_refuses_is_a_one_line_usage_error(tmp_path, capsys):
    """A Redis config file with a bad field: exit status 2 and the reason
    (a tfde ConfigError), no traceback."""
    config = tmp_path / "redis.json"
    config.write_text('{"redis_host_ip": ["127.0.0.1"], "redis_host_port": ["abc"]}')
    code = cli.main(["train", "--backend", "redis", "--redis-config", str(config), "--interactions", "3000"])
    assert code == 2
    err = capsys.readouterr().err
    assert "tfde: error: redis_host_port must be a list of ints, got ('abc',)" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "flag, value, seen",
    [
        ("--batch-size", "0", "must be >= 1 and finite, got 0"),  # was taken for the default, 1024
        ("--dim", "0", "must be >= 1 and finite, got 0"),  # likewise (64)
        ("--epochs", "0", "must be >= 1 and finite, got 0"),  # trained nothing, then a KeyError traceback
        ("--learning-rate", "-1", "must be >= 0.0 and finite, got -1"),  # trained away from the data
        ("--learning-rate", "nan", "must be >= 0.0 and finite, got nan"),
        ("--k", "0", "must be >= 1 and finite, got 0"),  # a recall@0
        ("--users", "0", "must be >= 1 and finite, got 0"),  # a numpy traceback
        ("--examples", "99", "must be >= 100 and finite, got 99"),  # (dlrm's synthetic log) a ValueError traceback
        ("--learning-rate", "inf", "must be >= 0.0 and finite, got inf"),
        ("--max-rows", "0", "must be >= 1 and finite, got 0"),  # was taken for no limit
        ("--min-count", "0", "must be >= 1 and finite, got 0"),  # likewise
        ("--workers", "two", "expected an int, got 'two'"),
        ("--sync-every", "0", "must be >= 1 and finite, got 0"),
    ],
)
def test_a_number_out_of_range_is_a_usage_error_before_anything_runs(flag, value, seen, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"tfde train: error: argument {flag}: {seen}" in err, err


@pytest.mark.parametrize(
    "args, seen",
    [
        (["--interactions", "500"], "475 training examples make no full batch of 1,024"),
        (["--model", "dlrm", "--examples", "4000"], "3,600 training examples make no full batch of 4,096"),
    ],
)
def test_data_without_one_full_batch_is_a_usage_error(args, seen, capsys):
    """Too little data for one batch trained no step and ended in a KeyError
    traceback from the empty history: now exit status 2 and the fix."""
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert f"tfde: error: {seen}: lower the batch size (tfde train --batch-size) or train on more data" in err, err


def test_make_data_command(tmp_path, capsys):
    assert cli.main(["make-data", str(tmp_path / "d"), "--ratings", "500", "--seed", "2"]) == 0
    assert "wrote 500 ratings" in capsys.readouterr().out
    assert len((tmp_path / "d" / "ratings.csv").read_text().splitlines()) == 501
    assert len(demo_data.movielens_csv(str(tmp_path / "d" / "ratings.csv")).all_items) > 1
    assert cli.main(["make-data", str(tmp_path / "e"), "--ratings", "0"]) == 2
    assert "num_ratings must be an int >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "e" / "ratings.csv").exists()
    with pytest.raises(ValueError, match="num_movies must be an int >= 1, got 2.5"):
        demo_data.write_movielens_csv(tmp_path / "f", num_movies=2.5)


@pytest.mark.keras
@pytest.mark.parametrize("model", ["two-tower", "dlrm"])
def test_the_demo_s_examples_per_second_count_the_sync_at_each_epoch_s_end(model, monkeypatch):
    # The semi-sync benchmark compares every k by these figures: a sync the
    # epoch's time leaves out makes a large k look faster than it is.  Every
    # sync here takes 1 s more, and every > the steps of an epoch, so the
    # only syncs are at the epochs' ends.
    from tfde import semi_sync
    from tfde.demo import clicks, dlrm

    slow = 1.0
    run = semi_sync.PeriodicSync.sync

    def slow_sync(self):
        if self.running and self.steps > 0:
            time.sleep(slow)
        run(self)

    monkeypatch.setattr(semi_sync.PeriodicSync, "sync", slow_sync)
    batch = 256
    if model == "two-tower":
        data = demo_data.synthetic(3_000, 300, 200, seed=5)
        result = train(data, epochs=3, batch_size=batch, embedding_dim=8, verbose=0, k=10, sync_every=1000)
        examples = (len(data.train_users) // batch + 1) * batch
    else:
        data = clicks.synthetic(3_000, seed=5)
        result = dlrm.train(data, epochs=3, batch_size=batch, embedding_dim=8, verbose=0, sync_every=1000)
        examples = (data.num_train // batch + 1) * batch
    # At most one epoch's examples per (sync + steps) seconds.
    assert result["examples_per_s"] < examples / slow, result


def test_sync_local_slots_without_copies_is_refused_before_training(capsys):
    code = cli.main(["train", "--workers", "2", "--sync-every", "4", "--sync-local-slots"])
    assert code == 2
    assert "--sync-local-slots keeps the slots in the copies of --sync-replicate; add it" in capsys.readouterr().err
