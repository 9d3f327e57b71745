"""Differential observability: compare each rank with its peers.

Ranks of a data-parallel job run the same code, so a rank that differs from the others is the suspect.
Two tools: robust z-scores of a per-rank metric over its peers, and the alignment of collective instants
across ranks (who arrived last at a collective, who finished it last), which separates a slow rank from a
slow link when per-rank totals look alike.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rankscope.analyzer.medians import median, row_medians
from rankscope.analyzer.records import Collectives
from rankscope.analyzer.steps import step_times, window_starts
from rankscope.analyzer.thresholds import (HELD_PIECES, HELD_STEPS, LATE_MARGIN, LEAVE_ONE_OUT_MAX, STEP_SPAN, Z_FLOOR,
                                           Z_MIN)
from rankscope.schema.patterns import RankPattern

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x 1.4826 = its standard deviation
# Ops that do not end together on every rank of the group, so instants are not lined up by them:
# point-to-point ops pair two ranks (the "same" send of two pipeline ranks goes to different neighbours at
# different times), and a broadcast ends on a receiver once the root's data arrived, on the root once all
# received (DDP's per-step buffer broadcast), which would mismatch the instances.
NOT_LINED_UP = re.compile(r"send|recv|broadcast", re.I)
# ...yet every rank must arrive at a broadcast, and a straggler may be late there only: between a step's
# all-reduce and the next step's buffer broadcast, the root waits for it and both then reach the all-reduce
# together. Broadcasts are lined up by the lined-up collectives around them instead.
ROOTED = re.compile(r"broadcast", re.I)


def peers_median(x: np.ndarray) -> float:
    """Median over the ranks that have a value (NaN = unknown); NaN when none has."""
    finite = x[np.isfinite(x)]
    return median(finite) if finite.size else float("nan")


def robust_z(x: np.ndarray, floor: float) -> np.ndarray:
    """(x - median) / scale, scale = max(1.4826 * MAD, floor), over the finite entries.

    The floor (a small fraction of the step time) keeps near-identical healthy ranks from turning
    microseconds of noise into huge z-scores. NaN entries stay NaN and do not count as peers.
    """
    finite = np.isfinite(x)
    if not finite.any():
        return np.full(x.shape, np.nan)
    vals = x[finite]
    med = median(vals)
    scale = max(MAD_TO_SIGMA * median(np.abs(vals - med)), floor, 1e-12)
    return (x - med) / scale



def peer_deviation(x: np.ndarray, floor: float) -> tuple[np.ndarray, np.ndarray]:
    """(z, excess) of each rank against its peers: excess = x - the peers' median, z = excess / robust scale.

    In a small job a rank is compared with the *others* only: with 4 ranks, the outlier itself (and one
    noisy peer on the other side) would otherwise inflate the MAD enough to hide it. In a large job one
    rank moves neither the median nor the MAD, so the global statistics serve every rank at once.
    """
    finite = np.isfinite(x)
    n = int(finite.sum())
    if n > LEAVE_ONE_OUT_MAX or n < 2:
        med = peers_median(x)
        return robust_z(x, floor), x - med
    z = np.full(x.shape, np.nan)
    excess = np.full(x.shape, np.nan)
    for i in np.flatnonzero(finite):
        others = x[finite & (np.arange(x.size) != i)]
        med = float(np.median(others))
        scale = max(MAD_TO_SIGMA * float(np.median(np.abs(others - med))), floor, 1e-12)
        excess[i] = x[i] - med
        z[i] = excess[i] / scale
    return z, excess


@dataclass(frozen=True)
class Alignment:
    """Per-rank medians over the collective instances that every compared rank saw (NaN: not compared).

    Lateness is the rank's own instant minus the earliest rank's instant of the same instance; arrival
    lateness is taken per step (see _late_per_step), finish lateness per instance.
    """

    arrival_late_s: np.ndarray  # enter lateness per step: a rank that arrives last holds everybody up
    finish_late_s: np.ndarray  # done lateness: a rank that finishes last has the slow transfer
    transfer_s: np.ndarray  # done - last arrival: the transfer as this rank saw it
    bytes: np.ndarray  # payload per collective
    instances: int  # how many collective instances were lined up
    op: str | None  # the most frequent collective among them
    late_share: np.ndarray  # share of steps it arrived later than the other ranks (by LATE_MARGIN of a step)
    # The least, over the window's pieces (HELD_PIECES of at least HELD_STEPS steps each), by which its late
    # share led every other rank's: how steadily it was the late one (NaN: not compared or too few steps)...
    held_lead: np.ndarray
    mostly_held_lead: np.ndarray  # ...and the next least once the window has all HELD_PIECES: late all through it
    # but one piece, where a peer was late as often (a pipeline stage's rank inherits its upstream's spells)
    halves_lead: np.ndarray  # a window of one piece only (held leads NaN): the least lead its late share
    # guarantees in either half of it, wherever its late steps fall (_halves_lead; NaN in any other window)

    @classmethod
    def empty(cls, n: int) -> Alignment:
        nan = np.full(n, np.nan)
        return cls(nan, nan.copy(), nan.copy(), nan.copy(), 0, None, nan.copy(), nan.copy(), nan.copy(), nan.copy())



def _late_per_step(enter: np.ndarray, step_s: float,
                   held: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per rank (row): how late it arrives per step, the median over stretches of one step (STEP_SPAN) of its
    largest lateness among the instances (columns) that start there; and the share of those stretches in
    which it arrived later than the median of the other ranks by LATE_MARGIN of a step. A straggler is late
    where its extra work ends, at one collective of the step: at every one of DDP's buckets, but only at the
    first of back-to-back per-parameter all-reduces, where the median over instances would hide it. And it
    is late every step, where a rank on a busy CPU is late in some steps only.
    Lateness a rank inherits is not its own: `held` (same shape as `enter`) is how much longer than the
    quickest rank each rank stayed in a rooted collective (a broadcast's root waits there for the last
    receiver, the straggler), and that much of its lateness at the instances within a step after it is
    forgiven (else the root, held there, arrives at the next all-reduces as late as the straggler that held
    it); None: no rooted instance was lined up. Last, how
    steadily each rank was the late one (_held_lead: in every piece of the window, and in all but one; _halves_lead:
    in a window of one piece)."""
    first = enter.min(axis=0)
    order = np.argsort(first, kind="stable")  # instances by time (completion order may differ)
    if (np.diff(order) < 0).any():  # reordered only when out of order: 100,000 ranks x 16 copied costs ~20 ms
        enter, first = enter[:, order], first[order]
        held = None if held is None else held[:, order]
    late = enter - first
    if held is not None:
        late -= _carried(held, first, step_s)
    np.maximum(late, 0.0, out=late)  # in place, as the stretches below: 100,000 ranks' temporaries are 13 MB each
    ends = np.searchsorted(first, first + STEP_SPAN * step_s, side="left")
    starts = np.flatnonzero(ends - np.arange(first.size) >= 1)
    stretches = np.empty((late.shape[0], starts.size))
    for c, j in enumerate(starts.tolist()):
        np.max(late[:, j:ends[j]], axis=1, out=stretches[:, c])
    n = stretches.shape[0]
    if n > LEAVE_ONE_OUT_MAX:  # one rank moves no median of many
        others = np.median(stretches, axis=0, keepdims=True)
    else:  # a small job: each rank against the others only (of two ranks, the median of both halves it)
        others = np.stack([np.median(np.delete(stretches, i, axis=0), axis=0) for i in range(n)])
    was_late = stretches - others >= LATE_MARGIN * step_s
    return (row_medians(stretches), np.mean(was_late, axis=1), *_held_lead(was_late), _halves_lead(was_late))


def _held_lead(was_late: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per rank (row of ranks x stretches in time order): the least, over the window's pieces, by which its
    share of late stretches led the largest of the other ranks'. A rank a tenth of the step slower leads in
    every piece; a healthy rank of an oversubscribed host, late as often over the window, is late in spells
    and leads little in its weakest piece. Then the next least, of a window cut in all HELD_PIECES (else the
    least again). NaN for all when the window has fewer than two pieces of HELD_STEPS stretches."""
    n, m = was_late.shape
    pieces = min(HELD_PIECES, m // HELD_STEPS)
    if pieces < 2 or n < 2:
        return np.full(n, np.nan), np.full(n, np.nan)
    share = np.stack([c.mean(axis=1) for c in np.array_split(was_late, pieces, axis=1)], axis=1)  # ranks x pieces
    lead = np.sort(_lead(share), axis=1)
    return lead[:, 0], lead[:, 1 if pieces == HELD_PIECES else 0]


def _halves_lead(was_late: np.ndarray) -> np.ndarray:
    """Per rank (row of ranks x stretches), in a window of one piece only (HELD_STEPS to twice as many stretches:
    _held_lead NaN), the least lead over the other ranks that its late share guarantees in either half of it,
    wherever its late stretches fall: a rank late in a share s of the window is late in at least 2s - 1 of each
    half, another late in o in at most 2o of either, so it leads by 2(s - o) - 1 at least: a window of few long
    steps still tells a rank late all through it. NaN in a shorter window, and in a longer one, cut instead
    (_held_lead)."""
    n, m = was_late.shape
    if n < 2 or not HELD_STEPS <= m < 2 * HELD_STEPS:
        return np.full(n, np.nan)
    return 2 * _lead(was_late.mean(axis=1, keepdims=True))[:, 0] - 1


def _lead(share: np.ndarray) -> np.ndarray:
    """Ranks x pieces: each rank's late share less the largest of the other ranks' in the same piece."""
    top = np.partition(share, share.shape[0] - 2, axis=0)[-2:]  # the largest is every rank's best other but its
    return share - np.where(share == top[1], top[0], top[1])  # own (a tie: the same)


def _carried(held: np.ndarray, first: np.ndarray, step_s: float) -> np.ndarray:
    """Per rank and instance (columns in time order, `first`: their earliest enters): the hold of the rank's
    latest rooted instance before it, if that began less than a step earlier (else 0)."""
    carried = np.zeros_like(held)
    rooted = np.flatnonzero((held > 0).any(axis=0))
    if rooted.size == 0:
        return carried
    prev = np.searchsorted(rooted, np.arange(first.size), side="left") - 1  # latest rooted column before each
    has = prev >= 0
    cols = np.flatnonzero(has)
    src = rooted[prev[has]]
    near = first[cols] - first[src] < step_s
    carried[:, cols[near]] = held[:, src[near]]
    return carried


def _rooted_between(anchors: np.ndarray, rooted: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Enter and done instants (each ranks x instances) of the rooted collectives between two lined-up
    instances (`anchors`: ranks x instances, enter instants) where every rank entered as many of them (DDP
    broadcasts its buffers in one or several calls); `rooted`: each rank's rooted (enter, done) rows, sorted
    by enter. Ranks run one collective sequence, so the k-th of each rank in a gap is one instance."""
    n, m = anchors.shape
    if m < 2 or not rooted or not all(r.size for r in rooted):
        return np.zeros((n, 0)), np.zeros((n, 0))
    anchors = anchors[:, np.argsort(anchors.min(axis=0), kind="stable")]
    before = np.stack([np.searchsorted(r[:, 0], a) for r, a in zip(rooted, anchors)])  # rooted enters before each
    counts = np.diff(before, axis=1)  # rooted enters in the gap after anchor j, per rank
    gaps = np.flatnonzero((counts == counts[0]).all(axis=0) & (counts[0] > 0))
    if gaps.size == 0:
        return np.zeros((n, 0)), np.zeros((n, 0))
    taken = np.concatenate([before[:, j, None] + np.arange(counts[0, j]) for j in gaps], axis=1)
    rows = np.stack([r[taken[i]] for i, r in enumerate(rooted)])  # ranks x instances x (enter, done)
    return rows[:, :, 0], rows[:, :, 1]


def _rooted(records: Collectives, compared: np.ndarray) -> list[np.ndarray]:
    """Per compared rank: its rooted collectives' (enter, done) rows, sorted."""
    order = np.lexsort((records.done, records.enter, records.row))
    rows = np.stack([records.enter[order], records.done[order]], axis=1)
    per_rank = np.split(rows, np.cumsum(records.counts)[:-1])
    return [r for r, seen in zip(per_rank, compared) if seen]


def _place_in_run(row: np.ndarray, op: np.ndarray, done: np.ndarray) -> np.ndarray | None:
    """Per record: its place in the run of a rank's records of one op that ended at the same instant, one
    after another (0 for the first); None where no two did (gloo's, and NCCL's one a sync: no pass made)."""
    tied = (done[1:] == done[:-1]) & (row[1:] == row[:-1]) & (op[1:] == op[:-1])
    if not tied.any():
        return None
    at = np.arange(done.size)
    starts = np.concatenate(([True], ~tied))
    return at - np.maximum.accumulate(np.where(starts, at, 0))


def align_collectives(patterns: Sequence[RankPattern], step_s: float | None = None,
                      records: Collectives | None = None) -> Alignment:
    """Line up the ranks' collectives instance by instance.

    Each rank's collectives (those that end together on every rank, see NOT_LINED_UP; over the time all
    were watched) are matched to a reference rank's by nearest `done` (same op, |delta| < half a step);
    instances that every compared rank saw are kept. Ranks that matched fewer than half of the reference's
    instances (a rank that stopped, or whose window missed them) are not compared, so that one of them
    does not wipe out every instance. Broadcasts count for arrival only, lined up by _rooted_between.
    Vectorized: O(records log 16), no per-pair work. `records`: the patterns' collectives, when read already.
    """
    n = len(patterns)
    cols = Collectives.of(patterns) if records is None else records
    # The group's own collectives, over the stretch every rank was watched (one attached later, or whose
    # window began later, has no records before it: the others' would find no partner there).
    seen = cols.counts > 0
    since = float(window_starts(patterns)[seen].max()) if seen.any() else 0.0
    # The ops present, each name matched once, not once a record (counted, not sorted: 1.6M records, ~20 ms)
    ops = set(np.flatnonzero(np.bincount(cols.op, minlength=len(cols.ops))).tolist())
    lined_up = sorted(i for i in ops if not NOT_LINED_UP.search(cols.ops[i]))
    rooted_ops = [i for i in ops if ROOTED.search(cols.ops[i])]
    lined = cols.filter(np.isin(cols.op, lined_up) & (cols.enter >= since))
    counts = lined.counts
    if n < 2 or np.count_nonzero(counts) < 2:
        return Alignment.empty(n)
    if step_s is None:
        step_s = peers_median(step_times(patterns, cols))
    if not np.isfinite(step_s) or step_s <= 0:
        return Alignment.empty(n)

    op_ids = {cols.ops[i]: j for j, i in enumerate(lined_up)}
    op = np.searchsorted(lined_up, lined.op)  # each record's index among the lined-up ops
    enter, done, nbytes = lined.enter, lined.done, lined.bytes.astype(float)
    row = lined.row
    offset = lined.offsets

    # Reference: among the ranks with the most records, the one whose last `done` is the median, so that
    # neither an early nor a late rank (maybe the culprit) sets the instances.
    cand = np.flatnonzero(counts == counts.max())
    last_done = done[offset[cand] + counts[cand] - 1]
    ref = cand[np.argsort(last_done, kind="stable")[len(cand) // 2]]
    ref_sl = slice(offset[ref], offset[ref] + counts[ref])
    ref_op, ref_done = op[ref_sl], done[ref_sl]
    n_inst = int(counts[ref])

    # Collectives a host sync completed together (NCCL's, pending until it) share their `done`: the nearest
    # is then the first of the reference's group, for every one of them. Each matches the reference's record
    # at its own place in its group instead (its ordinal among the rank's run of one op ending at once; the
    # sync completes them in one order on every rank of a sequence). Without, a step's many all-reduces would
    # all match the group's first, and none would line up.
    pos = _place_in_run(row, op, done)
    col = np.full(op.size, -1, dtype=np.intp)
    dist = np.full(op.size, np.inf)
    # In place where it can be: each temporary of 1.6M records is 13 MB of fresh memory (in a process's first
    # window, huge pages the kernel compacts and clears). 100,000 ranks: ~20 ms, where a temporary per step
    # took ~30 ms, ~100 in the first window.
    for o in np.unique(ref_op):
        idx = np.flatnonzero(ref_op == o)
        idx = idx[np.argsort(ref_done[idx], kind="stable")]
        vals = ref_done[idx]
        mine = op == o
        sel = slice(None) if mine.all() else np.flatnonzero(mine)  # one op, the common case: no gather
        d = done[sel]
        hi = np.searchsorted(vals, d)
        lo = np.clip(hi - 1, 0, vals.size - 1)
        np.clip(hi, 0, vals.size - 1, out=hi)
        d_lo, d_hi = vals[lo], vals[hi]
        np.abs(np.subtract(d, d_lo, out=d_lo), out=d_lo)
        np.abs(np.subtract(d, d_hi, out=d_hi), out=d_hi)
        np.copyto(lo, hi, where=d_hi < d_lo)  # the nearer of the two
        dist[sel] = np.minimum(d_lo, d_hi, out=d_lo)
        if pos is not None:  # the place in the group of the reference's records ending at that instant
            near = vals[lo]
            first = np.searchsorted(vals, near, side="left")
            lo = np.minimum(first + pos[sel], np.searchsorted(vals, near, side="right") - 1)
        col[sel] = idx[lo]

    # One record per (rank, instance): the nearest, should two records of a rank match one instance.
    ok = np.flatnonzero(dist < step_s / 2)
    every = ok.size == op.size  # each record matched an instance: the columns themselves, no gather of 1.6M
    key = (row if every else row[ok]) * n_inst
    key += col if every else col[ok]
    in_order = bool((key[1:] > key[:-1]).all())
    if in_order:  # the common case, each instance matched once and in order: no sort
        take = ok
    else:
        order = np.lexsort((dist[ok], key))
        first = np.ones(order.size, dtype=bool)
        first[1:] = key[order][1:] != key[order][:-1]
        take = ok[order[first]]

    if take.size == n * n_inst:  # every rank matched every instance, in order (key is 0, 1, ...): no scatter
        E, D, B = ((a if every and in_order else a[take]).reshape(n, n_inst) for a in (enter, done, nbytes))
    else:
        E = np.full((n, n_inst), np.nan)
        D, B = E.copy(), E.copy()
        E[row[take], col[take]] = enter[take]
        D[row[take], col[take]] = done[take]
        B[row[take], col[take]] = nbytes[take]

    finite = np.isfinite(D)
    compared = finite.sum(axis=1) >= max(2, (n_inst + 1) // 2)
    if np.count_nonzero(compared) < 2:
        return Alignment.empty(n)
    kept = finite[compared].all(axis=0)
    if not kept.any():
        return Alignment.empty(n)
    Ek, Dk, Bk = (E, D, B) if compared.all() and kept.all() else (a[compared][:, kept] for a in (E, D, B))

    out = Alignment.empty(n)
    rooted = _rooted(cols.filter(np.isin(cols.op, rooted_ops) & (cols.enter >= since)), compared) if rooted_ops else []
    r_enter, r_done = _rooted_between(Ek, rooted)
    if r_enter.size:
        stay = r_done - r_enter
        held = np.concatenate([np.zeros_like(Ek), stay - stay.min(axis=0)], axis=1)
        arrivals = np.concatenate([Ek, r_enter], axis=1)
    else:
        held, arrivals = None, Ek
    (out.arrival_late_s[compared], out.late_share[compared], out.held_lead[compared],
     out.mostly_held_lead[compared], out.halves_lead[compared]) = _late_per_step(arrivals, step_s, held)
    out.finish_late_s[compared] = row_medians(Dk - Dk.min(axis=0))
    out.transfer_s[compared] = row_medians(Dk - Ek.max(axis=0))
    out.bytes[compared] = row_medians(Bk)
    names = {i: name for name, i in op_ids.items()}
    top_op = Counter(ref_op[kept].tolist()).most_common(1)[0][0]
    return Alignment(out.arrival_late_s, out.finish_late_s, out.transfer_s, out.bytes,
                     int(np.count_nonzero(kept)), names[top_op], out.late_share, out.held_lead, out.mostly_held_lead,
                     out.halves_lead)
