"""The diagnosis document of the contract, assembled from the rank patterns of one window."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress
from operator import attrgetter
from typing import Any

import numpy as np

from rankscope.analyzer.baseline import Baseline, Comparison, Reference, StepProfile
from rankscope.analyzer.differential import align_collectives
from rankscope.analyzer.metrics import RankTable, rank_table
from rankscope.analyzer.peers import peer_groups, pure_pipeline
from rankscope.analyzer.rules.gpu import gpu_straggler, gpu_throttle, launch_bound
from rankscope.analyzer.rules.hangs import HANGS, hang
from rankscope.analyzer.rules.links import link_findings, slow_link
from rankscope.analyzer.rules.nodes import node_fault
from rankscope.analyzer.rules.regression import GROWN_STAGE, explaining, grown_stage, regression, restated
from rankscope.analyzer.rules.stragglers import compute_straggler, cpu_contention
from rankscope.analyzer.stability import confirm_span, confirm_windows
from rankscope.analyzer.thresholds import DEFAULT_HANG_TIMEOUT_S, SLOWDOWN_THRESHOLD
from rankscope.schema.finding import Finding, plain
from rankscope.schema.patterns import RankPattern

NOT_ANALYZED = frozenset({"exited"})  # listed in `ranks`, left out of the comparison
# Windows with these findings stay out of the job's baseline: a hung job has no steps, and a regressed one
# would otherwise become its own baseline within a few windows (the job stays "slower than yesterday").
NOT_BASELINE = HANGS | {"regression"}


def empty_diagnosis(job: str | None = None) -> dict:
    """The document before anything was observed: every key of a real one, nothing in them."""
    return {"job": job, "window": {"start": None, "end": None}, "step_time_s": None, "baseline": None,
            "ranks": [], "findings": []}


def diagnose(patterns: Sequence[RankPattern], hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
             baselines: dict[str, Baseline] | None = None,
             slowdown_threshold: float = SLOWDOWN_THRESHOLD) -> dict[str, dict[str, Any]]:
    """job -> diagnosis document, for patterns of any number of jobs. With `baselines` (job -> its past,
    kept by the caller across windows), each job is also compared with its own baseline, which this window
    then joins: `slowdown_threshold` slower is `baseline.slower` in the document, and a `regression`."""
    jobs = list(map(attrgetter("job"), patterns))
    by_job: dict[str, list[RankPattern]] = {}
    if len(set(jobs)) == 1:  # the common case, one job: no append per pattern
        by_job[jobs[0]] = list(patterns)
    else:
        for job, p in zip(jobs, patterns):
            by_job.setdefault(job, []).append(p)
    return {job: diagnose_job(ps, hang_timeout_s, None if baselines is None else baselines.setdefault(job, Baseline()),
                              slowdown_threshold)
            for job, ps in by_job.items()}


def find(patterns: Sequence[RankPattern], hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> list[Finding]:
    """The findings for the analyzed patterns of one job, largest cost first."""
    return findings_of(rank_table(patterns), hang_timeout_s)


def findings_of(table: RankTable, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                reference: Reference | None = None, slowdown_threshold: float = SLOWDOWN_THRESHOLD,
                profile: StepProfile | None = None) -> list[Finding]:
    """`profile`: the table's StepProfile where the caller has it (compared with `reference`; computed here
    otherwise: ~15 ms at 100,000 ranks)."""
    hung = hang(table.patterns, hang_timeout_s)
    if hung:  # a stalled job has no steps to compare: the hang is the whole story
        for f in _compared(table, reference, slowdown_threshold, profile):
            hung[0].outranks(f, "the job hangs: its few steps before the stall compare nothing")
        return hung
    return _compared(table, reference, slowdown_threshold, profile)


def _compared(table: RankTable, reference: Reference | None, slowdown_threshold: float,
              profile: StepProfile | None) -> list[Finding]:
    """The findings of the rules that compare ranks with their peers, and the job with its baseline."""
    groups = peer_groups(table.patterns, table.records)
    found: list[Finding] = []
    timed: list[Finding] = []
    # Ranks that waited for a CPU their own job's processes held (no finding): late for that, not for a link.
    self_contended: set[int] = set()
    # Small stragglers, reported once they held several windows: kept out of the other rules' reasoning (a rank
    # named is no suspect of a slow link) until the end, where they add ranks nothing else named...
    small: list[Finding] = []
    for rows in groups:  # ranks are compared with the ranks of their own role only (pipeline stages)
        peers = table if len(groups) == 1 else rank_table([table.patterns[i] for i in rows], table.job_step_s,
                                                          table.records.take(rows))
        alignment = align_collectives(peers.patterns, peers.job_step_s, peers.records)
        throttled = gpu_throttle(peers)
        explained = {r for f in throttled for r in f.ranks}
        contended, waited_for_job = cpu_contention(peers, alignment)
        self_contended |= waited_for_job
        # A throttled GPU is the root cause of its rank's GPU-side straggling: report the cause, not the symptom.
        stragglers = _kept(compute_straggler(peers, alignment), throttled,
                           lambda f, by: f.component == "gpu" and set(f.ranks) <= explained and by.ranks[0] in f.ranks,
                           "a throttled GPU is the cause of its rank's straggling")
        small += [f for f in stragglers if confirm_windows(f.evidence) > 1]
        stragglers = [f for f in stragglers if confirm_windows(f.evidence) == 1] + contended
        # Where the host shows nothing, the GPU may: NCCL's peers wait for a straggler inside its kernels.
        on_gpu = _kept(gpu_straggler(peers, set()), throttled + stragglers + small,
                       lambda f, by: bool(set(f.ranks) & set(by.ranks)),
                       "the rank was named already: its GPU time is that finding's")
        found += stragglers + on_gpu + throttled + node_fault(peers)
        timed += slow_link(peers, alignment, {r for f in found for r in f.ranks} | self_contended)
    found += launch_bound(table)
    # The link matrix (NCCL profiler plugin) names the precise link or node; the timing-based rule, from
    # collective instants, serves jobs without the plugin and adds only what the matrix does not cover.
    measured = link_findings(table.patterns, {r for f in found for r in f.ranks} | self_contended)
    # ...nor what the matrix's slow links explain: in a ring, the rank receiving over a slow rank's link
    # finishes its all-reduces last, and the timing rule would name that receiver beside the slow rank.
    covered = {r for f in measured for r in f.ranks} | {r for f in measured for row in f.evidence["links"]
                                                         for r in (row["src"], row["dst"])}
    found += measured + _kept(timed, measured, lambda f, by: set(f.ranks) <= covered and bool(set(f.ranks) & _ends(by)),
                              "the link matrix measured the links its ranks' late finishes came from")
    # Has the whole job changed? Asked beside the other findings too: a finding of a single window (a slow
    # link's transient) must not hide a regression of every rank in its first slow windows, as deep detail,
    # raised by the slowdown, then keeps it from being compared. A regression in the collectives beside other
    # findings restates them: the peers wait for the straggler.
    if reference is not None:
        now = profile if profile is not None else StepProfile.of(table, pure_pipeline(groups, table.records))
        costliest = sorted(found, key=_order)[:1]
        found += grown_stage(table, reference, now, slowdown_threshold)
        found += _kept(regression(table, reference, now, slowdown_threshold), costliest,
                       lambda f, by: f.component == "link",
                       "a regression in the collectives beside it restates it: the peers wait for it")
    # ...unless a whole-job regression named every rank: the job being slower than its baseline does not say
    # which rank it waits for (a straggler slows the whole job too, and would hide behind it).
    named = [f for f in found if f.kind != "regression"]
    found += _kept(small, named, lambda f, by: bool(set(f.ranks) & set(by.ranks)),
                   "the rank was named already: a small straggler adds only ranks nothing else named")
    return sorted(found, key=_order)


def _order(f: Finding) -> tuple[float, float, str]:
    """The document's order: the costliest first."""
    return -f.cost, -f.score, f.kind


def _kept(candidates: list[Finding], winners: list[Finding], beats: Callable[[Finding, Finding], bool],
          reason: str) -> list[Finding]:
    """The `candidates` no winner beats (`beats(candidate, winner)`); each one beaten is recorded, with `reason`,
    as outranked by the first winner that beats it."""
    kept = []
    for f in candidates:
        by = next((w for w in winners if beats(f, w)), None)
        if by is None:
            kept.append(f)
        else:
            by.outranks(f, reason)
            by.outranked += [o for o in f.outranked if o not in by.outranked]  # what it had outranked, it now does
    return kept


def _ends(f: Finding) -> set[int]:
    """The ranks a link matrix finding names, and the ends of its slow links."""
    return set(f.ranks) | {r for row in f.evidence["links"] for r in (row["src"], row["dst"])}


def diagnose_job(patterns: Sequence[RankPattern], hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                 baseline: Baseline | None = None,
                 slowdown_threshold: float = SLOWDOWN_THRESHOLD) -> dict[str, Any]:
    """The contract's diagnosis document for the patterns of one job, compared with `baseline` when given,
    which this window then joins unless it is hung or regressed. A window an agent recorded at raised detail
    (its probes cost the job time) is shown against the baseline but neither joins it nor makes a
    regression: the regression of the last comparable window is held through it (`"held": true`), unless
    the job hangs, since the slowdown that raised the detail is what the user is looking at."""
    if not patterns:
        raise ValueError("diagnose_job needs at least one pattern")
    jobs = set(map(attrgetter("job"), patterns))
    if len(jobs) > 1:
        raise ValueError(f"diagnose_job got patterns of several jobs: {sorted(jobs)}")
    states = list(map(attrgetter("state"), patterns))
    kept = [state not in NOT_ANALYZED for state in states]
    analyzed = list(compress(patterns, kept))
    table = rank_table(analyzed)
    reference = baseline.reference() if baseline is not None else None
    comparable = not any(map(attrgetter("raised_detail"), patterns))
    # Once: the regression rule's, then the baseline's; a pure pipeline's with each rank's work (grown_stage).
    pipeline = bool(analyzed) and pure_pipeline(peer_groups(analyzed, table.records), table.records)
    profile = StepProfile.of(table, pipeline) if analyzed else None
    findings = findings_of(table, hang_timeout_s, reference if comparable else None, slowdown_threshold, profile)
    regressed = next((f for f in findings if f.kind == "regression"), None)
    if regressed is not None and baseline is not None:  # (only a job with a baseline regresses)
        explained_by = explaining(regressed, findings)
        if restated(explained_by, baseline.explained_by):
            findings.remove(regressed)
            by = next(f for f in findings if explaining(regressed, [f]) and baseline.explained_by <= set(f.ranks))
            by.outranks(regressed, "its delay is what the regression costs the job: the regression restates it")
        baseline.explained(frozenset().union(*explained_by))
    # A hung job has no steps: a window's few steps before the stall, or the whole window read as one step
    # (10 s for a 60 ms job), would mislead; the hang's evidence says how long it has stalled.
    hung = any(f.kind in HANGS for f in findings)
    # Per-rank columns (seconds per step) as plain lists once (100,000 ranks: no per-value conversion calls).
    # input_s (data loading) is part of host_s; gc_s and runq_s (waiting for a CPU) are the page's and the
    # metrics' too.
    values = [[None] * len(analyzed) if hung else _seconds(getattr(table, attr))
              for attr in ("step_s", "sync_s", "comm_s", "host_s", "input_s", "gc_s", "runq_s")]
    profile = None if hung else profile
    compared = (Comparison(profile.step_s, reference.profile.step_s, reference.slower(profile.step_s,
                                                                                        slowdown_threshold))
                if reference and profile else None)
    listed = [f.to_dict() for f in findings]
    if baseline is not None:
        baseline.compared = compared
    if baseline is not None and comparable:
        # A window the threshold above the baseline but within its noise is no regression yet, nor the job's
        # normal: left out, so that a slowdown cannot creep into the baseline and widen its noise until the
        # slowdown is within it.
        # The window the agent attached in neither joins nor continues a run: the attach shared the job's CPUs.
        if not any(map(_attaching, patterns)):
            above = reference is not None and profile is not None and reference.above(profile.step_s,
                                                                                      slowdown_threshold)
            if not above and not any(f.kind in NOT_BASELINE for f in findings):
                baseline.add(profile)
            else:  # a run of windows above the baseline is judged as one too (baseline.RUN_WINDOWS)
                baseline.left_out(profile.step_s if above else None)
        baseline.regression = next((f for f in listed if f["kind"] == "regression" or f["criterion"] == GROWN_STAGE),
                                   None)
    elif baseline is not None and baseline.regression and not hung:
        listed = sorted([*listed, {**baseline.regression, "held": True}], key=lambda f: -f["cost"])
    # One look, no past (`diagnose`): what must hold several windows is seen once, so it is unconfirmed.
    once = [] if baseline is not None else [f for f in listed if confirm_windows(f["evidence"]) > 1]
    suspects = [{"kind": f["kind"], "ranks": f["ranks"], "windows": 1, "needs": confirm_windows(f["evidence"]),
                 "of": confirm_span(f["evidence"]),
                 "summary": f["summary"], "criterion": f["criterion"], "why": f["why"]} for f in once]
    return {
        "job": patterns[0].job,
        "window": plain({"start": min(map(attrgetter("window_start"), patterns)),
                         "end": max(map(attrgetter("window_end"), patterns))}),
        "step_time_s": plain(profile.step_s if profile else None),
        "outside_steps": None if hung or not analyzed else _outside(table),
        "baseline": plain({"step_time_s": reference.profile.step_s, "windows": reference.windows,
                           "end": reference.profile.end, "noise_s": reference.noise_s,
                           "slower": bool(compared and compared.slower)})
        if reference else None,
        "ranks": _rank_entries(patterns, states, kept, values),
        "findings": [f for f in listed if f not in once],
        **({"unconfirmed": suspects} if suspects else {}),
    }


def _outside(table: RankTable) -> dict[str, float] | None:
    """The window's time outside the job's steps (start-up, pauses such as a checkpoint's save, the tail):
    medians over ranks, apart from the step time, which holds none of it."""
    outside = table.job_outside
    if outside is None:
        return None
    seconds, share, longest = outside
    return {"seconds": round(seconds, 6), "share": round(share, 4), "longest_s": round(longest, 6)}


def _attaching(p: RankPattern) -> bool:
    """A window that began when the agent began watching the rank: its probes were being compiled and placed
    on the job's CPUs meanwhile, so its steps run slow, and joining the baseline it would widen its noise."""
    return p.since is not None and p.window_start <= p.since


def _rank_entries(patterns: Sequence[RankPattern], states: list[str], kept: list[bool],
                  values: list[list[float | None]]) -> list[dict[str, Any]]:
    """The document's `ranks`, in rank order: each pattern's identity and its row of `values` (the analyzed
    patterns' step_time_s, sync_s, comm_s, host_s, input_s, gc_s and runq_s; None for the others). Read a
    column at a time and built by one dict display each: 100,000 ranks in ~0.11 s, where building each
    entry from its pattern key by key took ~0.15 s."""
    n = len(patterns)
    if not all(kept):  # a rank not analyzed (exited) has no values
        rows = (np.cumsum(kept) - 1).tolist()  # its row among the analyzed
        values = [[column[r] if k else None for r, k in zip(rows, kept)] for column in values]
    ranks, pids = list(map(attrgetter("rank"), patterns)), list(map(attrgetter("pid"), patterns))
    columns = [ranks, pids, list(map(attrgetter("host"), patterns)), states, *values,
               list(map(attrgetter("identity_source"), patterns))]
    keys = list(zip(ranks, pids))
    order = sorted(range(n), key=keys.__getitem__)
    if order != list(range(n)):  # already in order, the common case: no gather
        columns = [[column[i] for i in order] for column in columns]
        patterns = [patterns[i] for i in order]
    entries = [{"rank": rank, "pid": pid, "host": host, "state": state, "step_time_s": step, "sync_s": sync,
                "comm_s": comm, "host_s": host_s, "input_s": input_s, "gc_s": gc, "runq_s": runq,
                "identity_source": source}
               for rank, pid, host, state, step, sync, comm, host_s, input_s, gc, runq, source in zip(*columns)]
    # Exact per-call times of forward, data-loader __next__, --trace-function; then why not, where they would
    # have been. Few ranks have either: only theirs are visited.
    for i in compress(range(n), map(attrgetter("python_timed"), patterns)):
        entries[i]["python_timed"] = plain([f.to_dict() for f in patterns[i].python_timed])
    for i in compress(range(n), map(attrgetter("python_untimed"), patterns)):
        entries[i]["python_untimed"] = patterns[i].python_untimed
    return entries


def _seconds(values: np.ndarray) -> list[float | None]:
    """Rounded to microseconds; None for unknown (NaN), which JSON cannot carry."""
    rounded = np.round(values, 6)
    if not np.isnan(rounded).any():  # the common case: no value looked at in Python (100,000 ranks: ~10 ms a column)
        return rounded.tolist()
    return [None if v != v else v for v in rounded.tolist()]
