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
them (across the forward pass) mark where steps begin.
A window is not all steps: a job starts up before its first step, pauses between steps (a checkpoint's save,
an evaluation) and may end before the window does. The step is the steps' own duration, the mean span less the
spans that hold a pause, and the rest of the window is its time outside steps, reported apart (a window with a
checkpoint's save is no slower a job). The collectives shipped may be only the window's last ones: then the
call counts give the steps of the whole window, and the time before the shipped ones is steps at their pace
unless it is far slower (start-up, or a pause among them).
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
from rankscope.analyzer.thresholds import (BURSTS_SEEN, EXTRA_CALLS, FAR_GAP, LEAD_DRIFT, LONG_GAP, LONG_MEAN,
                                           MIN_REPEATS, MISSED_BURSTS, NOT_EVERY_STEP, PAUSE_MIN_S, PAUSE_STEPS,
                                           SHORT_SEQUENCE, UPPER_QUARTILE, WHOLE_STEPS, WINDOW_STEPS)
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
    A key called `per` times a step holds up to `per` calls more or fewer than its share (the sequence cuts a
    step at either end), whatever the window's length: every key's count then implies the same number of steps
    within one, the fewest that any key implies. A tolerance growing with the count lets a step less one call
    pass for a step in a long sequence (FSDP2's many all-gathers a step) and reads the step short; a looser
    bound (1.5 calls for a key called once a step) lets a shorter period pass; a tighter one than `per` loses
    the true period of a key called several times a step.
    A key may also hold calls outside the steps, EXTRA_CALLS a step at most (a Trainer's gather of the loss at
    each logging step and before its first step): taken as the step's share, they push the other keys short.
    Keys called in fewer than half the steps (DDP's broadcast of the module's state before the first step, a
    logging step's gather) are no part of the period, up to NOT_EVERY_STEP of the sequence: left in, they admit
    no period at all, and the step falls back to the window over the calls of one all-reduce."""
    n = keys.size
    uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    positions = [np.flatnonzero(keys == u) for u in uniq]
    # Running count of each key: any k consecutive collectives of a period-k sequence hold each key `per` times.
    running = np.vstack([np.zeros(uniq.size, np.intp), np.cumsum(np.eye(uniq.size, dtype=np.intp)[inverse], axis=0)])
    out = []
    for k in range(1, n // MIN_REPEATS + 1):
        per = np.rint(counts * k / n).astype(int)
        every = per > 0  # the others are called in fewer than half the steps: not the step's
        if not every.any() or counts[~every].sum() > NOT_EVERY_STEP * n or per.sum() != k:
            continue
        steps = float((counts / np.maximum(per, 1))[every].min())  # extra calls only add: the fewest is the steps
        if (counts - per * steps > per + EXTRA_CALLS * steps)[every].any():
            continue
        if np.mean(((running[k:] - running[:-k])[:, every] == per[every]).all(axis=1)) < WHOLE_STEPS:
            continue
        out.append(_Candidate(k, [(pos, p) for pos, p in zip(positions, per.tolist()) if p]))
    return out


def _proposed(seq: Sequence[tuple[str, int]]) -> list[_Candidate]:
    """Sizes first (two buckets of different sizes are two collectives of one step); names alone when sizes
    vary from step to step."""
    return _candidates(_key_ids(seq)) or _candidates(_key_ids([op for op, _ in seq]))


def _start_up(seq: Sequence[tuple[str, int]]) -> int:
    """Where the steps begin in a sequence that opens with the job's start-up: after the last call of a key
    seen MIN_REPEATS times at most (DDP's broadcast of the module's state), if in its first half; else 0.
    Start-up also calls the step's own collectives (the Trainer gathers the batch's token count before its
    first step), a call more than the steps' share, which the period's tolerance rightly refuses."""
    keys = _key_ids(seq)
    once = np.flatnonzero(np.bincount(keys) <= MIN_REPEATS)
    last = int(np.flatnonzero(np.isin(keys, once)).max(initial=-1)) + 1
    return last if last <= len(seq) // 2 else 0


def _periods(enter: np.ndarray, candidates: list[_Candidate], one_a_step: np.ndarray) -> np.ndarray:
    """Per row of `enter` (ranks x collectives, one key sequence): k of its period, 0 where none. `one_a_step`:
    per row, whether the rank's own count of its synchronized steps says one collective a step.
    - The smallest candidate holds distinct collectives, each a whole number of times: that is one step by
      names and sizes (steps may still alternate in length, two loader workers in phase, so that timing
      alone would call two steps one).
    - One kind of collective only (DDP's buckets all of one size, or one bucket): the long gaps between calls
      decide. Bursts of K calls a step leave a long gap (across the forward pass) every K calls, at a fixed
      spacing; a step of one call leaves long gaps only where a step ran late, at random places, or where the
      job pauses every K steps (a checkpoint's save every 25: a lattice as regular as bursts), which only
      the count of its steps tells apart."""
    rows = enter.shape[0]
    if not candidates:
        return np.zeros(rows, np.intp)
    ks = np.ones(rows, np.intp) * candidates[0].k
    if len(candidates[0].keys) == 1 and enter.shape[1] > 2:
        ks = np.where(one_a_step, candidates[0].k, _burst(enter, {c.k for c in candidates}))
        # Bursts are the job's: the ranks of one sequence show the same ones. A period most of them do not share
        # is hiccups on one rank that fell K calls apart, and would read as a step K times too long.
        periods, seen = np.unique(ks, return_counts=True)
        ks = np.where(np.isin(ks, periods[seen * 2 > rows]), ks, candidates[0].k)
    return ks


def _spans(enter: np.ndarray, c: _Candidate) -> np.ndarray | None:
    """Rows x spans of candidate `c`: from each call to the same key's call one step later (`per` of its calls
    on); None where no key repeats. Every instant between the first and the last call lies in k of them."""
    parts = [enter[:, pos[per:]] - enter[:, pos[:-per]] for pos, per in c.keys if pos.size > per]
    return np.concatenate(parts, axis=1) if parts else None


def _one_a_step(functions: FunctionTable, rows: np.ndarray, seq: Sequence[tuple[str, int]]) -> np.ndarray:
    """Per row: whether its calls of the sequence's first op are one per synchronized step, where the rank
    counts those steps (DDP's reducer waits for its buckets once a step: Role.EXPOSED); False where unknown."""
    synced = [j for j, role in enumerate(functions.roles) if role == Role.EXPOSED]
    if not synced:
        return np.zeros(rows.size, bool)
    steps = functions.count[rows][:, synced].max(axis=1)
    return (steps > 0) & (np.rint(functions.count_of(seq[0][0])[rows] / np.maximum(steps, 1)) == 1)


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


def _period_op(seq: Sequence[tuple[str, int]], c: _Candidate) -> tuple[str, int, int]:
    """The most frequent op of one period, how many times a step calls it (from the candidate's calls per step
    of each key: the first k collectives need not be one whole step, order varies), and its calls shipped."""
    per_op: dict[str, list[int]] = {}
    for pos, per in c.keys:
        counts = per_op.setdefault(seq[pos[0]][0], [0, 0])
        counts[0] += per
        counts[1] += pos.size
    op = max(per_op, key=lambda name: per_op[name][0])
    return op, *per_op[op]


@dataclass(frozen=True)
class Steps:
    """Per pattern of one job: its step time and its window's time outside steps (NaN: unknown)."""

    step_s: np.ndarray
    outside_s: np.ndarray  # before the first step, in pauses between steps, after the last one
    longest_s: np.ndarray  # the longest of those stretches (0 where there is none)


def _split(spans: np.ndarray, k: int, first: np.ndarray, last: np.ndarray, window_start: np.ndarray,
           window_s: np.ndarray, steps: np.ndarray, unseen: np.ndarray) -> Steps:
    """Per row: its step from its `spans` (rows x spans of a k-collective period), and the time outside steps
    of its window. `first`/`last`: its first and last shipped collective's entry; `steps`: the steps its call
    counts give the whole window; `unseen`: how many of them came before the first shipped collective.
    - A span PAUSE_STEPS x the upper quartile of the spans and PAUSE_MIN_S beyond it holds a pause (a
      checkpoint's save, an evaluation): the step is the mean of the others, and a pause's time beyond a step
      is outside steps (it lies in k spans, so their excess is summed and divided by k).
    - Before the first shipped collective: the unseen steps and one cut by the window's start, LEAD_DRIFT
      slower than the shipped ones at most (the job's pace may drift); time beyond that, (PAUSE_STEPS - 1)
      steps and PAUSE_MIN_S at least, is start-up or a pause.
      After the last one: one step; longer by (PAUSE_STEPS - 1) steps is the tail (the job ended or stalled).
    - Where the shipped collectives cover the window, or the rest of it held a pause, the step is theirs;
      else the rest is steps at its own pace, and the step is the window's time in steps over the steps its
      call counts give (where the window holds fewer than WINDOW_STEPS, the shipped steps' within what those
      counts allow: one step more or fewer). A job whose steps change within the window (a neighbour's load
      coming and going) is not its last steps."""
    at = min(spans.shape[1] - 1, int(UPPER_QUARTILE * spans.shape[1]))
    quartile = np.partition(spans, at, axis=1)[:, at, None]
    paused = spans > np.maximum(PAUSE_STEPS * quartile, quartile + PAUSE_MIN_S)
    step = np.nanmean(np.where(paused, np.nan, spans), axis=1)  # never all NaN: the quartile's own span is kept
    excess = np.where(paused, spans - step[:, None], 0.0)
    lead = first - window_start - (unseen + 1) * (1 + LEAD_DRIFT) * step
    long_lead = lead > np.maximum((PAUSE_STEPS - 1) * step, PAUSE_MIN_S)
    lead = np.where(long_lead & (steps >= 1), lead, 0.0)  # no call count: what came before is unknown
    tail = window_start + window_s - last - step
    tail = np.where(tail > np.maximum((PAUSE_STEPS - 1) * step, PAUSE_MIN_S), tail, 0.0)
    outside = excess.sum(axis=1) / k + lead + tail
    longest = np.maximum.reduce([excess.max(axis=1), lead, tail])
    in_steps = window_s - outside
    with np.errstate(divide="ignore", invalid="ignore"):
        lo = np.where(steps >= 1, in_steps / (steps + 1), 0.0)  # no count: the spans alone
        hi = np.where(steps > 1, in_steps / (steps - 1), np.inf)
        counted = np.where(steps >= WINDOW_STEPS, in_steps / steps, np.clip(step, lo, hi))
    return Steps(np.where((unseen < 1) | (lead > 0), step, counted), outside, longest)


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
    """The step time of every pattern of one job (NaN: unknown): step_split's."""
    return step_split(patterns, records, window_s, functions).step_s


def step_split(patterns: Sequence[RankPattern], records: Collectives | None = None,
               window_s: np.ndarray | None = None, functions: FunctionTable | None = None) -> Steps:
    """The step time of every pattern of one job and its window's time outside steps; `records`: their
    collectives, `window_s`: their window_seconds, `functions`: their FunctionTable, when read already (each
    read is a pass over the patterns: ~20 ms at 100,000).
    Vectorized: ranks of a job share their collective sequence, so periods are proposed once per distinct
    sequence and spans are taken per group."""
    cols = Collectives.of(patterns) if records is None else records
    n = len(patterns)
    out, outside, longest = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    window_s = window_seconds(patterns) if window_s is None else window_s
    starts = window_starts(patterns)
    for rows in cols.sequences():
        size = int(cols.counts[rows[0]])
        if not size:
            continue
        first = slice(cols.offsets[rows[0]], cols.offsets[rows[0]] + size)  # the group's sequence: its first row's
        seq = [(cols.ops[o], b) for o, b in zip(cols.op[first].tolist(), cols.bytes[first].tolist())]
        enter = cols.per_row(cols.enter, rows, size)
        candidates = _proposed(seq)
        if head := _start_up(seq):  # the steps after the job's start-up, where their period is the shorter
            after = _proposed(seq[head:])
            if after and (not candidates or after[0].k < candidates[0].k):
                seq, enter, candidates = seq[head:], enter[:, head:], after
        functions = FunctionTable.of(patterns) if functions is None else functions
        ks = _periods(enter, candidates, _one_a_step(functions, rows, seq))
        for c in candidates:
            mine = np.flatnonzero(ks == c.k)
            if not mine.size or (spans := _spans(enter[mine], c)) is None:
                continue
            # The window's call counts cover all of it (the collectives shipped may cover only its last steps).
            op, per_step, shipped = _period_op(seq, c)
            at = rows[mine]
            steps = functions.count_of(op)[at] / per_step
            split = _split(spans, c.k, enter[mine].min(axis=1), enter[mine].max(axis=1), starts[at], window_s[at],
                           steps, np.clip(steps - shipped / per_step, 0.0, None))
            ok = np.isfinite(split.step_s) & (split.step_s > 0)
            out[at[ok]], outside[at[ok]], longest[at[ok]] = split.step_s[ok], split.outside_s[ok], split.longest_s[ok]
    known = np.isfinite(out)
    seen = cols.counts > 0
    if known.any():  # one synchronous job, one step time: the median of the ranks' own
        out[seen] = float(np.median(out[known]))
    for i in np.flatnonzero(np.isnan(out)):
        out[i] = _fallback(patterns[i])
    return Steps(out, outside, longest)
