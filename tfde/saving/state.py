"""Saving and restoring one Variable's state (rows, slots, policy and
admission state) as streams of chunks (tfde/saving/format.py).

Who writes what in a distributed job (tfde/exchange.py): every worker writes
the keys it owns: all of its local tables (sharded layout), or its share of a
shared store (Redis).  Restoring into a job of M workers, every worker reads
the chunks of every writer and keeps the keys it owns now, so a checkpoint of
N workers restores into M (tfde.saving.CheckpointManager gives it every
writer's bundle).
"""

from __future__ import annotations

import itertools
import os
import re
import uuid
from typing import Callable, Dict, Optional, Sequence, Tuple

import tensorflow as tf

from tfde import exchange
from tfde.errors import CheckpointError
from tfde.saving import format as fmt

_ADMISSION = "admission"
_EVICTED = "evicted"  # tombstones of the change log (tfde/changes.py)


def streams(var) -> Dict[str, "object"]:
    """stream name -> the Variable holding it (rows, each slot, the admission
    filter's counts)."""
    out = {"rows": var}
    for name, slot in var._slots.items():
        out[f"slot:{name}"] = slot
    counts = getattr(var.admission_filter, "counts", None)
    if counts is not None:
        out[_ADMISSION] = counts
    if var.changes is not None:
        out[_EVICTED] = var.changes.evicted
    return out


def worker_of(var) -> Tuple[int, int]:
    """(rank, size) of this process in the job that trains `var`; (0, 1) alone."""
    host = exchange.host_collectives(var._strategy)
    return (0, 1) if host is None else (host.rank, host.size)


def in_checkpoints(var) -> bool:
    """False when the store is the source of truth (Redis table_store_mode 2)."""
    return all(t.in_checkpoints for t in var.tables)


def files_dir(var) -> Optional[str]:
    """Where the rows go instead of the checkpoint (Redis table_store_mode 1:
    model_lib_abs_dir/model_tag_runtime), or None."""
    return var.tables[0].files_dir


def _owned(var, keys, rows, rank, size):
    if size <= 1:
        return keys, rows
    mine = tf.equal(var.placement.owners(keys, size), rank)
    return tf.boolean_mask(keys, mine), tf.boolean_mask(rows, mine)


def save_variable(var, writer: fmt.ChunkWriter) -> None:
    """Writes `var`'s streams in chunks to `writer`, then its meta.  With a
    files_dir, the streams go to a bundle of their own there (named in the
    meta as `external`, one per save, so every checkpoint keeps its dump)."""
    rank, size = worker_of(var)
    shared = var.tables[0].shared_between_workers
    meta = fmt.VariableMeta(
        var.name, var.key_dtype.name, {}, worker=rank, workers=size, sharded=size > 1 and not shared
    )
    meta_writer, external = writer, files_dir(var)
    if external is not None:
        os.makedirs(external, exist_ok=True)
        meta.external = os.path.join(external, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', var.name)}-{uuid.uuid4().hex}")
        writer = fmt.BundleWriter(writer.base, prefix_counter(f"{meta.external}_temp/part"))
    if in_checkpoints(var):
        for stream, v in streams(var).items():
            initial = None if stream == "rows" else float(v.initializer.p0)
            sm = meta.streams[stream] = fmt.StreamMeta(v.dim, v.value_dtype.name, initial)
            chunks = v.export(fmt.chunk_rows(v.dim, v.value_dtype))
            if shared:  # a shared store: each worker writes the keys it owns
                chunks = (_owned(var, keys, rows, rank, size) for keys, rows in chunks)
            fmt.write_stream(writer, stream, sm, chunks)
    if external is not None:
        writer.finish(meta)
        tf.raw_ops.MergeV2Checkpoints(
            checkpoint_prefixes=tf.stack(writer.prefixes), destination_prefix=meta.external, delete_old_dirs=True
        )
    meta_writer.finish(meta)


def _check_compatible(var, meta: fmt.VariableMeta, where: str) -> None:
    if meta.key_dtype != var.key_dtype.name:
        raise CheckpointError(
            f"{where}: Variable {meta.variable!r} was saved with {meta.key_dtype} keys, but "
            f"{var.name!r} has {var.key_dtype.name} keys; restore into a Variable created with "
            f"key_dtype={meta.key_dtype}"
        )
    rows = meta.streams.get("rows")
    if rows is not None and (rows.dim != var.dim or rows.value_dtype != var.value_dtype.name):
        raise CheckpointError(
            f"{where}: Variable {meta.variable!r} was saved with rows of dim {rows.dim} "
            f"({rows.value_dtype}), but {var.name!r} holds dim {var.dim} "
            f"({var.value_dtype.name}); create it with the saved dim and dtype"
        )


def check_compatible(var, readers: Sequence[fmt.ChunkReader]) -> None:
    """Raises CheckpointError when `var`'s keys, dim or dtype differ from
    what the checkpoint saved for it (its metadata only): run for every
    Variable of a restore before the first one changes."""
    for reader in readers:
        meta = reader.meta()
        if meta is not None:
            _check_compatible(var, meta, reader.where)


def _check_complete(metas: Sequence[Tuple[str, fmt.VariableMeta]], rank: int, size: int) -> None:
    """Refuses shards of local tables that miss some writer's part.  One
    shard is enough for the worker that wrote it, in a job of as many
    workers (each worker saved to a directory of its own: it owns the same
    keys again)."""
    sharded = [m for _, m in metas if m.sharded]
    if not sharded:
        return
    workers = sharded[0].workers
    have = sorted({m.worker for m in sharded})
    if have == [rank] and workers == size:
        return
    if have != list(range(workers)):
        where = metas[0][0]
        raise CheckpointError(
            f"{where} holds worker {', '.join(map(str, have))}'s shard of Variable {sharded[0].variable!r}, "
            f"written by {workers} workers with local tables; the other shards are in the other workers' "
            f"files. This is worker {rank} of {size}: a shard restores alone only into the worker that wrote it, "
            "in a job of as many workers. Restore with tfde.saving.CheckpointManager (or "
            "tfde.keras.callbacks.ModelCheckpoint) from the directory all workers saved to, which holds every "
            "worker's files, or from this worker's own directory when each worker saved to one"
        )


def restore_variable(var, readers: Sequence[fmt.ChunkReader]) -> None:
    """Replaces `var`'s state with what `readers` hold (one per writer of the
    checkpoint).  Every worker of a job calls it; each keeps the keys it owns
    now.

    A refused restore changes nothing (docs/saving.md, 'A refused restore changes nothing'): every chunk
    is read and checked first (checksum, shape, row counts; one chunk in
    memory at a time), and only when the whole checkpoint is known good are
    the tables cleared and filled from a second read.  (A store that fails
    during that second pass, e.g. a Redis server lost, can still be left
    part-filled; restore again once it is back.)"""
    metas = []
    for reader in readers:
        meta = reader.meta()
        if meta is not None:
            if meta.external:  # the rows are in a dump of their own (table_store_mode 1)
                if not os.path.exists(meta.external + ".index"):
                    raise CheckpointError(
                        f"{reader.where} keeps the rows of {meta.variable!r} in {meta.external}, "
                        "which is missing; it was deleted or model_lib_abs_dir moved"
                    )
                reader = fmt.BundleReader(meta.external, reader.base, where=meta.external)
            _check_compatible(var, meta, reader.where)
            metas.append((reader, reader.where, meta))
    if not metas:
        raise CheckpointError(
            f"{readers[0].where if readers else 'the checkpoint'}: no tfde state for Variable "
            f"{var.name!r}; the checkpoint belongs to another model"
        )
    rank, size = worker_of(var)
    _check_complete([(w, m) for _, w, m in metas], rank, size)
    if not in_checkpoints(var) or not any(m.streams for _, _, m in metas):
        return  # the store is the source of truth: nothing to restore
    shared = var.tables[0].shared_between_workers
    targets = streams(var)
    if shared and size > 1:
        # Every worker checks every file; all of them refuse, or none does
        # (one worker empties the shared store for all of them).
        host = exchange.host_collectives(var._strategy)
        error = _first_error(lambda: _validate(var, targets, metas))
        if host.total(int(error is not None)):
            raise error or CheckpointError(
                f"another worker refused to restore {var.name!r} (see its error); nothing was changed"
            )
        _create_slots(var, targets, metas)
        if rank == 0:
            _clear(targets.values())
        exchange.barrier(var._strategy)
    else:
        _validate(var, targets, metas)
        _create_slots(var, targets, metas)
        _clear(targets.values())
    try:
        for reader, _, meta in metas:
            for stream in sorted(meta.streams):
                target = targets.get(stream)
                if target is None:  # e.g. admission counts saved, no filter now: nothing to put them in
                    continue
                for keys, rows in fmt.read_stream(reader, stream, meta, target.key_dtype, target.value_dtype):
                    keys, rows = _owned(var, keys, rows, rank, size)
                    target.upsert(keys, rows)
    except CheckpointError as e:  # the files changed between the two passes
        raise CheckpointError(
            f"{e} (the file changed during the restore, which had already replaced "
            f"{var.name!r}'s tables: they are incomplete; restore again)"
        ) from None
    if shared and size > 1:
        exchange.barrier(var._strategy)
    for hook in (var.restrict_policy, var.changes):
        if hook is not None:
            hook.after_restore()


def _create_slots(var, targets, metas) -> None:
    """Adds to `targets` the slots the optimizer has not created yet in this
    process (before the clear: a shared store may hold their tables already,
    with keys the checkpoint does not have)."""
    for _, _, meta in metas:
        for stream, sm in meta.streams.items():
            if stream.startswith("slot:") and stream not in targets:
                targets[stream] = var.slot(
                    stream[len("slot:") :], sm.initial, dim=sm.dim, value_dtype=tf.as_dtype(sm.value_dtype)
                )


def _first_error(fn) -> Optional[Exception]:
    """What fn() raised, or None (so that every worker learns of it before
    raising, instead of leaving the others waiting at a barrier)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised by the caller
        return e
    return None


def _validate(var, targets, metas) -> None:
    """The first pass of restore_variable: raises CheckpointError unless
    every stream it would load fits its table and every chunk reads back
    intact.  Reads each chunk and drops it (memory: one chunk)."""
    for reader, where, meta in metas:
        for stream, sm in sorted(meta.streams.items()):
            target = targets.get(stream)
            if target is None and not stream.startswith("slot:"):
                continue  # not loaded (see restore_variable)
            if target is not None and (target.dim != sm.dim or target.value_dtype.name != sm.value_dtype):
                raise CheckpointError(
                    f"{where}: stream {stream!r} of Variable {meta.variable!r} holds rows of dim {sm.dim} "
                    f"({sm.value_dtype}), but {target.name!r} holds dim {target.dim} ({target.value_dtype.name}); "
                    "restore into a Variable made with the same optimizer, policy and admission filter"
                )
            try:
                value_dtype = tf.as_dtype(sm.value_dtype)
            except TypeError:
                raise CheckpointError(
                    f"{where}: stream {stream!r} has value dtype {sm.value_dtype!r}, which is "
                    "not a TensorFlow dtype; the file is corrupted"
                ) from None
            for _ in fmt.read_stream(reader, stream, meta, var.key_dtype, value_dtype):
                pass


def _clear(variables) -> None:
    for v in variables:
        for t in v.tables:
            t.clear()


def prefix_counter(root: str) -> Callable[[], str]:
    """next_prefix for save_variable: root-000000, root-000001, ..."""
    counter = itertools.count()
    return lambda: f"{root}-{next(counter):06d}"
