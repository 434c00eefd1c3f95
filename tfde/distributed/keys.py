"""Keys on collectives that carry numbers only (tfde/distributed/)."""

from __future__ import annotations

import tensorflow as tf

BYTES = [bytes([b]) for b in range(256)]  # byte value -> 1-byte string


def transport_keys(keys, move, max_over_workers):
    """move(keys) for collectives that carry numbers only: string keys travel
    as zero-padded byte codes [k, longest] plus their lengths and are rebuilt
    byte for byte.  move must be row-wise (it may reorder or regroup rows)."""
    if keys.dtype != tf.string:
        return move(keys)
    lengths = tf.strings.length(keys)
    longest = max_over_workers(tf.reduce_max(tf.concat([lengths, [1]], 0)))
    codes = tf.cast(tf.io.decode_raw(keys, tf.uint8, fixed_length=longest), tf.int32)
    packed = tf.concat([tf.reshape(codes, [-1, longest]), lengths[:, None]], 1)  # [k, longest + 1]
    packed = move(packed)
    return strings_from_codes(packed[:, :-1], packed[:, -1])


def strings_from_codes(codes, lengths):
    """Strings rebuilt byte for byte from zero-padded byte codes [k, n]
    (integers) and their lengths [k]."""
    joined = tf.strings.reduce_join(tf.gather(tf.constant(BYTES), codes), axis=1)
    return tf.strings.substr(joined, tf.zeros_like(lengths), lengths)
