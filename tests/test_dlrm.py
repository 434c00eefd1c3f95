"""The DLRM demo (`tfde train --model dlrm`; docs/demo.md): the click logs,
the model trained end to end through the command, one worker and two."""

import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from distributed_check import start_logged, wait_all

from tfde import cli
from tfde.demo import clicks
from tfde.demo.clicks import auc

ROOT = Path(__file__).resolve().parent.parent


def test_the_synthetic_log_is_criteo_like_and_deterministic():
    start = time.perf_counter()
    a = clicks.synthetic(200_000, 1_000_000, seed=4)
    made = time.perf_counter() - start
    b = clicks.synthetic(200_000, 1_000_000, seed=4)
    np.testing.assert_array_equal(a.train_cats, b.train_cats)
    np.testing.assert_array_equal(a.train_labels, b.train_labels)
    assert a.train_dense.shape[1] == 13 and a.train_cats.shape[1] == 26
    assert a.cardinalities[0] == 10 and a.cardinalities[-1] == 1_000_000
    assert all(x < y for x, y in zip(a.cardinalities, a.cardinalities[1:]))
    for j, card in enumerate(a.cardinalities):
        assert a.train_cats[:, j].min() >= 0 and a.train_cats[:, j].max() < card
    # Zipf ids: in the largest feature a few ids are frequent, most are rare.
    _, counts = np.unique(a.train_cats[:, -1], return_counts=True)
    assert counts.max() > 1000 and np.median(counts) <= 2
    assert 0.15 < a.train_labels.mean() < 0.4  # a click rate like Criteo's
    assert made < 30, f"generating 200k examples took {made:.1f}s"
    assert not np.array_equal(clicks.synthetic(1000, 1000, seed=5).train_labels, b.train_labels[:900])


def test_auc_is_the_rank_statistic():
    assert auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5  # ties share their rank
    rng = np.random.default_rng(0)
    y, s = rng.random(2000) < 0.3, rng.random(2000)
    pairs = np.mean([[float(p > n) + 0.5 * float(p == n) for n in s[~y]] for p in s[y]])
    assert auc(y, s) == pytest.approx(pairs)


def criteo_lines(n, seed=0):
    """Lines in Criteo's TSV format whose label depends on C1 (learnable)."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        c1 = int(rng.integers(0, 40))
        label = int(rng.random() < (0.8 if c1 % 2 else 0.1))
        ints = [str(int(x)) if rng.random() > 0.1 else "" for x in rng.integers(0, 50, 13)]
        cats = [f"{c1:08x}"] + [f"{int(x):08x}" if rng.random() > 0.05 else "" for x in rng.integers(0, 500, 25)]
        lines.append("\t".join([str(label)] + ints + cats))
    return lines


def test_the_criteo_reader_takes_the_tsv_format_with_string_keys(tmp_path):
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(criteo_lines(300)) + "\n")
    data = clicks.criteo_tsv(str(path))
    assert data.string_keys and data.num_train == 270 and len(data.test_labels) == 30
    assert data.train_cats.shape == (270, 26) and data.train_dense.shape == (270, 13)
    assert "" in set(data.train_cats[:, 5])  # an empty categorical value is the key ''
    assert clicks.criteo_tsv(str(path), max_examples=100).num_train == 90
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: 3 tab-separated fields, Criteo's format has 40"):
        clicks.criteo_tsv(str(bad))
    bad.write_text("\t".join(["2"] + ["1"] * 13 + ["a"] * 26) + "\n")
    with pytest.raises(ValueError, match="the label must be 0 or 1, got 2"):
        clicks.criteo_tsv(str(bad))
    bad.write_text("\t".join(["1"] + ["x"] * 13 + ["a"] * 26) + "\n")
    with pytest.raises(ValueError, match="the 13 integer fields must be integers"):
        clicks.criteo_tsv(str(bad))


@pytest.mark.keras
def test_tfde_train_model_dlrm_beats_the_dense_baseline(capsys):
    code = cli.main(
        ["train", "--model", "dlrm", "--examples", "60000", "--max-cardinality", "100000", "--batch-size", "1024"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    aucs = re.search(r"held-out AUC: ([\d.]+)  \(logistic regression on the dense features: ([\d.]+)\)", out)
    assert aucs and float(aucs.group(1)) > float(aucs.group(2)) + 0.03, out
    assert re.search(r"rows stored: [\d,]+ in 26 tables \(C1 10, C2 ", out), out
    assert "placement plan 'auto' (rows) over 1 worker(s):" in out and "C26 (dim 16, ~100000 rows)" in out
    assert re.search(r"final loss [\d.]+, [\d,]+ examples/s, [\d.]+ ms/step", out), out


@pytest.mark.keras
def test_tfde_train_model_dlrm_on_a_criteo_file(tmp_path, capsys):
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(criteo_lines(6000, seed=1)) + "\n")
    code = cli.main(
        ["train", "--model", "dlrm", "--data", str(path), "--batch-size", "256", "--epochs", "3", "--dim", "8"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Criteo TSV, string keys" in out
    assert float(re.search(r"held-out AUC: ([\d.]+)", out).group(1)) > 0.75, out


def train_workers(tmp_path, *runs, engine="mwms"):
    """`tfde train --model dlrm --workers 2 --exchange-stats ...` with each
    of `runs` (argument lists), in fresh processes at once; returns each
    one's output and the collectives per step its worker 0 made."""
    command = [sys.executable, "-m", "tfde_cli", "train", "--model", "dlrm", "--workers", "2", "--engine", engine]
    command += ["--exchange-stats", "--examples", "16000", "--max-cardinality", "20000", "--batch-size", "512"]
    command += ["--epochs", "2", "--learning-rate", "0.01"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = [tmp_path / f"run{i}.log" for i in range(len(runs))]
    procs = [start_logged(command + args, log, env=env, cwd=ROOT) for args, log in zip(runs, logs)]
    wait_all(procs, 600)
    results = []
    for proc, log in zip(procs, logs):
        out = log.read_text(errors="replace")
        assert proc.returncode == 0, out[-4000:]
        calls = re.search(r"ms/step, ([\d.]+) collectives/step", out)
        assert calls, out[-4000:]
        results.append((out, float(calls.group(1))))
    return results


def test_two_workers_make_the_same_collectives_per_step_for_2_or_26_features(tmp_path):
    """The collection layer's exchange does not grow with the features: 3
    collectives per lookup and 1 for the gradients, with 2 tables or 26;
    per-feature layers pay 3 per table and step.  (The command runs tf-keras
    whatever the parent runs: in the Keras 3 run only.)"""
    (out2, two), (out26, many), (_, per_feature) = train_workers(
        tmp_path,
        ["--features", "2", "--placement", "round_robin"],
        ["--features", "26"],
        ["--features", "5", "--layers", "per-feature"],
    )
    assert two == many == 4.0, (out2[-2000:], out26[-2000:])
    assert re.search(r"rows stored \(worker 0's shard\): [\d,]+ in 26 tables", out26), out26[-2000:]
    assert re.search(r"held-out AUC: ([\d.]+)", out26)
    assert per_feature == 5 * 3 + 1
