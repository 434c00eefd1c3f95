"""Synchronous, exact training of tfde Variables over several workers.

Every worker owns the keys whose stable hash routes to it (`owner`;
docs/design.md, decisions 4 and 6) and is the only one that reads them from or writes them to
its store: its own local cuckoo tables ("sharded local tables"), or the Redis
tables all workers share ("shared store").  An `Exchange` moves ids, rows and
gradients between the workers, in two steps per Variable and training step:

* `rows_for(unique_keys, find)` (lookup): every worker gets the rows of its
  keys, each read by its owner;
* `owner_gradients(keys, grads)` (apply): the gradients of every worker reach
  the owner of each key, summed over workers; the owner applies the optimizer
  to the key and writes its row, slots and policy state: every key is written
  exactly once per step.

Two routings implement them:

* `GatherExchange` (tf.distribute: MultiWorkerMirroredStrategy, automatic
  inside its replica context): the workers all-gather their unique ids; the
  union G, identical and identically ordered on every worker, becomes every
  worker's step buffer; owners fill in their rows of G and an all-reduce (sum
  with zeros elsewhere, so exact) gives everyone all of G.  Gradients of the
  shared buffer are all-reduced, and each owner keeps its keys.
* `AllToAllExchange` (Horovod, installed by tfde.distributed.horovod): ids go
  to their owners and rows come back through all-to-all; each worker's step
  buffer holds only its own keys; gradients go back to the owners the same way
  and are summed there.  Less traffic than gathering when workers are many.

With the loss averaged over the global batch (Keras under a tf.distribute
strategy; custom loops with tf.nn.compute_average_loss; Horovod by averaging
gradients), N workers with batch B compute the same update as one worker with
batch N*B, up to the order of float summation.

This module uses only TensorFlow and imports nothing from tfde.distributed.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Optional

import numpy as np
import tensorflow as tf

from tfde.errors import ConfigError
from tfde.hashing import stable_hash

_installed: Optional["Exchange"] = None


def owner(keys, size: int):
    """Worker (int32 in [0, size)) that owns each key.

    ((h mod 2**32) * size) >> 32 of the key's stable hash h: the low 32 bits,
    so that ownership is independent of the shard a key takes inside a
    Variable (which uses the high 32 bits)."""
    low = tf.bitwise.bitwise_and(stable_hash(keys), tf.constant(0xFFFFFFFF, tf.int64))
    return tf.cast(tf.bitwise.right_shift(low * size, 32), tf.int32)


class Exchange:
    """Moves ids, rows and gradients between the workers of one synchronous
    job.  rank: this worker (int or int32 scalar tensor); size: the number of
    workers (int).  Every worker calls every method in the same order."""

    rank = 0
    size = 1
    # Whether its collectives may run inside tf.data functions (reads there
    # happen on tf.data's threads, beside the step; tfde.Variable._reader).
    collectives_in_tf_data = False

    def rows_for(self, unique_keys, find):
        """unique_keys [u]: this worker's deduplicated keys; find(keys) ->
        [k, d] reads this worker's store.  Returns (buffer_keys [b],
        buffer_rows [b, d], positions [u] of unique_keys in the buffer)."""
        raise NotImplementedError

    def owner_gradients(self, buffer_keys, grads):
        """buffer_keys [b] and this worker's gradient [b, d] of its buffer
        rows.  Returns (keys [k] this worker owns and must update, their
        gradients [k, d] summed over workers and over duplicate keys)."""
        raise NotImplementedError

    def gradient_scale(self, optimizer) -> float:
        """Factor for owner_gradients' sums when `optimizer` applies them: 1
        where the engine sums gradients (tf.distribute, whose loss is already
        divided by the global batch); 1/size where it averages them."""
        return 1.0

    def average_dense(self, grads: list) -> list:
        """The gradients of the dense weights (tensors, IndexedSlices or
        None), averaged over the workers where the engine leaves that to the
        optimizer (Horovod without its DistributedOptimizer's
        compute_gradients); unchanged where the engine does it
        (tf.distribute aggregates in apply_gradients)."""
        return grads

    def owned(self, keys):
        """bool [k]: which keys this worker owns."""
        return tf.equal(owner(keys, self.size), self.rank)


def _sum_per_key(keys, grads):
    unique, seg = tf.unique(keys, out_idx=tf.int32)
    return unique, tf.math.unsorted_segment_sum(grads, seg, tf.size(unique))


class GatherExchange(Exchange):
    """The routing for tf.distribute (see the module docstring); uses the
    collectives of the current replica context."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.rank = ctx.replica_id_in_sync_group
        self.size = ctx.num_replicas_in_sync

    def _gather(self, tensor):
        return _measured(lambda t: self.ctx.all_gather(t, axis=0), tensor)

    def _sum(self, tensor):
        return _measured(lambda t: self.ctx.all_reduce(tf.distribute.ReduceOp.SUM, t), tensor)

    def rows_for(self, unique_keys, find):
        sizes = self._gather(tf.shape(unique_keys, out_type=tf.int32)[:1])
        every = _transport_keys(unique_keys, self._gather, lambda n: tf.reduce_max(self._gather(n[None])))
        union, index = tf.unique(every, out_idx=tf.int32)
        start = tf.reduce_sum(sizes[: self.rank])
        mine = index[start:start + tf.shape(unique_keys)[0]]
        rows = find(union)
        rows = tf.where(self.owned(union)[:, None], rows, tf.zeros_like(rows))
        return union, self._sum(rows), mine

    def owner_gradients(self, buffer_keys, grads):
        # The buffer is the same on every worker: sum per buffer row, then per key.
        keys, summed = _sum_per_key(buffer_keys, self._sum(grads))
        mask = self.owned(keys)
        return tf.boolean_mask(keys, mask), tf.boolean_mask(summed, mask)


class DatasetGatherExchange(Exchange):
    """Reads inside tf.data functions under MultiWorkerMirroredStrategy
    (rows_for only: tf.data functions never train).

    A tf.data function has no replica context, so this routing launches the
    strategy's collectives itself, on the strategy's group of workers.  Each
    read site (one traced read of one Variable) numbers its executions on
    this worker, and the k-th executions of a site on every worker meet in
    collectives whose instance keys derive from the site and k (so a map may
    even run in parallel).  A site must run as often on every worker, as a
    tfrs FactorizedTopK metric over the same candidates does at every step.
    Sites are numbered in trace order, the same on every worker of an SPMD
    program; the reads that meet check that they are of the same Variable.
    Three collectives per read:

    * an all-gather of [count, key width] (sizes the blocks alike);
    * an all-gather of self-describing blocks (a header row with this
      process's nonce, its key count and the Variable's id, then its keys):
      the union G, this worker's rank and its keys' positions in G come from
      it alone;
    * an all-reduce of the owners' rows of G (zeros elsewhere, so exact),
      followed by a fingerprint of G that every worker checks."""

    _NONCE = int.from_bytes(os.urandom(7), "big")  # this process, in the headers of its blocks
    _FINGERPRINT = 4  # 12-bit pieces: sums over workers stay exact in float32
    # Instance keys in [2**30, 2**31): far above the strategy's own (they
    # count up from 100, a few per training step).  A site has 2**26 of
    # them, three per execution: reused after 22 million executions.
    _KEY_BASE, _SITE_KEYS, _MAX_SITES = 1 << 30, 1 << 26, 16
    _sites = 0

    def __init__(self, strategy, variable_name: str):
        launchers = getattr(getattr(strategy.extended, "_cross_device_ops", None), "_launchers", None)
        if not launchers or len(launchers) != 1 or not hasattr(launchers[0], "_group_key"):
            raise ConfigError(
                f"tfde cannot run collectives inside a tf.data function under {type(strategy).__name__}: it "
                "reaches them through MultiWorkerMirroredStrategy with one device per worker; use a store all "
                "workers share (table_creator=tfde.RedisTableCreator(...)), or read inside the training step")
        if DatasetGatherExchange._sites >= self._MAX_SITES:
            raise ConfigError(
                f"more than {self._MAX_SITES} tf.data functions read tfde Variables with each worker's own tables "
                "in this process: each such read site takes a range of the strategy's collective keys. Read "
                "the same Variable in fewer Dataset.map functions, or use a store all workers share "
                "(table_creator=tfde.RedisTableCreator(...))")
        self._site = DatasetGatherExchange._sites
        DatasetGatherExchange._sites += 1
        self._group_key = launchers[0]._group_key
        self._device = launchers[0]._device
        # The strategy's CommunicationOptions(timeout_seconds=...) bounds these too.
        self._timeout = float(getattr(launchers[0]._options, "timeout_seconds", None) or 0)
        self.size = strategy.num_replicas_in_sync
        self._variable_id = int.from_bytes(hashlib.blake2b(variable_name.encode(), digest_size=7).digest(), "big")
        with tf.init_scope():
            self._executions = local_variable(tf.zeros([], tf.int64), [], False, f"tfde_tf_data_reads_{self._site}")

    def _instance_keys(self):
        """The three instance keys of this execution of the site."""
        k = tf.math.floormod(self._executions.assign_add(1, read_value=True) - 1, self._SITE_KEYS // 3)
        first = tf.cast(self._KEY_BASE + self._site * self._SITE_KEYS + 3 * k, tf.int32)
        return first, first + 1, first + 2

    def _collective(self, op, tensor, instance_key, **kwargs):
        with tf.device(self._device):
            return _measured(lambda t: op(input=t, group_size=self.size, group_key=self._group_key,
                                          instance_key=instance_key, ordering_token=[],
                                          timeout_seconds=self._timeout, **kwargs), tensor)

    def rows_for(self, unique_keys, find):
        heads_key, blocks_key, rows_key = self._instance_keys()
        gather, reduce = tf.raw_ops.CollectiveGatherV2, tf.raw_ops.CollectiveReduceV2
        count = tf.shape(unique_keys, out_type=tf.int64)[0]
        strings = unique_keys.dtype == tf.string
        lengths = tf.cast(tf.strings.length(unique_keys), tf.int64) if strings else None
        own_width = tf.reduce_max(tf.concat([lengths, [1]], 0)) + 1 if strings else tf.constant(1, tf.int64)
        heads = self._collective(gather, tf.stack([count, own_width])[None], heads_key)  # [size, 2]
        most = tf.reduce_max(heads[:, 0])
        width = tf.maximum(tf.reduce_max(heads[:, 1]), 3)  # the header row needs 3 columns
        if strings:
            codes = tf.io.decode_raw(unique_keys, tf.uint8, fixed_length=tf.cast(width - 1, tf.int32))
            encoded = tf.concat([tf.reshape(tf.cast(codes, tf.int64), [-1, width - 1]), lengths[:, None]], 1)
        else:
            encoded = tf.pad(tf.cast(unique_keys, tf.int64)[:, None], [[0, 0], [0, width - 1]])
        header = tf.pad(tf.stack([tf.constant(self._NONCE, tf.int64), count,
                                  tf.constant(self._variable_id, tf.int64)])[None], [[0, 0], [0, width - 3]])
        block = tf.concat([header, tf.pad(encoded, [[0, most - count], [0, 0]])], 0)  # [1 + most, width]
        blocks = tf.reshape(self._collective(gather, block, blocks_key), [self.size, -1, width])
        ours = tf.equal(blocks[:, 0, 0], self._NONCE)
        checks = [
            tf.debugging.assert_equal(tf.math.count_nonzero(ours, dtype=tf.int32), 1, message=(
                "tfde: a tf.data read's all-gather did not hold exactly one block of this worker")),
            tf.debugging.assert_equal(blocks[:, 0, 2], tf.constant(self._variable_id, tf.int64), message=(
                "tfde: the workers' tf.data reads that met in one collective read different Variables: the "
                "tf.data functions that read tfde Variables were built in another order, or only on some "
                "workers. Under MultiWorkerMirroredStrategy every worker builds them in the same order")),
        ]
        with tf.control_dependencies(checks):
            rank = tf.cast(tf.argmax(tf.cast(ours, tf.int32)), tf.int32)
        counts = blocks[:, 0, 1]
        valid = tf.sequence_mask(counts, tf.shape(blocks, out_type=tf.int64)[1] - 1)
        every = tf.boolean_mask(blocks[:, 1:], valid)  # [sum(counts), width], in worker order
        if strings:
            every = _strings_from_codes(every[:, :-1], every[:, -1])
        else:
            every = tf.cast(every[:, 0], unique_keys.dtype)
        union, index = tf.unique(every, out_idx=tf.int32)
        start = tf.cast(tf.reduce_sum(counts[:rank]), tf.int32)
        mine = index[start:start + tf.cast(count, tf.int32)]
        rows = find(union)
        rows = tf.where(tf.equal(owner(union, self.size), rank)[:, None], rows, tf.zeros_like(rows))
        carrier = tf.float64 if rows.dtype == tf.float64 else tf.float32  # exact for every row dtype
        fingerprint = self._fingerprint(union)
        summed = self._collective(reduce, tf.concat([tf.reshape(tf.cast(rows, carrier), [-1]),
                                                     tf.cast(fingerprint, carrier)], 0),
                                  rows_key, merge_op="Add", final_op="Id")
        check = tf.debugging.assert_equal(
            tf.cast(summed[-self._FINGERPRINT:], tf.int64), fingerprint * self.size, message=(
                "tfde: the workers' tf.data reads that met in one collective disagree on the keys they read; "
                "see docs/lookups.md"))
        with tf.control_dependencies([check]):
            rows = tf.reshape(tf.cast(summed[:-self._FINGERPRINT], rows.dtype), tf.shape(rows))
        return union, rows, mine

    @classmethod
    def _fingerprint(cls, keys):
        """int64 [_FINGERPRINT]: 12-bit pieces of a 48-bit digest of the
        list of keys (order included)."""
        h = stable_hash(keys)
        # Every term < 2**40: the sums stay below 2**63 for fewer than 2**23 keys.
        weights = tf.math.floormod(tf.range(tf.size(h, out_type=tf.int64)), 65521) + 1
        low = tf.reduce_sum(tf.bitwise.bitwise_and(h, 0xFFFFFF) * weights)
        high = tf.reduce_sum(tf.bitwise.bitwise_and(tf.bitwise.right_shift(h, 40), 0xFFFFFF) * (weights + 7))
        digest = tf.bitwise.bitwise_xor(low, tf.bitwise.left_shift(high, 5)) + tf.size(h, out_type=tf.int64)
        return tf.stack([tf.bitwise.bitwise_and(tf.bitwise.right_shift(digest, 12 * i), 0xFFF)
                         for i in range(cls._FINGERPRINT)])


class AllToAllExchange(Exchange):
    """The routing for engines with an all-to-all collective (Horovod).

    alltoall(tensor, splits) -> (received, received_splits) sends
    tensor[sum(splits[:w]) : sum(splits[:w+1])] to worker w;
    max_over_workers(scalar) -> scalar.  gradient_scale: the factor for
    summed gradients (1/size where the engine's convention is to average)."""

    def __init__(self, rank, size, alltoall, max_over_workers, gradient_scale=1.0, all_gather=None):
        self.rank, self.size = rank, size
        self._alltoall = lambda t, splits: _measured(lambda x: alltoall(x, splits), t)
        self._max = lambda t: _measured(max_over_workers, t)
        self._scale = gradient_scale
        self.all_gather = all_gather  # (tensor) -> concatenation over workers, for HostCollectives

    def gradient_scale(self, optimizer) -> float:
        return self._scale

    def _route(self, keys):
        """(order sorting keys by owner, splits [size])."""
        own = owner(keys, self.size)
        order = tf.argsort(own, stable=True)
        return order, tf.math.bincount(own, minlength=self.size, maxlength=self.size, dtype=tf.int32)

    def _send_keys(self, keys, splits):
        """(keys received from every worker, received splits)."""
        received_splits = []

        def move(t):
            out, rsplits = self._alltoall(t, splits)
            received_splits.append(rsplits)
            return out

        return _transport_keys(keys, move, self._max), received_splits[0]

    def rows_for(self, unique_keys, find):
        order, splits = self._route(unique_keys)
        sent = tf.gather(unique_keys, order)
        received, received_splits = self._send_keys(sent, splits)
        rows, _ = self._alltoall(find(received), received_splits)  # back to the askers, in the order sent
        rows = tf.scatter_nd(order[:, None], rows, tf.shape(rows, out_type=tf.int32))
        return unique_keys, rows, tf.range(tf.size(unique_keys))

    def owner_gradients(self, buffer_keys, grads):
        keys, summed = _sum_per_key(buffer_keys, grads)
        order, splits = self._route(keys)
        received, _ = self._send_keys(tf.gather(keys, order), splits)
        received_grads, _ = self._alltoall(tf.gather(summed, order), splits)
        return _sum_per_key(received, received_grads)


class HostCollectives:
    """Collectives for code that runs between steps, eagerly, on every worker
    (restriction): gather(numpy [k] array) -> concatenation over workers in
    worker order; total(int) -> sum over workers; rank, size as in Exchange."""

    def __init__(self, gather_fn, rank: int, size: int):
        self._gather, self.rank, self.size = gather_fn, rank, size

    def gather(self, array):
        return self._gather(tf.constant(array)).numpy()

    def total(self, value: int) -> int:
        return int(self.gather(np.array([value], np.int64)).sum())


def host_collectives(strategy=None) -> Optional[HostCollectives]:
    """HostCollectives of the job this process is a worker of, or None when it
    trains alone; `strategy`: the tf.distribute strategy to use when none is
    in scope.  Every worker must make the same calls in the same order."""
    if _installed is not None and _installed.size > 1:
        if getattr(_installed, "all_gather", None) is None:
            raise ConfigError(f"the installed exchange {type(_installed).__name__} has no all_gather for "
                              "between-step collectives")
        return HostCollectives(_installed.all_gather, int(_installed.rank), _installed.size)
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    if strategy is None or strategy.num_replicas_in_sync <= 1:
        return None
    if tf.distribute.has_strategy() and tf.distribute.get_replica_context() is not None:
        raise ConfigError("restriction runs between training steps, not inside strategy.run; call it from the "
                          "training loop (tfde.AutoRestrictor) or a Keras callback (RestrictCallback)")
    if strategy not in _strategy_hosts:  # built once per strategy: tracing and a rank collective
        _strategy_hosts[strategy] = _strategy_host(strategy)
    return _strategy_hosts[strategy]


_strategy_hosts = {}


def _strategy_host(strategy) -> HostCollectives:
    """HostCollectives through strategy.run (the only way to reach the
    strategy's collectives from outside its replica context)."""

    @tf.function(reduce_retracing=True)
    def gather(t):
        # tf.identity places the input on the replica's device: the collective
        # refuses a tensor that has none ("destinations can not be empty").
        return strategy.run(lambda x: tf.distribute.get_replica_context().all_gather(tf.identity(x), axis=0),
                            args=(t,))

    @tf.function
    def rank():
        return strategy.run(lambda: tf.identity(tf.distribute.get_replica_context().replica_id_in_sync_group))

    def in_scope(fn, *args):
        with strategy.scope():
            return strategy.experimental_local_results(fn(*args))[0]

    return HostCollectives(lambda t: in_scope(gather, t), int(in_scope(rank)), strategy.num_replicas_in_sync)


def barrier(strategy=None) -> None:
    """Returns when every worker has called it.  With a shared store (Redis),
    call it after training and before another worker or process reads the
    tables: each key is written by its owner, and the other workers' last
    writes may still be under way when this worker finishes.  No-op when
    this process trains alone."""
    host = host_collectives(strategy)
    if host is not None:
        host.total(1)


def install(exchange: Optional[Exchange]) -> None:
    """Makes `exchange` the one every tfde Variable uses (None removes it);
    for engines outside tf.distribute (tfde.distributed.horovod.init)."""
    global _installed
    _installed = exchange


def active() -> Optional[Exchange]:
    """The exchange for the code being traced or run now, or None when this
    process trains alone.  An installed exchange wins; otherwise a
    tf.distribute replica context with more than one replica."""
    if _installed is not None:
        return _installed if _installed.size > 1 else None
    _refuse_bare_horovod()
    if not tf.distribute.has_strategy():
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync <= 1:  # cross-replica context, or one replica
        return None
    return GatherExchange(ctx)


def installed() -> Optional["Exchange"]:
    """The exchange install() made the one every Variable uses, or None."""
    return _installed


def _refuse_bare_horovod():
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None:
        return
    try:
        running = hvd.is_initialized() and hvd.size() > 1
    except Exception:  # pragma: no cover - horovod half-imported
        return
    if running:
        raise ConfigError(
            f"Horovod runs {hvd.size()} workers but tfde's exchange is not installed, so tfde Variables would "
            "train each worker's keys apart; call tfde.distributed.horovod.init() (it calls hvd.init()) before "
            "building the model")


def local_variable(initial, shape, trainable: bool, name: str):
    """A plain ResourceVariable of this process, built directly so that a
    tf.distribute strategy in scope does not mirror it (step buffers,
    measurements).  distribute_strategy marks it as created in the strategy's
    scope, which Keras checks."""
    from tensorflow.python.ops import resource_variable_ops

    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    return resource_variable_ops.ResourceVariable(initial, shape=tf.TensorShape(shape), trainable=trainable,
                                                  name=name, distribute_strategy=strategy)


# ---------------------------------------------------------------- measuring

class ExchangeStats:
    """What this process handed to the exchange's collectives: payload bytes,
    seconds spent inside them (waiting for the other workers included) and
    calls, accumulated in plain local variables.  Enabled by
    enable_stats(); read with .read() (eager)."""

    def __init__(self):
        self._vars = None

    def _variables(self):
        if self._vars is None:
            with tf.init_scope():  # created on first use, lifted out of any tf.function
                self._vars = [local_variable(tf.zeros([], dt), [], False, f"tfde_exchange_{what}")
                              for dt, what in ((tf.int64, "bytes"), (tf.float64, "seconds"), (tf.int64, "calls"))]
        return self._vars

    def record(self, nbytes, seconds):
        b, s, c = self._variables()
        return tf.group(b.assign_add(nbytes), s.assign_add(seconds), c.assign_add(1))

    def read(self) -> dict:
        if self._vars is None:
            return {"bytes": 0, "seconds": 0.0, "calls": 0}
        b, s, c = self._vars
        return {"bytes": int(b.numpy()), "seconds": float(s.numpy()), "calls": int(c.numpy())}


_stats: Optional[ExchangeStats] = None


def enable_stats() -> ExchangeStats:
    """Starts measuring the exchange of this process (for benchmarks)."""
    global _stats
    if _stats is None:
        _stats = ExchangeStats()
    return _stats


def stats() -> Optional[ExchangeStats]:
    """The measurements started by enable_stats(), or None."""
    return _stats


def _measured(collective, tensor):
    """collective(tensor), timed and counted when stats are enabled."""
    if _stats is None:
        return collective(tensor)
    with tf.control_dependencies([tensor]):
        start = tf.timestamp()
    with tf.control_dependencies([start]):
        out = collective(tf.identity(tensor))
    with tf.control_dependencies(tf.nest.flatten(out)):
        seconds = tf.timestamp() - start
    nbytes = tf.size(tensor, out_type=tf.int64) * tensor.dtype.size
    with tf.control_dependencies([_stats.record(nbytes, seconds)]):
        return tf.nest.map_structure(tf.identity, out)


_BYTES = [bytes([b]) for b in range(256)]  # byte value -> 1-byte string


def _transport_keys(keys, move, max_over_workers):
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
    return _strings_from_codes(packed[:, :-1], packed[:, -1])


def _strings_from_codes(codes, lengths):
    """Strings rebuilt byte for byte from zero-padded byte codes [k, n]
    (integers) and their lengths [k]."""
    joined = tf.strings.reduce_join(tf.gather(tf.constant(_BYTES), codes), axis=1)
    return tf.strings.substr(joined, tf.zeros_like(lengths), lengths)
