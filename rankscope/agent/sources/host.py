"""What /proc says of each rank's host side, window by window: its major page faults, its main thread's minor
page faults and time in the kernel, and how idle the CPUs it may run on sat (agent/host/cpu_idle.py). No
probes: a few /proc reads per window (~40 us per rank)."""
from __future__ import annotations

from rankscope.agent.host.cpu_idle import CpuIdle
from rankscope.agent.host.targets import Target, main_thread_faults, major_faults
from rankscope.agent.sources.source import Source
from rankscope.schema.patterns import HostCpus, RankPattern


class HostFacts(Source):
    def __init__(self) -> None:
        self._cpu_idle = CpuIdle()
        self._faults: dict[int, int] = {}  # pid -> major faults at the previous window's end
        self._main: dict[int, tuple[int, float]] = {}  # pid -> main thread's minor faults, kernel s, likewise

    def attach(self, target: Target) -> None:
        """Counts from here: the first window (`diagnose`'s only one) has its own counts too."""
        self._faults[target.pid] = major_faults(target.pid)
        if (main := main_thread_faults(target.pid)) is not None:
            self._main[target.pid] = main

    def fill(self, patterns: list[RankPattern]) -> None:
        self._cpu_idle.advance()
        for p in patterns:
            faults = major_faults(p.pid)
            # A process first seen in this window counts from here (as its other counters do).
            p.major_faults = max(faults - self._faults.setdefault(p.pid, faults), 0)
            self._faults[p.pid] = faults
            if (main := main_thread_faults(p.pid)) is not None:
                if (before := self._main.get(p.pid)) is not None:  # unknown if never read before, not 0
                    p.minor_faults, p.kernel_s = max(main[0] - before[0], 0), max(main[1] - before[1], 0.0)
                self._main[p.pid] = main
            cpus = self._cpu_idle.of(p.pid)
            p.cpus = None if cpus is None else HostCpus(*cpus)

    def forget(self, pid: int) -> None:
        self._faults.pop(pid, None)
        self._main.pop(pid, None)
