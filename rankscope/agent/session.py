"""An observation session: the processes watched, and the sources (sources/source.py) that fill in each
window's pattern of every one of them.

Used the same way by `rankscope diagnose` (one window) and the node agent (a window every few seconds).
A process that exits is reported once as exited, with what was collected up to its exit, then forgotten.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from rankscope.agent.detail import LIGHT, Detail
from rankscope.agent.host.targets import Target, TargetError, inspect_process
from rankscope.agent.inject.inject import InjectError
from rankscope.agent.inject.shim import allowed, inject_shim
from rankscope.agent.loader.program import ProbeProgram
from rankscope.agent.loader.trace_stream import TraceStream
from rankscope.agent.sources.gpu import GpuViews
from rankscope.agent.sources.host import HostFacts
from rankscope.agent.sources.probes import KINDS
from rankscope.agent.sources.program import ProgramSource
from rankscope.agent.sources.python_exact import PythonTiming, TracedFunction
from rankscope.agent.sources.python_profile import PythonFrames
from rankscope.agent.sources.python_sampler import PythonSampler
from rankscope.agent.sources.source import Source
from rankscope.schema.patterns import RankPattern

log = logging.getLogger(__name__)

LIBRARY_PATTERNS = {kind.name: kind.library for kind in KINDS if kind.library is not None}
JOB_PATTERNS = {name: pattern for name, pattern in LIBRARY_PATTERNS.items()
                if next(k for k in KINDS if k.name == name).identifies_job}


def host_name() -> str:
    """The node's name: Kubernetes' NODE_NAME when set (a pod's hostname is the pod's), else the host's."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


class Session:
    def __init__(self, program: ProbeProgram | None = None, traced: tuple[TracedFunction, ...] = (),
                 detail: Detail = LIGHT, inject_shim: bool = False, inject_allow: tuple[str, ...] = ()):
        self.program = program or ProbeProgram()
        self.inject_shim = inject_shim  # load the CUPTI shim into processes that do not map it (--inject-shim)
        self.inject_allow = inject_allow  # only into these cgroups, containers, pods (--inject-allow); all if empty
        self.host = host_name()
        self.detail = detail
        self.targets: dict[int, Target] = {}
        self._window_start = time.time()
        self.sampler = sampler = PythonSampler(frequency=detail.python_hz)
        self.probes = ProgramSource(self.program, detail)
        self.frames = PythonFrames(sampler, detail)  # also keeps the last window's full stacks
        # Attached in this order (the probes first: a process they cannot watch is not watched; the timer
        # times what the sampler found), filled in this order.
        self.gpu = GpuViews(launches=detail.hot_probes)
        self.sources: list[Source] = [
            self.probes,
            self.frames,
            PythonTiming(sampler, traced, detail),
            self.gpu,
            HostFacts(),
        ]

    def add(self, pid: int) -> Target:
        """Inspect and attach to `pid`; TargetError or ProbeError say why not."""
        if pid in self.targets:
            return self.targets[pid]
        target = inspect_process(pid, LIBRARY_PATTERNS, set(JOB_PATTERNS))
        self.probes.attach(target)  # ProbeError: not watched
        target.attached_at = time.time()  # accounted from here (the watched map entry is in)
        if not target.alive():  # exited while we attached: do not keep probes for a reused PID
            self.probes.detach(pid)
            raise TargetError(f"process {pid} exited while attaching")
        self.targets[pid] = target
        if self.inject_shim:  # before the other sources attach: the GPU source then finds the shim's probes
            self._inject_shim(target)
        for source in self.sources[1:]:  # each optional: one that cannot watch the process logs why
            source.attach(target)
        return target

    def _inject_shim(self, target: Target) -> None:
        """Loads the CUPTI shim into a process that runs CUDA (maps libcuda): a CPU-only one (gloo), or one
        that has not initialized CUDA yet, is left as it is."""
        if "cuda" not in target.libraries:
            log.warning("pid %d maps no libcuda: no GPU work to time, the CUPTI shim is not loaded", target.pid)
            return
        if not allowed(target.pid, self.inject_allow):
            log.warning("pid %d is in no cgroup, container or pod that --inject-allow names: the CUPTI shim is "
                        "not loaded", target.pid)
            return
        try:
            inject_shim(target.pid, start_time=target.start_time)
        except InjectError as e:  # the process is as it was: its CPU-side pattern goes on
            log.warning("pid %d: CUPTI shim not loaded: %s", target.pid, e)

    def window(self) -> list[RankPattern]:
        """The patterns of every watched process since the previous window."""
        exited = {pid for pid, t in self.targets.items() if not t.alive()}
        for pid in exited:
            self._detach(pid)
        now = time.time()
        start, self._window_start = self._window_start, now
        patterns = [self._pattern(t, start, now, t.pid in exited) for t in self.targets.values()]
        for source in self.sources:
            source.fill(patterns)
        for pid in exited:
            log.info("pid %d exited", pid)
            self._forget(pid)
        return patterns

    def _pattern(self, t: Target, start: float, now: float, exited: bool) -> RankPattern:
        """`t`'s pattern for the window from `start` to `now` before the sources fill it: who it is, as its
        launcher named it (the probes may know better: NCCL's communicator)."""
        ident = t.identity
        return RankPattern(job=ident.job, rank=ident.rank, world_size=ident.world_size, pid=t.pid, host=self.host,
                           # A rank attached during this window has been accounted only since then.
                           window_start=max(start, t.attached_at), window_end=now,
                           state="exited" if exited else "running", identity_source=ident.source,
                           since=t.attached_at)

    def trace_streams(self) -> list[TraceStream]:
        """Every stream a trace capture of the watched processes reads: the uprobe program's, then the
        other sources'."""
        return [s for source in self.sources for s in source.trace_streams()]

    def drops(self) -> dict[str, int]:
        """What the kernel side had no room for since the start, by kind: completed collectives (their stream
        was full), Python samples or sleeps (a map was full) and GPU activity records the CUPTI shim lost."""
        py = self.sampler.counters()
        return {"collectives": self.program.lost_collectives,
                "python_samples": py["dropped"] + py["off_cpu_dropped"], "gpu_records": self.gpu.records_lost()}

    def set_detail(self, detail: Detail) -> None:
        """What the next windows record (call right after window(): samples are counted at one rate)."""
        if detail != self.detail:
            log.info("detail: %s", detail.level)
            for source in self.sources:
                source.set_detail(detail)
            self.detail = detail

    def remove(self, pid: int) -> None:
        """Stop watching `pid` (its data since the last window is dropped)."""
        if pid in self.targets:
            self._detach(pid)
            self._forget(pid)

    def _detach(self, pid: int) -> None:
        for source in self.sources:
            source.detach(pid)

    def _forget(self, pid: int) -> None:
        del self.targets[pid]
        for source in self.sources:
            source.forget(pid)

    def close(self) -> None:
        """Detach every source, all at once: each removal mostly waits for the kernel (a grace period for
        its links, one per tracepoint under the kernel's event lock), so the sources' waits overlap."""
        with ThreadPoolExecutor(len(self.sources), thread_name_prefix="session-close") as pool:
            list(pool.map(lambda source: source.close(), self.sources))
