"""Interaction data for the demo: a built-in synthetic generator and a
MovieLens-format CSV reader.

Synthetic model (deterministic for a seed):
  * items have power-law popularity: weight of the item of rank r is
    r ** -popularity_exponent;
  * there are `num_tastes` latent tastes; each item has an affinity to each
    taste (lognormal), each user a primary and a secondary taste;
  * user activity is power-law too (a few heavy users, many light ones);
  * an interaction of user u picks a taste (primary with p=0.7, secondary
    0.2, uniform 0.1) and then an item with probability proportional to
    popularity * affinity(item, taste) ** sharpness.
So popularity alone is a fair baseline and the users' tastes are what a
model can learn beyond it.
"""

from __future__ import annotations

import csv
import dataclasses

import numpy as np


@dataclasses.dataclass
class Interactions:
    """Parallel arrays of (user id string, item id int64), split in two."""

    train_users: np.ndarray  # [n] object (str)
    train_items: np.ndarray  # [n] int64
    test_users: np.ndarray
    test_items: np.ndarray
    all_items: np.ndarray    # [m] int64, every item id that exists

    @property
    def num_train(self) -> int:
        return len(self.train_items)


def _item_ids(n: int, rng) -> np.ndarray:
    # Sparse, large ids like real catalogues (not 0..n-1).
    return rng.choice(np.int64(1) << 40, size=n, replace=False).astype(np.int64) + 1_000_000


def synthetic(num_interactions: int = 1_000_000, num_users: int = 50_000, num_items: int = 20_000,
              num_tastes: int = 48, popularity_exponent: float = 0.9, sharpness: float = 2.0,
              test_fraction: float = 0.05, seed: int = 0) -> Interactions:
    rng = np.random.default_rng(seed)
    item_ids = _item_ids(num_items, rng)
    popularity = (np.arange(1, num_items + 1, dtype=np.float64)) ** -popularity_exponent
    rng.shuffle(popularity)
    affinity = rng.lognormal(0.0, 1.0, size=(num_tastes, num_items)) ** sharpness
    p_item_given_taste = popularity[None, :] * affinity
    cdf = np.cumsum(p_item_given_taste, axis=1)
    cdf /= cdf[:, -1:]

    activity = (np.arange(1, num_users + 1, dtype=np.float64)) ** -0.8
    rng.shuffle(activity)
    users = rng.choice(num_users, size=num_interactions, p=activity / activity.sum())
    primary = rng.integers(0, num_tastes, size=num_users)
    secondary = rng.integers(0, num_tastes, size=num_users)
    pick = rng.random(num_interactions)
    taste = np.where(pick < 0.7, primary[users],
                     np.where(pick < 0.9, secondary[users], rng.integers(0, num_tastes, size=num_interactions)))
    u = rng.random(num_interactions)
    items = np.empty(num_interactions, np.int64)
    for t in range(num_tastes):  # inverse-CDF sampling per taste
        sel = np.nonzero(taste == t)[0]
        items[sel] = np.minimum(np.searchsorted(cdf[t], u[sel]), num_items - 1)
    user_names = np.array([f"user_{i}" for i in range(num_users)], dtype=object)
    return _split(user_names[users], item_ids[items], item_ids, test_fraction, rng)


def movielens_csv(path: str, test_fraction: float = 0.05, seed: int = 0) -> Interactions:
    """Reads ``userId,movieId,rating,timestamp`` (header required); every
    rating counts as an interaction."""
    users, items = [], []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["userId", "movieId"]:
            raise ValueError(f"{path}: expected a MovieLens ratings CSV whose header starts with userId,movieId; "
                             f"got {header!r}")
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                users.append(f"user_{row[0].strip()}")
                items.append(int(row[1]))
            except (IndexError, ValueError):
                raise ValueError(f"{path}:{lineno}: expected userId,movieId,... with an integer movieId, "
                                 f"got {row!r}") from None
    if not items:
        raise ValueError(f"{path}: no ratings found")
    rng = np.random.default_rng(seed)
    items = np.asarray(items, np.int64)
    return _split(np.asarray(users, object), items, np.unique(items), test_fraction, rng)


def _split(users, items, all_items, test_fraction, rng) -> Interactions:
    order = rng.permutation(len(items))
    n_test = max(1, int(len(items) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Interactions(users[train], items[train], users[test], items[test], np.asarray(all_items, np.int64))
