"""How much the agent records: light always-on detail, and deep detail for a while after a slowdown.

The published systems keep an always-on layer cheap and raise the detail on demand when a job slows down.
Here the trigger is the job's own step time against its baseline (analyzer/baseline.py): when it exceeds
the baseline by the threshold, the agent samples Python frames faster, counts kernel launches, times
`forward` and data-loader `__next__` exactly, and ships more of each rank's collectives and Python functions for `deep_s` seconds, then rests in light mode for COOLDOWN x `deep_s`
before it may trigger again, so that a lasting slowdown cannot keep the job in deep mode.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankscope.agent.sources.python_sampler import DEFAULT_FREQUENCY
from rankscope.analyzer.baseline import Comparison
from rankscope.analyzer.stability import REGRESSION_WINDOWS

DEEP_SECONDS = 60.0
COOLDOWN = 4  # x deep_s in light mode after each deep episode: deep mode costs at most 1/5 of the time


@dataclass(frozen=True)
class Detail:
    level: str
    python_hz: int  # frame samples per second per CPU
    max_collectives: int  # per pattern: collective instants shipped (the latest of the window)
    top_python: int  # per pattern: Python functions shipped
    # Probes on per-call hot paths: kernel launches counted (~0.6 us each), Python's eval loop, to time
    # forward and data-loader __next__ exactly (~1.3 us per entry), and the CUPTI shim's launch records joined
    # to their kernels (CUPTI's API records cost time on every CUDA call). Too costly to leave on.
    hot_probes: bool


# Light: ~2 KB patterns (64 collectives, ~13 bytes each: a few steps of a job with many buckets, to line
# ranks up; a cluster of 100k ranks then pulls ~200 MB a window), ~0.2% of a core; 199 Hz is off the timer beat. Deep: a whole window's collectives for all but the most
# collective-heavy jobs (a pipeline stage's ~20 a step at ~12 steps/s is ~1,500 in 6 s).
LIGHT = Detail("light", DEFAULT_FREQUENCY, max_collectives=64, top_python=5, hot_probes=False)
DEEP = Detail("deep", 4 * DEFAULT_FREQUENCY + 3, max_collectives=4096, top_python=20, hot_probes=True)


@dataclass
class Trigger:
    """Why the agent is in deep mode."""

    job: str
    since: float  # unix s
    until: float  # unix s: back to light unless the slowdown lasts
    step_time_s: float
    baseline_step_s: float

    def to_dict(self) -> dict[str, Any]:
        slower = self.step_time_s / self.baseline_step_s - 1
        return {"level": DEEP.level, "since": self.since, "until": self.until, "job": self.job,
                "reason": (f"step time {self.step_time_s * 1e3:.1f} ms is {slower:.0%} above the job's baseline "
                           f"{self.baseline_step_s * 1e3:.1f} ms")}


LEVELS = {d.level: d for d in (LIGHT, DEEP)}


class SlowdownTrigger:
    """Chooses the detail of each next window; `fixed` pins it (`rankscope agent --detail deep`)."""

    def __init__(self, deep_s: float = DEEP_SECONDS, fixed: Detail | None = None):
        if deep_s <= 0:
            raise ValueError("the deep-mode time must be positive")
        self.deep_s = deep_s
        self.fixed = fixed
        self.trigger: Trigger | None = None
        self._rest_until = 0.0  # unix s: no new trigger before
        self._slower: dict[str, int] = {}  # job -> light windows in a row slower than its baseline

    @property
    def raised(self) -> bool:
        """Deep detail chosen by a slowdown (not pinned): the job runs slower for the probes themselves (a 4 ms
        step CPU-bound MLP, ~94k eval-loop entries a second, ran 15-50% slower), so its windows are not
        compared with a baseline of light ones."""
        return self.trigger is not None

    def update(self, compared: Mapping[str, Comparison | None], now: float) -> Detail:
        """The detail for the next window, from this window's step time of each job against its baseline
        (job -> Baseline.compared: None without a baseline yet). Deep
        detail is raised once a job is slower than its baseline in REGRESSION_WINDOWS light windows in a row,
        as a regression is confirmed: raised on one noisy window, its own cost kept the job slower."""
        if self.fixed:
            return self.fixed
        if self.trigger and now >= self.trigger.until:
            self._rest_until = self.trigger.until + COOLDOWN * self.deep_s
            self.trigger = None
            self._slower.clear()
        elif self.trigger is None:
            self._slower = {job: self._slower.get(job, 0) + 1 for job, c in compared.items() if c and c.slower}
        if self.trigger is None and now >= self._rest_until:
            for job, c in sorted(compared.items()):
                if c and self._slower.get(job, 0) >= REGRESSION_WINDOWS:
                    self.trigger = Trigger(job, now, now + self.deep_s, c.step_s, c.baseline_step_s)
                    break
        return DEEP if self.trigger else LIGHT

    def mode(self) -> dict[str, Any]:
        """The `mode` entry of the diagnosis document."""
        if self.fixed:
            return {"level": self.fixed.level, "reason": "set by --detail"}
        return self.trigger.to_dict() if self.trigger else {"level": LIGHT.level}
