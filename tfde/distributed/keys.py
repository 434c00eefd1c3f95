"""Keys on collectives that carry numbers only, and the unions and per-key
sums of every worker's keys gathered on every worker (tfde/distributed/)."""

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


def gathered_unions(key_lists, gather, gather_blocks, max_over_workers, size):
    """(per list of `key_lists` (one per part, this worker's keys): (the
    union of every worker's keys of that part, the same on every worker, in
    order of first appearance; positions in it of every worker's keys,
    worker after worker), the key counts [worker, part] int32).  gather(t):
    the concatenation over the workers of t; gather_blocks(t, rows per
    worker): the same for t that may be empty on every worker.  One gather
    of every part's key count, one of every part's keys (string keys: one
    max_over_workers more, for their longest length)."""
    parts = len(key_lists)
    counts = tf.stack([tf.shape(k, out_type=tf.int32)[0] for k in key_lists])
    sizes = tf.reshape(gather(counts), [size, parts])  # [worker, part]
    packed, unpack = pack_keys(key_lists, max_over_workers)
    # Worker after worker, each worker's parts in order.
    every = gather_blocks(packed, tf.reduce_sum(sizes, axis=1))
    if parts == 1:
        pieces = [every]
    else:
        part_of = tf.repeat(tf.tile(tf.range(parts), [size]), tf.reshape(sizes, [-1]))
        pieces = tf.dynamic_partition(every, part_of, parts)
    unions = [tf.unique(unpack(pieces[i], i), out_idx=tf.int32) for i in range(parts)]
    return [(u.y, u.idx) for u in unions], sizes


def sum_gathered(parts, gather, max_over_workers, size):
    """Per part of `parts` (this worker's (keys [n], values [n, d] of a
    static d)): (the union of every worker's keys, the same on every
    worker; [u, d] the values every worker passed with each key, summed).
    Every worker's keys and values are gathered on every worker, in one
    gather each for all the parts (gathered_unions; the values flattened
    in one dtype, carrier_dtype: float64 for all when one part is float64,
    each sum then rounded once to its part's dtype), then summed per key
    worker after worker: every worker sums the same numbers in the same
    order, so the sums are the same on all.  gather(t): the concatenation
    over the workers of t, which may be empty on every worker (Horovod's
    allgather); max_over_workers: as for gathered_unions."""
    widths = []
    for _, values in parts:  # before any collective
        if values.shape.rank != 2 or values.shape[-1] is None:
            raise ValueError(
                f"tfde: values summed over the workers need a shape [n, d] of a static d, got {values.shape}"
            )
        widths.append(int(values.shape[-1]))
    keys = [k for k, _ in parts]
    unions, sizes = gathered_unions(keys, gather, lambda t, _rows: gather(t), max_over_workers, size)
    carrier = carrier_dtype([values.dtype for _, values in parts])
    flat = tf.concat([tf.reshape(tf.cast(values, carrier), [-1]) for _, values in parts], 0)
    # Worker after worker, each worker's parts in order.
    every = gather(flat)
    n = len(parts)
    pieces = tf.split(every, tf.reshape(sizes * tf.constant(widths, tf.int32)[None, :], [-1]), num=size * n)
    out = []
    for i, ((union, positions), (_, values)) in enumerate(zip(unions, parts)):
        gathered = tf.reshape(tf.concat(pieces[i::n], 0), [-1, widths[i]])
        summed = tf.math.unsorted_segment_sum(gathered, positions, tf.size(union))
        out.append((union, tf.ensure_shape(tf.cast(summed, values.dtype), [None, widths[i]])))
    return out
