"""Synchronous, exact training of tfde Variables over several workers.

Every worker owns the keys whose stable hash routes to it (DESIGN decisions 4
and 6) and is the only one that reads them from or writes them to its store:
its own local cuckoo tables ("sharded local tables"), or the Redis tables that
all workers share ("shared store").  One training step, for each Variable:

1. lookup: the workers all-gather the unique ids of their batches; the union
   G (deduplicated, in the same order on every worker) is what this step
   touches.  Each worker reads the rows of G it owns, zeros elsewhere, and an
   all-reduce (sum) gives every worker every row of G.  The rows go into the
   step buffer, identical on all workers.
2. apply: each worker's gradient for the step buffer is summed over workers
   (all-reduce), so every worker holds the gradient of the global batch; the
   owner of each key applies the optimizer to it and writes it (row, optimizer
   slots, policy state) to its store: every key is written exactly once.

With the loss averaged over the global batch (Keras does this under a
tf.distribute strategy; custom loops use tf.nn.compute_average_loss), N workers
with batch B compute the same update as one worker with batch N*B, up to the
order of float summation.

An `Exchange` carries the collectives.  Under a tf.distribute strategy with
more than one replica (MultiWorkerMirroredStrategy, MirroredStrategy) the
strategy's replica context is used automatically; Horovod installs its own
(tfde.distributed.horovod).  This module uses only TensorFlow; it imports
nothing from tfde.distributed.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfde.hashing import stable_hash

_installed: Optional["Exchange"] = None


class Exchange:
    """Collectives over the workers of one synchronous job.

    rank: this worker's index (int or int32 scalar tensor), size: the number
    of workers (int).  Both methods are called by every worker in the same
    order with tensors of the same dtype and trailing shape."""

    rank = 0
    size = 1

    def all_gather(self, tensor):
        """Concatenation over workers along axis 0 (lengths may differ)."""
        raise NotImplementedError

    def all_reduce_sum(self, tensor):
        """Element-wise sum over workers (same shape on every worker)."""
        raise NotImplementedError


class StrategyExchange(Exchange):
    """The collectives of the current tf.distribute replica context."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.rank = ctx.replica_id_in_sync_group
        self.size = ctx.num_replicas_in_sync

    def all_gather(self, tensor):
        return self.ctx.all_gather(tensor, axis=0)

    def all_reduce_sum(self, tensor):
        return self.ctx.all_reduce(tf.distribute.ReduceOp.SUM, tensor)


def install(exchange: Optional[Exchange]) -> None:
    """Makes `exchange` the one every tfde Variable uses (None removes it).
    For engines outside tf.distribute, e.g. Horovod."""
    global _installed
    _installed = exchange


def active() -> Optional[Exchange]:
    """The exchange for the code being traced/run now, or None when this
    process trains alone.  An installed exchange wins; otherwise a
    tf.distribute replica context with more than one replica."""
    if _installed is not None and _installed.size > 1:
        return _installed
    if not tf.distribute.has_strategy():
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None:  # cross-replica context: no collectives possible here
        return None
    if ctx.num_replicas_in_sync <= 1:
        return None
    return StrategyExchange(ctx)


def owner(keys, size: int):
    """Worker (int32 in [0, size)) that owns each key.

    ((h mod 2**32) * size) >> 32 of the key's stable hash h: the low 32 bits,
    so that ownership is independent of the shard a key takes inside a
    Variable (which uses the high 32 bits)."""
    low = tf.bitwise.bitwise_and(stable_hash(keys), tf.constant(0xFFFFFFFF, tf.int64))
    return tf.cast(tf.bitwise.right_shift(low * size, 32), tf.int32)


def gather_rows(ex: Exchange, unique_keys, find):
    """Step 1 of the module docstring.

    unique_keys: [u] this worker's deduplicated keys.  find(keys) -> rows
    [k, dim] reads this worker's store.  Returns (keys of G [g], rows of G
    [g, dim], positions [u] of unique_keys in G)."""
    sizes = ex.all_gather(tf.shape(unique_keys, out_type=tf.int32)[:1])
    every = gather_keys(ex, unique_keys)
    union, index = tf.unique(every, out_idx=tf.int32)
    start = tf.reduce_sum(sizes[: ex.rank])
    mine = index[start:start + tf.shape(unique_keys)[0]]
    rows = find(union)
    owned = tf.equal(owner(union, ex.size), ex.rank)
    rows = tf.where(owned[:, None], rows, tf.zeros_like(rows))
    return union, ex.all_reduce_sum(rows), mine


_BYTES = [bytes([b]) for b in range(256)]  # byte value -> 1-byte string


def gather_keys(ex: Exchange, keys):
    """all_gather of keys [k]; collectives carry numbers only, so string keys
    travel as zero-padded byte codes [k, longest] plus their lengths and are
    rebuilt byte for byte."""
    if keys.dtype != tf.string:
        return ex.all_gather(keys)
    lengths = tf.strings.length(keys)
    longest = tf.reduce_max(ex.all_gather(tf.reduce_max(tf.concat([lengths, [1]], 0))[None]))
    codes = tf.cast(tf.io.decode_raw(keys, tf.uint8, fixed_length=longest), tf.int32)  # [k, longest]
    codes = tf.reshape(codes, [-1, longest])
    codes, lengths = ex.all_gather(codes), ex.all_gather(lengths)
    joined = tf.strings.reduce_join(tf.gather(tf.constant(_BYTES), codes), axis=1)
    return tf.strings.substr(joined, tf.zeros_like(lengths), lengths)


def owned_mask(ex: Exchange, keys):
    """bool [k]: which of `keys` this worker owns."""
    return tf.equal(owner(keys, ex.size), ex.rank)
