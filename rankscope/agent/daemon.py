"""The node agent: a window at a time, collect every watched rank's pattern, diagnose, publish, serve."""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time

from rankscope.agent.detail import SlowdownTrigger
from rankscope.agent.host.discovery import training_processes
from rankscope.agent.host.targets import TargetError
from rankscope.agent.loader.program import ProbeError
from rankscope.agent.service.auth import Access
from rankscope.agent.service.history import StepHistory, Store
from rankscope.agent.service.http import make_app, serve_windows
from rankscope.agent.service.notify import Notifier
from rankscope.agent.service.snapshot import AgentHealth, Snapshot, TargetView, targets_of
from rankscope.agent.session import JOB_PATTERNS, Session
from rankscope.agent.trace_capture import capture
from rankscope.agent.views import trace as chrome
from rankscope.agent.views.dump import dump, to_json
from rankscope.agent.views.profile import window_profiles
from rankscope.analyzer.baseline import SLOWDOWN_THRESHOLD, Baseline
from rankscope.analyzer.diagnosis import diagnose
from rankscope.analyzer.stability import Confirmer

log = logging.getLogger(__name__)


class Agent:
    MAX_EXITED = 256  # exited targets kept in /v1/targets

    def __init__(self, session: Session, discover_all: bool, hang_timeout_s: float,
                 trigger: SlowdownTrigger | None = None, slowdown_threshold: float = SLOWDOWN_THRESHOLD,
                 history: Store | None = None, notifier: Notifier | None = None):
        self.session = session
        self.hang_timeout_s = hang_timeout_s
        self.discover_all = discover_all
        self.trigger = trigger or SlowdownTrigger()
        self.slowdown_threshold = slowdown_threshold
        self.baselines: dict[str, Baseline] = {}  # job -> its recent windows (jobs that ended are dropped)
        self.confirmer = Confirmer()  # a finding is reported once it held (stability.py)
        self.history = StepHistory(store=history)  # the page's chart and /v1/history, on disk with a store
        self.notifier = notifier  # --notify-url: a POST when a finding starts and ends
        self.windows = 0
        self.attach_errors = 0
        self.snapshot = Snapshot(history=self.history)  # a restarted agent serves its kept history at once
        self._refused: dict[int, str] = {}  # discovered processes that could not be watched, and why
        self._exited: dict[int, TargetView] = {}  # kept so that users see what left, most recent last
        self._skipped: dict[int, str] = {}  # training-library processes that are not ranks (launchers, workers)

    def discover(self) -> None:
        if not self.discover_all:
            return
        known = set(self.session.targets) | set(self._refused) | set(self._skipped) | {os.getpid()}
        watch, skipped = training_processes(JOB_PATTERNS, exclude=known)
        self._skipped.update(skipped)
        for pid in watch:
            try:
                self.session.add(pid)
                log.info("watching pid %d", pid)
            except (TargetError, ProbeError) as e:
                self._refused[pid] = str(e)
                self.attach_errors += 1
        self._refused = {pid: why for pid, why in self._refused.items() if os.path.exists(f"/proc/{pid}")}
        self._skipped = {pid: why for pid, why in self._skipped.items() if os.path.exists(f"/proc/{pid}")}

    def window(self) -> Snapshot:
        """Close a window: read the maps, diagnose, publish. Never raises for one bad process."""
        libraries = {pid: sorted(t.libraries) + ([f"cpython-{t.python}"] if t.python else [])
                     for pid, t in self.session.targets.items()}
        containers = {pid: t.container for pid, t in self.session.targets.items()}
        patterns = self.session.window()
        self.windows += 1
        if self.trigger.raised:  # recorded in the deep detail a slowdown raised: not compared with the baseline
            for p in patterns:
                p.raised_detail = True
        views = targets_of(patterns, libraries, containers)
        for v in views:
            if v.state == "exited":
                self._exited[v.pid] = v
        while len(self._exited) > self.MAX_EXITED:
            del self._exited[next(iter(self._exited))]
        current = {v.pid for v in views}
        docs = diagnose(patterns, self.hang_timeout_s, self.baselines, self.slowdown_threshold)
        self.baselines = {job: b for job, b in self.baselines.items() if job in docs}
        self.session.set_detail(self.trigger.update({job: b.compared for job, b in self.baselines.items()},
                                                    time.time()))
        self.confirmer.confirm(docs)
        for doc in docs.values():
            doc["mode"] = self.trigger.mode()
        if self.notifier is not None:
            self.notifier.update(docs)
        self.snapshot = Snapshot(
            window_end=max((p.window_end for p in patterns), default=None),
            targets=views + [v for pid, v in self._exited.items() if pid not in current],
            patterns=patterns,
            diagnoses=docs,
            errors=[f"pid {pid}: {why}" for pid, why in sorted(self._refused.items())],
            skipped=[f"pid {pid}: {why}" for pid, why in sorted(self._skipped.items())],
            profiles=window_profiles(patterns, self.session.frames.last, self.session.frames.last_frequency, docs),
            history=self.history.record(docs),
            health=AgentHealth(windows=self.windows, attach_errors=self.attach_errors, drops=self.session.drops(),
                               last_window=time.time()),
        )
        self.discover()
        return self.snapshot

    def stacks(self) -> dict:
        """Every watched rank's threads and their Python stacks now (GET /v1/stacks); ranks as the last
        window's patterns name them (NCCL's own may differ from the environment's)."""
        ranks = {p.pid: p.rank for p in self.snapshot.patterns}
        groups, errors = dump([(t.pid, ranks.get(t.pid, t.identity.rank)) for t in list(self.session.targets.values())])
        return to_json(groups, errors)

    def trace(self, seconds: float, job: str | None, rank: int | None) -> list[dict]:
        """A trace capture of one job's ranks (GET /v1/trace): `job`'s, or the only job's; `rank`'s alone if
        named. Ranks as the last window's patterns name them."""
        running = [p for p in self.snapshot.patterns if p.state == "running" and p.pid in self.session.targets]
        jobs = sorted({p.job for p in running})
        if job is None and len(jobs) > 1:
            raise ValueError(f"several jobs are watched, choose one with ?job=: {jobs[:64]}")
        chosen = [p for p in running if (job is None or p.job == job) and (rank is None or p.rank == rank)]
        if not chosen:
            raise LookupError(f"no watched rank {rank} of job {job} in the last window; jobs: {jobs[:64]}")
        cap = capture(self.session.trace_streams(), [p.pid for p in chosen], seconds)
        functions = chrome.functions_of(self.session.program)
        return [chrome.chrome_trace(chrome.RankInfo.of(p), cap, functions) for p in chosen]


async def serve(agent: Agent, host: str, port: int, window_s: float, access: Access, captures: bool = True,
                tls: ssl.SSLContext | None = None) -> None:
    """Serve the agent's API; without `captures`, no /v1/stacks and /v1/trace (404)."""
    loop = asyncio.get_running_loop()
    app = make_app(lambda: agent.snapshot, access, agent.stacks if captures else None,
                   agent.trace if captures else None)
    try:
        await serve_windows(app, host, port, window_s, lambda: loop.run_in_executor(None, agent.window), "agent",
                            first=lambda: loop.run_in_executor(None, agent.discover), tls=tls)
    finally:
        agent.session.close()
        agent.history.close()
        if agent.notifier is not None:
            agent.notifier.close()
