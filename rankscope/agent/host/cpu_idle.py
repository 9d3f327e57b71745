"""How idle the CPUs a rank may run on sat during a window: whether its host was CPU-saturated.

On a saturated host a straggler's extra work is not all lost time: while the others wait for it they free
their CPUs, and its work or the loader workers use them, so fixing it gains less than the wait its cost
reports. A straggler's evidence carries the idle share (rules/stragglers.py) so the reader sees when that is.
Reading /proc/stat costs ~30 us on a 2-CPU host (~0.3 ms at 256 CPUs) once per window.
"""
from __future__ import annotations

import os
import time


def _idle_ticks() -> dict[int, int]:
    """Per CPU: the ticks it spent idle (idle + iowait: a CPU waiting on I/O could have run work) since boot."""
    out = {}
    with open("/proc/stat", "rb") as f:
        for line in f:
            if not line.startswith(b"cpu") or line[3:4] == b" ":  # the "cpu " line sums every CPU
                continue
            if not line[3:4].isdigit():
                break
            name, _user, _nice, _system, idle, iowait, *_ = line.split()
            out[int(name[3:])] = int(idle) + int(iowait)
    return out


class CpuIdle:
    """Each CPU's idle share between consecutive `advance()` calls."""

    def __init__(self) -> None:
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self._ticks, self._at = _idle_ticks(), time.monotonic()
        self._share: dict[int, float] = {}

    def advance(self) -> None:
        """Close the window: the shares from the previous call to now."""
        ticks, at = _idle_ticks(), time.monotonic()
        span = max(at - self._at, 1e-9)
        self._share = {cpu: min(max((n - self._ticks.get(cpu, n)) * self._tick_s / span, 0.0), 1.0)
                       for cpu, n in ticks.items()}
        self._ticks, self._at = ticks, at

    def of(self, pid: int) -> tuple[int, float] | None:
        """(CPUs `pid` may run on, their mean idle share over the last window); None when unknown (the
        process exited, or no window closed yet)."""
        try:
            cpus = [c for c in os.sched_getaffinity(pid) if c in self._share]
        except OSError:
            return None
        if not cpus:
            return None
        return len(cpus), sum(self._share[c] for c in cpus) / len(cpus)
