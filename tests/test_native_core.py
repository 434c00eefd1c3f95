"""The cuckoo core without TensorFlow (C++ stress test), and the stable hash
and initial rows checked bit for bit against their Python references."""

import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfde import _native, hashing
from tfde.initializers import InitSpec, init_rows_reference

SRC = _native.source_dir() / "cuckoo"


@pytest.fixture(scope="module")
def stress_binary():
    cxx = shutil.which("g++") or shutil.which("c++")
    out = Path(tempfile.mkdtemp()) / "stress_test"
    subprocess.run([cxx, "-std=c++17", "-O2", "-pthread", str(SRC / "stress_test.cc"), "-o", str(out)], check=True)
    return out


# The random seed is drawn in the test, not at collection: pytest-xdist's
# workers must collect the same test ids.
@pytest.mark.parametrize("seed", [7, None], ids=["seed7", "random-seed"])
def test_cpp_stress_threads_against_shadow_maps(stress_binary, seed):
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 30)
    proc = subprocess.run([str(stress_binary), str(seed), "4", "1500"], capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, f"stress test failed (replay with seed {seed}):\n{proc.stdout}\n{proc.stderr}"
    assert f"seed {seed}" in proc.stdout and "PASS" in proc.stdout


def test_core_has_no_tensorflow_includes():
    for name in ("cuckoo_table.h", "hash.h", "init_rows.h", "stress_test.cc"):
        includes = [line for line in (SRC / name).read_text().splitlines() if line.startswith("#include")]
        assert includes and not any("tensorflow" in line or "Eigen" in line for line in includes), name


def _unxorshift(z: int, k: int) -> int:
    out = z
    for _ in range(64 // k + 1):
        out = z ^ (out >> k)
    return out


def test_mix64_is_a_bijection_so_int_keys_are_their_hashes():
    """The cuckoo core keeps no int key in its buckets, only the key's 64-bit
    internal hash (Mix64 of the stable hash, itself Mix64 of the key), and
    treats equal hashes as equal keys (cuckoo_table.h, KeyTraits).  That holds
    only while Mix64 is invertible: undo it step by step here."""
    m = (1 << 64) - 1

    def unmix(h):
        z = _unxorshift(h, 31)
        z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & m
        z = _unxorshift(z, 27)
        z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & m
        z = _unxorshift(z, 30)
        return (z - 0x9E3779B97F4A7C15) & m

    rng = random.Random(3)
    for z in [0, 1, m, 1 << 63, 0x9E3779B97F4A7C15] + [rng.getrandbits(64) for _ in range(2000)]:
        assert unmix(hashing.mix64(z)) == z


@pytest.mark.parametrize("dtype", [tf.int64, tf.int32])
def test_stable_hash_matches_reference_for_ints(dtype):
    info = np.iinfo(dtype.as_numpy_dtype)
    keys = np.concatenate(
        [
            np.arange(-50, 50),
            [info.min, info.max, 0, 1, 2**20],
            np.random.default_rng(0).integers(info.min, info.max, 200),
        ]
    ).astype(dtype.as_numpy_dtype)
    got = hashing.stable_hash(tf.constant(keys)).numpy().view(np.uint64)
    want = np.array([hashing.stable_hash_py(int(k)) for k in keys], np.uint64)
    np.testing.assert_array_equal(got, want)


def test_vectorized_numpy_hash_matches_native():
    keys = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 1000, dtype=np.int64)
    np.testing.assert_array_equal(
        hashing.stable_hash_np(keys), hashing.stable_hash(tf.constant(keys)).numpy().view(np.uint64)
    )


def test_int32_and_int64_keys_hash_alike():
    keys = np.arange(-1000, 1000)
    a = hashing.stable_hash(tf.constant(keys, tf.int32)).numpy()
    b = hashing.stable_hash(tf.constant(keys, tf.int64)).numpy()
    np.testing.assert_array_equal(a, b)


def test_stable_hash_matches_reference_for_strings():
    keys = [b"", b"a", b"abcdefg", b"abcdefgh", b"abcdefghi", "ünïcode".encode(), b"x" * 100, b"\0\0"]
    got = hashing.stable_hash(tf.constant(keys)).numpy().view(np.uint64)
    want = np.array([hashing.stable_hash_py(k) for k in keys], np.uint64)
    np.testing.assert_array_equal(got, want)


def test_pinned_hash_values_never_change():
    # Part of the on-disk / in-Redis format (docs/design.md, decision 4): these must not move.
    assert hashing.stable_hash_py(0) == 0xE220A8397B1DCDAF
    assert hashing.stable_hash_py(1) == 0x910A2DEC89025CC1
    assert hashing.stable_hash_py(b"user_1") == hashing.stable_hash_py("user_1")
    assert [hashing.shard_of_py(hashing.stable_hash_py(k), 4) for k in range(8)] == list(
        hashing.shard_index(tf.constant(np.arange(8), tf.int64), 4).numpy()
    )


def test_the_owner_and_bucket_routing_is_one_formula():
    """((h & 0xFFFFFFFF) * n) >> 32 as a Python int, numpy and TF, pinned;
    tests/test_redis.py pins the C++ one to it."""
    keys = np.random.default_rng(5).integers(-(2**63), 2**63 - 1, size=1000)
    hashes = hashing.stable_hash_np(keys)
    for n in (1, 2, 3, 7, 64):
        want = [hashing.route_low_py(int(h), n) for h in hashes]
        assert hashing.route_low_np(hashes, n).tolist() == want
        assert hashing.route_low(tf.constant(hashes.view(np.int64)), n).numpy().tolist() == want
    assert [hashing.route_low_py(hashing.stable_hash_py(k), 4) for k in range(8)] == [1, 2, 0, 3, 3, 2, 2, 1]


def test_sequential_ids_spread_evenly_over_shards():
    shards = hashing.shard_index(tf.range(100_000, dtype=tf.int64), 8).numpy()
    counts = np.bincount(shards, minlength=8)
    assert counts.min() > 0.95 * 100_000 / 8, counts


@pytest.mark.parametrize(
    "spec",
    [
        InitSpec("uniform", -0.5, 0.25, 11),
        InitSpec("normal", 0.1, 2.0, 12),
        InitSpec("truncated_normal", 0.0, 1.0, 13),
        InitSpec("constant", 0.75, 0, 1),
    ],
)
def test_init_rows_match_reference(spec):
    ops = _native.load()
    keys = np.array([0, 1, -5, 2**40, 77], np.int64)
    got = ops.tfde_init_rows(tf.constant(keys), Tvalue=tf.float64, dim=7, **spec.attrs()).numpy()
    want = init_rows_reference(list(keys), spec, 7)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if spec.kind == "truncated_normal":
        assert np.all(np.abs(got) <= 2.0)


def test_init_rows_distribution():
    ops = _native.load()
    got = ops.tfde_init_rows(
        tf.range(20000, dtype=tf.int64),
        Tvalue=tf.float32,
        dim=8,
        init_kind="normal",
        init_p0=1.0,
        init_p1=3.0,
        init_seed=5,
    ).numpy()
    assert abs(got.mean() - 1.0) < 0.05 and abs(got.std() - 3.0) < 0.05
    # Every column a normal of its own, those sharing a Box-Muller pair
    # (0-1, 2-3, ...) too: the right spread and no correlation.
    z = (got - 1.0) / 3.0
    assert np.all(np.abs(z.mean(0)) < 0.04) and np.all(np.abs(z.std(0) - 1.0) < 0.03), (z.mean(0), z.std(0))
    assert np.all(np.abs(np.mean(np.abs(z) < 1.0, 0) - 0.6827) < 0.015)
    corr = np.corrcoef(z.T) - np.eye(8)
    assert np.abs(corr).max() < 0.035, corr
    u = ops.tfde_init_rows(
        tf.range(20000, dtype=tf.int64),
        Tvalue=tf.float32,
        dim=8,
        init_kind="uniform",
        init_p0=-1.0,
        init_p1=1.0,
        init_seed=5,
    ).numpy()
    assert u.min() >= -1.0 and u.max() < 1.0 and abs(u.mean()) < 0.02
