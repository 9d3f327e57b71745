"""A regression: the whole job slower than its own baseline (analyzer/baseline.py), named by the function whose
time per step grew the most; and a pipeline stage with no peer that slowed it, its own work grown (grown_stage).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rankscope.analyzer.baseline import Reference, StepProfile
from rankscope.analyzer.metrics import DATA_LOADING, RankTable
from rankscope.analyzer.rules.stragglers import STRAGGLERS
from rankscope.analyzer.rules.wording import ms
from rankscope.analyzer.thresholds import (BROAD_SHARE, CPU_RAN_SHARE, CPU_WAIT_SHARE, GROWN_SHARE, NAMING_SHARE,
                                           PYTHON_SHARE, SLOWDOWN_THRESHOLD, STRAGGLER_SHARE, Z_MIN)
from rankscope.schema.finding import Finding, Why
from rankscope.schema.patterns import Role


def regression(t: RankTable, ref: Reference, now: StepProfile | None,
               threshold: float = SLOWDOWN_THRESHOLD) -> list[Finding]:
    """The job is `threshold` slower than its baseline and the growth is on (nearly) every rank. `now`: the
    window's profile (StepProfile.of(t)).

    A straggler slows the whole job too, but only its own time grows: its peers' grows in the collectives, where
    they wait for it, and the caller leaves a regression in the collectives out beside other findings.
    """
    if now is None:
        return []
    base = ref.profile
    grown = now.step_s - base.step_s
    if not ref.slower(now.step_s, threshold):
        return []
    valid = np.isfinite(t.step_s)

    # The probed functions and the host time outside them partition a step: which part grew the most on
    # (nearly) every rank? A wait's growth falls on the ranks that waited, so the largest growth may not be
    # the change (an all-reduce grown on the ranks that wait in it, beside host time grown on every rank).
    parts = {name: (now.functions[name] - base.functions.get(name, 0.0), t.fn_s[valid, j], t.fn_roles[j])
             for j, name in enumerate(t.fn_names)}
    parts[None] = (now.host_s - base.host_s, t.host_s[valid], None)
    for name in sorted(parts, key=lambda k: -parts[k][0]):
        growth, per_rank, role = parts[name]
        if growth < NAMING_SHARE * grown:
            return []
        before = base.host_s if name is None else base.functions.get(name, 0.0)
        broad = np.count_nonzero(per_rank - before >= GROWN_SHARE * growth) / max(int(valid.sum()), 1)
        if broad >= BROAD_SHARE:
            break
    else:
        return []
    python = sorted(((f, s - base.python.get(f, 0.0)) for f, s in now.python.items()), key=lambda x: -x[1])
    function, component = name, role.component if role else "cpu"
    if name is None and python and python[0][1] >= PYTHON_SHARE * grown:
        function = python[0][0]  # host time grew: the Python function where it went names it
        component = "input" if DATA_LOADING.search(function) else "python"
    cost = float(np.clip(grown / now.step_s, 0.0, 1.0))
    waited, ran = now.runq_s - base.runq_s, now.oncpu_s - base.oncpu_s  # NaN without a scheduler view
    starved = bool(waited >= CPU_WAIT_SHARE * grown and ran < CPU_RAN_SHARE * grown)
    if starved:
        function, component = None, "cpu"
        where = (f"the ranks wait {ms(waited)} longer per step for a CPU while running as long as before "
                 f"({_busy(t)}); {name or 'host work'} grew by {ms(growth)} per step waiting with them")
    else:
        where = f"{function or 'host work outside CUDA and NCCL calls'} grew by {ms(growth)} per step"
    why = [Why("step_growth", grown / base.step_s, threshold, "share of the baseline step"),
           Why("run_growth_z", ref.run_z(now.step_s), Z_MIN, "the baseline's noise (robust z)"),
           Why("part_growth", growth / grown, NAMING_SHARE, "share of the step's growth"),
           Why("ranks_grown_share", broad, BROAD_SHARE, "share of ranks")]
    if starved:
        why += [Why("cpu_wait_growth", waited / grown, CPU_WAIT_SHARE, "share of the step's growth"),
                Why("cpu_run_growth", ran / grown, CPU_RAN_SHARE, "share of the step's growth", "<")]
    return [Finding(
        kind="regression", ranks=sorted(int(r) for r in t.rank[valid]), function=function, component=component,
        score=grown / ref.noise_s, cost=cost,
        criterion="slower_waiting_for_cpu" if starved else "step_slower_than_baseline", why=why,
        summary=(f"every rank is slower than the job's baseline: {ms(now.step_s)} per step instead of "
                 f"{ms(base.step_s)} (+{grown / base.step_s:.0%}); {where}; costs {cost:.0%} of step time"),
        evidence={"cpu_starved": starved, "runq_growth_s": waited, "oncpu_growth_s": ran,  # NaN: None (plain)
                  "step_time_s": now.step_s, "baseline_step_s": base.step_s, "baseline_windows": ref.windows,
                  "baseline_end": base.end, "baseline_noise_s": ref.noise_s, "grown_s": grown, "function_growth_s": growth,
                  "function_baseline_s": before, "ranks_grown_share": broad,
                  "python_growth": [{"function": f, "grown_s": g} for f, g in python[:3] if g > 0]},
    )]


GROWN_STAGE = "stage_work_grew"  # grown_stage's criterion: a finding against the baseline, held as a regression is


def grown_stage(t: RankTable, ref: Reference, now: StepProfile | None,
                threshold: float = SLOWDOWN_THRESHOLD) -> list[Finding]:
    """A pipeline stage that computes longer than it did, the job slower for it: the other stages wait for it,
    blocked receiving from it. In a pure pipeline (every rank alone in its role: profiles that keep each rank's
    work) a stage is compared with no one, and stages unequal by design wait on each other in every window: its
    own past tells that it grew. Named where the job is `threshold` slower than its baseline (Reference.slower),
    the stage's own work (step - COMM) grew by STRAGGLER_SHARE of that or more, and every other rank's by under
    GROWN_SHARE (their growth is in the wait), less its longer wait for a CPU (the host's other load, not its
    work). Its cost is the job's growth: what it lost against its past."""
    if now is None or now.ranks.size == 0 or not ref.slower(now.step_s, threshold):
        return []
    grown = now.step_s - ref.profile.step_s
    work, runq = ref.profile.of_ranks(t.rank)
    growth = t.work_s - work
    if not np.isfinite(growth).all():  # a rank the baseline did not see, or no step: no past to hold it to
        return []
    i = int(np.argmax(growth))
    waited = np.clip(np.nan_to_num(t.runq_s - runq), 0.0, None)  # 0 without a scheduler view
    others = float(np.max(np.delete(growth - waited, i), initial=-np.inf))
    if growth[i] < STRAGGLER_SHARE * grown or others >= GROWN_SHARE * grown:
        return []
    rank, cost = int(t.rank[i]), float(np.clip(grown / now.step_s, 0.0, 1.0))
    on_gpu = t.sync_s[i] > t.host_s[i]  # its work is mostly waiting for its own GPU
    why = [Why("step_growth", grown / ref.profile.step_s, threshold, "share of the baseline step"),
           Why("run_growth_z", ref.run_z(now.step_s), Z_MIN, "the baseline's noise (robust z)"),
           Why("stage_work_growth", float(growth[i]) / grown, STRAGGLER_SHARE, "share of the step's growth",
               rank=rank),
           Why("others_work_growth", others / grown, GROWN_SHARE, "share of the step's growth", "<")]
    return [Finding(
        kind="compute_straggler", ranks=[rank], function=None, component="gpu" if on_gpu else "cpu",
        score=grown / ref.noise_s, cost=cost, criterion=GROWN_STAGE, why=why,
        summary=(f"rank {rank}, a pipeline stage with no peer, computes {ms(float(growth[i]))} longer per step than "
                 f"in the job's baseline ({'GPU work' if on_gpu else 'host work'}); the other stages wait for it "
                 f"in {_waited_in(t, i)}: {ms(now.step_s)} per step instead of {ms(ref.profile.step_s)}; "
                 f"costs {cost:.0%} of step time"),
        # As a straggler's: per_rank holds the named rank, its excess_s the "N ms longer per step"
        evidence={"step_time_s": now.step_s, "baseline_step_s": ref.profile.step_s, "grown_s": grown,
                  "others_work_growth_s": others,  # the most any other rank's work grew, less its CPU wait's
                  "per_rank": [{"rank": rank, "excess_s": float(growth[i]), "cost_s": grown,
                                "work_s": float(t.work_s[i]), "baseline_work_s": float(work[i]),
                                "comm_s": float(t.comm_s[i])}]},
    )]


def _waited_in(t: RankTable, i: int) -> str:
    """The communication the other ranks than row `i` spend most time in: where they wait for it."""
    comm = [j for j, r in enumerate(t.fn_roles) if r == Role.COMM]
    if not comm or len(t) < 2:
        return "their receives"
    others = np.delete(t.fn_s[:, comm], i, axis=0)
    return t.fn_names[comm[int(np.argmax(others.sum(axis=0)))]]


def explaining(f: Finding, others: Sequence[Finding]) -> list[frozenset[int]]:
    """The ranks of each straggler among `others` whose delay is what regression `f` costs the whole job.
    (Not a slow link: a transient one in the window that straddles a regression's onset would hold the
    regression back.)"""
    grown, step, ranks = f.evidence["grown_s"], f.evidence["step_time_s"], set(f.ranks)
    return [frozenset(o.ranks) for o in others
            if o.kind in STRAGGLERS and set(o.ranks) < ranks and o.cost * step >= STRAGGLER_SHARE * grown]


def restated(explained_by: Sequence[frozenset[int]], before: frozenset[int]) -> bool:
    """Whether a straggler that explains a regression (`explained_by`: explaining's) restates it: unless other
    ranks explained it in the last windows of the same run of slower ones (`before`). One rank's delay slows
    every step it is late in, so a straggler that costs the job its slowdown is late in all of them; where the
    job's work grew on every rank, which rank lags moves from window to window, and each window's straggler
    would otherwise hide the regression for good."""
    return any(before <= ranks for ranks in explained_by)


def _busy(t: RankTable) -> str:
    """What kept the ranks' CPUs: the host's idle share, and the busiest tasks outside the job."""
    job = {p.pid for p in t.patterns}
    idle = [p.cpus.idle for p in t.patterns if p.cpus is not None]
    waited: dict[tuple[str, int], float] = {}
    for n in (n for p in t.patterns for n in p.neighbours if not n.job and n.pid not in job):
        waited[n.name, n.pid] = waited.get((n.name, n.pid), 0.0) + n.waited_s
    others = ", ".join(f"{name} (pid {pid})" for name, pid in sorted(waited, key=lambda k: -waited[k])[:2])
    cpus = f"the host's CPUs {float(np.median(idle)):.0%} idle" if idle else "the host's CPUs busy"
    return f"{cpus}; other tasks ran while they waited: {others}" if others else cpus
