"""Stragglers: a rank the others wait for in collectives, and where its extra time goes (its own GPU work,
host work, a data-loading function, Python GC, or waiting for a CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, NamedTuple

import numpy as np

from rankscope.analyzer.differential import Alignment, peer_deviation, peers_median
from rankscope.analyzer.metrics import DATA_LOADING, RankTable
from rankscope.analyzer.rules.wording import ms, range_ms, rank_list
from rankscope.analyzer.thresholds import (ALWAYS_LATE, ALWAYS_LATE_BY, CONTENDED_HELD, CONTENTION_RAN,
                                           CONTENTION_SHARE, FAR_LATE_BY, FAULTS_HELD, FAULTS_SPREAD, GPU_SHARE,
                                           LATE_RATIO, LATE_RATIO_STEPS, LATE_SOME, LATE_STEPS, LEAVE_ONE_OUT_MAX,
                                           MIN_RANKS, OTHER_WORK, PAIR_RANKS, PEERS_RARELY, PYTHON_SHARE, SMALL_HELD,
                                           SMALL_LATE, SMALL_RAN, SMALL_RATIO, SMALL_USER, SMALL_WINDOWS, STEADY_SPAN,
                                           STEADY_WINDOWS, STRAGGLER_MIN_EXCESS, Z_FLOOR, Z_MIN)
from rankscope.schema.finding import Finding, Why
from rankscope.schema.patterns import RankPattern, Role

STRAGGLERS = frozenset({"compute_straggler", "input_straggler", "python_gc", "cpu_contention"})  # this module's kinds
PAGE_FAULTS = "page faults"  # the function a straggler's extra time is in when that is mostly faulting

_HOST_TIME = None  # "function" of time outside every probed function


def faulting(t: RankTable) -> np.ndarray:
    """Per row: the kernel time a step its page faults beyond its peers' cost it (0 where none, or unknown),
    which is not the rank's work. Ranks running the same code fault in different amounts of memory: glibc's
    malloc hands freed memory back to the OS or keeps it depending on each process's own history, and the
    pages it hands back are faulted in again on the next step: healthy ranks alike in user time can differ
    by a tenth of the step in the kernel, and be that much longer on a CPU and late at the collectives,
    without being stragglers. Counted as the extra faults at the rank's own cost per fault, at
    most its extra kernel time in its steps (in_steps): a rank whose kernel time grows without faults (a
    loader's reads) keeps it, and a pause's faults (a checkpoint's buffers) are no step's."""
    kernel = in_steps(peer_deviation(t.kernel_s, 0.0)[1], t.outside_per_step_s)
    faults = peer_deviation(t.faults, 0.0)[1]
    with np.errstate(invalid="ignore", divide="ignore"):
        cost = np.minimum(kernel, faults * t.kernel_s / t.faults)
    return np.clip(np.nan_to_num(cost, nan=0.0, posinf=0.0, neginf=0.0), 0.0, None)


def excused_faults(paged: np.ndarray, step: float, through: np.ndarray | None = None) -> np.ndarray:
    """Of the page faults' time beyond the peers' (`paged`, faulting): what is not the rank's work. All of it
    within FAULTS_SPREAD of the step, the ranks' usual spread; beyond, the excuse shrinks as fast as the time
    grows, to none at twice the spread: a rank that far out faults as its work does, not as its malloc's
    history happens to (continuous, so a healthy rank just past the spread is not suddenly late by all of it).
    None for a rank late all through the window (`through`, late_through; None: the collectives not lined up)."""
    excused = np.minimum(paged, np.clip(2 * FAULTS_SPREAD * step - paged, 0.0, None))
    return excused if through is None else np.where(through, 0.0, excused)


def late_through(a: Alignment, paged: np.ndarray, step: float, runq: np.ndarray, user: np.ndarray) -> np.ndarray:
    """Per row: the late one all through the window, its late share ahead of every peer's by SMALL_HELD in each
    piece of it (Alignment.held_lead), by CONTENDED_HELD where it was held behind others for a CPU (`runq`:
    _runq_excess) and worked no longer in user mode (`user`; NaN: unknown); a rank faulting beyond the ranks'
    usual spread (`paged`: faulting), by FAULTS_HELD in all pieces but one (Alignment.mostly_held_lead). A window
    of one piece, by as much in either half of it (Alignment.halves_lead); False where it is shorter."""
    lead, mostly = _leads(a)
    with np.errstate(invalid="ignore"):
        leads = lead >= _lead_bar(paged, step, runq, user)
        return leads | ((paged > FAULTS_SPREAD * step) & (mostly >= FAULTS_HELD))


def _leads(a: Alignment) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its held lead and its mostly held lead, either half's in a window of one piece (late_through)."""
    return (np.where(np.isfinite(a.held_lead), a.held_lead, a.halves_lead),
            np.where(np.isfinite(a.mostly_held_lead), a.mostly_held_lead, a.halves_lead))


def _lead_bar(paged: np.ndarray, step: float, runq: np.ndarray, user: np.ndarray) -> np.ndarray:
    """Per row: the held lead that makes it late all through the window (late_through): CONTENDED_HELD where
    it was held behind others for a CPU and worked no longer in user mode, SMALL_HELD otherwise."""
    with np.errstate(invalid="ignore"):
        contended = (runq >= STRAGGLER_MIN_EXCESS * step) & (runq >= paged) & (user < SMALL_USER * step)
    return np.where(contended, CONTENDED_HELD, SMALL_HELD)


def in_steps(excess: np.ndarray, outside: np.ndarray | float) -> np.ndarray:
    """A rank's excess per step of a window total beyond its peers' (time on a CPU, in user mode, its GPU
    busy), less the most of it its time outside steps (`outside`, RankTable.outside_per_step_s) can hold. A
    window's totals hold what a rank does in its pauses too (the rank that writes a checkpoint, while its peers
    wait for it), which is no step's work: only what its pauses cannot hold is surely in its steps. A rank that
    works longer in every step still shows it in its arrivals and in its share of the collectives' wait."""
    with np.errstate(invalid="ignore"):
        return np.where(excess > 0, np.clip(excess - outside, 0.0, None), excess)


def decidable(t: RankTable, min_ranks: int = MIN_RANKS) -> np.ndarray | None:
    """Rows with a known step time, or None when too few ranks to compare."""
    valid = np.isfinite(t.step_s)
    ok = np.count_nonzero(valid) >= min_ranks and np.isfinite(t.job_step_s) and t.job_step_s > 0
    return valid if ok else None


@dataclass(frozen=True)
class Straggling:
    """The ranks (rows) the others wait for, and what the rules weigh them by."""

    rows: np.ndarray  # the others wait for them...
    thin: np.ndarray  # ...these by being late in some steps of a window of few (LATE_RATIO_STEPS): small ones
    small: np.ndarray  # small stragglers: named once seen in SMALL_WINDOWS of twice as many (empty without `a`)...
    held: np.ndarray  # ...but these at once: late all through the window (SMALL_HELD), or longer in user time
    # (SMALL_USER)
    steady: np.ndarray  # working longer (or later on average) in a window too short to cut, none of the above:
    # named once seen in STEADY_WINDOWS of STEADY_SPAN (empty without `a`)
    z: np.ndarray  # robust z of the own work per step (step - COMM) against the peers'
    excess: np.ndarray  # own work per step beyond the peers' median, less `excused`...
    excused: np.ndarray  # ...its extra page faults' time within the ranks' usual spread (excused_faults; what the
    # others wait for is both: a finding reports their sum)
    paged: np.ndarray  # its extra page faults' time, whole (faulting): beyond `excused`, part of `excess`
    gpu_excess: np.ndarray  # its GPU busy longer than its peers' a step (_gpu_busy_excess; NaN: not measured)
    ran: np.ndarray  # on a CPU longer than its peers a step, less `excused` (NaN: not measured)
    user: np.ndarray  # in user mode longer than its peers a step (NaN: no kernel view)
    work: np.ndarray
    comm_med: float
    checks: Checks  # what it compared, per row: the findings' `why` (explain)


@dataclass(frozen=True)
class Checks:
    """What straggling() compared, per row, beside Straggling's own arrays: what `explain` reads."""

    step: float
    comm_excess: np.ndarray  # time in collectives beyond the peers' (below 0: it waits less)
    arrivals: Arrivals | None = None  # None: the collectives not lined up (totals only)
    share: np.ndarray | None = None  # late share, and its peers' (_late_shares)
    peers_share: np.ndarray | None = None
    steps: float = 0.0  # the window's steps
    works: np.ndarray | None = None  # own extra work that the lateness must be SMALL_RAN of (ran + waited + GPU)
    lead: np.ndarray | None = None  # held lead (late_through's), and the bar it had to clear
    lead_bar: np.ndarray | None = None
    mostly: np.ndarray | None = None


def straggling(t: RankTable, min_ranks: int = MIN_RANKS, a: Alignment | None = None) -> Straggling | None:
    """Rows whose own work per step (step - COMM) is a robust outlier while they wait less in collectives
    than their peers. With `a` (the collectives lined up), the rank must also arrive last, later than its peers
    by at least STRAGGLER_MIN_EXCESS of the step (C4's rule: the others wait for it). That decides two ranks,
    and it keeps collectives that overlap the rank's own work (DDP's buckets all-reduced on gloo's threads
    during backward: COMM then spans most of the step on every rank, and step - COMM is noise) from naming a
    rank that is in fact the first to arrive. The kernel time of a rank's page faults beyond its peers' is
    not its work within the ranks' usual spread (faulting, excused_faults)."""
    if a is not None and a.instances == 0:  # nothing lined up (no collective instants shipped): totals only
        a = None
    valid = decidable(t, PAIR_RANKS if a is not None else min_ranks)
    if valid is None:
        return None
    step = t.job_step_s
    paged = faulting(t)
    outside = t.outside_per_step_s
    user = in_steps(peer_deviation(np.where(valid, t.oncpu_s - t.kernel_s, np.nan), 0.0)[1], outside)  # NaN: unknown
    through = None if a is None else late_through(a, paged, step, _runq_excess(t), user)
    faults = excused_faults(paged, step, through)
    work = np.where(valid, t.work_s - faults, np.nan)
    z, excess = peer_deviation(work, Z_FLOOR * step)
    comm_med = peers_median(np.where(valid, t.comm_s, np.nan))
    gpu_excess = _gpu_busy_excess(t)
    ran = in_steps(peer_deviation(t.oncpu_s, 0.0)[1], outside) - faults
    small = held = thin = steady = np.zeros(valid.shape, dtype=bool)
    comm_excess = peer_deviation(np.where(valid, t.comm_s, np.nan), 0.0)[1]
    checks = Checks(step, comm_excess)
    with np.errstate(invalid="ignore"):
        # Against the others only, as its work is: of three ranks, a straggler whose peer is late too (a broadcast's
        # root it holds up) is the median and would wait no less than itself.
        waits_less = comm_excess < 0
        outlier = (z >= Z_MIN) & (excess >= STRAGGLER_MIN_EXCESS * step) & waits_less
        flagged = valid & outlier
        if a is not None:
            steps = peers_median(t.window_s[valid]) / step  # in the window
            arrives = _arrives_last(a, valid, step, steps, faults)
            thin, late_by = arrives.thin, arrives.late_by
            # On a host loaded several deep, gloo's buckets overlap backward unevenly and step - COMM swings
            # between the others, hiding a rank late in nearly every step: the instants decide, when the rank
            # also waits in collectives for less than its peers by half its lateness or more (they wait for it).
            # A rank whose link is slow arrives late too, after its collectives ended late: it waits in them as
            # long as its peers.
            far_less = comm_med - t.comm_s >= 0.5 * late_by
            surely = valid & arrives.always & (excess > 0) & far_less
            flagged = (flagged & arrives.last) | surely
            thin = thin & flagged & ~surely  # a new array: arrives.thin stays as _arrives_last made it
            busier = np.isfinite(a.held_lead) & (user >= SMALL_USER * step)  # held lead NaN: too few steps to cut
            # Its own work longer both ways, step - COMM and user time: the one the others wait for, however little
            # later it arrives. A pipeline stage's spinner is late at its stage's all-reduce by 2-6% of the step
            # in 40-50% of them: its peer waits for it there through the other stage's ranks, along the sends.
            worked = busier & (excess >= STRAGGLER_MIN_EXCESS * step) & (late_by > 0)
            # ...or later than its peers at all, on average and in more of the steps, however little and whatever it
            # waits: where a rank had slack, its extra work fills it first, and on a host the job oversubscribes
            # its spin takes the CPU its peers wait for, so it is late by little and in under half the steps,
            # while its longer user time tells it from a peer late as often by its page faults.
            leads = busier & arrives.oftener
            # Its own work is also its host's wait for its own GPU: a slower GPU keeps the host no longer on a CPU,
            # longer in its synchronizations.
            own_gpu = np.fmax(in_steps(peer_deviation(np.where(valid, t.sync_s, np.nan), 0.0)[1], outside), gpu_excess)
            # Page faults not excused are its own work, and on a host short of CPUs they take longer in wall time
            # than on a CPU: at its share of the CPU while runnable. Its faults only, not all its time on a
            # CPU: scaled so, a healthy rank of a host loaded several deep would look as if it worked late.
            with np.errstate(divide="ignore", invalid="ignore"):
                share = np.clip(np.nan_to_num(t.oncpu_s / (t.oncpu_s + t.runq_s), nan=1.0), 0.1, 1.0)
            waited = (paged - faults) * (1.0 / share - 1.0)
            works = ran + waited + np.clip(np.nan_to_num(own_gpu, nan=0.0), 0.0, None) >= SMALL_RAN * late_by
            # ...or a suspect at least where its user time is longer by SMALL_USER: along a pipeline its lateness
            # grows beyond its own extra work. Not on a CPU longer alone: a healthy rank faulting on an
            # oversubscribed host runs longer for windows running. Nor named from one window: such a rank can be
            # late by a sixth of the step.
            small = valid & (arrives.some | worked | leads) & (~flagged | thin) & (works | (user >= SMALL_USER * step))
            small &= waits_less | leads
            # Named at once where its user time is longer in a window long enough to cut, however late it is:
            # healthy ranks stay within a few percent of the step in user time, where its lateness alone may not
            # tell (vCPUs lent to other guests make every rank late now and then).
            held = small & ((works & through) | busier)
            steady = valid & ~np.isfinite(a.held_lead) & (outlier | (late_by > 0))
            steady &= (user >= SMALL_USER * step) & ~flagged & ~small
            lead, mostly = _leads(a)
            checks = Checks(step, comm_excess, arrives, *_late_shares(a, valid), steps,
                            ran + waited + np.clip(np.nan_to_num(own_gpu, nan=0.0), 0.0, None), lead,
                            _lead_bar(paged, step, _runq_excess(t), user), mostly)
    return Straggling(np.flatnonzero(flagged), np.flatnonzero(thin), np.flatnonzero(small), np.flatnonzero(held),
                      np.flatnonzero(steady), z, excess, faults, paged, gpu_excess, ran, user, work, comm_med, checks)


def explain(t: RankTable, found: Straggling, i: int) -> tuple[str, list[Why]]:
    """Why row `i` is among `found`: the test that named it (a finding's criterion) and the figures that test
    compared (its `why`), of the branches straggling() takes for the set the row is in, the first whose every
    figure crosses its threshold."""
    c, step, rank = found.checks, found.checks.step, int(t.rank[i])

    def why(measure: str, value: float, threshold: float, unit: str, op: str = ">=") -> Why:
        return Why(measure, float(value), float(threshold), unit, op, rank)

    excess = found.excess[i] / step
    outlier = [why("own_work_z", found.z[i], Z_MIN, "robust z"),
               why("own_work_excess", excess, STRAGGLER_MIN_EXCESS, "share of step"),
               why("collective_wait_vs_peers", c.comm_excess[i], 0.0, "s", "<")]
    if c.arrivals is None:  # totals only
        return _first([("works_longer", outlier)])
    late_s, share = c.arrivals.late_by[i], c.share[i]
    late_by = late_s / step
    peers = float(np.nan_to_num(c.peers_share[i], nan=1.0))
    later = why("late_by", late_by, STRAGGLER_MIN_EXCESS, "share of step")
    some = why("late_share", share, LATE_SOME, "share of steps")
    rarely = why("peers_late_share", peers, PEERS_RARELY, "share of steps", "<=")
    often = why("late_share", share, LATE_RATIO * np.nan_to_num(c.peers_share[i]),
                f"share of steps, {LATE_RATIO:g}x the peers'")
    if i in found.rows:
        return _first([
            ("arrives_last", [*outlier, later, why("late_share", share, LATE_STEPS, "share of steps")]),
            ("arrives_last_far_behind", [*outlier, later, some, why("late_by", late_by, FAR_LATE_BY, "share of step"),
                                         rarely]),
            ("arrives_last_often", [*outlier, later, some, often,
                                    why("late_steps", share * c.steps, LATE_RATIO_STEPS, "steps")]),
            ("always_late", [why("late_share", share, ALWAYS_LATE, "share of steps"), rarely,
                             why("late_by", late_by, ALWAYS_LATE_BY, "share of step"),
                             why("own_work_excess", excess, 0.0, "share of step", ">"),
                             why("collective_wait_shortfall", (found.comm_med - t.comm_s[i]) / late_s, 0.5,
                                 "share of the lateness")]),
            ("arrives_last_often", [*outlier, later, some, often]),  # over few steps: waiting for a CPU (thin)
        ])
    user = why("user_time_excess", found.user[i] / step, SMALL_USER, "share of step")
    after = why("late_by", late_by, 0.0, "share of step", ">")
    leads = [user, why("late_share", share, peers, "share of steps, the peers'", ">"), after]
    arrived = [[later, why("late_share", share, SMALL_LATE, "share of steps"),  # later, worked, or leads
                why("late_share", share, SMALL_RATIO * peers, f"share of steps, {SMALL_RATIO:g}x the peers'")],
               [user, why("own_work_excess", excess, STRAGGLER_MIN_EXCESS, "share of step"), after], leads]
    worked = why("own_extra_work", c.works[i] / late_s, SMALL_RAN, "share of the lateness")
    works = [[worked], [user]]
    waits = [[outlier[2]], leads]
    through = [[why("held_lead", c.lead[i], c.lead_bar[i], "share of steps ahead of every peer")],
               [why("faulting_excess", found.paged[i] / step, FAULTS_SPREAD, "share of step", ">"),
                why("mostly_held_lead", c.mostly[i], FAULTS_HELD, "share of steps ahead of every peer")]]
    small = list(product(arrived, works, waits))
    if i in found.held:
        return _first([("late_all_through", [*x, *y, *z, worked, *h]) for (x, y, z), h in product(small, through)]
                      + [("longer_in_user_mode", [*x, *y, *z, user]) for x, y, z in small])
    if i in found.small:
        return _first([("small_straggler", [*x, *y, *z]) for x, y, z in small])
    return _first([("steady_straggler", [user, *outlier]), ("steady_straggler", [user, after])])


def _first(branches: list[tuple[str, list[Why]]]) -> tuple[str, list[Why]]:
    """The first branch whose every figure crossed its threshold (the first, where none did: the test of the
    rule's why says so), each figure once."""
    name, figures = next((b for b in branches if all(w.crossed() for w in b[1])), branches[0])
    return name, list(dict.fromkeys(figures))


class Arrivals(NamedTuple):
    """Per row, how it arrives at the collectives against its peers (their median; False or 0 where not
    compared). "Late" is later by at least STRAGGLER_MIN_EXCESS of the step, in one step."""

    last: np.ndarray  # late in most steps, or in many and far more often than its peers (LATE_STEPS; LATE_SOME,
    # LATE_RATIO: a rank of a busy CPU is late in some)
    always: np.ndarray  # late by ALWAYS_LATE_BY in nearly every step while its peers rarely are (ALWAYS_LATE)
    some: np.ndarray  # late in more steps than its peers: a small straggler's lateness (SMALL_LATE, SMALL_RATIO)
    oftener: np.ndarray  # later than its peers on average, and late in more of the steps than they are
    thin: np.ndarray  # `last` only by LATE_RATIO, over fewer than LATE_RATIO_STEPS of the window's steps
    late_by: np.ndarray  # how much later than its peers it arrives per step, less its excused page faults


def _arrives_last(a: Alignment, valid: np.ndarray, step: float, steps: float, faults: np.ndarray | float = 0.0
                  ) -> Arrivals:
    """Per row: how it arrives at the collectives (Arrivals), over the window's `steps`, its lateness less what
    its extra page faults are excused (`faults`: excused_faults)."""
    late = np.where(valid, a.arrival_late_s, np.nan)
    share, peers_share = _late_shares(a, valid)
    with np.errstate(invalid="ignore"):
        late_by = np.nan_to_num(peer_deviation(late, 0.0)[1], nan=0.0) - faults
        later = late_by >= STRAGGLER_MIN_EXCESS * step
        rarely = np.nan_to_num(peers_share, nan=1.0) <= PEERS_RARELY
        surely = (share >= LATE_STEPS) | ((share >= LATE_SOME) & (late_by >= FAR_LATE_BY * step) & rarely)
        ratio = (share >= LATE_SOME) & (share >= LATE_RATIO * np.nan_to_num(peers_share))
        always = (share >= ALWAYS_LATE) & rarely
        ahead = share >= SMALL_RATIO * np.nan_to_num(peers_share, nan=1.0)
        some = later & (share >= SMALL_LATE) & ahead
        oftener = (share > np.nan_to_num(peers_share, nan=1.0)) & (late_by > 0)
        thin = later & ratio & ~surely & (share * steps < LATE_RATIO_STEPS)
        return Arrivals(later & (surely | ratio), (late_by >= ALWAYS_LATE_BY * step) & always, some, oftener, thin,
                        late_by)


def _late_shares(a: Alignment, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the share of the steps it arrived late in (0: not compared), and its peers' (NaN: unknown)."""
    share = np.where(valid, a.late_share, np.nan)
    return np.nan_to_num(share, nan=0.0), share - peer_deviation(share, 0.0)[1]


def _runq_excess(t: RankTable) -> np.ndarray:
    """Per row: how much longer per step its main thread waited for a CPU than its peers' (NaN: unknown),
    against the same peers as its work (the others only, in a small job: of two ranks, the median of both
    would halve the difference); in its steps (in_steps)."""
    return in_steps(peer_deviation(t.runq_s, 0.0)[1], t.outside_per_step_s)


def _contended(t: RankTable, rows: np.ndarray, found: Straggling) -> np.ndarray:
    """The straggling rows whose extra time is waiting for a CPU, not computing: at least CONTENTION_SHARE of
    it, while the rank ran hardly longer than its peers (under CONTENTION_RAN of it). A hog's victim does
    the same work as its peers, and runs only a few percent of its extra time beyond theirs. A rank that works
    longer on a busy host waits longer for a CPU too, on a host loaded several deep more than it ran, but runs
    a third of its extra time or more beyond its peers."""
    runq = _runq_excess(t)[rows]
    ran = found.ran[rows]
    excess = found.excess
    with np.errstate(invalid="ignore"):
        return rows[(runq >= CONTENTION_SHARE * excess[rows]) & ~(ran >= CONTENTION_RAN * excess[rows])]


def _contention_why(rank: int, runq: float, ran: float, excess: float, other: float) -> list[Why]:
    """The figures _contended and cpu_contention weighed a straggler's extra time by (`excess`: Straggling's):
    its wait for a CPU beyond its peers' (`runq`), its time on one (`ran`; NaN: unknown, which does not clear
    it), and the share of its wait behind other jobs' processes (`other`, _other_work)."""
    ran_why = [Why("cpu_run_excess", ran / excess, CONTENTION_RAN, "share of its extra time", "<", rank)]
    return [Why("cpu_wait_excess", runq / excess, CONTENTION_SHARE, "share of its extra time", ">=", rank),
            *(ran_why if np.isfinite(ran) else []),
            Why("waited_for_other_jobs", other, OTHER_WORK, "share of its wait", ">=", rank)]


def _waited_for_job(t: RankTable, rows: np.ndarray, found: Straggling) -> np.ndarray:
    """The straggling rows whose extra time is waiting for a CPU behind their own job's processes: that wait
    (the run-queue wait beyond the peers', at the share of it the scheduler saw the job's own processes hold the
    CPU) is at least CONTENTION_SHARE of it, while the rank ran no longer than its peers by the straggler bar,
    nor in user mode by SMALL_USER. A job with more busy ranks than CPUs holds each rank back in turn, the one
    with more to do at least as often (a pipeline stage computing three times its upstream's, 4 ranks on 2
    CPUs); a rank that works longer runs longer. Unknown times (NaN) clear no one; an older agent marks no
    neighbour as the job's, so its patterns keep their verdicts."""
    step = t.job_step_s
    job_share = np.array([1.0 - _other_work(t.patterns[i]) for i in rows])
    with np.errstate(invalid="ignore"):
        behind_job = _runq_excess(t)[rows] * job_share >= CONTENTION_SHARE * found.excess[rows]
        ran_no_longer = (found.ran[rows] < STRAGGLER_MIN_EXCESS * step) & ~(found.user[rows] >= SMALL_USER * step)
        return rows[behind_job & ran_no_longer]


def _other_work(p: RankPattern) -> float:
    """The share of the rank's wait behind its named neighbours that was behind processes outside its job (1.0
    when none is named; an older agent marks none as the job's, so its patterns keep their verdicts)."""
    waited = sum(n.waited_s for n in p.neighbours)
    return sum(n.waited_s for n in p.neighbours if not n.job) / waited if waited > 0 else 1.0


def _python_excess(names: list[str], per_step: np.ndarray, i: int, valid: np.ndarray,
                   excess: float, outside: float) -> tuple[str, float] | None:
    """The Python function holding most of a straggler's extra time in its steps (in_steps, its `outside`: a
    checkpoint's save names none), if any, and that time per step: of the sampled main-thread functions
    (t.py_names, t.py_s) or of the exactly timed ones (t.timed_names, t.timed_s)."""
    if not names:
        return None
    known = valid & np.isfinite(per_step).all(axis=1)  # NaN rows: ranks not timed at all
    if not known[i] or known.sum() < 2:  # a rank timed among untimed peers would look slow in all it was timed in
        return None
    extra = in_steps(per_step[i] - np.median(per_step[_peers_of(known, i)], axis=0), outside)
    j = int(np.argmax(extra))
    return (names[j], float(extra[j])) if extra[j] >= PYTHON_SHARE * excess else None


def _peers_of(valid: np.ndarray, i: int) -> np.ndarray:
    """The rows row `i` is compared with where its extra time lies: the others in a small job, as its work is
    (peer_deviation; of two ranks, a median over both halves the difference). Of three ranks, with itself among
    them, a straggler whose one peer is slow too is the median: no time beyond its peers' outside probed
    functions, and a garbage collector's microsecond more would name it python_gc."""
    peers = valid.copy()
    if np.count_nonzero(valid) <= LEAVE_ONE_OUT_MAX:
        peers[i] = False
    return peers


def _peer_medians(x: np.ndarray, valid: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per row of `rows`: the median of `x` (ranks x columns) over its peers (_peers_of). In a large job its
    peers are every rank, and one median serves them all: 100,000 ranks' per flagged rank would cost ~30 ms each."""
    if np.count_nonzero(valid) > LEAVE_ONE_OUT_MAX:
        return np.broadcast_to(np.median(x[valid], axis=0), (rows.size, x.shape[1]))
    return np.array([np.median(x[_peers_of(valid, i)], axis=0) for i in rows]).reshape(rows.size, x.shape[1])


def _timed_evidence(t: RankTable, i: int) -> dict[str, Any]:
    """The rank's exactly timed Python functions, per window (absent when nothing was timed)."""
    rows = t.patterns[i].python_timed
    if not rows:
        return {}
    return {"python_timed": [f.to_dict() for f in rows]}


def _host_evidence(t: RankTable, i: int, peers: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """What the scheduler and /proc saw of a rank, per step: they tell 'slow' from 'waiting for a CPU or a
    disk', and from 'faulting in memory' (its main thread's time in the kernel and minor page faults, beside
    its `peers`' per row: the median of the others' kernel time and faults)."""
    p = t.patterns[i]
    kernel = {}
    if np.isfinite(t.kernel_s[i]) and np.isfinite(t.faults[i]):
        kernel = {"kernel_s": float(t.kernel_s[i]), "minor_faults": float(t.faults[i]),
                  "peers_kernel_s": float(peers[0][i]), "peers_minor_faults": float(peers[1][i])}
    if not p.sched:
        return kernel
    per_step = t.step_s[i] / p.window_s
    return {"runq_s": float(t.runq_s[i]), "io_s": sum(x.io_s for x in p.sched.values()) * per_step,
            "reclaim_s": sum(x.reclaim_s for x in p.sched.values()) * per_step, "major_faults": p.major_faults,
            **kernel, **({"cpus": p.cpus.count, "cpus_idle": p.cpus.idle} if p.cpus is not None else {})}


def _gpu_busy_excess(t: RankTable) -> np.ndarray:
    """Per row: how much longer per step its GPU was busy than its peers' (the shim's union of kernel, copy
    and set intervals; NaN: not measured), in its steps (in_steps)."""
    busy = np.full(len(t.patterns), np.nan)
    for i, p in enumerate(t.patterns):
        if p.gpu is not None:
            busy[i] = p.gpu.busy_s / p.window_s * t.step_s[i]  # NaN with an unknown step
    return in_steps(peer_deviation(busy, 0.0)[1], t.outside_per_step_s)


def compute_straggler(t: RankTable, a: Alignment | None = None) -> list[Finding]:
    """Ranks that compute longer than their peers while the others wait for them in collectives (a rank
    that only waits longer for a CPU is cpu_contention's); the small ones are marked in their evidence with
    the windows they must be seen in (`confirm_windows`, see stability.py) unless they held all through
    this one (SMALL_HELD, SMALL_USER), the steady ones with those windows and the span they count in
    (`confirm_span`)."""
    found = straggling(t, a=a)
    if found is None:
        return []

    def waiting(rows: np.ndarray) -> np.ndarray:
        return np.union1d(_contended(t, rows, found), _waited_for_job(t, rows, found))

    small = np.setdiff1d(found.small, waiting(found.small))
    unheld = _findings(t, a, found, np.setdiff1d(small, found.held))
    for f in unheld:
        f.evidence["confirm_windows"] = SMALL_WINDOWS
    steady = _findings(t, a, found, np.setdiff1d(found.steady, waiting(found.steady)))
    for f in steady:
        f.evidence.update(confirm_windows=STEADY_WINDOWS, confirm_span=STEADY_SPAN)
    named = np.setdiff1d(found.rows, np.union1d(found.thin, waiting(found.rows)))
    return _findings(t, a, found, np.union1d(named, np.intersect1d(small, found.held))) + unheld + steady


def _findings(t: RankTable, a: Alignment | None, found: Straggling, flagged: np.ndarray) -> list[Finding]:
    """The findings for the `flagged` rows: one per kind, component and function their extra time lies in."""
    if flagged.size == 0:
        return []
    z, excess, work, comm_med = found.z, found.excess, found.work, found.comm_med
    step = t.job_step_s
    valid = np.isfinite(t.step_s)
    outside = t.outside_per_step_s

    # Where the excess lies: the function (or host time outside probes) furthest above its peers' median, a
    # function where it holds PYTHON_SHARE of the excess at least: where a straggler's host time is no longer
    # than its peers', a garbage collector microseconds longer would name a spinner python_gc. A function's
    # excess its pauses can hold is not its steps' (in_steps).
    cols = [j for j, r in enumerate(t.fn_roles) if r != Role.COMM]
    comm_cols = [j for j, r in enumerate(t.fn_roles) if r == Role.COMM]
    waited_in = None  # the collective the peers spend most time in: where they wait for the straggler
    if comm_cols:
        waited_in = t.fn_names[comm_cols[int(np.argmax(np.median(t.fn_s[valid][:, comm_cols], axis=0)))]]

    gpu_excess = found.gpu_excess
    paging = found.paged - found.excused  # the page faults' time beyond what is excused: in `excess`
    # Per flagged row: its peers' host time (column 0) and functions' (the rest), their kernel time and faults
    own = np.column_stack([t.host_s, t.fn_s[:, cols]])
    medians = _peer_medians(own, valid, flagged)
    peers_kernel = (t.kernel_s - peer_deviation(t.kernel_s, 0.0)[1], t.faults - peer_deviation(t.faults, 0.0)[1])
    groups: dict[tuple[str, str, str | None], list[dict[str, Any]]] = {}
    explained = {int(t.rank[i]): explain(t, found, i) for i in flagged}
    for i, med in zip(flagged, medians):
        host_excess, fn_excess = own[i, 0] - med[0], in_steps(own[i, 1:] - med[1:], outside[i])
        if paging[i] > 0 and paging[i] >= 0.5 * excess[i]:  # mostly faulting in memory (if at all), in the kernel
            function, component, where = PAGE_FAULTS, "host", float(paging[i] + found.excused[i])
        elif fn_excess.size and fn_excess.max() > host_excess and fn_excess.max() >= PYTHON_SHARE * excess[i]:
            j = cols[int(np.argmax(fn_excess))]
            function, component, where = t.fn_names[j], t.fn_roles[j].component, float(fn_excess.max())
            if component == "host" and gpu_excess[i] >= GPU_SHARE * where:
                component = "gpu"
        else:
            function, component, where = _HOST_TIME, "cpu", float(host_excess)
        python = _python_excess(t.py_names, t.py_s, i, valid, excess[i], outside[i])
        timed = _python_excess(t.timed_names, t.timed_s, i, valid, excess[i], outside[i])
        kind = "python_gc" if component == "python" else "compute_straggler"
        # The one holding more of the extra time; of two alike, the exactly timed one (a sampled estimate is
        # noisier). Not the timed one whatever it holds: on a host short of CPUs a spinning rank's timed loader
        # call grows a little too, waiting for a CPU, and would name an input straggler.
        named = max(filter(None, (timed, python)), key=lambda x: x[1], default=(None, 0.0))[0]
        if named is not None and component == "cpu":  # time outside CUDA/NCCL: the Python function is the where
            function = named
            if DATA_LOADING.search(named):
                kind, component = "input_straggler", "input"
        # Its extra time, as its cost takes it (below): the longest of its work, on a CPU and in user mode beyond
        # its peers'. Not its work alone: where its spin takes the CPU its peers wait for, they work as long as it
        # does, and "-0.8 ms longer per step" beside "costs 8% of step time" would read as nonsense.
        extra = float(np.nanmax([excess[i], found.ran[i], found.user[i]]))
        groups.setdefault((kind, component, function), []).append({
            "rank": int(t.rank[i]), "z": float(z[i]), "excess_s": extra + float(found.excused[i]),
            "cost_s": extra + float(found.excused[i] if function == PAGE_FAULTS else 0.0),
            "work_s": float(work[i]), "comm_s": float(t.comm_s[i]), "sync_s": float(t.sync_s[i]),
            "host_s": float(t.host_s[i]), "function_excess_s": where, "python_function": python and python[0],
            **({"gpu_busy_excess_s": float(gpu_excess[i])} if np.isfinite(gpu_excess[i]) else {}),
            "timed_function": timed and timed[0],
            "arrival_lateness_s": float(a.arrival_late_s[i]) if a is not None else None,
            **_host_evidence(t, i, peers_kernel),
            **_timed_evidence(t, i),
        })

    out = []
    for (kind, component, function), per_rank in groups.items():
        per_rank.sort(key=lambda r: r["rank"])
        ranks = [r["rank"] for r in per_rank]
        # What-if: without the straggler(s) the step shrinks by the extra work a step of the slowest of them.
        # Not by the others' wait for it read from the arrivals: in a short step the host's noise adds to that
        # wait, and where the job oversubscribes its host the others' own lateness, partly the straggler's doing
        # (it holds a CPU they need), hides it. Its work, its time on a CPU or in user mode beyond its peers',
        # the longest: where ranks share CPUs each of them reads short in its own way (its peers wait for it
        # while it runs, so its work reads short; they fault in more memory, so its time on a CPU does).
        # Its page faults within the ranks' usual spread (excused) count only where they are what it is named
        # for: beside a spin they are the spread, not the fault.
        cost = float(np.clip(max(r["cost_s"] for r in per_rank) / step, 0.0, 1.0))
        lead = max(per_rank, key=lambda r: r["z"])["rank"]  # the rank the score is of
        caller = per_rank[0]["python_function"]
        where = {"gpu": f"GPU work, waits in {function}" + (f" called from {caller}" if caller else ""),
                 "cpu": f"host work in {function}" if function else "host work outside CUDA and NCCL calls",
                 "input": f"loading input in {function}",
                 "python": "Python garbage collection pauses" + (f" triggered in {caller}" if caller else ""),
                 "host": _faulting_in(per_rank[0]) if function == PAGE_FAULTS
                 else f"host-side CUDA calls, in {function}"}[component]
        who = "it" if len(ranks) == 1 else "them"
        waits = f"in {waited_in}" if waited_in else "in collectives"
        verb = {"input_straggler": "spend", "python_gc": "stall"}.get(kind, "compute") + ("s" if len(ranks) == 1 else "")
        out.append(Finding(
            kind=kind, ranks=ranks, function=function, component=component,
            score=max(r["z"] for r in per_rank), cost=cost,
            criterion=explained[lead][0], why=[w for r in ranks for w in explained[r][1]],
            summary=(f"{rank_list(ranks)} {verb} {range_ms([r['excess_s'] for r in per_rank])} longer per step "
                     f"than {'its' if len(ranks) == 1 else 'their'} peers ({where}); the other ranks wait for "
                     f"{who} {waits}; costs {cost:.0%} of step time"),
            evidence={"step_time_s": step, "peers_work_s": peers_median(work), "peers_comm_s": comm_med,
                      "waited_in": waited_in, "per_rank": per_rank},
        ))
    return out


def _faulting_in(r: dict[str, Any]) -> str:
    """Where a straggler's extra time lies when that is its page faults (its evidence: `_host_evidence`)."""
    return (f"faulting in memory: {r['minor_faults']:,.0f} page faults a step, {ms(r['kernel_s'])} in the kernel; "
            f"its peers {r['peers_minor_faults']:,.0f}, {ms(r['peers_kernel_s'])}")


def cpu_contention(t: RankTable, a: Alignment | None = None) -> tuple[list[Finding], set[int]]:
    """Straggling ranks whose extra time is waiting for a CPU (runnable, not running): the scheduler gave
    their CPU to other tasks, named from the kernel's view of who ran while they waited. Also the ranks that
    waited for their own job's processes: no finding, but late for that reason (not their link's)."""
    found = straggling(t, PAIR_RANKS, a)
    if found is None:
        return [], set()
    z, excess = found.z, found.excess
    step = t.job_step_s
    runq_excess = _runq_excess(t)
    out = []
    # Late behind its own job's processes, without the wait doing no more than its peers: no finding either.
    own = {int(t.rank[i]) for i in _waited_for_job(t, np.union1d(found.rows, np.union1d(found.small, found.steady)),
                                                   found)}
    for i in _contended(t, found.rows, found):
        p = t.patterns[i]
        other = _other_work(p)
        if other < OTHER_WORK:
            own.add(int(t.rank[i]))
            continue
        main = p.sched["main"]
        neighbours = [{"name": n.name, "pid": n.pid, "cgroup": n.cgroup, "waited_s": n.waited_s, "job": n.job}
                      for n in p.neighbours]
        # The victim's threads also wait for a CPU inside the collectives (gloo's work runs on its own threads
        # there), which stretches them for every rank and is not the rank's extra work: the main thread's wait
        # for a CPU is what the job loses when that is the larger.
        lost = max(float(excess[i]), float(np.nan_to_num(runq_excess[i])))
        cost = float(np.clip(lost / step, 0.0, 1.0))
        who = ", ".join([f"{n['name']} (pid {n['pid']})" for n in neighbours if not n["job"]][:2]) or "other tasks"
        out.append(Finding(
            kind="cpu_contention", ranks=[int(t.rank[i])], function=None, component="cpu",
            score=float(z[i]), cost=cost, criterion="cpu_contended",
            why=[*explain(t, found, i)[1],
                 *_contention_why(int(t.rank[i]), runq_excess[i], found.ran[i], excess[i], other)],
            summary=(f"rank {t.rank[i]}'s main thread waits {ms(float(runq_excess[i]))} more per step than its "
                     f"peers' for a CPU it is ready to use, mostly while {who} ran; "
                     f"costs {cost:.0%} of step time"),
            evidence={"step_time_s": step, "thread_role": "main", "excess_s": float(excess[i]),
                      "runq_s": float(t.runq_s[i]), "peers_runq_s": float(t.runq_s[i] - runq_excess[i]),
                      "preempted": main.preempted, "runq_p99_s": main.runq_p99_s, "neighbours": neighbours},
        ))
    return out, own
