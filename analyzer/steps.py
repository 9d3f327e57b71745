"""Iteration (step) time of a rank, found without knowing the training code.

A synchronous training step issues the same sequence of collectives every iteration, so the collective
sequence is periodic: its period k is the number of collectives per step, and the time between a collective
and the same one k places later is the step time. Two things make the period hard to see in real jobs:
- the collectives of one step may look alike (DDP's gradient buckets of equal size; micro-batch sends), so
  the sequence of names and sizes repeats every 1 collective while the step holds 9;
- their order varies (gloo runs a step's all-reduces on two worker threads).
So names and sizes only propose periods (k collectives a step, each (op, bytes) called a whole number of times
among them), a collective's step runs to the same (op, bytes) call one step later, whatever the order in
between, and timing decides: k collectives must span one step *every* time, while a part of a step spans a
short stretch inside the backward pass here and the long gap across the forward pass there. The k whose spans gather most tightly
around their median (or its smallest divisor that agrees) is the period. The collectives shipped are only
the window's last ones, so once k is known the step is taken over the whole window from the call counts.
The ranks of one synchronous job share one step time, the median of their own estimates (a rank that saw
too few collectives, or whose window began later, does not stray). A rank that saw no collective instants
at all falls back to its call counts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .patterns import RankPattern, Role

MIN_REPEATS = 2  # a period must be seen at least twice to be believed
SPAN_TOLERANCE = 0.3  # a span "is one step" within this fraction of the median span
CV_SLACK = 2.0  # a divisor's spans may vary this many times more than sums of independent steps would
CV_FLOOR = 0.01  # ... counting the best k's variation as at least this (a perfectly regular job)
WINDOW_STEPS = 20  # steps in the window for the call counts to give the step (edges cost at most 1/20)


def _key_ids(keys: Sequence) -> np.ndarray:
    ids: dict = {}
    return np.fromiter((ids.setdefault(k, len(ids)) for k in keys), np.intp, len(keys))


@dataclass(frozen=True)
class _Candidate:
    """A period the names/sizes allow: k collectives a step, `per` calls of each key among them."""

    k: int
    keys: list[tuple[np.ndarray, int]]  # (positions of the key in the sequence, its calls per step)


def _candidates(keys: np.ndarray) -> list[_Candidate]:
    """Periods k whose calls per step make every key's count in the sequence (within the window's cut steps at
    either end) and add up to k. Order is not required: a step's collectives may complete in any order."""
    n = keys.size
    uniq, counts = np.unique(keys, return_counts=True)
    positions = [np.flatnonzero(keys == u) for u in uniq]
    out = []
    for k in range(1, n // MIN_REPEATS + 1):
        per = np.rint(counts * k / n).astype(int)
        expected = per * n / k
        if per.min() < 1 or per.sum() != k or (np.abs(counts - expected) > np.maximum(1.5, 0.1 * expected)).any():
            continue
        out.append(_Candidate(k, list(zip(positions, per.tolist()))))
    return out


def _periods(enter: np.ndarray, candidates: list[_Candidate]) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `enter` (ranks x collectives, one key sequence): (k, mean span) of the period, k = 0 where
    none. A candidate's spans run from each call to the same key's call one step later (`per` of its calls
    on). The candidate whose spans gather best around their median wins, reduced to its smallest divisor
    candidate that is steady enough to add up to it (a multiple of the period gathers better only because
    relative jitter shrinks over several steps). The mean, not the median: a step time is what a job's
    steps take on average (its throughput, and what its own log prints as ms/step)."""
    rows = enter.shape[0]
    if not candidates:
        return np.zeros(rows, np.intp), np.full(rows, np.nan)
    med = np.full((rows, len(candidates)), np.nan)
    mean, cv = med.copy(), med.copy()
    gathered = np.zeros((rows, len(candidates)))
    for j, c in enumerate(candidates):
        parts = [enter[:, pos[per:]] - enter[:, pos[:-per]] for pos, per in c.keys if pos.size > per]
        if not parts:
            continue
        spans = np.concatenate(parts, axis=1)
        med[:, j], mean[:, j] = np.median(spans, axis=1), spans.mean(axis=1)
        cv[:, j] = spans.std(axis=1) / np.where(mean[:, j] > 0, mean[:, j], np.nan)
        gathered[:, j] = np.mean(np.abs(spans - med[:, j:j + 1]) <= SPAN_TOLERANCE * med[:, j:j + 1], axis=1)
    ks = np.array([c.k for c in candidates])
    best = np.argmax(gathered, axis=1)  # ties: the smallest k
    choice = best.copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        # A divisor d of the best k is the period when its spans vary no more than steps that add up to the
        # k-span would: the CV of a sum of k/d steps is the CV of one over sqrt(k/d). Parts of a step (a short
        # gap inside backward here, the long one across forward there) vary far more than that.
        best_cv = cv[np.arange(rows), best]
        for j in range(len(candidates) - 1, -1, -1):  # the smallest consistent divisor is tried last, so it wins
            divides = (ks[best] % ks[j] == 0) & (ks[j] < ks[best])
            steady = cv[:, j] <= CV_SLACK * np.maximum(best_cv, CV_FLOOR) * np.sqrt(ks[best] / ks[j])
            choice = np.where(divides & steady, j, choice)
    step = mean[np.arange(rows), choice]
    ok = np.isfinite(step) & (step > 0)
    return np.where(ok, ks[choice], 0), np.where(ok, step, np.nan)


def _period_op(seq: Sequence[tuple[str, int]], k: int) -> tuple[str, int]:
    """The most frequent op of one period and how many times a step calls it."""
    ops = [op for op, _ in seq[:k]]
    op = max(set(ops), key=ops.count)
    return op, ops.count(op)


def _over_window(p: RankPattern, op: str, per_step: int) -> float:
    """The step over the whole window from call counts: window / (op's calls / per_step); NaN with too few
    steps in the window to beat the edges (a step cut by the window's start or end) or no count."""
    steps = (p.functions[op].count if op in p.functions else 0) / per_step
    return p.window_s / steps if steps >= WINDOW_STEPS else np.nan


def _fallback(p: RankPattern) -> float:
    """Window / calls of the most frequent collective: one call per step in plain data parallelism."""
    calls = max((f.count for f in p.functions.values() if f.role == Role.COMM), default=0)
    return p.window_s / calls if calls > 0 else np.nan


def step_time(p: RankPattern) -> float | None:
    """The rank's own step time in seconds, or None when it shows no collectives at all."""
    t = float(step_times([p])[0])
    return t if np.isfinite(t) else None


def step_times(patterns: Sequence[RankPattern]) -> np.ndarray:
    """The step time of every pattern of one job (NaN: unknown). Vectorized: ranks of a job share their
    collective sequence, so periods are proposed once per distinct sequence and spans are taken per group."""
    out = np.full(len(patterns), np.nan)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(patterns):
        groups.setdefault(tuple((c.op, c.bytes) for c in p.collectives), []).append(i)
    for seq, rows in groups.items():
        if not seq:
            continue
        enter = np.array([[c.enter for c in patterns[i].collectives] for i in rows], dtype=float)
        # Sizes first (two buckets of different sizes are two collectives of one step); names alone when
        # sizes vary from step to step.
        candidates = _candidates(_key_ids(seq)) or _candidates(_key_ids([op for op, _ in seq]))
        ks, spans = _periods(enter, candidates)
        # The window's call counts cover all of it (the collectives shipped cover only its last steps).
        ops = {k: _period_op(seq, k) for k in set(ks.tolist()) if k}
        out[rows] = [_over_window(patterns[i], *ops[k]) if k else np.nan for i, k in zip(rows, ks.tolist())]
        out[rows] = np.where(np.isfinite(out[rows]), out[rows], spans)
    known = np.isfinite(out)
    seen = np.fromiter((bool(p.collectives) for p in patterns), bool, len(patterns))
    if known.any():  # one synchronous job, one step time: the median of the ranks' own
        out[seen] = float(np.median(out[known]))
    for i in np.flatnonzero(np.isnan(out)):
        out[i] = _fallback(patterns[i])
    return out
