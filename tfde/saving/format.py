"""How tfde writes a Variable's state into TensorFlow checkpoint bundles.

A Variable's persistent state is a set of *streams*, one per table family:
``rows`` (the embedding rows), ``slot:<name>`` (optimizer slots and policy
state, e.g. ``slot:m``, ``slot:policy-freq``) and ``admission`` (the counts of
an admission filter).  A stream is written in chunks of at most
`chunk_rows(dim, dtype)` rows, each chunk as two tensors of a TF V2 bundle:

    <base>/<stream>/keys/<i:06d>   [n] key dtype
    <base>/<stream>/rows/<i:06d>   [n, dim] value dtype

and the Variable's metadata as one string tensor ``<base>/.tfde`` (JSON, see
`VariableMeta`).  `<base>` is ``_tfde/<object path>``.  Bundles carry
CRC32C checksums of every tensor and a format version of their own; the meta
carries tfde's FORMAT_VERSION.  Any TF program can list and read them
(tf.train.list_variables / load_checkpoint).

Each chunk is its own SaveV2 call (so saving needs memory for one chunk, not
for the table); TensorFlow merges the per-chunk bundles into the checkpoint
(MergeV2Checkpoints renames the data files, it does not copy them).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tfde.errors import CheckpointError

FORMAT_VERSION = 1
# A chunk holds at most this many bytes of rows (plus its keys): 64 MiB keeps
# the save's memory bounded and the number of data files of a 10M-row dim-64
# table (2.4 GiB) near 40.
CHUNK_BYTES = 64 << 20


def chunk_rows(dim: int, dtype: tf.DType) -> int:
    return max(1, CHUNK_BYTES // (dim * dtype.size + 8))


@dataclasses.dataclass
class StreamMeta:
    """One stream: its table family's shape and what was written."""

    dim: int
    value_dtype: str
    initial: Optional[float]  # what a missing key of a slot reads (None: rows)
    chunks: int = 0
    rows: int = 0
    crc32: List[int] = dataclasses.field(default_factory=list)  # per chunk, of its keys' and rows' bytes


@dataclasses.dataclass
class VariableMeta:
    """What a reader needs before touching a chunk.

    worker/workers: which worker of how many wrote this bundle, and whether
    its rows are that worker's shard only (`sharded`: local tables of a
    distributed job) or whole.  A checkpoint written by several workers is
    only complete with every worker's bundle (tfde.saving.CheckpointManager)."""

    variable: str
    key_dtype: str
    streams: Dict[str, StreamMeta]
    worker: int = 0
    workers: int = 1
    sharded: bool = False
    external: Optional[str] = None  # bundle prefix holding the streams, when not this file
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> "VariableMeta":
        try:
            raw = json.loads(text)
            version = raw.get("format")
            if version != FORMAT_VERSION:
                raise CheckpointError(
                    f"{where} was written in tfde checkpoint format {version}, this tfde reads format "
                    f"{FORMAT_VERSION}; restore it with the tfde version that wrote it and re-save"
                )
            raw["streams"] = {k: StreamMeta(**v) for k, v in raw["streams"].items()}
            return cls(**raw)
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: the tfde metadata is unreadable ({e}); the file is corrupted") from None


def base_name(object_path: str) -> str:
    return f"_tfde/{object_path}"


def tensor_name(base: str, stream: str, part: str, i: int) -> str:
    return f"{base}/{stream}/{part}/{i:06d}"


def _first_line(e) -> str:
    return str(getattr(e, "message", e)).strip().splitlines()[0]


def _key_bytes(keys: np.ndarray):
    if keys.dtype == object:  # string keys: lengths, then the bytes
        return np.array([len(k) for k in keys], np.int64).tobytes() + b"".join(keys)
    return memoryview(np.ascontiguousarray(keys)).cast("B")


def chunk_crc(keys: np.ndarray, rows: np.ndarray) -> int:
    """CRC32 (zlib) of a chunk's key bytes followed by its row bytes (read in
    place: no copy of the chunk)."""
    rows = np.ascontiguousarray(rows)
    if rows.dtype.kind == "V" or rows.dtype.name == "bfloat16":  # not a buffer-protocol format
        rows = rows.view(np.uint8)
    return zlib.crc32(memoryview(rows).cast("B"), zlib.crc32(_key_bytes(keys)))


class ChunkWriter:
    """Where save_variable puts a Variable's chunks and meta."""

    # Whether the meta must carry a CRC32 per chunk: False where the file
    # format checksums every tensor itself (TF bundles: CRC32C, verified on
    # every read).
    wants_crc = True
    base = ""  # the Variable's name inside the file

    def write(self, stream: str, i: int, keys: tf.Tensor, rows: tf.Tensor) -> None:
        raise NotImplementedError

    def finish(self, meta: VariableMeta) -> None:
        raise NotImplementedError


class ChunkReader:
    """Where restore_variable reads them; `where` names the file in errors,
    `base` the Variable's name inside it."""

    where: str
    base: str = ""

    def meta(self) -> Optional[VariableMeta]:
        raise NotImplementedError

    def read(self, stream: str, i: int, key_dtype: tf.DType, value_dtype: tf.DType) -> Tuple[tf.Tensor, tf.Tensor]:
        raise NotImplementedError


class BundleWriter(ChunkWriter):
    """Each chunk, and the meta, as its own V2 bundle at next_prefix();
    `prefixes` lists them for MergeV2Checkpoints."""

    wants_crc = False

    def __init__(self, base: str, next_prefix):
        self.base, self._next, self.prefixes = base, next_prefix, []

    def _save(self, tensors: Dict[str, tf.Tensor]) -> None:
        prefix = self._next()
        names = sorted(tensors)
        tf.raw_ops.SaveV2(
            prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=[tensors[n] for n in names]
        )
        self.prefixes.append(tf.constant(prefix))

    def write(self, stream, i, keys, rows):
        self._save({tensor_name(self.base, stream, "keys", i): keys, tensor_name(self.base, stream, "rows", i): rows})

    def finish(self, meta):
        self._save({f"{self.base}/.tfde": tf.constant(meta.to_json())})


class BundleReader(ChunkReader):
    """Reads a (merged) checkpoint bundle; TF's read errors (missing,
    truncated, checksum mismatch) become CheckpointErrors naming the file."""

    def __init__(self, prefix: str, base: str, where: Optional[str] = None):
        self.prefix, self.base, self.where = prefix, base, where or prefix

    def _tensor(self, name: str, dtype: tf.DType, missing_ok: bool = False):
        try:
            return tf.raw_ops.RestoreV2(prefix=self.prefix, tensor_names=[name], shape_and_slices=[""], dtypes=[dtype])[
                0
            ]
        except tf.errors.NotFoundError as e:
            if missing_ok:
                return None
            raise CheckpointError(
                f"{self.where}: tensor {name!r} is missing ({_first_line(e)}); the checkpoint "
                "is incomplete or belongs to another model"
            ) from None
        except (
            tf.errors.DataLossError,
            tf.errors.OutOfRangeError,
            tf.errors.InvalidArgumentError,
            tf.errors.FailedPreconditionError,
        ) as e:
            raise CheckpointError(
                f"{self.where}: reading {name!r} failed: {_first_line(e)}. The file is "
                "truncated or corrupted; restore an earlier checkpoint"
            ) from None

    def meta(self):
        raw = self._tensor(f"{self.base}/.tfde", tf.string, missing_ok=True)
        return None if raw is None else VariableMeta.from_json(raw.numpy().decode(), self.where)

    def read(self, stream, i, key_dtype, value_dtype):
        return (
            self._tensor(tensor_name(self.base, stream, "keys", i), key_dtype),
            self._tensor(tensor_name(self.base, stream, "rows", i), value_dtype),
        )


def write_stream(writer: ChunkWriter, stream: str, sm: StreamMeta, chunks) -> None:
    """Writes the non-empty (keys, rows) `chunks` of one stream, counting
    them (and, where the writer wants it, their CRC32) into `sm`."""
    for keys, rows in chunks:
        n = int(tf.size(keys))
        if n == 0:
            continue
        writer.write(stream, sm.chunks, keys, rows)
        if writer.wants_crc:
            sm.crc32.append(chunk_crc(keys.numpy(), rows.numpy()))
        sm.chunks += 1
        sm.rows += n


def read_stream(
    reader: ChunkReader, stream: str, meta: VariableMeta, key_dtype: tf.DType, value_dtype: tf.DType
) -> Iterator[Tuple[tf.Tensor, tf.Tensor]]:
    """(keys, rows) chunks of one stream, each checked against the meta
    (shape, CRC32, row count) before it is handed out."""
    sm = meta.streams[stream]
    total = 0
    for i in range(sm.chunks):
        keys, rows = reader.read(stream, i, key_dtype, value_dtype)
        if rows.shape.rank != 2 or rows.shape[1] != sm.dim or rows.shape[0] != keys.shape[0]:
            raise CheckpointError(
                f"{reader.where}: chunk {i} of {stream!r} has {keys.shape[0]} keys and rows of "
                f"shape {rows.shape}, expected [{keys.shape[0]}, {sm.dim}]; the file is corrupted"
            )
        if sm.crc32 and chunk_crc(keys.numpy(), rows.numpy()) != sm.crc32[i]:
            raise CheckpointError(
                f"{reader.where}: chunk {i} of {stream!r} of Variable {meta.variable!r} fails "
                "its CRC32 check; the file is corrupted, restore an earlier checkpoint"
            )
        total += int(keys.shape[0])
        yield keys, rows
    if total != sm.rows:
        raise CheckpointError(
            f"{reader.where}: stream {stream!r} holds {total} rows, its metadata says {sm.rows}; the file is corrupted"
        )
