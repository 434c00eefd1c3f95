"""A tfde Variable's state in a Keras weights store (model.save to .keras,
save_weights to .weights.h5, in Keras 3 and tf-keras): the same chunk
streams and meta as checkpoints (tfde/saving/format.py), as store entries

    tfde.meta                 uint8 [n]   the VariableMeta JSON
    <stream>.keys.<i>         [n] int keys, or for string keys
    <stream>.keybytes.<i>     uint8 [total] + <stream>.keylens.<i> int64 [n]
    <stream>.rows.<i>         [n, dim]

checked on load against the CRC32 of every chunk recorded in the meta.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfde.errors import CheckpointError
from tfde.saving import format as fmt

META = "tfde.meta"


class StoreWriter(fmt.ChunkWriter):
    base = "_tfde/layer"  # the name of its streams in an external bundle (Redis table_store_mode 1)

    def __init__(self, store):
        self.store = store

    def write(self, stream, i, keys, rows):
        k = keys.numpy()
        if k.dtype == object:
            self.store[f"{stream}.keylens.{i}"] = np.array([len(x) for x in k], np.int64)
            self.store[f"{stream}.keybytes.{i}"] = np.frombuffer(b"".join(k), np.uint8)
        else:
            self.store[f"{stream}.keys.{i}"] = k
        self.store[f"{stream}.rows.{i}"] = rows.numpy()

    def finish(self, meta):
        self.store[META] = np.frombuffer(meta.to_json().encode(), np.uint8)


class StoreReader(fmt.ChunkReader):
    base = StoreWriter.base

    def __init__(self, store, where: str):
        self.store, self.where = store, where

    def meta(self):
        if META not in self.store:
            return None
        return fmt.VariableMeta.from_json(bytes(np.asarray(self.store[META], np.uint8)).decode(), self.where)

    def _get(self, name):
        try:
            return np.asarray(self.store[name])
        except KeyError:
            raise CheckpointError(
                f"{self.where}: entry {name!r} is missing; the file is incomplete or belongs to another model"
            ) from None

    def read(self, stream, i, key_dtype, value_dtype):
        if key_dtype == tf.string:
            lens = self._get(f"{stream}.keylens.{i}").astype(np.int64)
            raw = self._get(f"{stream}.keybytes.{i}").tobytes()
            if int(lens.sum()) != len(raw):
                raise CheckpointError(
                    f"{self.where}: chunk {i} of {stream!r} has {len(raw)} key bytes, its "
                    f"lengths say {int(lens.sum())}; the file is corrupted"
                )
            ends = np.cumsum(lens)
            keys = tf.constant(np.array([raw[e - n : e] for n, e in zip(lens, ends)], dtype=object), tf.string)
        else:
            keys = tf.constant(self._get(f"{stream}.keys.{i}"), key_dtype)
        rows = self._get(f"{stream}.rows.{i}")
        want = np.dtype(value_dtype.as_numpy_dtype)
        if rows.dtype.kind == "V":
            # tf-keras's h5 store keeps a bfloat16 array as opaque records
            # with no dtype: their bytes are the rows, in the meta's dtype.
            if rows.dtype.itemsize != want.itemsize:
                raise CheckpointError(
                    f"{self.where}: chunk {i} of {stream!r} holds {rows.dtype.itemsize}-byte values without a "
                    f"dtype; the table's {value_dtype.name} needs {want.itemsize} bytes: the file is corrupted"
                )
            rows = rows.view(want)
        return keys, tf.constant(rows, value_dtype)
