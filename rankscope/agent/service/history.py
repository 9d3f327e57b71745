"""Each job's windows as the page's chart, /v1/history and `rankscope history` read them: step time, baseline
and findings. The documents themselves keep only the last window, and the baseline's past
(analyzer/baseline.py) leaves out hung and regressed windows, which are exactly the ones a person wants to
see against the baseline.

The last KEEP_WINDOWS windows of each job being diagnosed stay in memory; with a store (history_store.py)
every window is also kept on disk, so that a restarted agent serves what it had and a span of hours or
days can be read. A query reads the store and adds the windows of memory it has not written yet."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

KEEP_WINDOWS = 240  # 20 minutes of 5 s windows in memory, per job
MAX_POINTS = 2000  # points of one job in one answer: a longer span is thinned (finding changes kept)
MAX_JOBS = 64  # jobs in one answer, those seen last first
DEFAULT_SPAN_S = 3600.0  # a query without `since` reads the last hour


@dataclass(frozen=True)
class StepPoint:
    """One window of a job as the chart draws it."""

    end: float  # unix s
    step_time_s: float | None  # None: no step completed (a hang)
    baseline_s: float | None  # the baseline the window was compared with (None until three windows)
    findings: tuple[str, ...]  # kinds reported in the window


@dataclass(frozen=True)
class Window:
    """One window of a job as it is kept: its point and the findings it reported, evidence included."""

    job: str
    point: StepPoint
    findings: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, job: str, doc: Mapping[str, Any]) -> Window:
        baseline = doc.get("baseline")
        findings = tuple(doc["findings"])
        return cls(job, StepPoint(end=doc["window"]["end"], step_time_s=doc.get("step_time_s"),
                                  baseline_s=baseline["step_time_s"] if baseline else None,
                                  findings=tuple(f["kind"] for f in findings)), findings)


UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_AGO_S = 366 * 86400.0


def parse_time(text: str, now: float) -> float:
    """A point in time as /v1/history and `rankscope history` take it: unix seconds, or a duration before
    `now` (`90s`, `30m`, `3h`, `7d`). ValueError for anything else."""
    text = text.strip()
    if text and text[-1] in UNITS:
        ago = _number(text[:-1], text) * UNITS[text[-1]]
        if not 0 <= ago <= MAX_AGO_S:
            raise ValueError(f"a duration from 0 to {MAX_AGO_S / 86400:.0f}d, not {text[:64]!r}")
        return now - ago
    t = _number(text, text)
    if not 0 <= t <= now + MAX_AGO_S:
        raise ValueError(f"unix seconds up to a year from now, not {text[:64]!r}")
    return t


def _number(text: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds or a duration: {whole[:64]!r}") from None


FindingKey = tuple[str, tuple[int, ...]]  # a finding's identity across windows: its kind and ranks


def finding_key(f: Mapping[str, Any]) -> FindingKey:
    return f["kind"], tuple(f["ranks"])


@dataclass
class Episode:
    """A finding from the first window that reported it to the last one in a row."""

    kind: str
    ranks: list[int]
    start: float  # end of its first window (its onset)
    end: float  # end of its last window
    windows: int
    finding: dict[str, Any]  # as its first window reported it, evidence included


@dataclass
class JobHistory:
    """A job's windows of a span: `points` (oldest first, thinned to MAX_POINTS) and its findings' episodes."""

    points: list[StepPoint] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)


class Store(Protocol):
    def put(self, windows: list[Window]) -> None: ...

    def read(self, job: str | None, since: float, until: float) -> dict[str, JobHistory] | None: ...

    def close(self) -> None: ...


class Episodes:
    """Builds episodes from windows read oldest first: a finding absent from a window ends its episode."""

    def __init__(self) -> None:
        self.open: dict[FindingKey, Episode] = {}
        self.done: list[Episode] = []

    def add(self, end: float, keys: list[FindingKey], finding: Any) -> None:
        """`finding(i)`: the window's i-th finding dict, read only at an onset (the store parses it then)."""
        for key in [k for k in self.open if k not in keys]:
            self.done.append(self.open.pop(key))
        for i, key in enumerate(keys):
            if key in self.open:
                self.open[key].end, self.open[key].windows = end, self.open[key].windows + 1
            else:
                self.open[key] = Episode(key[0], list(key[1]), end, end, 1, finding(i))

    def all(self) -> list[Episode]:
        return sorted(self.done + list(self.open.values()), key=lambda e: (e.start, e.kind))


def thin(points: list[StepPoint], limit: int = MAX_POINTS) -> list[StepPoint]:
    """At most about `limit` points, evenly spaced, keeping every window whose findings differ from the one
    before (the onsets the chart marks) and the last."""
    if len(points) <= limit:
        return points
    stride = -(-len(points) // limit)
    return [p for i, p in enumerate(points)
            if i % stride == 0 or i == len(points) - 1 or p.findings != points[i - 1].findings]


def job_history(windows: list[Window]) -> JobHistory:
    episodes = Episodes()
    for w in windows:
        episodes.add(w.point.end, [finding_key(f) for f in w.findings], lambda i, w=w: dict(w.findings[i]))
    return JobHistory(thin([w.point for w in windows]), episodes.all())


class StepHistory:
    """job -> its last `keep` windows in memory (a job no longer diagnosed is forgotten there), and every
    window in `store` when there is one. Recorded from the window's thread, read from HTTP handlers'."""

    def __init__(self, keep: int = KEEP_WINDOWS, store: Store | None = None):
        self.keep = keep
        self.store = store
        self._jobs: dict[str, deque[Window]] = {}
        self._lock = threading.Lock()

    def record(self, diagnoses: Mapping[str, Mapping[str, Any]]) -> StepHistory:
        """Adds each document's window (once per window end), hands the new ones to the store (it never
        blocks: history_store.py), and returns itself for the snapshot."""
        new: list[Window] = []
        with self._lock:
            self._jobs = {job: self._jobs.get(job) or deque(maxlen=self.keep) for job in diagnoses}
            for job, doc in diagnoses.items():
                windows, end = self._jobs[job], doc["window"]["end"]
                if end is None or (windows and windows[-1].point.end == end):
                    continue
                windows.append(Window.of(job, doc))
                new.append(windows[-1])
        if new and self.store is not None:
            self.store.put(new)
        return self

    def held(self) -> dict[tuple[str, FindingKey], int]:
        """(job, finding) -> how many windows in a row, up to the last, reported it (at most `keep`)."""
        out: dict[tuple[str, FindingKey], int] = {}
        with self._lock:
            for job, windows in self._jobs.items():
                keys = [{finding_key(f) for f in w.findings} for w in reversed(windows)]
                for key in keys[0] if keys else ():
                    out[(job, key)] = next((n for n, ks in enumerate(keys) if key not in ks), len(keys))
        return out

    def points(self) -> dict[str, list[StepPoint]]:
        """Each job's windows in memory."""
        with self._lock:
            return {job: [w.point for w in windows] for job, windows in self._jobs.items()}

    def query(self, job: str | None = None, since: float | None = None, until: float | None = None
              ) -> dict[str, JobHistory]:
        """Job (`job`'s alone if named) -> its windows that ended in [since, until] (the last hour by
        default): the store's, then memory's newer ones; memory's alone without a store or when it fails."""
        until = time.time() if until is None else until
        since = until - DEFAULT_SPAN_S if since is None else since
        with self._lock:
            recent = {j: [w for w in ws if since <= w.point.end <= until]
                      for j, ws in self._jobs.items() if job is None or j == job}
        stored = self.store.read(job, since, until) if self.store is not None else None
        if stored is None:
            return _latest({j: job_history(ws) for j, ws in recent.items() if ws})
        for j, ws in recent.items():
            kept = stored.get(j)
            last = kept.points[-1].end if kept and kept.points else float("-inf")
            newer = [w for w in ws if w.point.end > last]
            if newer:
                stored[j] = _joined(kept, newer) if kept else job_history(newer)
        return _latest(stored)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def _joined(kept: JobHistory, newer: list[Window]) -> JobHistory:
    """The store's history of a job followed by memory's windows it has not written yet (a window or two):
    an episode open at the store's last window goes on into them."""
    tail = job_history(newer)
    last_end = kept.points[-1].end
    open_ = {(e.kind, tuple(e.ranks)): e for e in kept.episodes if e.end == last_end}
    episodes = list(kept.episodes)
    for e in tail.episodes:
        before = open_.get((e.kind, tuple(e.ranks)))
        if before is not None and e.start == newer[0].point.end:
            before.end, before.windows = e.end, before.windows + e.windows
        else:
            episodes.append(e)
    return JobHistory(thin(kept.points + tail.points), episodes)


def _latest(jobs: dict[str, JobHistory]) -> dict[str, JobHistory]:
    """At most MAX_JOBS jobs, those whose last window is the most recent, by name."""
    chosen = sorted(jobs, key=lambda j: -(jobs[j].points[-1].end if jobs[j].points else 0.0))[:MAX_JOBS]
    return {j: jobs[j] for j in sorted(chosen)}


MAX_JOB_NAME = 256


def history_answer(history: StepHistory, query: dict[str, str], now: float) -> dict[str, Any]:
    """GET /v1/history?job=&since=&until=: each job's windows ended in the span (the last hour by default)
    and its findings from onset to end. ValueError for a parameter out of its bounds."""
    job = query.get("job")
    if job is not None and not 0 < len(job) <= MAX_JOB_NAME:
        raise ValueError(f"job must be 1 to {MAX_JOB_NAME} characters")
    try:
        until = parse_time(query["until"], now) if "until" in query else now
        since = parse_time(query["since"], now) if "since" in query else None
    except ValueError as e:
        raise ValueError(f"since and until take unix seconds or a duration ago (90s, 30m, 3h, 7d): {e}") from None
    since = until - DEFAULT_SPAN_S if since is None else since
    if since > until:
        raise ValueError("since is after until")
    jobs = history.query(job, since, until)
    return {"since": since, "until": until,
            "jobs": {j: [asdict(p) for p in h.points] for j, h in jobs.items()},
            "findings": {j: [asdict(e) for e in h.episodes] for j, h in jobs.items()}}
