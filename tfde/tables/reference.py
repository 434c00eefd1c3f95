"""The reference table: a plain Python dict, the executable spec of Table.

Eager only and slow; the test suite runs every backend against it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfde.initializers import InitSpec, init_rows_reference
from tfde.tables.base import Table, TableCreator, as_deltas, as_keys, as_rows, check_dtypes, register_creator


def _py_key(k):
    return k if isinstance(k, bytes) else int(k)


class ReferenceTable(Table):
    """dict[key] -> numpy row.  Not thread-safe; eager mode only."""

    def __init__(self, name, key_dtype, value_dtype, dim):
        self.key_dtype, self.value_dtype, self.dim = check_dtypes(key_dtype, value_dtype, dim)
        self.name = name
        self.rows: dict = {}

    def _keys(self, keys):
        return [_py_key(k) for k in as_keys(keys, self.key_dtype, self.name).numpy()]

    def _missing_rows(self, missing, keys):
        if isinstance(missing, InitSpec):
            return init_rows_reference(keys, missing, self.dim)
        d = as_rows(missing, self.value_dtype, self.dim, self.name, "defaults").numpy()
        return np.broadcast_to(d, (len(keys), self.dim)) if d.shape[0] == 1 else d

    def find(self, keys, missing):
        ks = self._keys(keys)
        out = np.zeros((len(ks), self.dim), self.value_dtype.as_numpy_dtype)
        exists = np.zeros(len(ks), bool)
        miss = [i for i, k in enumerate(ks) if k not in self.rows]
        if miss:
            if isinstance(missing, InitSpec):
                out[miss] = self._missing_rows(missing, [ks[i] for i in miss])
            else:
                out[miss] = self._missing_rows(missing, ks)[miss]
        for i, k in enumerate(ks):
            if k in self.rows:
                out[i] = self.rows[k]
                exists[i] = True
        return tf.constant(out), tf.constant(exists)

    def insert(self, keys, values):
        ks = self._keys(keys)
        vs = as_rows(values, self.value_dtype, self.dim, self.name).numpy()
        if vs.shape[0] != len(ks):
            raise ValueError(f"{len(ks)} keys but {vs.shape[0]} rows")
        for k, v in zip(ks, vs):
            self.rows[k] = v.copy()

    def accum(self, keys, deltas, missing):
        ks = self._keys(keys)
        ds = as_deltas(deltas, self.value_dtype, self.dim, self.name).numpy()
        if ds.shape[0] != len(ks):
            raise ValueError(f"{len(ks)} keys but {ds.shape[0]} deltas")
        stored = self.value_dtype.as_numpy_dtype
        # The sum in the wider of the rows' compute type and the deltas' type,
        # rounded to the table's dtype; a float64 sum of a float16 or bfloat16
        # row goes through float32, as TensorFlow's and the native ops'
        # conversions go.
        acc = np.float64 if np.float64 in (stored, ds.dtype) else np.float32
        half = self.value_dtype in (tf.float16, tf.bfloat16)
        init = self._missing_rows(missing, ks)
        for i, (k, d) in enumerate(zip(ks, ds)):
            base = self.rows.get(k, init[i].astype(stored))
            total = base.astype(acc) + d.astype(acc)
            self.rows[k] = (total.astype(np.float32) if half else total).astype(stored)

    def remove(self, keys):
        n = 0
        for k in self._keys(keys):
            n += self.rows.pop(k, None) is not None
        return tf.constant(n, tf.int64)

    def clear(self):
        self.rows.clear()

    def size(self):
        return tf.constant(len(self.rows), tf.int64)

    def memory_bytes(self):
        """The rows' bytes (the dict and its keys not counted)."""
        return tf.constant(sum(row.nbytes for row in self.rows.values()), tf.int64)

    def export_chunk(self, cursor, max_rows):
        items = sorted(self.rows.items())
        cursor, max_rows = int(cursor), int(max_rows)
        chunk = items[cursor : cursor + max_rows]
        nxt = cursor + len(chunk) if cursor + len(chunk) < len(items) else -1
        keys = tf.constant([k for k, _ in chunk], dtype=self.key_dtype) if chunk else tf.zeros([0], self.key_dtype)
        vals = (
            tf.constant(np.stack([v for _, v in chunk]), dtype=self.value_dtype)
            if chunk
            else tf.zeros([0, self.dim], self.value_dtype)
        )
        return keys, vals, tf.constant(nxt, tf.int64)


@register_creator
@dataclasses.dataclass(frozen=True)
class ReferenceTableCreator(TableCreator):
    """Creates ReferenceTables (tests and executable spec only)."""

    def create(self, name, key_dtype, value_dtype, dim):
        return ReferenceTable(name, key_dtype, value_dtype, dim)
