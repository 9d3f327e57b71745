"""Iteration (step) time of a rank, found without knowing the training code.

A synchronous training step issues the same sequence of collectives every iteration, so the collective
sequence is periodic: its smallest period k is the number of collectives per step, and the time between
a collective and the same one k places later is the step time.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from .patterns import RankPattern, Role

MIN_REPEATS = 2  # a period must be seen at least twice to be believed


def smallest_period(seq: Sequence[Hashable]) -> int | None:
    """Smallest k with seq[i] == seq[i + k] for every i, among periods repeated at least MIN_REPEATS times."""
    n = len(seq)
    for k in range(1, n // MIN_REPEATS + 1):
        if all(seq[i] == seq[i + k] for i in range(n - k)):
            return k
    return None


def _period(p: RankPattern, cache: dict[tuple, int | None]) -> int | None:
    # (op, bytes) first: two all-reduce buckets of different sizes per step are two collectives of one
    # step, not two steps; op alone when sizes vary from step to step.
    for key in (tuple([(c.op, c.bytes) for c in p.collectives]), tuple([c.op for c in p.collectives])):
        if key not in cache:
            cache[key] = smallest_period(key)
        if cache[key] is not None:
            return cache[key]
    return None


def _fallback(p: RankPattern) -> float | None:
    """Window / calls of the most frequent collective: one call per step in plain data parallelism."""
    calls = max((f.count for f in p.functions.values() if f.role == Role.COMM), default=0)
    return p.window_s / calls if calls > 0 else None


def step_time(p: RankPattern) -> float | None:
    """The rank's step time in seconds, or None when it shows no collectives at all."""
    k = _period(p, {})
    if k is not None:
        enter = np.fromiter((c.enter for c in p.collectives), float, len(p.collectives))
        return float(np.median(enter[k:] - enter[:-k]))
    return _fallback(p)


def step_times(patterns: Sequence[RankPattern]) -> np.ndarray:
    """step_time of every pattern (NaN for None), vectorized: ranks of one job share their collective
    sequence, so the period is found once per distinct sequence and medians are taken per group."""
    out = np.full(len(patterns), np.nan)
    cache: dict[tuple, int | None] = {}
    groups: dict[tuple[int, int], list[int]] = {}  # (period, length) -> rows
    for i, p in enumerate(patterns):
        k = _period(p, cache)
        if k is None:
            fb = _fallback(p)
            out[i] = np.nan if fb is None else fb
        else:
            groups.setdefault((k, len(p.collectives)), []).append(i)
    for (k, n), rows in groups.items():
        enter = np.array([[c.enter for c in patterns[i].collectives] for i in rows], dtype=float).reshape(len(rows), n)
        out[rows] = np.median(enter[:, k:] - enter[:, :-k], axis=1)
    return out
