"""A job's collective records as flat columns, read once and shared by the steps, the peer groups and the
alignment (100,000 ranks hold 1.6M records: each pass over them as Python objects cost ~0.1 s a field).
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
        lists = list(map(_collectives, patterns))
        counts = np.fromiter(map(len, lists), np.intp, len(lists))
        recs = list(chain.from_iterable(lists))
        names = list(map(attrgetter("op"), recs))
        ops = sorted(set(names))
        ids = {name: i for i, name in enumerate(ops)}
        n = len(recs)
        # One op (a data-parallel job's all-reduces) needs no lookup per record: 1.6M records, ~30 ms.
        op = np.zeros(n, np.intp) if len(ops) == 1 else np.fromiter(map(ids.__getitem__, names), np.intp, n)
        return cls(counts, ops, op,
                   np.fromiter(map(attrgetter("bytes"), recs), np.int64, n),
                   np.fromiter(map(attrgetter("enter"), recs), float, n),
                   np.fromiter(map(attrgetter("done"), recs), float, n))

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
