"""The stable key hash (docs/design.md, decision 4) and shard routing.

The definition lives in backends/cuckoo/hash.h and docs/formats.md ('The stable key hash'); this module
holds a numpy reference implementation (the tests compare it with the native
op bit for bit) and TensorFlow wrappers around the native op.  The hash is part
of tfde's on-disk and in-Redis format and never changes silently.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfde import _native

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int (uint64 arithmetic)."""
    z = (z + _GOLDEN) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def stable_hash_py(key) -> int:
    """Reference stable hash of one int or bytes/str key, as a uint64 int."""
    if isinstance(key, (bytes, str)):
        data = key.encode() if isinstance(key, str) else key
        h = mix64(len(data) ^ 0x5F3759DF5F3759DF)
        for off in range(0, len(data), 8):
            word = int.from_bytes(data[off : off + 8].ljust(8, b"\0"), "little")
            h = mix64(h ^ word)
        return h
    return mix64(int(np.int64(key)) & _M)


def shard_of_py(hash_u64: int, num_shards: int) -> int:
    """Shard among num_shards of a key whose stable hash is hash_u64: its
    high 32 bits (backends/cuckoo/hash.h computes it natively)."""
    return ((hash_u64 >> 32) * num_shards) >> 32


# The low 32 bits of the hash route a key to its owning worker and to its
# Redis bucket: ((h & 0xFFFFFFFF) * n) >> 32, independent of its shard
# inside a Variable (the high bits).  Defined once per kind of caller: a
# Python int, numpy arrays, TF tensors (backends/cuckoo/hash.h RedisBucketOf
# is the C++ one); tests/test_native_core.py pins them to each other, and
# tests/test_redis.py the Python ones to the native ops.


def route_low_py(hash_u64: int, n: int) -> int:
    """Owner / bucket among n of a key whose stable hash is hash_u64."""
    return ((hash_u64 & 0xFFFFFFFF) * n) >> 32


def route_low_np(hashes: np.ndarray, n: int) -> np.ndarray:
    """route_low_py of each stable hash (int64 or uint64 array): int64."""
    low = hashes.view(np.uint64) & np.uint64(0xFFFFFFFF)
    return ((low * np.uint64(n)) >> np.uint64(32)).astype(np.int64)


def route_low(hashes, n: int):
    """route_low_py of each stable hash (int64 tensor): int32 tensor."""
    low = tf.bitwise.bitwise_and(hashes, tf.constant(0xFFFFFFFF, tf.int64))
    return tf.cast(tf.bitwise.right_shift(low * n, 32), tf.int32)


def stable_hash_np(keys: np.ndarray) -> np.ndarray:
    """Stable hash of integer keys, vectorized numpy (uint64 array)."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.int64).view(np.uint64) + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def stable_hash(keys):
    """Stable hash of each key: int64 tensor with the uint64 bits, same shape."""
    h, _ = _native.load().tfde_stable_hash(keys, num_shards=0)
    return h


def shard_index(keys, num_shards: int):
    """Shard (int32 in [0, num_shards)) owning each key; same shape as keys."""
    _, s = _native.load().tfde_stable_hash(keys, num_shards=int(num_shards))
    return s
