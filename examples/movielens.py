"""MovieLens CSV files for the examples: ratings.csv (userId,movieId,rating,
timestamp) and movies.csv (movieId,title,genres) in one directory, as
`tfde make-data DIR` writes them and as MovieLens's own CSV releases
(latest-small, 25M, ...) ship them.

Not an example itself: the programs next to it import it
(`python examples/x.py` puts examples/ on sys.path).
"""

from __future__ import annotations

import csv
import os

import numpy as np

DATA_ENV = "TFDE_EXAMPLE_DATA"  # the data directory, when not given on the command line
DEFAULT_DIR = "movielens"  # ... and when neither is given


def data_dir(given=None) -> str:
    """The data directory: `given` (the command line), else $TFDE_EXAMPLE_DATA,
    else ./movielens; it must hold ratings.csv and movies.csv."""
    directory = given or os.environ.get(DATA_ENV) or DEFAULT_DIR
    missing = [name for name in ("ratings.csv", "movies.csv") if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise SystemExit(
            f"{directory}: no {' or '.join(missing)} there. Expected a directory with MovieLens's "
            f"ratings.csv and movies.csv; write one with `tfde make-data {directory}` (or give another "
            f"directory as the first argument, or in ${DATA_ENV})"
        )
    return directory


def _rows(path, header):
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        seen = next(reader, None)
        if seen is None or [h.strip() for h in seen[: len(header)]] != header:
            raise SystemExit(
                f"{path}: expected a MovieLens CSV whose header starts with {','.join(header)}, got {seen!r}"
            )
        for lineno, row in enumerate(reader, start=2):
            if row:
                yield lineno, row


def load(directory: str) -> dict:
    """Every rating as numpy arrays, one entry per rating:
    "user_id" [n] int64, "movie_id" [n] int64, "movie_title" [n] str;
    and the whole catalogue: "all_movie_ids" [m] int64, "all_movie_titles"
    [m] str (movies.csv order)."""
    titles = {}
    movies_path = os.path.join(directory, "movies.csv")
    for lineno, row in _rows(movies_path, ["movieId", "title"]):
        try:
            titles[int(row[0])] = row[1]
        except (IndexError, ValueError):
            raise SystemExit(
                f"{movies_path}:{lineno}: expected movieId,title,genres with an integer movieId, got {row!r}"
            ) from None
    users, movies = [], []
    ratings_path = os.path.join(directory, "ratings.csv")
    for lineno, row in _rows(ratings_path, ["userId", "movieId"]):
        try:
            user, movie = int(row[0]), int(row[1])
        except (IndexError, ValueError):
            raise SystemExit(
                f"{ratings_path}:{lineno}: expected userId,movieId,rating,timestamp with integer ids, got {row!r}"
            ) from None
        if movie not in titles:
            raise SystemExit(
                f"{ratings_path}:{lineno}: movieId {movie} is not in {movies_path}; the two files "
                "must come from the same release (or the same `tfde make-data` run)"
            )
        users.append(user)
        movies.append(movie)
    if not movies:
        raise SystemExit(f"{ratings_path}: no ratings")
    movie_ids = np.asarray(movies, np.int64)
    return {
        "user_id": np.asarray(users, np.int64),
        "movie_id": movie_ids,
        "movie_title": np.asarray([titles[m] for m in movies]),
        "all_movie_ids": np.asarray(list(titles), np.int64),
        "all_movie_titles": np.asarray(list(titles.values())),
    }


def split(ratings: dict, validation_fraction: float = 0.1, seed: int = 2023):
    """(train, validation): the per-rating arrays of `ratings` shuffled with
    `seed` and cut in two; the same on every worker of a job."""
    n = len(ratings["movie_id"])
    order = np.random.default_rng(seed).permutation(n)
    n_validation = max(1, int(n * validation_fraction))
    per_rating = ("user_id", "movie_id", "movie_title")
    return (
        {k: ratings[k][order[n_validation:]] for k in per_rating},
        {k: ratings[k][order[:n_validation]] for k in per_rating},
    )
