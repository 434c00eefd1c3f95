"""Placement plans: which worker holds which table of a layer with many
tables (tfde.keras.layers.DistributedEmbedding; docs/distributed.md,
"Placement plans").

A plan splits each table into column slices (only tables wider than
`column_slice_threshold`) and gives every slice a tfde.exchange.Placement:
ROWS (its keys spread over every worker by stable hash) or OnWorker(w) (the
whole slice on worker w).  The slicing depends only on the table configs and
the threshold, never on the number of workers, so a layer has the same
tables (and the same checkpoint entries) in a job of any size; only the
placement of its slices changes with the workers.

Plans:
  rows             every slice by rows over all workers (tfde's default for a
                   single table).
  round_robin      whole slices on workers in turn, in table order (the basic
                   strategy of NVIDIA's distributed-embeddings).
  memory_balanced  whole slices, the heaviest first, each on the worker that
                   holds the least so far; a slice weighs expected_rows *
                   width (TableConfig.weight).
  auto             one worker: rows.  Several: a slice heavier than a fair
                   share (total weight / workers) is spread by rows; the
                   others are placed whole, memory_balanced, counting each
                   spread slice as weight / workers on every worker.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from tfde.errors import ConfigError
from tfde.exchange import ROWS, OnWorker, Placement
from tfde.tables.base import int_arg

PLANS = ("auto", "rows", "round_robin", "memory_balanced")


class Slice:
    """Columns [start, stop) of table `table` (a TableConfig), placed by
    `placement`."""

    def __init__(self, table, start: int, stop: int, placement: Placement = ROWS):
        self.table, self.start, self.stop, self.placement = table, start, stop, placement

    @property
    def width(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.table.embedding_dim

    @property
    def suffix(self) -> str:
        """What names the slice's Variable after its table's: '' for a whole
        table, '-cols{start}_{stop}' for a column slice."""
        return "" if self.whole else f"-cols{self.start}_{self.stop}"

    @property
    def weight(self) -> int:
        return (self.table.expected_rows or 1) * self.width


class Plan:
    """The slices of every table of a layer and where each one lives.
    str(plan) lists them, a table per line."""

    def __init__(self, kind: str, asked: str, workers: int, slices: List[Slice]):
        self.kind, self.asked, self.workers, self.slices = kind, asked, workers, slices

    def of(self, table_name: str) -> List[Slice]:
        return [s for s in self.slices if s.table.name == table_name]

    def worker_loads(self) -> List[float]:
        """Weight held by each worker (a slice by rows counts weight /
        workers on each)."""
        loads = [0.0] * self.workers
        for s in self.slices:
            if isinstance(s.placement, OnWorker):
                loads[s.placement.worker % self.workers] += s.weight
            else:
                for w in range(self.workers):
                    loads[w] += s.weight / self.workers
        return loads

    def __str__(self):
        head = f"placement plan {self.asked!r}" + (f" ({self.kind})" if self.kind != self.asked else "")
        lines = [f"{head} over {self.workers} worker(s):"]
        names = list(dict.fromkeys(s.table.name for s in self.slices))
        for name in names:
            parts = []
            for s in self.of(name):
                where = s.placement.describe(self.workers)
                parts.append(where if s.whole else f"columns {s.start}-{s.stop}: {where}")
            table = self.of(name)[0].table
            rows = table.expected_rows or "?"
            lines.append(f"  {name} (dim {table.embedding_dim}, ~{rows} rows): {'; '.join(parts)}")
        return "\n".join(lines)

    __repr__ = __str__


def slices_of(table, threshold: Optional[int]) -> List[Slice]:
    """The column slices of `table`: one whole slice, or, when the table is
    wider than `threshold`, ceil(dim / threshold) slices of near-equal width
    (the first ones one column wider)."""
    dim = table.embedding_dim
    if threshold is None or dim <= threshold:
        return [Slice(table, 0, dim)]
    count = math.ceil(dim / threshold)
    base, extra = divmod(dim, count)
    out, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        out.append(Slice(table, start, stop))
        start = stop
    return out


def make_plan(tables: Sequence, workers: int, placement: str = "auto", column_slice_threshold=None) -> Plan:
    """The plan for `tables` (TableConfigs, in layer order) over `workers`."""
    if placement not in PLANS:
        raise ConfigError(f"placement must be one of {PLANS}, got {placement!r}")
    if column_slice_threshold is not None:
        t = int_arg(column_slice_threshold)
        if t is None or t < 1:
            raise ConfigError(f"column_slice_threshold must be an int >= 1 or None, got {column_slice_threshold!r}")
        column_slice_threshold = t
    slices = [s for table in tables for s in slices_of(table, column_slice_threshold)]
    kind = placement
    if placement == "auto":
        kind = "rows" if workers <= 1 else "auto"
    if kind == "rows":
        pass
    elif kind == "round_robin":
        for i, s in enumerate(slices):
            s.placement = OnWorker(i % workers)
    elif kind == "memory_balanced":
        _balance(slices, [0.0] * workers)
    else:  # auto over several workers
        fair = sum(s.weight for s in slices) / workers
        spread = [s for s in slices if s.weight > fair]
        whole = [s for s in slices if s.weight <= fair]
        _balance(whole, [sum(s.weight for s in spread) / workers] * workers)
    return Plan(kind, placement, workers, slices)


def _balance(slices, loads):
    """Places `slices` whole, the heaviest first, each on the least loaded
    worker (the lowest index among equals); `loads` starts as given."""
    for s in sorted(slices, key=lambda s: -s.weight):  # sorted() is stable: equals keep table order
        w = min(range(len(loads)), key=lambda i: (loads[i], i))
        s.placement = OnWorker(w)
        loads[w] += s.weight
