"""Which keys of a Variable changed since a step: for incremental exports
(tfde.saving.export_changes) that update a serving copy without a full dump.

Enabled per Variable with ``track_changes=True``.  The clock is the
optimizer's ``iterations``: a row written by the training step that starts at
iteration t is labelled t + 1 (the value of ``iterations`` after that step),
in a slot ``changes-step`` (removed with the row, saved with it).  A removed
key (restriction, TTL, ``remove``) gets a *tombstone* labelled with the
latest label the Variable has seen; writing the key again deletes its
tombstone.  So every key is in exactly one of: stored (with the label of its
last write), tombstoned (with the label of its removal), or neither.

``changes(since)`` returns the rows written with label > since and the keys
removed with label >= since (a removal at label == since may have happened
after an export taken at that step; removing an absent key from a serving
copy is harmless, missing an eviction is not).
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import tensorflow as tf

from tfde._defaults import CHUNK_ROWS


class ChangeLog:
    """Change labels and tombstones of one Variable (see the module docstring).

    Thread-safety: as the Variable (one training step at a time)."""

    def __init__(self, variable):
        self.variable = variable
        self.written = variable.slot("changes-step", -1.0, dim=1, value_dtype=tf.float64)
        with tf.init_scope():
            self.evicted = type(variable)(
                f"{variable.name}-evicted",
                key_dtype=variable.key_dtype,
                value_dtype=tf.float64,
                dim=1,
                initializer=-1.0,
                num_shards=variable.num_shards,
                table_creator=variable.table_creator,
                trainable=False,
            )
            self.clock = tf.Variable(
                tf.constant(0.0, tf.float64), trainable=False, name=f"{variable.name.replace('/', '_')}_changes_clock"
            )

    def step_values(self, keys, step) -> dict:
        """The labels of the rows a training step (starting at iteration
        `step`) writes: joined to the step's write of those rows
        (tfde.Variable._write_step), so a row is never stored unlabelled."""
        return {self.written: tf.fill([tf.size(keys), 1], tf.cast(step, tf.float64) + 1.0)}

    def on_apply(self, keys, step) -> Optional[tf.Operation]:
        """After the step's write: deletes the written keys' tombstones and
        advances the clock.  The tombstones live in a Variable of their own
        (they outlive the rows), so they cannot join that write: when this
        removal fails after the write (the step then reports the error), a
        key is stored and tombstoned until a later step writes it again."""
        label = tf.cast(step, tf.float64) + 1.0
        advance = self.clock.assign(tf.maximum(self.clock, label))
        if self.variable._local is not None:
            # Between the syncs of semi-synchronous training the labels are
            # written to this worker's local tables; the tombstones go when
            # the sync writes the rows (after_sync).
            return advance
        return tf.group(self.evicted.remove(keys), advance)

    def after_sync(self, keys) -> Optional[tf.Operation]:
        """Deletes the tombstones of `keys`, whose rows a sync of
        semi-synchronous training has just written (tfde/semi_sync.py)."""
        return self.evicted.remove(keys)

    def on_remove(self, keys) -> Optional[tf.Operation]:
        """Tombstones the stored ones of `keys` (called before removing them)."""
        _, stored = self.variable._find(keys)
        gone = tf.boolean_mask(keys, stored)
        return self.evicted.upsert(gone, tf.fill([tf.size(gone), 1], self.clock.read_value()))

    def after_restore(self) -> None:
        self.clock.assign(self.evicted.max_value(self.written.max_value(0.0)))

    def changed(self, since: int) -> Iterator[Tuple[tf.Tensor, tf.Tensor]]:
        """(keys, rows) chunks written after step `since` (eager)."""
        for keys, labels in self.written.export(CHUNK_ROWS):
            keys = tf.boolean_mask(keys, labels[:, 0] > float(since))
            if int(tf.size(keys)):
                yield keys, self.variable._find(keys)[0]

    def removed(self, since: int) -> Iterator[tf.Tensor]:
        """Chunks of keys removed at or after step `since` (eager)."""
        for keys, labels in self.evicted.export(CHUNK_ROWS):
            keys = tf.boolean_mask(keys, labels[:, 0] >= float(since))
            if int(tf.size(keys)):
                yield keys

    def forget(self, before: int) -> int:
        """Drops tombstones older than step `before` (once every serving copy
        has applied them); returns how many."""
        dropped = 0
        for keys, labels in list(self.evicted.export(CHUNK_ROWS)):
            old = tf.boolean_mask(keys, labels[:, 0] < float(before))
            dropped += int(self.evicted.remove(old))
        return dropped
