"""Semi-synchronous training: workers train apart for k steps, then sync.

docs/semi-sync.md describes the cycle and its rules (docs/design.md,
decision 11).  ``every=1`` is the exact synchronous training of every other
tfde program: nothing here runs.  With ``every=k > 1``, between two syncs
(the "local steps"):

* a worker reads the rows and optimizer slots of its batches' keys from
  tables of its own (`LocalTables`, in-process cuckoo tables): the first
  lookup of a key after a sync fetches its row and slots from the store
  (straight from Redis, or from the key's owner through the exchange) and
  keeps a copy of them as the key's "base";
* its optimizer updates those tables with its own gradients alone: no ids,
  rows or gradients cross workers, and its dense weights take its own
  gradients too (scaled by Exchange.local_step_scale, so that averaging
  the weights after one local SGD step gives the exact step).

A sync (every k steps, before every checkpoint save, at the end) runs on
every worker at once:

* each worker's deltas (local value minus base) of the keys whose row or
  slots it changed go to the store.  In a job, the exchange takes them to
  each key's owner: the rows' deltas summed over the workers (as an exact
  step sums their gradients), the slots' deltas averaged over the workers
  that changed the key (optimizer state such as Adam's moments are moving
  averages: a sum would over-count their decay, even below zero); the
  owner adds them to its table, or writes the key's new row and slots to
  a shared store, its only writer as in an exact step.  A process training
  alone (several may share a Redis store) adds its rows' deltas with the
  store's atomic accumulation, so concurrent pushes never lose an update,
  and writes its slots as they are (the last process to sync a key sets
  them);
* the local tables are emptied, so the next lookup of a key reads the
  store's row, which holds every worker's deltas;
* the dense weights are averaged over the workers (their optimizer state
  stays each worker's own).

A sync that fails detaches the local tables without pushing again (no
delta is ever counted twice); that worker's unsynced deltas are lost.

With replicate=True (tables sharded over the workers of a job), each worker
keeps two copies of every such table, made at start: its base (the store
as of the last sync) and its working copy (with its changes since), which
training reads and writes as it would a store.  At a sync every worker gets
the merged changes of every key and computes the new values as the owner
does (_Entry.sync_copy), so both copies equal the stores again.  A lookup
between syncs then runs no collective; a restriction or a restore makes the
copies anew (rewriting_stores).  With slots="local" as well, a sync
merges the rows and policy state only: each worker's optimizer slots stay
in its working copy across syncs (as its dense optimizer state does), and
the owner writes its own to the store.

Per-key state besides rows and optimizer slots merges by its own rule
(_Entry): a frequency policy's counts are summed like the rows,
timestamps and change labels keep the largest of the workers' values; a
restriction syncs first (Variable.restrict).  Keys an admission filter
has not admitted stay out of the local rows, so no sync stores them; a
CounterFilter's counts are summed like the rows (AdmissionFilter.
sync_counts), and a filter with other state is refused.  Checkpoint
saves and exports that read the stores between syncs sync first in a
process alone, and are refused in a job (before_export).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Optional, Sequence

import tensorflow as tf

from tfde import exchange as _exchange
from tfde import step_kernels
from tfde.errors import ConfigError
from tfde.initializers import InitSpec
from tfde.local import local_variable
from tfde.optimizer_rules import rule_for
from tfde.tables.base import int_arg
from tfde.tables.cuckoo import CuckooTableCreator

_ZERO = InitSpec("constant", 0.0, 0.0, 0)  # what a key missing from a local table reads (never used: see fill)
_ALL_ROWS = 2**62  # export_chunk's max_rows for "every row in one chunk"

_running: Optional["PeriodicSync"] = None  # the PeriodicSync whose local steps are on
# Counts the starts and stops of local steps; a step traced during local
# steps checks it when it runs, so a stale one (traced then, run after
# stop()) fails instead of training tables nobody syncs.
_GENERATION = []


def _generation():
    with tf.init_scope():
        if not _GENERATION:
            _GENERATION.append(local_variable(tf.constant(0, tf.int64), [], False, "tfde_local_steps"))
    return _GENERATION[0]


def sync_options(replicate, slots) -> tuple:
    """(replicate, slots), checked: PeriodicSync's options."""
    if not isinstance(replicate, bool):
        raise ConfigError(f"replicate must be True or False, got {replicate!r}")
    if slots not in SLOTS_RULES:
        raise ConfigError(f"slots must be one of {SLOTS_RULES}, got {slots!r}")
    if slots == "local" and not replicate:
        raise ConfigError(
            'slots="local" keeps each worker\'s optimizer slots in its copies of the tables, and needs them: '
            'pass replicate=True too (docs/semi-sync.md, "Optimizer slots kept per worker")'
        )
    return replicate, slots


def every_arg(every) -> int:
    """`every` (steps between syncs) as an int >= 1, or a ConfigError."""
    k = int_arg(every)
    if k is None or k < 1:
        raise ConfigError(f"every must be an int >= 1 (steps between syncs; 1 is exact training), got {every!r}")
    return k


def local_steps_on() -> bool:
    """Whether training takes local steps now (read while tracing a step)."""
    return _running is not None


class LocalTables:
    """A Variable's tables of this worker between syncs: `rows` (its local
    rows, which training reads and writes: Variable._train_tables) and
    `base` (the rows those keys had in the store when first fetched after
    the last sync).  Both hold exactly the keys fetched since the last sync
    (with copies, both hold the whole store: see `copy`).  Written by a
    training step's lookup (fill) and apply, and emptied by the sync; one
    step at a time."""

    def __init__(self, var, copy: bool = False):
        creator = CuckooTableCreator()
        self.var = var
        # Copies of the Variable's whole store (PeriodicSync(replicate=True)),
        # kept across syncs: `base` holds every stored key as of the last
        # sync, `rows` the same with this worker's changes since.
        self.copy = copy
        self.rows = creator.create(f"{var.name}/local_rows", var.key_dtype, var.value_dtype, var.dim)
        self.base = creator.create(f"{var.name}/local_base", var.key_dtype, var.value_dtype, var.dim)


# How a sync merges the workers' changes of one kind of state; _LOCAL: it
# does not (optimizer slots of copies with slots="local": each worker's own).
_SUM, _MEAN, _MAX, _LOCAL = "sum", "mean", "max", "local"
SLOTS_RULES = ("merged", "local")  # PeriodicSync's slots=


class _Entry:
    """A trained Variable and its per-key state's LocalTables: its optimizer
    slots and, when it has them, its restrict policy's state, its change
    labels and its admission filter's counts.  `merges` says how a sync
    merges each one's changes (module docstring): the rows, a frequency
    policy's counts and admission counts take the sum of the workers'
    deltas ("sum"), optimizer slots the mean of the deltas of the workers
    that changed the key ("mean"), timestamps and change labels the latest
    of the workers' values ("max").  With copies and local_slots, the
    optimizer slots are not merged at all ("local"): a sync neither sends
    nor changes them, and the owner writes its own to the store."""

    def __init__(self, var, slots: list, state: list, counts=None, copy: bool = False, local_slots: bool = False):
        slot_merge = _LOCAL if copy and local_slots else _MEAN
        parts = [(var, _SUM)] + [(s, slot_merge) for s in slots] + list(state)
        self.var = var
        self.variables = [v for v, _ in parts]  # a key's row and state: written together
        self.slots = self.variables[1:]  # every Variable of the key's state but the rows
        # An admission filter's per-key counts (tfde.admission.CounterFilter):
        # a Variable of their own, for the keys not stored yet, written apart.
        self.counts = counts
        every = self.variables + ([counts] if counts is not None else [])
        self.merges = [m for _, m in parts] + ([_SUM] if counts is not None else [])
        # With copies (PeriodicSync(replicate=True)), the tables hold the
        # whole store (LocalTables.copy): no lookup between syncs fetches,
        # a key they lack is not stored (its initial values), and `touched`
        # holds the keys looked up since the last sync (those a sync pushes
        # if they changed).
        self.copy = copy
        self.tables = [LocalTables(v, copy) for v in every]
        self.touched = None
        if copy:
            self.touched = CuckooTableCreator().create(f"{var.name}/local_touched", var.key_dtype, tf.float32, 1)
        self.widths = [v.dim for v in every]
        # The tables a sync merges (all but "local" ones), in order: what
        # deltas() and payload() hold, side by side.
        self.merged = [i for i, m in enumerate(self.merges) if m != _LOCAL]
        self.merged_widths = [self.widths[i] for i in self.merged]
        # With an admission filter, a key the store does not hold stays out
        # of the local rows until the filter admits it (the optimizer asks
        # it as in an exact step); its base is its initial row.
        self.admits = var.admission_filter is not None

    def attach(self, on: bool) -> None:
        for t in self.tables:
            t.var._local = t if on else None

    def read_store(self, keys):
        """[k, sum of widths (+ 1)]: the stored rows and state of `keys`
        side by side; missing keys read their initial values.  With an
        admission filter, a last column tells which keys are stored (1)."""
        found = [t.var._find(keys, in_step=True, initial=True) for t in self.tables]
        columns = [tf.cast(rows, self.compute_dtype()) for rows, _ in found]
        if self.admits:
            columns.append(tf.cast(found[0][1], self.compute_dtype())[:, None])
        return tf.concat(columns, 1)

    def missing(self, keys):
        """The keys of `keys` [u] not fetched since the last sync."""
        _, hit = self.tables[0].base.find(keys, _ZERO)
        return tf.boolean_mask(keys, tf.logical_not(hit))

    def touch(self, keys) -> tf.Operation:
        """With copies: records that `keys` were looked up since the last sync."""
        return self.touched.insert(keys, tf.zeros([tf.size(keys), 1]))

    def read_copy(self, keys):
        """With copies: the rows a lookup of `keys` reads (the working copy;
        a key it lacks is not stored, and reads its initial row)."""
        return self.tables[0].rows.find(keys, self.var._missing(keys, for_update=True))[0]

    def _base(self, t, keys, dtype):
        """The base rows of `keys` in LocalTables `t`, as `dtype`: with a copy,
        a key it lacks reads its initial values, as from the store."""
        default = t.var._missing(keys, for_update=True) if self.copy else _ZERO
        return tf.cast(t.base.find(keys, default)[0], dtype)

    def fill(self, keys, packed) -> list:
        """Stores the fetched rows and state `packed` (read_store) of `keys`
        as their base and, but for the keys an admission filter has not
        admitted yet (whose counts only), as their local values."""
        if self.admits:
            stored = packed[:, -1] > 0
            packed = packed[:, :-1]
        ops = []
        for t, part in zip(self.tables, tf.split(packed, self.widths, axis=1)):
            part = tf.cast(part, t.var.value_dtype)
            ops.append(t.base.insert(keys, part))
            if self.admits and t.var is not self.counts:
                ops.append(t.rows.insert(tf.boolean_mask(keys, stored), tf.boolean_mask(part, stored)))
            else:
                ops.append(t.rows.insert(keys, part))
        return ops

    def held(self, keys):
        """bool [c]: which of `keys` have a local row (stored when fetched,
        or admitted since)."""
        return self.tables[0].rows.find(keys, _ZERO)[1]

    def read_local(self, keys):
        """The rows a lookup of `keys` reads between syncs: the local rows;
        a key an admission filter has not admitted reads the Variable's
        default for such keys (tfde.admission)."""
        default = self.var._missing(keys) if self.admits else _ZERO
        return self.tables[0].rows.find(keys, default)[0]

    def compute_dtype(self):
        return tf.float64 if any(t.var.value_dtype == tf.float64 for t in self.tables) else tf.float32

    def deltas(self, owned=None):
        """(keys [c], deltas [c, sum of merged_widths], local values [c, sum
        of merged_widths]) of the keys whose row or merged state changed
        since it was fetched; deltas are local value minus base, in float32
        (float64 where any of the state is float64: policy state is).
        With slots kept per worker ("local"), also the keys this worker owns
        (`owned`: keys -> bool) whose slots alone changed: the owner stores
        its slots with the key's row (sync_copy), so a step whose update
        rounded away in every column of a row still stores its slots."""
        compute = self.compute_dtype()
        # Every fetched key (the base holds them all; the local tables hold
        # a key not admitted yet in its counts only: elsewhere it is its
        # base).  With copies, the keys looked up since the last sync.
        keys, _, _ = (self.touched if self.copy else self.tables[0].base).export_chunk(0, _ALL_ROWS)
        local, deltas = [], []
        for t in (self.tables[i] for i in self.merged):
            now, base = self._now_and_base(t, keys, compute)
            local.append(now)
            deltas.append(now - base)
        packed, local = tf.concat(deltas, 1), tf.concat(local, 1)
        changed = tf.reduce_any(tf.not_equal(packed, 0), axis=1)
        if owned is not None and len(self.merged) < len(self.tables):
            changed = tf.logical_or(changed, self._slots_alone_changed(keys, changed, owned, compute))
        return tuple(tf.boolean_mask(t, changed) for t in (keys, packed, local))

    def _now_and_base(self, t, keys, compute):
        """(local values, base values) of `keys` in LocalTables `t`."""
        base = self._base(t, keys, compute)
        found, held = t.rows.find(keys, _ZERO)
        return tf.where(held[:, None], tf.cast(found, compute), base), base

    def _slots_alone_changed(self, keys, changed, owned, compute):
        """bool [c]: which of `keys` this worker owns, did not change in the
        merged tables (`changed`), and changed in a "local" one (its slots).
        Only those few keys are read again."""
        quiet = tf.where(tf.logical_not(changed))[:, 0]
        mine = owned(tf.gather(keys, quiet))
        quiet = tf.boolean_mask(quiet, mine)
        some = tf.gather(keys, quiet)
        moved = tf.zeros_like(quiet, tf.bool)
        for i in range(len(self.tables)):
            if i not in self.merged:
                now, base = self._now_and_base(self.tables[i], some, compute)
                moved = tf.logical_or(moved, tf.reduce_any(tf.not_equal(now, base), axis=1))
        return tf.scatter_nd(quiet[:, None], moved, tf.shape(changed, out_type=tf.int64))

    def payload(self, keys, packed, local, rank, size):
        """What this worker sends the owners at a sync in a job: per kind of
        state its delta ("sum", "mean") or, for "max", its local values in
        the block of `size` blocks that is this worker's (zeros in the
        others: the exchange sums, and the owner takes the largest); then
        a column of ones (the owner counts the workers that changed a key's
        row and state: with an admission filter, those that hold a row of
        it, and not those that only counted it)."""
        columns = []
        merges = [self.merges[i] for i in self.merged]
        pieces = zip(tf.split(packed, self.merged_widths, axis=1), tf.split(local, self.merged_widths, axis=1), merges)
        for delta, value, merge in pieces:
            if merge == _MAX:
                mine = tf.one_hot(rank, size, dtype=value.dtype)
                columns.append(tf.reshape(value[:, None, :] * mine[None, :, None], [-1, size * value.shape[1]]))
            else:
                columns.append(delta)
        if self.admits:  # a key this worker only counted is not one whose row or slots it changed
            changed = tf.cast(self.held(keys), packed.dtype)[:, None]
        else:
            changed = tf.ones_like(packed[:, :1])
        return tf.concat(columns + [changed], 1)

    def push_alone(self, keys, packed, local) -> list:
        """A process training alone: the deltas of "sum" state (rows,
        counts) added to the store atomically per key (Table.accum; several
        processes may push the same keys at once), optimizer slots written
        as they are, "max" state written as the larger of the stored and
        the local value.  Only keys with a local row get a row; the others
        (an admission filter's waiting keys) push their counts."""
        ops = []
        deltas, values = tf.split(packed, self.widths, axis=1), tf.split(local, self.widths, axis=1)
        held = self.held(keys) if self.admits else None
        rows_of = keys if held is None else tf.boolean_mask(keys, held)

        def of_held(t):
            return t if held is None else tf.boolean_mask(t, held)

        for v, merge, delta, value in zip(self.variables, self.merges, deltas, values):
            if merge == _SUM:
                # The delta in the compute dtype: the store rounds each sum
                # once, as a merge does (a float16 delta would round twice).
                ops.append(v.accum(rows_of, of_held(delta)))
                continue
            value = tf.cast(of_held(value), v.value_dtype)
            if merge == _MAX:
                value = tf.maximum(value, v._find(rows_of, in_step=True, initial=True)[0])
            ops += v._write_step(rows_of, value, {}, store=True)
        if self.counts is not None:
            waiting = tf.logical_not(held)
            ops.append(self.counts.accum(tf.boolean_mask(keys, waiting), tf.boolean_mask(deltas[-1], waiting)))
            ops.append(self.counts.remove(rows_of))  # admitted: its count goes, as in an exact step
        if self.var.changes is not None:
            ops.append(self.var.changes.after_sync(rows_of))
        return [op for op in ops if op is not None]

    def add_owned(self, keys, summed, size) -> list:
        """The keys this worker owns: `summed` (payload, summed over the
        workers) holds their merged changes and, last, how many workers
        changed each key.  The owner is the only writer of its keys in the
        job, as in a training step: in-process tables add the deltas in
        place where that is all there is to do; otherwise the owner reads
        the key's row and state, merges and writes them back in one write
        (Variable._write_step), missing keys starting from their initial
        values, as a training step does.  With an admission filter, only
        keys some worker holds a row of get one; the others keep their
        summed counts, and an admitted key's count goes."""
        count = summed[:, -1:]
        body = summed[:, :-1]
        held = count[:, 0] > 0 if self.admits else None  # some worker holds a row of the key
        widths = [w * size if m == _MAX else w for w, m in zip(self.widths, self.merges)]
        parts = tf.split(body, widths, axis=1)
        rows_of = keys if held is None else tf.boolean_mask(keys, held)
        ops, new = [], []
        in_place = not self.var.shared_between_workers and not self.admits and _MAX not in self.merges
        for v, merge, part in zip(self.variables, self.merges, parts):
            if merge == _MEAN:
                part = tf.math.divide_no_nan(part, count)
            if in_place:
                ops.append(v.accum(keys, part))  # rounded once, as below (Table.accum)
                continue
            part = part if held is None else tf.boolean_mask(part, held)
            stored = tf.cast(v._find(rows_of, in_step=True, initial=True)[0], part.dtype)
            new.append(tf.cast(_merged(stored, part, merge, size), v.value_dtype))
        if not in_place:
            ops += self.var._write_step(rows_of, new[0], dict(zip(self.slots, new[1:])), store=True)
        if self.counts is not None:
            waiting = tf.logical_not(held)
            still = tf.boolean_mask(keys, waiting)
            counted = self.counts._find(still, in_step=True, initial=True)[0]
            ops += self.counts._write_step(still, counted + tf.boolean_mask(parts[-1], waiting), {}, store=True)
            ops.append(self.counts.remove(rows_of))  # admitted: its count goes, as in an exact step
        if self.var.changes is not None:
            with tf.control_dependencies(ops):
                ops.append(self.var.changes.after_sync(rows_of))
        return [op for op in ops if op is not None]

    def sync_copy(self, keys, summed, size, owned) -> list:
        """With copies: `summed` (payload, summed over the workers, on every
        worker) holds the merged changes of `keys` (every key some worker
        changed) and, last, how many workers changed each.  Every worker
        computes the keys' new row and state from its copy, which holds
        the store as of the last sync, in the same way; the owner (`owned`
        [u] bool) writes its keys to the store in one write, as add_owned
        does, and every worker writes them all to both copies."""
        count = summed[:, -1:]
        merged = [(self.tables[i], self.merges[i]) for i in self.merged]
        widths = [t.var.dim * size if m == _MAX else t.var.dim for t, m in merged]
        new = {}
        for (t, merge), part in zip(merged, tf.split(summed[:, :-1], widths, axis=1)):
            if merge == _MEAN:
                part = tf.math.divide_no_nan(part, count)
            new[t] = tf.cast(_merged(self._base(t, keys, part.dtype), part, merge, size), t.var.value_dtype)
        mine = tf.boolean_mask(keys, owned)

        def owners(t):
            """The new values of the owner's keys in table t; for local
            slots, its own (its working copy)."""
            if t in new:
                return tf.boolean_mask(new[t], owned)
            return t.rows.find(mine, t.var._missing(mine, for_update=True))[0]

        rows = self.tables[0]
        ops = self.var._write_step(
            mine, owners(rows), {s: owners(t) for s, t in zip(self.slots, self.tables[1:])}, store=True
        )
        ops += [op for t, n in new.items() for op in (t.base.insert(keys, n), t.rows.insert(keys, n))]
        if self.var.changes is not None:
            with tf.control_dependencies(ops):
                ops.append(self.var.changes.after_sync(mine))
        return [op for op in ops if op is not None]

    def owned_store(self):
        """(keys, read_store of them): every key of this worker's store."""
        tables = self.var._write_tables()
        keys = tf.concat([t.export_chunk(0, _ALL_ROWS)[0] for t in tables], 0)
        return keys, self.read_store(keys)

    def load_copy(self, keys, packed) -> list:
        """Makes `keys` with their read_store values `packed` both copies."""
        ops = []
        for t, part in zip(self.tables, tf.split(packed, self.widths, axis=1)):
            part = tf.cast(part, t.var.value_dtype)
            with tf.control_dependencies([t.base.clear(), t.rows.clear(), self.touched.clear()]):
                ops += [t.base.insert(keys, part), t.rows.insert(keys, part)]
        return ops

    def clear(self) -> list:
        """Empties the local tables (with copies: forgets the keys looked up;
        the sync has made both copies equal to the stores)."""
        if self.copy:
            return [self.touched.clear()]
        return [op for t in self.tables for op in (t.rows.clear(), t.base.clear())]

    def dirty(self) -> bool:
        """Whether a local table holds anything since the last sync (eager)."""
        return int((self.touched if self.copy else self.tables[0].base).size()) > 0


def _merged(stored, part, merge: str, size: int):
    """A key's new value from its `stored` one [k, d] and the workers'
    merged change `part`: the sum's or the mean's [k, d] added, or, for
    "max", the largest of the stored value and the `size` workers' blocks
    [k, size * d] (_Entry.payload)."""
    if merge == _MAX:
        return tf.maximum(stored, tf.reduce_max(tf.reshape(part, [-1, size, stored.shape[-1]]), axis=1))
    return stored + part


class LocalSteps(_exchange.Exchange):
    """The exchange of a local step (tfde.exchange.active() while local
    steps are on): lookups read the LocalTables, fetching keys they do not
    hold yet through `inner` (the engine's exchange), and gradients stay on
    this worker."""

    def __init__(self, sync: "PeriodicSync", inner: _exchange.Exchange):
        self._sync, self._inner = sync, inner
        self.rank, self.size = inner.rank, inner.size

    @property
    def collective(self) -> bool:
        return False

    def fused_table(self, variable):
        # With copies: the working copy, read as a store is (one native op
        # for the step's lookups of every such Variable).
        e = self._sync._entry(variable)
        return e.tables[0].rows if e.copy and step_kernels.lookup_qualifies(variable) else None

    def looked_up(self, variable, keys) -> list:
        return [self._stale_check(), self._sync._entry(variable).touch(keys)]

    def _stale_check(self):
        return tf.debugging.assert_equal(
            _generation().read_value(),
            tf.constant(self._sync._generation, tf.int64),
            message="this training step was traced during the local steps of semi-synchronous training that "
            "have stopped since (PeriodicSync.stop); trace it again (Keras: model.make_train_function(force=True), "
            "which the PeriodicSync callback does)",
        )

    def rows_for_many(self, lookups):
        entries = [self._sync._entry(p.variable) for p in lookups]
        with tf.control_dependencies([self._stale_check()]):
            lookups = [_exchange.Lookup(tf.identity(p.keys), p.find, p.placement, p.variable) for p in lookups]
        out = [None] * len(lookups)
        for i, (e, p) in enumerate(zip(entries, lookups)):
            if e.copy:  # this worker's copies: no collective
                with tf.control_dependencies([e.touch(p.keys)]):
                    out[i] = (p.keys, e.read_copy(p.keys), None)
        misses = [None if e.copy else e.missing(p.keys) for e, p in zip(entries, lookups)]
        fetched = [None] * len(lookups)
        through = [
            i
            for i, e in enumerate(entries)
            if self._inner.collective and not e.var.shared_between_workers and not e.copy
        ]
        for i, e in enumerate(entries):
            if out[i] is None and i not in through:  # a shared store (or training alone): read it here
                fetched[i] = e.read_store(misses[i])
        if through:
            found = self._inner.rows_for_many(
                [_exchange.Lookup(misses[i], entries[i].read_store, entries[i].var.placement) for i in through]
            )
            for i, (_, rows, mine) in zip(through, found):
                fetched[i] = rows if mine is None else tf.gather(rows, mine)
        for i, (e, p, miss, rows) in enumerate(zip(entries, lookups, misses, fetched)):
            if out[i] is None:
                with tf.control_dependencies(e.fill(miss, rows)):
                    out[i] = (p.keys, e.read_local(p.keys), None)
        return out

    def gradient_scale(self, optimizer) -> float:
        # The rows' deltas are summed over the workers at a sync, as an
        # exact step sums (or averages) their gradients: each worker
        # applies its share of the exact step.
        return self._inner.local_step_scale() / self._inner.size

    def prepare_gradients(self, optimizer, grads_and_vars) -> list:
        # The dense weights are averaged at a sync: each worker applies the
        # whole exact step's scale to its own gradient.
        scale = self._inner.local_step_scale()
        if scale == 1.0:
            return grads_and_vars
        return [
            (g if g is None or getattr(v, "_tfde_variable", None) is not None else _scaled(g, scale), v)
            for g, v in grads_and_vars
        ]


def _scaled(g, scale):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(scale, g.dtype)


def _tf_variable(v):
    """The tf.Variable behind a dense weight (Keras 3 wraps one)."""
    return v if isinstance(v, tf.Variable) else getattr(v, "value", v)


class PeriodicSync:
    """Semi-synchronous training of `variables` and `dense` weights by
    `optimizer`: local steps, with a sync every `every` steps (see the
    module docstring and docs/semi-sync.md).  tfde.keras.callbacks.
    PeriodicSync runs it for model.fit; a custom loop calls start() before
    tracing its step, after_step() after each step and stop() at the end.

    Args:
      every: steps between syncs, an int >= 1; 1 is exact synchronous
        training (start() then changes nothing).
      variables: the tfde Variables the optimizer trains.
      optimizer: the tfde.DynamicEmbeddingOptimizer (possibly wrapped by an
        engine's distributed optimizer).
      dense: the dense weights to average at each sync, or a function
        returning them (called when the first sync is traced: a Keras
        model builds its weights in its first step).
      strategy: the tf.distribute strategy of the job, if any (default: the
        one in scope, else the one the Variables were made under).
      replicate: in a job, each worker keeps a copy of every table whose
        keys are sharded over the workers (not of a store they share, such
        as Redis) between syncs, updated at each sync: lookups between
        syncs then run no collective at all.  Memory: two copies of every
        such table, with its optimizer slots and policy state, on every
        worker.  Not with admission filters.  docs/semi-sync.md, "Copies of sharded
        tables".
      slots: with replicate=True, how a sync treats the optimizer slots of
        the copied tables (Adam's moments, ...): "merged" (default: the
        mean of the changes of the workers that changed a key, on every
        worker) or "local" (each worker keeps its own across syncs, as it
        does its dense optimizer state; the owner's go to the store, and so
        into checkpoints).  "local" sends a third of the bytes per key with
        Adam; docs/semi-sync.md, "Optimizer slots kept per worker".

    Not thread-safe: one training loop drives it.

    Example:
      >>> sync = tfde.semi_sync.PeriodicSync(16, [table], opt, model.trainable_variables)
      >>> sync.start()
      >>> for batch in data:
      ...     train_step(batch)
      ...     sync.after_step()
      >>> sync.stop()
    """

    def __init__(
        self,
        every: int,
        variables: Sequence,
        optimizer,
        dense: Sequence = (),
        strategy=None,
        replicate: bool = False,
        slots: str = "merged",
    ):
        self.every = every_arg(every)
        self.replicate, self.slots = sync_options(replicate, slots)
        unique = {id(v): v for v in variables}
        # Sorted by name: every worker pushes the same Variables in the same
        # order (the sync's collectives pair them up).
        self.variables = sorted(unique.values(), key=lambda v: v.name)
        self.optimizer = optimizer
        self._dense = dense
        if strategy is None and tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
        if strategy is None:
            strategy = next((v._strategy for v in self.variables if v._strategy is not None), None)
        self.strategy = strategy if strategy is not None and strategy.num_replicas_in_sync > 1 else None
        self.steps = 0  # local steps since the last sync
        self.syncs = 0
        self._entries = None
        self._sync_fn = self._load_fn = None
        self._job = False  # whether it trains in a job of several workers (set by start)
        self._generation = 0

    # ---------------------------------------------------------------- control

    @property
    def running(self) -> bool:
        return _running is self

    def start(self) -> None:
        """Turns local steps on (with every > 1); trace the training step
        after this call."""
        global _running
        if self.every == 1:
            return
        if _running is not None:
            raise ConfigError(
                "semi-synchronous training is on already (one PeriodicSync at a time); stop() it first, or "
                "tfde.semi_sync.abort() what a failed run left on"
            )
        if self.strategy is None and _exchange.installed() is None and _workers_in_tf_config() > 1:
            raise ConfigError(
                f"TF_CONFIG names {_workers_in_tf_config()} workers, but PeriodicSync found no strategy: its syncs "
                "would not reach the other workers; pass strategy= (or create it and the Variables under "
                "strategy.scope())"
            )
        engine = _exchange.installed()
        self._job = self.strategy is not None or (engine is not None and engine.collective)
        self._entries = [self._make_entry(v) for v in self.variables]
        self._sync_fn = self._load_fn = None  # traced against these entries' tables
        for e in self._entries:
            e.attach(True)
        _running = self
        self._generation = int(_generation().assign_add(1).numpy())
        _exchange.set_local_steps(lambda inner: LocalSteps(self, inner))
        if engine is not None:
            engine.keep_gradients_local(self.optimizer, True)
        self.steps = 0
        try:
            self.load_copies()
        except BaseException:
            self.abort()
            raise

    def load_copies(self) -> None:
        """Makes each worker's copies (replicate=True) of the stores anew
        from what the stores hold, dropping the local steps' changes since
        the last sync; every worker must call it at the same point (start,
        and after a restriction or a checkpoint restore rewrote the
        stores).  Nothing without copies."""
        if not self.running or not any(e.copy for e in self._entries):
            return
        if self._load_fn is None:
            self._load_fn = tf.function(self._load_body, autograph=False)
        self._run(self._load_fn)
        self.steps = 0

    def after_step(self) -> bool:
        """Counts a training step; syncs after every `every`-th.  Returns
        whether it synced."""
        if not self.running:
            return False
        self.steps += 1
        if self.steps < self.every:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Pushes every worker's deltas to the stores, empties the local
        tables and averages the dense weights; every worker must call it
        at the same point.  Nothing to do (and no collective) when no step
        was counted (after_step, or `steps` set by the caller) since the
        last sync.  A sync that fails detaches the local tables (abort) and
        raises: what it did not push is lost, and never pushed twice."""
        if not self.running or self.steps == 0:
            return
        if self._sync_fn is None:
            self._sync_fn = tf.function(self._sync_body, autograph=False)
        try:
            self._run(self._sync_fn)
        except BaseException:
            self.abort()
            raise
        self.steps = 0
        self.syncs += 1

    def _run(self, fn) -> None:
        if self.strategy is not None:
            self.strategy.run(fn)
        else:
            fn()

    def stop(self) -> None:
        """Syncs, then turns local steps off (trace the step again)."""
        if not self.running:
            return
        self.sync()
        self.abort()

    def abort(self) -> None:
        """Turns local steps off without syncing: this worker's deltas since
        the last sync are dropped (what a failed run leaves must not be
        pushed twice or late)."""
        global _running
        if not self.running:
            return
        for e in self._entries:
            e.attach(False)
        _running = None
        _generation().assign_add(1)
        _exchange.set_local_steps(None)
        engine = _exchange.installed()
        if engine is not None:
            engine.keep_gradients_local(self.optimizer, False)
        self.steps = 0

    def pending(self) -> list:
        """What the next sync would push from this worker, eagerly: a list
        of (Variable, keys [c], deltas [c, dim], values [c, dim]) (numpy)
        for every trained Variable and each of its optimizer slots, policy
        state and change labels (slot Variables, Variable.slots) and
        admission counts (CounterFilter.counts), over the keys whose row or
        state changed since it was fetched (a key an admission filter has
        not admitted: its count only): the local value minus the base, and
        the local value.  A worker that stops now loses exactly these (with
        slots="local", the optimizer slots are not pushed, and not listed:
        they stay in the worker's copies; a key this worker owns whose slots
        alone changed is listed with zero deltas, _Entry.deltas)."""
        out = []
        ex = _exchange.engine_active()
        for e in self._entries if self.running else []:
            keys, packed, local = e.deltas(self._owned(e, ex))
            held = e.held(keys) if e.admits else tf.ones_like(keys, tf.bool)
            pieces = zip(tf.split(packed, e.merged_widths, axis=1), tf.split(local, e.merged_widths, axis=1))
            for v, (delta, value) in zip([e.tables[i].var for i in e.merged], pieces):
                # A key with a local row pushes its row and state; a key an
                # admission filter has not admitted, its count only.
                mine = tf.logical_not(held) if v is e.counts else held
                delta, value = tf.boolean_mask(delta, mine), tf.boolean_mask(value, mine)
                out.append(
                    (v, tf.boolean_mask(keys, mine).numpy(), delta.numpy(), tf.cast(value, v.value_dtype).numpy())
                )
        return out

    # ---------------------------------------------------------------- internals

    def _dirty(self) -> bool:
        """Whether a local table holds anything since the last sync (eager)."""
        return any(e.dirty() for e in self._entries or [])

    @staticmethod
    def _owned(e: _Entry, ex):
        """keys -> bool [k]: which of them this worker owns, for a Variable
        with copies in a job (_Entry.deltas); None otherwise."""
        if not (e.copy and ex.collective):
            return None
        return lambda keys: ex.owned(keys, e.var.placement)

    def _make_entry(self, var) -> _Entry:
        refused = f"semi-synchronous training (every={self.every}) does not support Variable {var.name!r}"
        state = []
        if var.restrict_policy is not None:
            merges = var.restrict_policy.sync_merges()
            if merges is None:
                raise ConfigError(
                    f"{refused}: its restrict policy {type(var.restrict_policy).__name__} has no rule to merge the "
                    "workers' changes of its state (RestrictPolicy.sync_merges); train it with every=1 (exact), or "
                    "use a policy of tfde's (docs/semi-sync.md)"
                )
            state += list(merges.items())
        if var.changes is not None:
            state.append((var.changes.written, _MAX))
        admission = var.admission_filter
        counts = None if admission is None else admission.sync_counts()
        if admission is not None and counts is None and not admission.stateless:
            raise ConfigError(
                f"{refused}: its admission filter {type(admission).__name__} keeps per-key state with no rule to "
                "merge the workers' changes (AdmissionFilter.sync_counts); train it with every=1 (exact), or "
                "admit with tfde.CounterFilter or tfde.ProbabilityFilter (docs/semi-sync.md)"
            )
        if not var.trainable:
            raise ConfigError(f"Variable {var.name!r} is not trainable: leave it out of PeriodicSync's variables")
        copy = self.replicate and self._job and not var.shared_between_workers
        if copy and admission is not None:
            raise ConfigError(
                f"{refused} with copies of its table (replicate=True): its admission filter "
                f"{type(admission).__name__} decides per worker which keys the store holds; train it with "
                "replicate=False, or without the filter"
            )
        slots = [var.slot(name, init) for name, init in rule_for(self.optimizer).slots(self.optimizer)]
        return _Entry(var, slots, state, counts, copy, local_slots=self.slots == "local")

    def _entry(self, var) -> _Entry:
        if var is None:
            raise ConfigError("a lookup between syncs of semi-synchronous training must name its Variable (Lookup)")
        for e in self._entries:
            if e.var is var:
                return e
        raise ConfigError(
            f"Variable {var.name!r} is trained while semi-synchronous training is on, but PeriodicSync was not "
            "given it; pass every trained tfde Variable (the Keras callback takes the model's)"
        )

    def _load_body(self):
        ex = _exchange.engine_active()
        copies = [e for e in self._entries if e.copy]
        parts = []
        for e in copies:
            keys, packed = e.owned_store()
            # Each key is in its owner's store only: the sum over the workers is its values.
            mine = ex.owned(keys, e.var.placement)
            parts.append((tf.boolean_mask(keys, mine), tf.boolean_mask(packed, mine)))
        everywhere = ex.sum_everywhere(parts)
        ops = [op for e, (keys, packed) in zip(copies, everywhere) for op in e.load_copy(keys, packed)]
        with tf.control_dependencies(ops):
            return tf.constant(True)

    def _sync_body(self):
        ex = _exchange.engine_active()
        pending = [(e,) + e.deltas(self._owned(e, ex)) for e in self._entries]
        writes = []
        if not ex.collective:
            # Alone (independent processes may share a Redis store).
            writes = [op for e, keys, packed, local in pending for op in e.push_alone(keys, packed, local)]
        else:
            # With copies: every worker gets the sums of every key's changes
            # and computes the new values; the owner writes them to the store.
            copies = [(e, keys, packed, local) for e, keys, packed, local in pending if e.copy]
            pending = [p for p in pending if not p[0].copy]
            if copies:
                everywhere = ex.sum_everywhere(
                    [(keys, e.payload(keys, packed, local, ex.rank, ex.size)) for e, keys, packed, local in copies]
                )
                for (e, _, _, _), (keys, summed) in zip(copies, everywhere):
                    writes += e.sync_copy(keys, summed, ex.size, ex.owned(keys, e.var.placement))
        if ex.collective and pending:
            # In a job: each key's deltas summed at its owner, its only
            # writer, by the exchange's own two steps: a lookup gives the
            # buffer the workers' deltas are summed in, then the owners get
            # the sums (with a last column of ones: how many workers
            # changed each key).
            buffers = ex.rows_for_many(
                [
                    _exchange.Lookup(keys, lambda k: tf.zeros([tf.size(k), 1], tf.float32), e.var.placement)
                    for e, keys, _, _ in pending
                ]
            )
            parts = [
                _exchange.Gradient(
                    buffer_keys,
                    tf.range(tf.size(keys)) if mine is None else mine,
                    e.payload(keys, packed, local, ex.rank, ex.size),
                    e.var.placement,
                )
                for (e, keys, packed, local), (buffer_keys, _, mine) in zip(pending, buffers)
            ]
            for (e, _, _, _), (owned, summed) in zip(pending, ex.owner_gradients_many(parts)):
                writes += e.add_owned(owned, summed, ex.size)
        with tf.control_dependencies(writes):
            cleared = [op for e in self._entries for op in e.clear()]
        # After the pushes: a worker whose partner is lost still makes its
        # writes before the average fails; and the average (or, without
        # dense weights, a one-number one) is a barrier: every owner's
        # writes are done before any worker's next lookup fetches.
        dense = self._dense() if callable(self._dense) else self._dense
        weights = [_tf_variable(v) for v in dense if getattr(v, "_tfde_variable", None) is None]
        weights = [w for w in weights if w.dtype.is_floating]
        assigns = []
        if ex.size > 1:
            with tf.control_dependencies(writes):
                values = [w.read_value() for w in weights] or [tf.zeros([1])]
            for w, mean in zip(weights, ex.average(values)):
                assigns.append(w.assign(mean))
            if not weights:
                assigns.append(ex.average(values)[0])
        with tf.control_dependencies(cleared + assigns):
            return tf.constant(True)


def sync_now() -> None:
    """Syncs the running semi-synchronous training, if any (a checkpoint
    save calls it first, so a checkpoint holds a consistent state).  It
    syncs even when no step was counted since the last sync: a Keras
    callback that saves may run before the one that counts steps."""
    if _running is not None:
        _running.steps = max(_running.steps, 1)
        _running.sync()


_REWRITING = []  # not empty while a restriction or a restore rewrites the stores


@contextlib.contextmanager
def rewriting_stores():
    """A restriction or a checkpoint restore (every worker at the same
    point) rewrites the stores: the copies of PeriodicSync(replicate=True)
    are made anew after it succeeds (a collective call)."""
    _REWRITING.append(True)
    try:
        yield
    finally:
        _REWRITING.pop()
    if _running is not None:
        _running.load_copies()


def rewriting() -> bool:
    """Whether a restriction or a restore is rewriting the stores now."""
    return bool(_REWRITING)


def before_export(what: str) -> None:
    """Called before `what` (a checkpoint save, a serving export) reads the
    stores: the running semi-synchronous training, if any, must have synced
    what its local steps changed.  A process training alone syncs here; in
    a job a sync is collective, and an export may run on one worker only
    (rank 0 only, with some engines), so it is refused with the way out instead."""
    if _running is None or not _running._dirty():
        return
    if not _exchange.engine_active().collective and _running.strategy is None:
        sync_now()
        return
    raise ConfigError(
        f"{what} during semi-synchronous training, with local steps not synced yet: it would miss every worker's "
        "changes since the last sync.  Save with tfde.CheckpointManager (it syncs first, on every worker), call "
        "PeriodicSync.sync() on every worker first, or put the PeriodicSync callback before the one that saves "
        "(it syncs at each epoch's end)"
    )


def discard_local() -> None:
    """Empties the local tables of the running semi-synchronous training,
    if any, dropping what was not synced (a checkpoint restore calls it:
    the restored rows are then read from the store)."""
    if _running is not None:
        for e in _running._entries:
            e.clear()
        _running.steps = 0


def running() -> Optional[PeriodicSync]:
    """The PeriodicSync whose local steps are on, or None."""
    return _running


def abort() -> None:
    """Turns off the local steps a failed run left on, without syncing (its
    unsynced deltas are dropped); nothing when none are on."""
    if _running is not None:
        _running.abort()


def _workers_in_tf_config() -> int:
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG", "") or "{}").get("cluster", {})
    except ValueError:
        return 1
    return sum(len(v) for k, v in cluster.items() if k in ("worker", "chief"))
