"""The job's own past: its best recent steps, and `regression`, a job slower than that baseline.

Peers tell a slow rank from the others; they cannot tell that every rank got slower (a new driver, a
slower dataset, a bigger model). For that a job is compared with itself: each window leaves a StepProfile
(the job's step time and what each function cost per step, medians over ranks), the baseline is the window
at the best quarter of the recent ones, and a job clearly slower than it is a regression, named by the
function whose time per step grew the most.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from rankscope.analyzer.differential import MAD_TO_SIGMA
from rankscope.analyzer.findings import DATA_LOADING, PYTHON_SHARE, Z_FLOOR, Z_MIN, ms
from rankscope.analyzer.metrics import RankTable
from rankscope.schema.finding import Finding

KEEP_WINDOWS = 720  # an hour of 5 s windows: "recent"
MIN_WINDOWS = 3  # fewer windows are no baseline
BEST_QUANTILE = 0.25  # the baseline is this quantile of the recent windows' step times: the good steps
SLOWDOWN_THRESHOLD = 0.10  # a job this much slower than its baseline has regressed (and triggers deep mode)
BROAD_SHARE = 0.75  # a regression: at least this share of ranks shows the growth, not one rank


@dataclass(frozen=True)
class StepProfile:
    """One window of a job: seconds per step, medians over its ranks."""

    end: float  # unix s
    step_s: float
    host_s: float  # outside every probed function
    functions: dict[str, float]  # probed function -> seconds per step
    python: dict[str, float]  # Python function -> self seconds per step

    @classmethod
    def of(cls, t: RankTable) -> StepProfile | None:
        """The window's profile; None when no rank has a known step time."""
        valid = np.isfinite(t.step_s)
        if not valid.any():
            return None
        fn = np.median(t.fn_s[valid], axis=0) if t.fn_names else []
        py = np.median(t.py_s[valid], axis=0) if t.py_names else []
        return cls(end=max(p.window_end for p in t.patterns), step_s=float(np.median(t.step_s[valid])),
                   host_s=float(np.median(t.host_s[valid])),
                   functions=dict(zip(t.fn_names, map(float, fn))), python=dict(zip(t.py_names, map(float, py))))


@dataclass(frozen=True)
class Reference:
    """The baseline a window is compared with."""

    profile: StepProfile
    windows: int  # how many recent windows it was chosen from
    spread_s: float  # robust spread of their step times: how much a step time moves by itself

    def slower(self, step_s: float, threshold: float = SLOWDOWN_THRESHOLD) -> bool:
        """A step time clearly above the baseline: by `threshold` of it, and beyond the windows' own noise
        (Z_MIN robust spreads), so that a job whose step time wanders is not called slower for it."""
        grown = step_s - self.profile.step_s
        return grown >= threshold * self.profile.step_s and grown >= Z_MIN * self.noise_s

    @property
    def noise_s(self) -> float:
        return max(self.spread_s, Z_FLOOR * self.profile.step_s)


class Baseline:
    """A job's recent window profiles; add each window after comparing it with `reference()` (diagnosis
    leaves out hung and regressed windows, so a regression does not become the baseline)."""

    def __init__(self, keep: int = KEEP_WINDOWS):
        self._windows: deque[StepProfile] = deque(maxlen=keep)

    def add(self, profile: StepProfile | None) -> None:
        if profile is not None:
            self._windows.append(profile)

    def reference(self) -> Reference | None:
        if len(self._windows) < MIN_WINDOWS:
            return None
        ordered = sorted(self._windows, key=lambda w: w.step_s)
        steps = np.array([w.step_s for w in ordered])
        spread = MAD_TO_SIGMA * float(np.median(np.abs(steps - np.median(steps))))
        return Reference(ordered[int(BEST_QUANTILE * (len(ordered) - 1))], len(ordered), spread)


def regression(t: RankTable, ref: Reference | None, threshold: float = SLOWDOWN_THRESHOLD) -> list[Finding]:
    """The job is `threshold` slower than its baseline and the growth is on (nearly) every rank.

    The caller asks only when no rank differs from its peers: a straggler slows the whole job too, but the
    straggler is the cause, not a change of the job.
    """
    now = StepProfile.of(t)
    if ref is None or now is None:
        return []
    base = ref.profile
    grown = now.step_s - base.step_s
    if not ref.slower(now.step_s, threshold):
        return []
    valid = np.isfinite(t.step_s)

    # The probed functions and the host time outside them partition a step: which part grew the most?
    parts = {name: (now.functions[name] - base.functions.get(name, 0.0), t.fn_s[valid, j], t.fn_roles[j])
             for j, name in enumerate(t.fn_names)}
    parts[None] = (now.host_s - base.host_s, t.host_s[valid], None)
    name = max(parts, key=lambda k: parts[k][0])
    growth, per_rank, role = parts[name]
    before = base.host_s if name is None else base.functions.get(name, 0.0)
    broad = np.count_nonzero(per_rank - before >= 0.5 * growth) / max(int(valid.sum()), 1)
    if broad < BROAD_SHARE:
        return []
    python = sorted(((f, s - base.python.get(f, 0.0)) for f, s in now.python.items()), key=lambda x: -x[1])
    function, component = name, role.component if role else "cpu"
    if name is None and python and python[0][1] >= PYTHON_SHARE * grown:
        function = python[0][0]  # host time grew: the Python function where it went names it
        component = "input" if DATA_LOADING.search(function) else "python"
    cost = float(np.clip(grown / now.step_s, 0.0, 1.0))
    where = function or "host work outside CUDA and NCCL calls"
    return [Finding(
        kind="regression", ranks=sorted(int(r) for r in t.rank[valid]), function=function, component=component,
        score=grown / ref.noise_s, cost=cost,
        summary=(f"every rank is slower than the job's baseline: {ms(now.step_s)} per step instead of "
                 f"{ms(base.step_s)} (+{grown / base.step_s:.0%}); {where} grew by {ms(growth)} per step; "
                 f"costs {cost:.0%} of step time"),
        evidence={"step_time_s": now.step_s, "baseline_step_s": base.step_s, "baseline_windows": ref.windows,
                  "baseline_end": base.end, "baseline_noise_s": ref.noise_s, "grown_s": grown, "function_growth_s": growth,
                  "function_baseline_s": before, "ranks_grown_share": broad,
                  "python_growth": [{"function": f, "grown_s": g} for f, g in python[:3] if g > 0]},
    )]
