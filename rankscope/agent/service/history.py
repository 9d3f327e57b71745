"""The recent windows' step times of each job, for the page's chart: the documents themselves keep only the
last window, and the baseline's past (analyzer/baseline.py) leaves out hung and regressed windows, which are
exactly the ones a person wants to see against the baseline."""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KEEP_WINDOWS = 240  # 20 minutes of 5 s windows; ~100 bytes each per job


@dataclass(frozen=True)
class StepPoint:
    """One window of a job as the chart draws it."""

    end: float  # unix s
    step_time_s: float | None  # None: no step completed (a hang)
    baseline_s: float | None  # the baseline the window was compared with (None until three windows)
    findings: tuple[str, ...]  # kinds reported in the window


class StepHistory:
    """job -> its last KEEP_WINDOWS windows; a job no longer diagnosed is forgotten."""

    def __init__(self, keep: int = KEEP_WINDOWS):
        self.keep = keep
        self._jobs: dict[str, deque[StepPoint]] = {}

    def record(self, diagnoses: Mapping[str, Mapping[str, Any]]) -> dict[str, list[StepPoint]]:
        """Adds each document's window (once per window end) and returns a copy for the snapshot."""
        self._jobs = {job: self._jobs.get(job) or deque(maxlen=self.keep) for job in diagnoses}
        for job, doc in diagnoses.items():
            points, end = self._jobs[job], doc["window"]["end"]
            if end is None or (points and points[-1].end == end):
                continue
            baseline = doc.get("baseline")
            points.append(StepPoint(end=end, step_time_s=doc.get("step_time_s"),
                                    baseline_s=baseline["step_time_s"] if baseline else None,
                                    findings=tuple(f["kind"] for f in doc["findings"])))
        return {job: list(points) for job, points in self._jobs.items()}
