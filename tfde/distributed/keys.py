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


def pack_keys(key_lists, max_over_workers, two_d=False):
    """Keys of several Variables (tensors of int32, int64 or string keys) as
    one int64 tensor, for collectives that carry numbers only, and
    unpack(rows of it, i) -> the keys of the i-th list's dtype.  Without
    string keys: [n] (two_d: [n, 1]), ints widened to int64.  With string
    keys: [n, width + 1], a string's zero-padded byte codes then its length,
    an int key in column 0; `width` is the longest string over every worker
    (max_over_workers(scalar): one collective)."""
    dtypes = [k.dtype for k in key_lists]
    strings = [k for k in key_lists if k.dtype == tf.string]
    width = None
    if strings:
        lengths = tf.concat([tf.strings.length(k) for k in strings] + [[1]], 0)
        width = max_over_workers(tf.reduce_max(lengths))
    columns = []
    for keys in key_lists:
        if keys.dtype != tf.string:
            k = tf.cast(keys, tf.int64)
            if width is not None:
                k = tf.pad(k[:, None], [[0, 0], [0, width]])
            elif two_d:
                k = k[:, None]
            columns.append(k)
        else:
            lengths = tf.strings.length(keys)
            codes = tf.cast(tf.io.decode_raw(keys, tf.uint8, fixed_length=width), tf.int64)
            columns.append(tf.concat([tf.reshape(codes, [-1, width]), tf.cast(lengths, tf.int64)[:, None]], 1))
    packed = columns[0] if len(columns) == 1 else tf.concat(columns, 0)

    def unpack(rows, i):
        if dtypes[i] == tf.string:
            return strings_from_codes(rows[:, :-1], tf.cast(rows[:, -1], tf.int32))
        first = rows if rows.shape.rank == 1 else rows[:, 0]
        return tf.cast(first, dtypes[i])

    return packed, unpack


def carrier_dtype(dtypes):
    """One float dtype that carries values of every dtype in `dtypes`
    exactly: their common dtype, float64 when one is float64, else float32."""
    dtypes = set(dtypes)
    if len(dtypes) == 1:
        return dtypes.pop()
    return tf.float64 if tf.float64 in dtypes else tf.float32
