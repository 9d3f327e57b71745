"""Iteration (step) time of a rank, found without knowing the training code.

A synchronous training step issues the same sequence of collectives every iteration, so the collective
sequence is periodic: its period k is the number of collectives per step, and the time between a collective
and the same one k places later is the step time. Two things make the period hard to see in real jobs:
- the collectives of one step may look alike (DDP's gradient buckets of equal size; micro-batch sends), so
  the sequence of names and sizes repeats every 1 collective while the step holds 9;
- their order varies (gloo runs a step's all-reduces on two worker threads).
So names and sizes propose periods (k collectives a step, each (op, bytes) called a whole number of times
among them, in any order), and a collective's step runs to the same (op, bytes) call one step later. The
smallest such period with distinct collectives is the step; where all calls look alike, the long gaps between
them (across the forward pass) mark where steps begin. The collectives shipped are only the window's last
ones, so once k is known the step is taken over the whole window from the call counts (with few steps in the
window, the last steps' spans within what the counts allow).
The ranks of one synchronous job share one step time, the median of their own estimates (a rank that saw
too few collectives, or whose window began later, does not stray). A rank that saw no collective instants
at all falls back to its call counts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from rankscope.analyzer.functions import FunctionTable
from rankscope.analyzer.medians import row_medians
from rankscope.analyzer.records import Collectives
from rankscope.analyzer.thresholds import (BURSTS_SEEN, FAR_GAP, LONG_GAP, LONG_MEAN, MIN_REPEATS, MISSED_BURSTS,
                                           SHORT_SEQUENCE, WHOLE_STEPS, WINDOW_STEPS)
from rankscope.schema.patterns import RankPattern, Role

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
    either end), add up to k, and fill most runs of k consecutive collectives exactly. Order within a step is
    not required: a step's collectives may complete in any order.
    A key called `per` times a step may hold up to ~`per` calls more or fewer than its share: the sequence
    cuts a step at either end. A tighter bound loses the true period of a key called several times a step;
    a looser one (1.5 calls for a key called once a step) lets a shorter period pass and reads the step short."""
    n = keys.size
    uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    positions = [np.flatnonzero(keys == u) for u in uniq]
    # Running count of each key: any k consecutive collectives of a period-k sequence hold each key `per` times.
    running = np.vstack([np.zeros(uniq.size, np.intp), np.cumsum(np.eye(uniq.size, dtype=np.intp)[inverse], axis=0)])
    out = []
    for k in range(1, n // MIN_REPEATS + 1):
        per = np.rint(counts * k / n).astype(int)
        expected = per * n / k
        tolerance = np.maximum(per, 0.1 * expected)
        if per.min() < 1 or per.sum() != k or (np.abs(counts - expected) > tolerance).any():
            continue
        if np.mean(((running[k:] - running[:-k]) == per).all(axis=1)) < WHOLE_STEPS:
            continue
        out.append(_Candidate(k, list(zip(positions, per.tolist()))))
    return out


def _periods(enter: np.ndarray, candidates: list[_Candidate]) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `enter` (ranks x collectives, one key sequence): (k, mean span) of the period, k = 0 where
    none. A candidate's spans run from each call to the same key's call one step later (`per` of its calls
    on). The mean, not the median: a step time is what steps take on average (a job's throughput, and what
    its own log prints as ms/step).
    - The smallest candidate holds distinct collectives, each a whole number of times: that is one step by
      names and sizes (steps may still alternate in length, two loader workers in phase, so that timing
      alone would call two steps one).
    - One kind of collective only (DDP's buckets all of one size, or one bucket): the long gaps between calls
      decide. Bursts of K calls a step leave a long gap (across the forward pass) every K calls, at a fixed
      spacing; a step of one call leaves long gaps only where a step ran late, at random places."""
    rows = enter.shape[0]
    if not candidates:
        return np.zeros(rows, np.intp), np.full(rows, np.nan)
    ks = np.ones(rows, np.intp) * candidates[0].k
    if len(candidates[0].keys) == 1 and enter.shape[1] > 2:
        ks = _burst(enter, {c.k for c in candidates})
        # Bursts are the job's: the ranks of one sequence show the same ones. A period most of them do not share
        # is hiccups on one rank that fell K calls apart, and would read as a step K times too long.
        periods, seen = np.unique(ks, return_counts=True)
        ks = np.where(np.isin(ks, periods[seen * 2 > rows]), ks, candidates[0].k)
    step = np.full(rows, np.nan)
    for k in np.unique(ks):
        c = next(c for c in candidates if c.k == k)
        parts = [enter[:, pos[per:]] - enter[:, pos[:-per]] for pos, per in c.keys if pos.size > per]
        if parts:
            mine = ks == k
            step[mine] = np.concatenate(parts, axis=1)[mine].mean(axis=1)
    ok = np.isfinite(step) & (step > 0)
    return np.where(ok, ks, 0), np.where(ok, step, np.nan)


def _burst(enter: np.ndarray, allowed: set[int]) -> np.ndarray:
    """Per row of one kind of collective: K when its long gaps (LONG_GAP x the median gap, LONG_MEAN x the mean
    at least) fall every K calls, at one phase, at least BURSTS_SEEN times (twice in a short sequence, far out:
    FAR_GAP); else 1.
    Any two long gaps recur at some spacing (two hiccups of a one-call step K calls apart would make a K-call
    "burst"), so a sequence long enough to show three must show three.
    The lattice need not be exact: a hiccup inside a burst (a CPU turn lost between buckets microseconds apart)
    would break an exact one and read the step at a fraction. At most 1 in
    MISSED_BURSTS of the lattice's places may lack its long gap, and at most half as many long gaps as it holds
    may fall off it (a multiple of K, which holds every other burst, has as many off it as on)."""
    gaps = np.diff(enter, axis=1)
    median = row_medians(gaps)
    long = gaps > np.maximum(LONG_GAP * median, LONG_MEAN * gaps.mean(axis=1))[:, None]
    short = enter.shape[1] <= SHORT_SEQUENCE
    seen = 2 if short else BURSTS_SEEN
    out = np.ones(enter.shape[0], np.intp)
    # Only rows with enough long gaps can be bursts: a steady job's rows have none, and leave the loop below.
    rows = np.flatnonzero(long.sum(axis=1) >= seen)
    # Only a short sequence may show two places, both long: there they must also stand far out.
    far = (gaps[rows] > FAR_GAP * median[rows, None]).astype(np.intp) if short else None
    long = long[rows].astype(np.intp)
    total = long.sum(axis=1)
    found = np.zeros(rows.size, bool)
    at = np.arange(rows.size)
    for k in sorted(allowed - {1}):
        if found.all():
            break
        on = _per_phase(long, k)
        phase = np.argmax(on, axis=1)  # the phase the bursts' ends fall on
        hits = on[at, phase]
        places = (gaps.shape[1] - phase + k - 1) // k
        fits = (~found & (hits >= seen) & ((places - hits) * MISSED_BURSTS <= places)
                & (2 * (total - hits) <= hits))
        if far is not None:
            fits &= (places >= BURSTS_SEEN) | (_per_phase(far, k)[at, phase] >= places)
        out[rows[fits]], found[fits] = k, True
    return out


def _per_phase(marks: np.ndarray, k: int) -> np.ndarray:
    """Per row of `marks` (rows x gaps, 0/1): the marked gaps at each phase of a k-call lattice."""
    return np.pad(marks, ((0, 0), (0, -marks.shape[1] % k))).reshape(marks.shape[0], -1, k).sum(axis=1)


def _period_op(seq: Sequence[tuple[str, int]], c: _Candidate) -> tuple[str, int]:
    """The most frequent op of one period and how many times a step calls it, from the candidate's calls per
    step of each key (the first k collectives need not be one whole step: order varies)."""
    per_op: dict[str, int] = {}
    for pos, per in c.keys:
        op = seq[pos[0]][0]
        per_op[op] = per_op.get(op, 0) + per
    op = max(per_op, key=per_op.__getitem__)
    return op, per_op[op]


def _over_window(functions: FunctionTable, rows: np.ndarray, window_s: np.ndarray, spans: np.ndarray, op: str,
                 per_step: int) -> np.ndarray:
    """Per row: the step over the whole window from call counts, window / n (n = op's calls / per_step), where
    the window holds WINDOW_STEPS steps or more. With fewer the edges (a step cut by the window's start or end)
    weigh too much, and the `spans` of the shipped collectives, the window's last steps only, are held within
    what the counts allow: the window lasts between n - 1 and n + 1 steps. A job whose steps change within the
    window (a neighbour's load coming and going) is not its last steps."""
    steps = functions.count_of(op)[rows] / per_step
    with np.errstate(divide="ignore", invalid="ignore"):
        lo = np.where(steps >= 1, window_s[rows] / (steps + 1), 0.0)  # no count: the spans alone
        hi = np.where(steps > 1, window_s[rows] / (steps - 1), np.inf)
        return np.where(steps >= WINDOW_STEPS, window_s[rows] / steps, np.clip(spans, lo, hi))


def _fallback(p: RankPattern) -> float:
    """Window / calls of the most frequent collective: one call per step in plain data parallelism."""
    calls = max((f.count for f in p.functions.values() if f.role == Role.COMM), default=0)
    return p.window_s / calls if calls > 0 else np.nan


def step_time(p: RankPattern) -> float | None:
    """The rank's own step time in seconds, or None when it shows no collectives at all."""
    t = float(step_times([p])[0])
    return t if np.isfinite(t) else None


def window_starts(patterns: Sequence[RankPattern]) -> np.ndarray:
    return np.fromiter(map(attrgetter("window_start"), patterns), float, len(patterns))


def window_seconds(patterns: Sequence[RankPattern]) -> np.ndarray:
    """Each pattern's window_s, as one array."""
    ends = np.fromiter(map(attrgetter("window_end"), patterns), float, len(patterns))
    return np.maximum(ends - window_starts(patterns), 1e-9)


def step_times(patterns: Sequence[RankPattern], records: Collectives | None = None,
               window_s: np.ndarray | None = None, functions: FunctionTable | None = None) -> np.ndarray:
    """The step time of every pattern of one job (NaN: unknown); `records`: their collectives, `window_s`:
    their window_seconds, `functions`: their FunctionTable, when read already (each read is a pass over the
    patterns: ~20 ms at 100,000).
    Vectorized: ranks of a job share their collective sequence, so periods are proposed once per distinct
    sequence and spans are taken per group."""
    cols = Collectives.of(patterns) if records is None else records
    out = np.full(len(patterns), np.nan)
    window_s = window_seconds(patterns) if window_s is None else window_s
    for rows in cols.sequences():
        k = int(cols.counts[rows[0]])
        if not k:
            continue
        first = slice(cols.offsets[rows[0]], cols.offsets[rows[0]] + k)  # the group's sequence: its first row's
        seq = [(cols.ops[o], b) for o, b in zip(cols.op[first].tolist(), cols.bytes[first].tolist())]
        enter = cols.per_row(cols.enter, rows, k)
        # Sizes first (two buckets of different sizes are two collectives of one step); names alone when
        # sizes vary from step to step.
        candidates = _candidates(_key_ids(seq)) or _candidates(_key_ids([op for op, _ in seq]))
        ks, spans = _periods(enter, candidates)
        # The window's call counts cover all of it (the collectives shipped cover only its last steps).
        for c in candidates:
            mine = ks == c.k
            if mine.any():
                functions = FunctionTable.of(patterns) if functions is None else functions
                out[rows[mine]] = _over_window(functions, rows[mine], window_s, spans[mine], *_period_op(seq, c))
    known = np.isfinite(out)
    seen = cols.counts > 0
    if known.any():  # one synchronous job, one step time: the median of the ranks' own
        out[seen] = float(np.median(out[known]))
    for i in np.flatnonzero(np.isnan(out)):
        out[i] = _fallback(patterns[i])
    return out
