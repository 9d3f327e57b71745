"""Peers: the ranks of a job that play the same role, which the rules compare with each other.

Data parallelism makes every rank alike; pipeline stages (and other model-parallel splits) do not: a lighter
stage waits for the heavier one by design, and its ranks are nobody's stragglers. Ranks of one role issue
the same communication: the same ops with the same payloads (the all-reduces of the same parameters in their
data-parallel group, the same sends and receives). So ranks are grouped by the set of (op, bytes) of the
collectives they were seen completing; a rank whose set is part of another group's (its window held fewer of
them, or none) joins that group.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from rankscope.analyzer.records import Collectives
from rankscope.schema.patterns import RankPattern

POINT_TO_POINT = re.compile(r"send|recv", re.I)  # a pipeline's transfers between stages, by the op's name


def peer_groups(patterns: Sequence[RankPattern], records: Collectives | None = None) -> list[np.ndarray]:
    """Row indices of `patterns`, one array per role (a job of one role: one array of every row); `records`:
    their collectives, when read already."""
    cols = Collectives.of(patterns) if records is None else records
    n = len(patterns)
    if not cols.op.size:  # no rank completed a collective: one role, as far as can be told
        return [np.arange(n)]
    # Every rank saw records, all of one op and payload, the common case: one role, no sort of 1.6M records
    # (~20 ms at 100,000 ranks) to tell their pairs.
    if cols.counts.all() and (cols.op == cols.op[0]).all() and (cols.bytes == cols.bytes[0]).all():
        return [np.arange(n)]
    # Each rank's set of (op, bytes) as a row of flags over the job's distinct pairs: read in numpy, not per record.
    sizes, size = np.unique(cols.bytes, return_inverse=True)
    pairs, pair = np.unique(cols.op * sizes.size + size.ravel(), return_inverse=True)
    flags = np.zeros((n, len(pairs)), bool)
    flags[cols.row, pair.ravel()] = True
    if (flags == flags[0]).all():  # the common case: no sort of rows
        return [np.arange(n)]
    rows, first, inverse = np.unique(flags, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    names = [(cols.ops[pr // sizes.size], int(sizes[pr % sizes.size])) for pr in pairs.tolist()]
    signature = [frozenset(names[j] for j in np.flatnonzero(r)) for r in rows]
    distinct = set(signature[i] for i in np.argsort(first, kind="stable"))  # as first seen, rank after rank
    # Largest first: each signature joins the first larger group whose signature holds it.
    heads: list[frozenset] = []
    home: dict[frozenset, int] = {}
    for sig in sorted(distinct, key=len, reverse=True):
        home[sig] = next((g for g, head in enumerate(heads) if sig <= head), None)
        if home[sig] is None:
            home[sig] = len(heads)
            heads.append(sig)
    groups = np.array([home[sig] for sig in signature], np.intp)[inverse]
    return [np.flatnonzero(groups == g) for g in range(len(heads))]


def pure_pipeline(groups: list[np.ndarray], records: Collectives) -> bool:
    """Whether no rank has a data-parallel peer: each alone in its role (`groups`, peer_groups'), or the job
    only sends and receives (a pipeline's stages pass activations and gradients of one size both ways, so their
    ops and payloads alike put them in one role; data-parallel peers all-reduce every step)."""
    if len(groups) > 1:
        return all(rows.size == 1 for rows in groups)
    ops = np.unique(records.op)
    return groups[0].size > 1 and ops.size > 0 and all(POINT_TO_POINT.search(records.ops[i]) for i in ops.tolist())
