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
from tfde.distributed.keys import transport_keys


class AllToAllExchange(exchange.Exchange):
    """The routing for engines with an all-to-all collective (Horovod).

    alltoall(tensor, splits) -> (received, received_splits) sends
    tensor[sum(splits[:w]) : sum(splits[:w+1])] to worker w;
    max_over_workers(scalar) -> scalar.  gradient_scale: the factor for
    summed gradients (1/size where the engine's convention is to average)."""

    def __init__(self, rank, size, alltoall, max_over_workers, gradient_scale=1.0, all_gather=None):
        self.rank, self.size = rank, size
        self._alltoall = lambda t, splits: exchange.measured(lambda x: alltoall(x, splits), t)
        self._max = lambda t: exchange.measured(max_over_workers, t)
        self._scale = gradient_scale
        self.all_gather = all_gather  # (tensor) -> concatenation over workers, for HostCollectives

    def gradient_scale(self, optimizer) -> float:
        return self._scale

    def _route(self, keys):
        """(order sorting keys by owner, splits [size])."""
        own = exchange.owner(keys, self.size)
        order = tf.argsort(own, stable=True)
        return order, tf.math.bincount(own, minlength=self.size, maxlength=self.size, dtype=tf.int32)

    def _send_keys(self, keys, splits):
        """(keys received from every worker, received splits)."""
        received_splits = []

        def move(t):
            out, rsplits = self._alltoall(t, splits)
            received_splits.append(rsplits)
            return out

        return transport_keys(keys, move, self._max), received_splits[0]

    def rows_for(self, unique_keys, find):
        order, splits = self._route(unique_keys)
        sent = tf.gather(unique_keys, order)
        received, received_splits = self._send_keys(sent, splits)
        rows, _ = self._alltoall(find(received), received_splits)  # back to the askers, in the order sent
        rows = tf.scatter_nd(order[:, None], rows, tf.shape(rows, out_type=tf.int32))
        return unique_keys, rows, tf.range(tf.size(unique_keys))

    def owner_gradients(self, buffer_keys, indices, values):
        keys, summed = exchange.sum_per_key(tf.gather(buffer_keys, indices), values)
        order, splits = self._route(keys)
        received, _ = self._send_keys(tf.gather(keys, order), splits)
        received_grads, _ = self._alltoall(tf.gather(summed, order), splits)
        return exchange.sum_per_key(received, received_grads)
