"""Interaction data for the demo: a built-in synthetic generator, a
MovieLens-format CSV reader, and a writer of the synthetic data as MovieLens
CSV files (`tfde make-data`, read by examples/).

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
import os

import numpy as np


@dataclasses.dataclass
class Interactions:
    """Parallel arrays of (user id string, item id int64), split in two."""

    train_users: np.ndarray  # [n] object (str)
    train_items: np.ndarray  # [n] int64
    test_users: np.ndarray
    test_items: np.ndarray
    all_items: np.ndarray  # [m] int64, every item id that exists

    @property
    def num_train(self) -> int:
        return len(self.train_items)


def _item_ids(n: int, rng) -> np.ndarray:
    # Sparse, large ids like real catalogues (not 0..n-1).
    return rng.choice(np.int64(1) << 40, size=n, replace=False).astype(np.int64) + 1_000_000


def synthetic(
    num_interactions: int = 1_000_000,
    num_users: int = 50_000,
    num_items: int = 20_000,
    num_tastes: int = 48,
    popularity_exponent: float = 0.9,
    sharpness: float = 2.0,
    test_fraction: float = 0.05,
    seed: int = 0,
) -> Interactions:
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
    taste = np.where(
        pick < 0.7,
        primary[users],
        np.where(pick < 0.9, secondary[users], rng.integers(0, num_tastes, size=num_interactions)),
    )
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
            raise ValueError(
                f"{path}: expected a MovieLens ratings CSV whose header starts with userId,movieId; got {header!r}"
            )
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                users.append(f"user_{row[0].strip()}")
                items.append(int(row[1]))
            except (IndexError, ValueError):
                raise ValueError(
                    f"{path}:{lineno}: expected userId,movieId,... with an integer movieId, got {row!r}"
                ) from None
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


# MovieLens's genre vocabulary (its README, "Movies Data File Structure").
MOVIELENS_GENRES = (
    "Action",
    "Adventure",
    "Animation",
    "Children",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "IMAX",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
)
NO_GENRES = "(no genres listed)"
# Seconds since the epoch of the first and last ratings of MovieLens
# latest-small; the written timestamps fall between them.
FIRST_TIMESTAMP_S = 828_124_615
LAST_TIMESTAMP_S = 1_537_799_250


def write_movielens_csv(
    directory: str, num_ratings: int = 100_000, num_users: int = 1_000, num_movies: int = 1_700, seed: int = 0
):
    """Writes synthetic() interactions as MovieLens files; returns the paths
    (ratings.csv, movies.csv) in `directory` (made if missing; files already
    there are replaced, each atomically).

    ratings.csv: ``userId,movieId,rating,timestamp``, one line per interaction
    of synthetic(num_ratings, num_users, num_movies, seed=seed) (train and
    held-out together), sorted by userId then movieId as MovieLens is.  The
    user ``user_{i}`` of synthetic() is userId i + 1; the item at position j
    of its ``all_items`` is movieId j + 1 (MovieLens's small ids rather than
    the generator's sparse ones).  Ratings (0.5 to 5.0 in half stars) and
    timestamps (seconds) are drawn from the seed too; nothing reads them.

    movies.csv: ``movieId,title,genres`` for every movie of the catalogue,
    rated or not: titles ``Movie 17 (1995)``, some ``Movie 23, The (1987)``
    (quoted, as MovieLens quotes titles with commas), genres ``A|B`` from
    MOVIELENS_GENRES or ``(no genres listed)``.

    Deterministic: the same arguments write the same bytes.
    """
    for name, value in (
        ("num_ratings", num_ratings),
        ("num_users", num_users),
        ("num_movies", num_movies),
        ("seed", seed),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < (0 if name == "seed" else 1):
            raise ValueError(
                f"write_movielens_csv: {name} must be an int >= {0 if name == 'seed' else 1}, got {value!r}"
            )
    directory = os.fspath(directory)
    data = synthetic(int(num_ratings), int(num_users), int(num_movies), seed=int(seed))
    users = np.concatenate([data.train_users, data.test_users])
    items = np.concatenate([data.train_items, data.test_items])
    user_ids = np.fromiter((int(u[len("user_") :]) for u in users), np.int64, len(users)) + 1
    by_id = np.argsort(data.all_items)
    movie_ids = by_id[np.searchsorted(data.all_items, items, sorter=by_id)].astype(np.int64) + 1

    # A generator of its own: ratings and titles do not change synthetic()'s draws.
    rng = np.random.default_rng([int(seed), 0x4D4C])
    ratings = rng.integers(1, 11, size=len(items)) / 2
    timestamps = rng.integers(FIRST_TIMESTAMP_S, LAST_TIMESTAMP_S + 1, size=len(items))
    order = np.lexsort((timestamps, movie_ids, user_ids))

    os.makedirs(directory, exist_ok=True)
    ratings_path = os.path.join(directory, "ratings.csv")
    movies_path = os.path.join(directory, "movies.csv")
    _write_csv(
        ratings_path,
        ["userId", "movieId", "rating", "timestamp"],
        ((user_ids[i], movie_ids[i], f"{ratings[i]:.1f}", timestamps[i]) for i in order),
    )
    years = rng.integers(1920, 2019, size=num_movies)
    # 1 to 3 genres; about 1% "(no genres listed)" (0.3% of MovieLens latest-small).
    num_genres = np.where(rng.random(num_movies) < 0.01, 0, rng.integers(1, 4, size=num_movies))

    def movies():
        for j in range(num_movies):
            movie_id = j + 1
            title = f"Movie {movie_id}, The ({years[j]})" if movie_id % 10 == 3 else f"Movie {movie_id} ({years[j]})"
            picked = sorted(rng.choice(len(MOVIELENS_GENRES), size=num_genres[j], replace=False))
            yield movie_id, title, "|".join(MOVIELENS_GENRES[g] for g in picked) or NO_GENRES

    _write_csv(movies_path, ["movieId", "title", "genres"], movies())
    return ratings_path, movies_path


def _write_csv(path: str, header, rows) -> None:
    """Writes a CSV as MovieLens does (\\n line ends, fields quoted only when
    they hold a comma or a quote) to a temporary file, then renames it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
            writer.writerow(header)
            writer.writerows(rows)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
