"""The job's own past: its usual recent steps, and `regression`, a job slower than that baseline.

Peers tell a slow rank from the others; they cannot tell that every rank got slower (a new driver, a
slower dataset, a bigger model). For that a job is compared with itself: each window leaves a StepProfile
(the job's step time and what each function cost per step, medians over ranks), the baseline is the median
window of the recent ones, and a job clearly slower than it is a
regression, named by the function whose time per step grew the most, or by the wait for a CPU when the job
runs as long as before and waits longer (rules/regression.py).
"""
from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from rankscope.analyzer.differential import MAD_TO_SIGMA
from rankscope.analyzer.metrics import RankTable
from rankscope.analyzer.thresholds import KEEP_WINDOWS, MIN_WINDOWS, RUN_WINDOWS, SLOWDOWN_THRESHOLD, Z_FLOOR, Z_MIN

# The baseline is the median window (the slower of two: in doubt, no finding), the job's usual pace: not the
# fastest (one lucky window), nor the best quarter, below the usual pace by design. Its noise is the smaller
# of two estimates of the windows' sigma: their spread about the median (the larger of the median and the mean
# absolute deviation's, as the median's alone reads ~0 over three windows of which two are alike), and the
# mean change from one window to the next, which a slow trend (a job still warming up) does not inflate.
MEAN_AD_TO_SIGMA = 1.2533  # mean absolute deviation of a normal distribution x sqrt(pi / 2): its sigma
SUCCESSIVE_TO_SIGMA = 0.8862  # mean |difference| of two draws of a normal distribution x sqrt(pi) / 2: its sigma


@dataclass(frozen=True)
class StepProfile:
    """One window of a job: seconds per step, medians over its ranks."""

    end: float  # unix s
    step_s: float
    host_s: float  # outside every probed function
    runq_s: float  # the main thread waiting for a CPU; NaN: no scheduler view
    oncpu_s: float  # the main thread running; NaN: no scheduler view
    functions: dict[str, float]  # probed function -> seconds per step
    python: dict[str, float]  # Python function -> self seconds per step
    # Each rank's own work per step (step - COMM) and its main thread's wait for a CPU (NaN: no scheduler view),
    # by rank, in a pure pipeline (no rank with a data-parallel peer): what a stage is compared with
    # (rules/regression.py grown_stage). Empty in any other job: a baseline's 720 windows of 100,000 ranks'
    # would hold over a gigabyte.
    ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), compare=False, repr=False)
    work_s: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
    ranks_runq_s: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)

    @classmethod
    def of(cls, t: RankTable, per_rank: bool = False) -> StepProfile | None:
        """The window's profile, with each rank's work where `per_rank` (a pure pipeline); None when no rank has
        a known step time."""
        valid = np.isfinite(t.step_s)
        if not valid.any():
            return None
        fn = np.median(t.fn_s[valid], axis=0) if t.fn_names else []
        py = np.median(t.py_s[valid], axis=0) if t.py_names else []
        with warnings.catch_warnings():  # no scheduler view on any rank: NaN, said once here
            warnings.simplefilter("ignore", RuntimeWarning)
            runq, oncpu = (float(np.nanmedian(x[valid])) for x in (t.runq_s, t.oncpu_s))
        return cls(end=max(map(attrgetter("window_end"), t.patterns)), step_s=float(np.median(t.step_s[valid])),
                   host_s=float(np.median(t.host_s[valid])), runq_s=runq, oncpu_s=oncpu,
                   functions=dict(zip(t.fn_names, map(float, fn))), python=dict(zip(t.py_names, map(float, py))),
                   **({"ranks": t.rank[valid], "work_s": t.work_s[valid], "ranks_runq_s": t.runq_s[valid]}
                      if per_rank else {}))

    def of_ranks(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each of `ranks`' own work per step and wait for a CPU in this window (NaN: a rank it did not see)."""
        if self.ranks.size == 0:
            return np.full(len(ranks), np.nan), np.full(len(ranks), np.nan)
        order = np.argsort(self.ranks)
        at = order[np.clip(np.searchsorted(self.ranks, ranks, sorter=order), 0, self.ranks.size - 1)]
        seen = self.ranks[at] == ranks
        return np.where(seen, self.work_s[at], np.nan), np.where(seen, self.ranks_runq_s[at], np.nan)


@dataclass(frozen=True)
class Reference:
    """The baseline a window is compared with."""

    profile: StepProfile
    windows: int  # how many recent windows it was chosen from
    spread_s: float  # robust spread of their step times: how much a step time moves by itself
    running: tuple[float, ...] = ()  # step times of the windows just before, each above it (oldest first)

    def above(self, step_s: float, threshold: float = SLOWDOWN_THRESHOLD) -> bool:
        """A step time `threshold` of the baseline or more above it."""
        return step_s - self.profile.step_s >= threshold * self.profile.step_s

    def slower(self, step_s: float, threshold: float = SLOWDOWN_THRESHOLD) -> bool:
        """A step time clearly above the baseline: by `threshold` of it, and beyond the windows' own noise,
        so that a job whose step time wanders is not called slower for it: the mean of the windows running
        above it with this one (RUN_WINDOWS at most; alone, this one) Z_MIN of that mean's spread above it."""
        if not self.above(step_s, threshold):
            return False
        run = self._run(step_s)
        return float(np.mean(run)) - self.profile.step_s >= Z_MIN * self.noise_s / math.sqrt(len(run))

    def run_z(self, step_s: float) -> float:
        """What `slower` holds to Z_MIN: how far the mean of the run of windows above the baseline (with this
        one) lies above it, in that mean's spread."""
        run = self._run(step_s)
        return (float(np.mean(run)) - self.profile.step_s) / (self.noise_s / math.sqrt(len(run)))

    def _run(self, step_s: float) -> list[float]:
        """This window's step time after those of the windows running above the baseline (RUN_WINDOWS at most)."""
        return [*self.running[-(RUN_WINDOWS - 1):], step_s]

    @property
    def noise_s(self) -> float:
        return max(self.spread_s, Z_FLOOR * self.profile.step_s)


@dataclass(frozen=True)
class Comparison:
    """One window's step time against the job's baseline: what the agent's slowdown trigger acts on."""

    step_s: float
    baseline_step_s: float
    slower: bool  # Reference.slower


class Baseline:
    """A job's recent window profiles; add each window after comparing it with `reference()` (diagnosis
    leaves out hung and regressed windows, so a regression does not become the baseline)."""

    def __init__(self, keep: int = KEEP_WINDOWS):
        self._windows: deque[StepProfile] = deque(maxlen=keep)
        self._running: deque[float] = deque(maxlen=RUN_WINDOWS - 1)  # Reference.running
        # The last comparable window's finding against this baseline, a regression or a pipeline stage grown
        # (diagnosis.py holds it through windows at raised detail, which are not compared)
        self.regression: dict[str, Any] | None = None
        # Per recent window of this run above the baseline, the ranks of the stragglers that explained its
        # regression (rules/regression.py restated): a few ints, cleared with the run.
        self._explained: deque[frozenset[int]] = deque(maxlen=RUN_WINDOWS - 1)
        self.compared: Comparison | None = None  # the last window's (None: no baseline yet, or no steps)

    def add(self, profile: StepProfile | None) -> None:
        """A window of the job's normal: it joins the baseline and ends a run of windows above it."""
        if profile is not None:
            self._windows.append(profile)
            self._end_run()

    def left_out(self, above_s: float | None) -> None:
        """A comparable window that does not join: one above the baseline (its step time) continues a run,
        any other (None: hung, no steps) ends it."""
        if above_s is None:
            self._end_run()
        else:
            self._running.append(above_s)

    def _end_run(self) -> None:
        self._running.clear()
        self._explained.clear()

    @property
    def explained_by(self) -> frozenset[int]:
        """The ranks of the stragglers that explained a regression in the run's last windows (RUN_WINDOWS - 1,
        as `running`: a rank that lagged once, hours into a lasting slowdown, is forgotten)."""
        return frozenset().union(*self._explained)

    def explained(self, ranks: frozenset[int]) -> None:
        """A window's regression beside stragglers on `ranks` that explain it (none: an empty set)."""
        self._explained.append(ranks)

    def reference(self) -> Reference | None:
        if len(self._windows) < MIN_WINDOWS:
            return None
        ordered = sorted(self._windows, key=lambda w: w.step_s)
        steps = np.array([w.step_s for w in self._windows])  # in the order they came
        deviation = np.abs(steps - np.median(steps))
        spread = min(max(MAD_TO_SIGMA * float(np.median(deviation)), MEAN_AD_TO_SIGMA * float(np.mean(deviation))),
                     SUCCESSIVE_TO_SIGMA * float(np.mean(np.abs(np.diff(steps)))))
        return Reference(ordered[len(ordered) // 2], len(ordered), spread, tuple(self._running))
