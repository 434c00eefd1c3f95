"""Click logs for the DLRM demo (`tfde train --model dlrm`; docs/demo.md):
a built-in synthetic Criteo-like log and a reader of Criteo's TSV format.

Synthetic model (deterministic for a seed):
  * 13 dense count features (lognormal integers, like Criteo's I1..I13) and
    26 categorical features C1..C26 with cardinalities spaced evenly on a
    log scale from 10 to `max_cardinality`; each example's id of feature j
    is Zipf-distributed over its cardinality (a few ids are frequent, most
    are rare), scrambled so that ids are not ranks;
  * a hidden ground-truth model gives each example's click probability:
    sigmoid(bias + v . log1p(dense) + sum_j s_j * w_j(id_j)), where w_j(id)
    is a fixed pseudo-random number in [-1, 1] of (feature, id) and the
    first 8 categorical features weigh most (s_j = 1.2, the rest 0.25);
    labels are drawn from it (a click rate of about 25%, as in Criteo).
So the dense features alone give a baseline (logistic regression on
them, `dense_baseline_auc`) and what the embeddings learn of the frequent
ids is what lifts the held-out AUC (`auc`) above it.

NumPy only (no TensorFlow, no tfde import): the benchmark's reference side
loads this file in TFRA's environment to read the same log and score it
the same way (benchmarks/dlrm_side.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]


@dataclasses.dataclass
class Clicks:
    """A click log split into train and held-out parts: dense [n, 13]
    float32 counts, categorical [n, 26] ids (int64, or str for Criteo TSV
    files), labels [n] float32."""

    train_dense: np.ndarray
    train_cats: np.ndarray
    train_labels: np.ndarray
    test_dense: np.ndarray
    test_cats: np.ndarray
    test_labels: np.ndarray
    cardinalities: list  # per categorical feature: its number of distinct ids (expected rows)

    @property
    def num_train(self) -> int:
        return len(self.train_labels)

    @property
    def string_keys(self) -> bool:
        return self.train_cats.dtype == object


def cardinalities(max_cardinality: int = 10_000_000) -> list:
    """The 26 cardinalities: evenly spaced on a log scale from 10 to max_cardinality."""
    if max_cardinality < 10:
        raise ValueError(f"max_cardinality must be >= 10, got {max_cardinality}")
    return [int(c) for c in np.round(np.logspace(1, np.log10(max_cardinality), len(CATEGORICAL)))]


def _unit(x: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random number in [-1, 1) of each uint64 `x` and `salt`
    (splitmix64's finalizer)."""
    z = (x.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)) & np.uint64(2**64 - 1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 52) - 1.0


def synthetic(
    num_examples: int = 1_000_000,
    max_cardinality: int = 10_000_000,
    zipf: float = 1.1,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> Clicks:
    """The synthetic log (see the module docstring)."""
    if num_examples < 100:
        raise ValueError(f"num_examples must be >= 100, got {num_examples}")
    rng = np.random.default_rng(seed)
    cards = cardinalities(max_cardinality)
    dense = np.floor(rng.lognormal(mean=1.0, sigma=1.4, size=(num_examples, len(DENSE)))).astype(np.float32)
    cats = np.empty((num_examples, len(CATEGORICAL)), np.int64)
    logit = np.full(num_examples, -1.9)
    v = rng.normal(0.0, 0.35, len(DENSE))
    logit += (np.log1p(dense) - 1.0) @ v
    for j, card in enumerate(cards):
        ranks = (rng.zipf(zipf, num_examples) - 1) % card
        # Scrambled: multiplying by a prime larger than every cardinality, and
        # adding an offset, permutes 0..card-1.
        ids = (ranks * 0x9E3779B1 + 7919 * j) % card
        cats[:, j] = ids
        logit += (1.2 if j < 8 else 0.25) * _unit(ids, j + 1)
    labels = (rng.random(num_examples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return _split(dense, cats, labels, cards, test_fraction)


def _split(dense, cats, labels, cards, test_fraction) -> Clicks:
    n = len(labels)
    test = max(1, int(n * test_fraction))
    cut = n - test
    return Clicks(dense[:cut], cats[:cut], labels[:cut], dense[cut:], cats[cut:], labels[cut:], cards)


def criteo_tsv(path: str, test_fraction: float = 0.1, max_examples: int = 0) -> Clicks:
    """A file in Criteo's TSV format: per line a label (0/1), 13 integer
    features and 26 categorical features as hex strings, tab-separated,
    any of them empty.  Categorical values become string keys (an empty one
    is the key ''); empty integers read 0 and negative ones are clipped to
    0.  The last test_fraction of the lines is held out."""
    labels, dense, cats = [], [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 1 + len(DENSE) + len(CATEGORICAL):
                raise ValueError(
                    f"{path}:{number}: {len(fields)} tab-separated fields, Criteo's format has "
                    f"{1 + len(DENSE) + len(CATEGORICAL)} (label, 13 integers, 26 categorical hex strings)"
                )
            try:
                label = int(fields[0])
                ints = [max(0, int(x)) if x else 0 for x in fields[1:14]]
            except ValueError:
                raise ValueError(f"{path}:{number}: the label and the 13 integer fields must be integers") from None
            if label not in (0, 1):
                raise ValueError(f"{path}:{number}: the label must be 0 or 1, got {label}")
            labels.append(label)
            dense.append(ints)
            cats.append(fields[14:])
            if max_examples and len(labels) >= max_examples:
                break
    if len(labels) < 2:
        raise ValueError(f"{path}: {len(labels)} example(s); need at least 2 (one to train on, one held out)")
    cats = np.array(cats, dtype=object)
    cards = [len(set(cats[:, j])) for j in range(cats.shape[1])]
    return _split(np.array(dense, np.float32), cats, np.array(labels, np.float32), cards, test_fraction)


def auc(labels, scores) -> float:
    """Area under the ROC curve (exact, by ranks; ties share their mean rank)."""
    labels = np.asarray(labels) > 0.5
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), np.float64)
    sorted_scores = np.asarray(scores)[order]
    # Mean rank of each run of equal scores.
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], len(scores)]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def dense_baseline_auc(data: Clicks, seed: int = 0) -> float:
    """Held-out AUC of a logistic regression on the dense features alone
    (log1p of the counts, standardized; full-batch gradient descent)."""
    x = np.log1p(data.train_dense.astype(np.float64))
    mean, std = x.mean(0), x.std(0) + 1e-9
    x = (x - mean) / std
    y = data.train_labels.astype(np.float64)
    w, b = np.zeros(x.shape[1]), 0.0
    for _ in range(300):
        p = 1.0 / (1.0 + np.exp(-(x @ w + b)))
        w -= 0.5 * (x.T @ (p - y)) / len(y)
        b -= 0.5 * float(np.mean(p - y))
    test = (np.log1p(data.test_dense.astype(np.float64)) - mean) / std
    return auc(data.test_labels, test @ w + b)
