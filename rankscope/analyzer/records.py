"""A job's collective records as flat columns, read once and shared by the steps, the peer groups and the
alignment: the patterns' own arrays (schema/patterns.py CollectiveColumns) joined, 100,000 ranks' 1.6M
records in ~0.1 s (read from a record object each, they took ~0.28 s).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import attrgetter

import numpy as np

from rankscope.schema.patterns import RankPattern

_collectives = attrgetter("collectives")
_ops = attrgetter("ops")


def _joined(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    """Records x 2 arrays, one under the other."""
    return np.concatenate(arrays) if arrays else np.zeros((0, 2), dtype)


@dataclass(frozen=True)
class Collectives:
    """Every record of `patterns`, rank after rank in each rank's own order."""

    counts: np.ndarray  # records per pattern
    ops: list[str]  # the distinct op names, sorted
    op: np.ndarray  # per record: its index in ops
    bytes: np.ndarray
    enter: np.ndarray
    done: np.ndarray

    @classmethod
    def of(cls, patterns: Sequence[RankPattern]) -> Collectives:
        cols = list(map(_collectives, patterns))
        keys = list(map(attrgetter("keys"), cols))
        counts = np.fromiter(map(len, keys), np.intp, len(cols))
        op, nbytes = _joined(keys, np.int64).T
        enter, done = _joined(list(map(attrgetter("instants"), cols)), float).T
        tables = list(dict.fromkeys(map(_ops, cols)))  # each distinct op table once: one in most jobs
        ops = sorted(set(chain.from_iterable(tables)))
        if tables and tables != [tuple(ops)]:  # the patterns' own indices are not the sorted table's
            ids = {name: i for i, name in enumerate(ops)}
            lookup = np.zeros((len(tables), max(map(len, tables))), np.intp)  # (table, its index) -> ops index
            for i, table in enumerate(tables):
                lookup[i, :len(table)] = [ids[name] for name in table]
            which = {table: i for i, table in enumerate(tables)}
            table_of = np.fromiter(map(which.__getitem__, map(_ops, cols)), np.intp, len(cols))
            op = lookup[np.repeat(table_of, counts), op]
        # Each column on its own (the joined arrays' are strided): the rules pass over them many times.
        return cls(counts, ops, np.ascontiguousarray(op, np.intp), np.ascontiguousarray(nbytes),
                   np.ascontiguousarray(enter), np.ascontiguousarray(done))

    @cached_property
    def offsets(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.counts)[:-1])).astype(np.intp)

    @cached_property
    def row(self) -> np.ndarray:
        """Per record: the index of its pattern."""
        return np.repeat(np.arange(self.counts.size), self.counts)

    def take(self, rows: np.ndarray) -> Collectives:
        """The records of the patterns `rows` (in that order)."""
        counts = self.counts[rows]
        starts = np.repeat(self.offsets[rows] - (np.cumsum(counts) - counts), counts)
        idx = starts + np.arange(starts.size)
        return Collectives(counts, self.ops, self.op[idx], self.bytes[idx], self.enter[idx], self.done[idx])

    def filter(self, keep: np.ndarray) -> Collectives:
        """Only the records where `keep` (per record) holds (these very columns when it holds for all)."""
        if keep.all():
            return self
        counts = np.bincount(self.row[keep], minlength=self.counts.size).astype(np.intp)
        return Collectives(counts, self.ops, self.op[keep], self.bytes[keep], self.enter[keep], self.done[keep])

    @cached_property
    def busy_share(self) -> np.ndarray:
        """Per pattern: the time at least one of its collectives was in flight, as a share of the time summed
        over them (1.0 without records). Under 1 where collectives overlap: DDP's gradient buckets all-reduced
        at once on gloo's worker threads (two of a few hundred ms each, entered ms apart), whose summed
        time exceeds the wall time the rank spent waiting in them."""
        share = np.ones(self.counts.size)
        # Records come in the order they completed: a rank's collectives overlap where one entered before the
        # one before it (the same rank's) completed. Most ranks' never do (100,000 ranks: a few ms to tell), and
        # only the others are summed exactly. Not those a host sync completed together (NCCL's, pending from
        # their enqueue to the sync, share its end): their functions' time counts that sync's wait once, on the
        # last of them (bpf/common.h, sync_return). Taken for overlap, a step's dozen of them would cut every
        # rank's COMM to a fraction of its wait and leave the rest as host work alike on all, hiding a straggler.
        row, done = self.row, self.done
        overlap = (self.enter[1:] < done[:-1]) & (row[1:] == row[:-1]) & (done[1:] != done[:-1])
        if overlap.any():
            rows = np.unique(row[1:][overlap])
            share[rows] = self.take(rows)._union_share()
        return share

    def _union_share(self) -> np.ndarray:
        """busy_share, summed exactly: every rank's records on one time line, each rank after the last one's
        end (so that one running maximum of the ends restarts at each rank), by entry."""
        t0, row = float(self.enter.min()), self.row
        shift = row * (float(self.done.max()) - t0 + 1.0)
        enter, done = self.enter - t0 + shift, self.done - t0 + shift
        order = np.argsort(enter, kind="stable")
        row, enter, done = row[order], enter[order], done[order]
        before = np.concatenate(([-np.inf], np.maximum.accumulate(done)[:-1]))  # the latest end before each
        new = np.clip(done - np.maximum(enter, before), 0.0, None)
        summed = np.bincount(row, weights=done - enter, minlength=self.counts.size)
        union = np.bincount(row, weights=new, minlength=self.counts.size)
        return np.divide(union, summed, out=np.ones_like(summed), where=summed > 0)

    def per_row(self, column: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
        """A per-record `column` of the patterns `rows` (ascending, k records each) as rows x k."""
        if rows.size == self.counts.size:  # every pattern (each of k records): a view, no gather of 1.6M records
            return column.reshape(rows.size, k)
        return column[self.offsets[rows, None] + np.arange(k)]

    def sequences(self) -> list[np.ndarray]:
        """Rows (patterns) grouped by their whole sequence of (op, bytes), in the order each first appears."""
        groups: list[tuple[int, np.ndarray]] = []
        for k in np.unique(self.counts).tolist():
            rows = np.flatnonzero(self.counts == k)
            keys = np.concatenate([self.per_row(self.op, rows, k), self.per_row(self.bytes, rows, k)], axis=1)
            if (keys == keys[0]).all():  # the common case, one sequence: no sort of rows
                groups.append((int(rows[0]), rows))
                continue
            _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
            groups += [(int(rows[f]), rows[inverse.ravel() == g]) for g, f in enumerate(first.tolist())]
        return [rows for _, rows in sorted(groups, key=lambda g: g[0])]
