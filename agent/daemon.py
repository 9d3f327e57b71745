"""The node agent: a window at a time, collect every watched rank's pattern, diagnose, publish, serve."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from aiohttp import web
from rankscope.analyzer.baseline import Baseline
from rankscope.analyzer.diagnosis import diagnose

from .bpf_program import ProbeError
from .detail import SlowdownTrigger
from .discovery import training_processes
from .server import make_app
from .session import JOB_PATTERNS, Session
from .snapshot import Snapshot, TargetView, targets_of
from .targets import TargetError

log = logging.getLogger(__name__)


class Agent:
    MAX_EXITED = 256  # exited targets kept in /v1/targets

    def __init__(self, session: Session, discover_all: bool, hang_timeout_s: float,
                 trigger: SlowdownTrigger | None = None):
        self.session = session
        self.hang_timeout_s = hang_timeout_s
        self.discover_all = discover_all
        self.trigger = trigger or SlowdownTrigger()
        self.baselines: dict[str, Baseline] = {}  # job -> its recent windows (jobs that ended are dropped)
        self.snapshot = Snapshot()
        self._refused: dict[int, str] = {}  # discovered processes that could not be watched, and why
        self._exited: dict[int, TargetView] = {}  # kept so that users see what left, most recent last

    def discover(self) -> None:
        if not self.discover_all:
            return
        known = set(self.session.targets) | set(self._refused) | {os.getpid()}
        for pid in training_processes(JOB_PATTERNS, exclude=known):
            try:
                self.session.add(pid)
                log.info("watching pid %d", pid)
            except (TargetError, ProbeError) as e:
                self._refused[pid] = str(e)
        self._refused = {pid: why for pid, why in self._refused.items() if os.path.exists(f"/proc/{pid}")}

    def window(self) -> Snapshot:
        """Close a window: read the maps, diagnose, publish. Never raises for one bad process."""
        libraries = {pid: sorted(t.libraries) + ([f"cpython-{t.python}"] if t.python else [])
                     for pid, t in self.session.targets.items()}
        patterns = self.session.window()
        views = targets_of(patterns, libraries)
        for v in views:
            if v.state == "exited":
                self._exited[v.pid] = v
        while len(self._exited) > self.MAX_EXITED:
            del self._exited[next(iter(self._exited))]
        current = {v.pid for v in views}
        docs = diagnose(patterns, self.hang_timeout_s, self.baselines)
        self.baselines = {job: b for job, b in self.baselines.items() if job in docs}
        self.session.set_detail(self.trigger.update(docs, time.time()))
        for doc in docs.values():
            doc["mode"] = self.trigger.mode()
        self.snapshot = Snapshot(
            window_end=max((p.window_end for p in patterns), default=None),
            targets=views + [v for pid, v in self._exited.items() if pid not in current],
            patterns=patterns,
            diagnoses=docs,
            errors=[f"pid {pid}: {why}" for pid, why in sorted(self._refused.items())],
        )
        self.discover()
        return self.snapshot


async def serve(agent: Agent, host: str, port: int, window_s: float) -> None:
    runner = web.AppRunner(make_app(lambda: agent.snapshot), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("serving on http://%s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await loop.run_in_executor(None, agent.discover)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=window_s)
            except asyncio.TimeoutError:
                try:
                    await loop.run_in_executor(None, agent.window)
                except Exception:  # keep serving the last good snapshot; the next window may succeed
                    log.exception("window failed")
    finally:
        await runner.cleanup()
        agent.session.close()
