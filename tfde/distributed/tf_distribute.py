"""tf.distribute for tfde Variables: MultiWorkerMirroredStrategy, one
replica per worker process.

Registered with the core (tfde/exchange.py) on import, so a strategy needs
no setup: inside its replica context every Variable routes through
`GatherExchange`, which uses the replica context's collectives:

* lookup: the workers all-gather their unique ids; the union G, identical
  and identically ordered on every worker, becomes every worker's step
  buffer; owners fill in their rows of G and an all-reduce (sum with zeros
  elsewhere, so exact) gives everyone all of G;
* apply: gradients of the shared buffer are all-reduced, and each owner
  keeps its keys.

Outside the replica context (docs/lookups.md): an eager read runs the
exchange through strategy.run (every worker must make it); a read inside a
tf.data function, which has no replica context, goes through
`DatasetGatherExchange`, which launches the strategy's collectives itself;
code between steps (restriction, checkpoints) gets its collectives through
strategy.run (`host_collectives`).
"""

from __future__ import annotations

import hashlib
import json
import os

import tensorflow as tf

from tfde import exchange
from tfde.distributed.fit_logs import FitLogs
from tfde.distributed.keys import carrier_dtype, gathered_unions, strings_from_codes
from tfde.errors import ConfigError
from tfde.hashing import stable_hash
from tfde.local import local_variable


class GatherExchange(exchange.Exchange):
    """The routing for tf.distribute (see the module docstring); uses the
    collectives of the current replica context."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.rank = ctx.replica_id_in_sync_group
        self.size = ctx.num_replicas_in_sync

    def _gather(self, tensor):
        return exchange.measured(lambda t: self.ctx.all_gather(t, axis=0), tensor)

    def _gather_blocks(self, tensor, rows_per_worker):
        """All-gather of `tensor` ([n, ...], n = rows_per_worker[rank]) that
        may be empty on every worker: TensorFlow's all-gather crashes the
        process (SIGSEGV, TF 2.21) when the gathered tensor is empty on all
        of them, as a step between syncs of semi-synchronous training can
        make it (no key is new to any worker).  Each worker adds one row,
        taken out after the gather by its known position."""
        pad = tf.zeros(tf.concat([[1], tf.shape(tensor)[1:]], 0), tensor.dtype)
        gathered = self._gather(tf.concat([tensor, pad], 0))
        ends = tf.cumsum(tf.cast(rows_per_worker, tf.int32) + 1)  # one past each worker's pad row
        is_pad = tf.scatter_nd((ends - 1)[:, None], tf.ones_like(ends), tf.shape(gathered)[:1]) > 0
        return tf.boolean_mask(gathered, tf.logical_not(is_pad))

    def _sum(self, tensor):
        return exchange.measured(lambda t: self.ctx.all_reduce(tf.distribute.ReduceOp.SUM, t), tensor)

    def _sum_many(self, tensors):
        """Each tensor of `tensors` summed over the workers, in one all-reduce."""
        if len(tensors) == 1:
            return [self._sum(tensors[0])]
        carrier = carrier_dtype([t.dtype for t in tensors])
        flats = [tf.reshape(tf.cast(t, carrier), [-1]) for t in tensors]
        # The sizes are taken before the all-reduce: measured, tf.size of
        # these tensors read 0 when computed after it in a graph.
        shapes = [tf.shape(t) for t in tensors]
        sizes = tf.stack([tf.shape(f)[0] for f in flats])
        summed = self._sum(tf.concat(flats, 0))
        pieces = tf.split(summed, sizes, num=len(tensors))
        out = [tf.cast(tf.reshape(p, shape), t.dtype) for p, shape, t in zip(pieces, shapes, tensors)]
        for o, t in zip(out, tensors):
            o.set_shape(t.shape)
        return out

    def average(self, tensors):
        # One all-reduce of them all (measured like the exchange's own).
        return [tf.cast(s / self.size, s.dtype) for s in self._sum_many(list(tensors))]

    def local_step_scale(self) -> float:
        # Keras and tf.nn.compute_average_loss divide each worker's loss by
        # the global batch, and the exact step sums the workers' gradients.
        return float(self.size)

    def _unions(self, key_lists):
        """Per list of `key_lists` (one per part, this worker's keys): (the
        union of every worker's keys of that part, the same on every
        worker; positions [n] of this worker's keys in it)."""
        unions, sizes = gathered_unions(key_lists, self._gather, self._gather_blocks, self._longest, self.size)
        out = []
        for i, ((union, positions), keys) in enumerate(zip(unions, key_lists)):
            start = tf.reduce_sum(sizes[: self.rank, i])
            out.append((union, positions[start : start + tf.shape(keys, out_type=tf.int32)[0]]))
        return out

    def _longest(self, n):
        """The largest of the workers' scalars `n` (one collective)."""
        return tf.reduce_max(self._gather(n[None]))

    def rows_for_many(self, lookups):
        # The unions of the parts' keys (_unions), then one all-reduce of
        # every part's rows: the same three collectives for any number of
        # Variables.
        out, rows = [], []
        for (union, mine), p in zip(self._unions([p.keys for p in lookups]), lookups):
            # The owner reads its keys; zeros elsewhere make the sum exact.
            owned = tf.cast(tf.where(self.owned(union, p.placement))[:, 0], tf.int32)
            found = p.find(tf.gather(union, owned))
            shape = tf.stack([tf.size(union), found.shape[-1]])
            # The union's length, not the owned keys' (known in eager mode).
            rows.append(tf.ensure_shape(tf.scatter_nd(owned[:, None], found, shape), [None, found.shape[-1]]))
            out.append((union, mine))
        return [(union, summed, mine) for (union, mine), summed in zip(out, self._sum_many(rows))]

    def sum_everywhere(self, parts):
        # The unions of the parts' keys (_unions), then one all-reduce of
        # every part's values placed in its union.  Gathering every
        # worker's values instead (keys.sum_gathered, as Horovod's exchange
        # does) moved 38% fewer bytes in the DLRM demo's syncs, and took as
        # long on loopback (docs/benchmarks.md).
        unions = self._unions([keys for keys, _ in parts])
        sums = [tf.math.unsorted_segment_sum(v, mine, tf.size(union)) for (union, mine), (_, v) in zip(unions, parts)]
        return [(union, summed) for (union, _), summed in zip(unions, self._sum_many(sums))]

    def owner_gradients_many(self, parts):
        # Each buffer is the same on every worker: sum per buffer row, then
        # all-reduce every part's sums at once, then sum per key.
        sums = [tf.math.unsorted_segment_sum(p.values, p.indices, tf.shape(p.buffer_keys)[0]) for p in parts]
        out = []
        for p, summed_rows in zip(parts, self._sum_many(sums)):
            keys, summed = exchange.sum_per_key(p.buffer_keys, summed_rows)
            mask = self.owned(keys, p.placement)
            out.append((tf.boolean_mask(keys, mask), tf.boolean_mask(summed, mask)))
        return out


class DatasetGatherExchange(exchange.Exchange):
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
                "workers share (table_creator=tfde.RedisTableCreator(...)), or read inside the training step"
            )
        if DatasetGatherExchange._sites >= self._MAX_SITES:
            raise ConfigError(
                f"more than {self._MAX_SITES} tf.data functions read tfde Variables with each worker's own tables "
                "in this process: each such read site takes a range of the strategy's collective keys. Read "
                "the same Variable in fewer Dataset.map functions, or use a store all workers share "
                "(table_creator=tfde.RedisTableCreator(...))"
            )
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
            # One run of the site at a time in this process, in the order of
            # its run numbers: a parallel map's runs would otherwise hold
            # several of the site's collectives in flight at once.
            self._one_at_a_time = tf.CriticalSection(name=f"tfde_tf_data_reads_{self._site}")

    def _instance_keys(self):
        """The three instance keys of this execution of the site."""
        k = tf.math.floormod(self._executions.assign_add(1, read_value=True) - 1, self._SITE_KEYS // 3)
        first = tf.cast(self._KEY_BASE + self._site * self._SITE_KEYS + 3 * k, tf.int32)
        return first, first + 1, first + 2

    def _collective(self, op, tensor, instance_key, **kwargs):
        with tf.device(self._device):
            return exchange.measured(
                lambda t: op(
                    input=t,
                    group_size=self.size,
                    group_key=self._group_key,
                    instance_key=instance_key,
                    ordering_token=[],
                    timeout_seconds=self._timeout,
                    **kwargs,
                ),
                tensor,
            )

    def rows_for(self, unique_keys, find, placement=exchange.ROWS):
        return self._one_at_a_time.execute(
            lambda: self._rows_for(unique_keys, find, placement), exclusive_resource_access=False
        )

    def rows_for_many(self, lookups):
        return [self.rows_for(p.keys, p.find, p.placement) for p in lookups]

    def _rows_for(self, unique_keys, find, placement):
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
        header = tf.pad(
            tf.stack([tf.constant(self._NONCE, tf.int64), count, tf.constant(self._variable_id, tf.int64)])[None],
            [[0, 0], [0, width - 3]],
        )
        block = tf.concat([header, tf.pad(encoded, [[0, most - count], [0, 0]])], 0)  # [1 + most, width]
        blocks = tf.reshape(self._collective(gather, block, blocks_key), [self.size, -1, width])
        ours = tf.equal(blocks[:, 0, 0], self._NONCE)
        checks = [
            tf.debugging.assert_equal(
                tf.math.count_nonzero(ours, dtype=tf.int32),
                1,
                message=("tfde: a tf.data read's all-gather did not hold exactly one block of this worker"),
            ),
            tf.debugging.assert_equal(
                blocks[:, 0, 2],
                tf.constant(self._variable_id, tf.int64),
                message=(
                    "tfde: the workers' tf.data reads that met in one collective read different Variables: the "
                    "tf.data functions that read tfde Variables were built in another order, or only on some "
                    "workers. Under MultiWorkerMirroredStrategy every worker builds them in the same order"
                ),
            ),
        ]
        with tf.control_dependencies(checks):
            rank = tf.cast(tf.argmax(tf.cast(ours, tf.int32)), tf.int32)
        counts = blocks[:, 0, 1]
        valid = tf.sequence_mask(counts, tf.shape(blocks, out_type=tf.int64)[1] - 1)
        every = tf.boolean_mask(blocks[:, 1:], valid)  # [sum(counts), width], in worker order
        if strings:
            every = strings_from_codes(every[:, :-1], every[:, -1])
        else:
            every = tf.cast(every[:, 0], unique_keys.dtype)
        union, index = tf.unique(every, out_idx=tf.int32)
        start = tf.cast(tf.reduce_sum(counts[:rank]), tf.int32)
        mine = index[start : start + tf.cast(count, tf.int32)]
        rows = find(union)
        rows = tf.where(tf.equal(placement.owners(union, self.size), rank)[:, None], rows, tf.zeros_like(rows))
        carrier = tf.float64 if rows.dtype == tf.float64 else tf.float32  # exact for every row dtype
        fingerprint = self._fingerprint(union)
        summed = self._collective(
            reduce,
            tf.concat([tf.reshape(tf.cast(rows, carrier), [-1]), tf.cast(fingerprint, carrier)], 0),
            rows_key,
            merge_op="Add",
            final_op="Id",
        )
        check = tf.debugging.assert_equal(
            tf.cast(summed[-self._FINGERPRINT :], tf.int64),
            fingerprint * self.size,
            message=(
                "tfde: the workers' tf.data reads that met in one collective disagree on the keys they read; "
                "see docs/lookups.md"
            ),
        )
        with tf.control_dependencies([check]):
            rows = tf.reshape(tf.cast(summed[: -self._FINGERPRINT], rows.dtype), tf.shape(rows))
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
        return tf.stack(
            [tf.bitwise.bitwise_and(tf.bitwise.right_shift(digest, 12 * i), 0xFFF) for i in range(cls._FINGERPRINT)]
        )


class TfDistributeEngine(exchange.Engine):
    """tf.distribute as seen by the core (tfde/exchange.py)."""

    def exchange(self):
        if not tf.distribute.has_strategy():
            return None
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync <= 1:  # cross-replica context, or one replica
            return None
        _check_one_replica_per_process(tf.distribute.get_strategy())
        return GatherExchange(ctx)

    def plain_reader(self, variable, in_tf_data):
        strategy = variable._job_strategy()
        if strategy is None or strategy.num_replicas_in_sync <= 1:
            return None
        if in_tf_data:
            reads = DatasetGatherExchange(strategy, variable._full_name)
            return lambda keys: variable._unpack(variable._find_everywhere_packed(keys, reads))
        if variable.shared_between_workers or not tf.executing_eagerly():
            return None  # graphs traced outside strategy.run read this worker's store

        def collective_read(keys):
            packed = strategy.run(variable._find_everywhere_packed, args=(keys,))
            return variable._unpack(strategy.experimental_local_results(packed)[0])

        return collective_read

    def workers(self, strategy):
        strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else strategy
        return 1 if strategy is None else strategy.num_replicas_in_sync

    def local_fit_logs(self, model, strategy):
        return FitLogs.install(model, strategy)

    def launched_workers(self):
        # TF_CONFIG's chief and workers (MultiWorkerMirroredStrategy's job; a
        # parameter-server cluster's chief saves alone, so it is left out).
        try:
            config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        except ValueError:
            return None
        cluster, task = config.get("cluster"), config.get("task")
        if not isinstance(cluster, dict) or not isinstance(task, dict) or "ps" in cluster:
            return None
        if task.get("type") not in ("chief", "worker"):
            return None
        return sum(len(cluster.get(k) or []) for k in ("chief", "worker")), "TF_CONFIG"

    def host_collectives(self, strategy):
        if tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
        if strategy is None or strategy.num_replicas_in_sync <= 1:
            return None
        if tf.distribute.has_strategy() and tf.distribute.get_replica_context() is not None:
            raise ConfigError(
                "restriction runs between training steps, not inside strategy.run; call it from the "
                "training loop (tfde.AutoRestrictor) or a Keras callback (RestrictCallback)"
            )
        if strategy not in _strategy_hosts:  # built once per strategy: tracing and a rank collective
            _strategy_hosts[strategy] = _strategy_host(strategy)
        return _strategy_hosts[strategy]


_strategy_hosts = {}


def _strategy_host(strategy) -> exchange.HostCollectives:
    """HostCollectives through strategy.run (the only way to reach the
    strategy's collectives from outside its replica context)."""

    @tf.function(reduce_retracing=True)
    def gather(t):
        # tf.identity places the input on the replica's device: the collective
        # refuses a tensor that has none ("destinations can not be empty").
        return strategy.run(lambda x: tf.distribute.get_replica_context().all_gather(tf.identity(x), axis=0), args=(t,))

    @tf.function
    def rank():
        return strategy.run(lambda: tf.identity(tf.distribute.get_replica_context().replica_id_in_sync_group))

    def in_scope(fn, *args):
        with strategy.scope():
            return strategy.experimental_local_results(fn(*args))[0]

    return exchange.HostCollectives(lambda t: in_scope(gather, t), int(in_scope(rank)), strategy.num_replicas_in_sync)


def _check_one_replica_per_process(strategy):
    devices = getattr(strategy.extended, "worker_devices", ())
    if len(devices) > 1:
        raise ConfigError(
            f"tfde trains with one replica per process, but {type(strategy).__name__} runs "
            f"{len(devices)} replicas here ({', '.join(devices)}); use MultiWorkerMirroredStrategy with one device "
            "per worker process (see docs/distributed.md, 'MultiWorkerMirroredStrategy')"
        )


exchange.register_engine(TfDistributeEngine())
