"""What /proc says of each rank's host side, window by window: its major page faults, and how idle the CPUs
it may run on sat (agent/host/cpu_idle.py). No probes: a few /proc reads per window (~30 us per rank)."""
from __future__ import annotations

from rankscope.agent.host.cpu_idle import CpuIdle
from rankscope.agent.host.targets import major_faults
from rankscope.agent.sources.source import Source
from rankscope.schema.patterns import HostCpus, RankPattern


class HostFacts(Source):
    def __init__(self) -> None:
        self._cpu_idle = CpuIdle()
        self._faults: dict[int, int] = {}  # pid -> major faults at the previous window's end

    def fill(self, patterns: list[RankPattern]) -> None:
        self._cpu_idle.advance()
        for p in patterns:
            faults = major_faults(p.pid)
            # A process first seen in this window counts from here (as its other counters do).
            p.major_faults = max(faults - self._faults.setdefault(p.pid, faults), 0)
            self._faults[p.pid] = faults
            cpus = self._cpu_idle.of(p.pid)
            p.cpus = None if cpus is None else HostCpus(*cpus)

    def forget(self, pid: int) -> None:
        self._faults.pop(pid, None)
