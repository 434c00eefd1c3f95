"""The all-to-all routing of tfde's exchange, for engines with an
all-to-all collective (Horovod: tfde/distributed/horovod.py).

Ids go to their owners and rows come back through all-to-all; each worker's
step buffer holds only its own keys; gradients go back to the owners the
same way and are summed there.  Less traffic than gathering
(tfde/distributed/tf_distribute.py) when workers are many.
"""

from __future__ import annotations

import tensorflow as tf

from tfde import exchange
from tfde.distributed.keys import carrier_dtype, pack_keys, sum_gathered
from tfde.errors import ConfigError


class AllToAllExchange(exchange.Exchange):
    """The routing for engines with an all-to-all collective (Horovod).

    alltoall(tensor, splits) -> (received, received_splits) sends
    tensor[sum(splits[:w]) : sum(splits[:w+1])] to worker w;
    max_over_workers(scalar) -> scalar.  gradient_scale: the factor for
    summed gradients (1/size where the engine's convention is to average).
    average(list of tensors) -> each averaged over the workers (None: this
    exchange cannot average, and semi-synchronous training refuses it)."""

    def __init__(self, rank, size, alltoall, max_over_workers, gradient_scale=1.0, all_gather=None, average=None):
        self.rank, self.size = rank, size
        self._alltoall = lambda t, splits: exchange.measured(lambda x: alltoall(x, splits), t)
        self._max = lambda t: exchange.measured(max_over_workers, t)
        self._scale = gradient_scale
        self.all_gather = all_gather  # (tensor) -> concatenation over workers, for HostCollectives
        self._average = average

    def gradient_scale(self, optimizer) -> float:
        return self._scale

    def local_step_scale(self) -> float:
        # The exact step applies scale * (sum over workers); a local step
        # applies this worker's share of it, times size.
        return self._scale * self.size

    def average(self, tensors):
        if self._average is None:
            raise ConfigError(f"{type(self).__name__} was made without average=: it cannot average dense weights")
        # One collective of them all, flattened into one tensor (measured
        # like the exchange's own).
        tensors = list(tensors)
        carrier = carrier_dtype([t.dtype for t in tensors])
        flats = [tf.reshape(tf.cast(t, carrier), [-1]) for t in tensors]
        sizes = [tf.size(f) for f in flats]
        mean = exchange.measured(lambda t: self._average([t])[0], tf.concat(flats, 0))
        pieces = tf.split(mean, tf.stack(sizes), num=len(tensors))
        return [tf.cast(tf.reshape(p, tf.shape(t)), t.dtype) for p, t in zip(pieces, tensors)]

    def _route(self, parts):
        """Where the entries of several Variables go: parts is a list of
        (keys [n_i], placement).  Returns a _Route over their concatenation
        sorted by owner (stable)."""
        own = tf.concat([placement.owners(keys, self.size) for keys, placement in parts], 0)
        counts = [tf.shape(keys, out_type=tf.int32)[0] for keys, _ in parts]
        part = tf.repeat(tf.range(len(parts)), tf.stack(counts))
        within = tf.concat([tf.range(n) for n in counts], 0)  # position in its own part
        order = tf.argsort(own, stable=True)
        splits = tf.math.bincount(own, minlength=self.size, maxlength=self.size, dtype=tf.int32)
        return _Route(order, splits, tf.gather(part, order), tf.gather(within, order), tf.gather(own, order), counts)

    def _send_keys(self, keys_list, route):
        """Every part's keys, in route order, to their owners.  Returns
        (received packed keys, their part [r], unpack, received splits);
        the part travels as a column beside the keys when there are
        several parts."""
        packed, unpack = pack_keys(keys_list, self._max, two_d=len(keys_list) > 1)
        sent = tf.gather(packed, route.order)
        if len(keys_list) > 1:
            sent = tf.concat([tf.cast(route.part, tf.int64)[:, None], sent], 1)
        received, received_splits = self._alltoall(sent, route.splits)
        if len(keys_list) == 1:
            return received, tf.zeros(tf.shape(received)[:1], tf.int32), unpack, received_splits
        return received[:, 1:], tf.cast(received[:, 0], tf.int32), unpack, received_splits

    def _send_rows(self, rows_list, part, splits, dims):
        """Rows of every part ([n_i, dims[i]] each) to other workers in one
        flat all-to-all.  The entries to send lie in the order whose part
        is `part` [n] (the rows of part i are its entries in that order);
        `splits` [size]: how many entries go to each worker.  Returns the
        flat values received, entry after entry (_take_rows)."""
        if len(rows_list) == 1:  # one part: the rows as they are
            return self._alltoall(rows_list[0], splits)[0]
        carrier = carrier_dtype([r.dtype for r in rows_list])
        entry_dims = tf.gather(tf.constant(dims, tf.int32), part)
        offsets = tf.cumsum(entry_dims, exclusive=True)
        positions = tf.dynamic_partition(tf.range(tf.size(part)), part, len(rows_list))
        index = [tf.reshape(tf.gather(offsets, pos)[:, None] + tf.range(d), [-1]) for pos, d in zip(positions, dims)]
        flat = tf.dynamic_stitch(index, [tf.reshape(tf.cast(r, carrier), [-1]) for r in rows_list])
        owner_of = tf.repeat(tf.range(self.size), splits)
        element_splits = tf.math.unsorted_segment_sum(entry_dims, owner_of, self.size)
        received, _ = self._alltoall(flat, element_splits)
        return received

    def _take_rows(self, flat, part, dims, dtypes):
        """The rows of each part out of flat values whose entries (each
        entry's part: `part`) lie one after the other."""
        if len(dtypes) == 1:
            return [tf.range(tf.shape(flat)[0])], [flat]
        offsets = tf.cumsum(tf.gather(tf.constant(dims, tf.int32), part), exclusive=True)
        positions = tf.dynamic_partition(tf.range(tf.size(part)), part, len(dtypes))
        rows = []
        for pos, d, dtype in zip(positions, dims, dtypes):
            taken = tf.gather(flat, tf.gather(offsets, pos)[:, None] + tf.range(d))
            rows.append(tf.cast(tf.reshape(taken, [-1, d]), dtype))
        return positions, rows

    def rows_for_many(self, lookups):
        # One all-to-all of every part's keys (string keys: one collective
        # more, for their longest length), one of every part's rows.
        route = self._route([(p.keys, p.placement) for p in lookups])
        received, received_part, unpack, received_splits = self._send_keys([p.keys for p in lookups], route)
        asked = tf.dynamic_partition(received, received_part, len(lookups))
        found = [p.find(unpack(asked[i], i)) for i, p in enumerate(lookups)]
        dims = [_width(rows) for rows in found]
        back = self._send_rows(found, received_part, received_splits, dims)
        positions, rows = self._take_rows(back, route.part, dims, [r.dtype for r in found])
        out = []
        for i, p in enumerate(lookups):
            # Entries of part i came back in route order: put them in key order.
            within = tf.gather(route.within, positions[i])
            shape = tf.stack([route.counts[i], dims[i]])
            out.append((p.keys, tf.scatter_nd(within[:, None], rows[i], shape), tf.range(route.counts[i])))
        return out

    def owner_gradients_many(self, parts):
        summed = [exchange.sum_per_key(tf.gather(p.buffer_keys, p.indices), p.values) for p in parts]
        route = self._route([(keys, p.placement) for (keys, _), p in zip(summed, parts)])
        dims = [_width(grads) for _, grads in summed]
        received, received_part, unpack, _ = self._send_keys([keys for keys, _ in summed], route)
        by_part = tf.dynamic_partition(tf.range(tf.size(route.part)), route.part, len(parts))
        sent = [tf.gather(grads, tf.gather(route.within, pos)) for (_, grads), pos in zip(summed, by_part)]
        flat = self._send_rows(sent, route.part, route.splits, dims)
        positions, grads = self._take_rows(flat, received_part, dims, [g.dtype for _, g in summed])
        keys = tf.dynamic_partition(received, received_part, len(parts))
        return [exchange.sum_per_key(unpack(keys[i], i), grads[i]) for i in range(len(parts))]

    def sum_everywhere(self, parts):
        # Every worker's keys and values gathered on every worker and
        # summed there: three all-gathers for all the parts, and a max more
        # with string keys (keys.sum_gathered).
        if self.all_gather is None:
            raise ConfigError(f"{type(self).__name__} was made without all_gather=: it cannot sum over every worker")

        def gather(t):
            return exchange.measured(self.all_gather, t)

        return sum_gathered(parts, gather, self._max, self.size)


def _width(rows) -> int:
    """The static row width of rows [n, d] (every Variable's rows have one)."""
    width = rows.shape[-1]
    if width is None:
        raise ValueError("tfde: the all-to-all exchange needs rows of a static width")
    return int(width)


class _Route:
    """Entries of several parts sorted by owner: order (into the parts'
    concatenation), splits [size] (entries per owner), and per sorted entry
    its part, its position in its part and its owner; counts: entries per
    part."""

    def __init__(self, order, splits, part, within, owner, counts):
        self.order, self.splits, self.part, self.within, self.owner, self.counts = (
            order,
            splits,
            part,
            within,
            owner,
            counts,
        )
