"""Scheduler tracepoints (bpf/sched.bpf.c): per-thread CPU, run-queue, sleep and I/O time of watched
processes, and the tasks that held the CPU while a watched thread waited for it."""
from __future__ import annotations

import re
from dataclasses import dataclass

from rankscope.agent.host import procfs
from rankscope.agent.host.targets import TargetError, parent_pid
from rankscope.agent.loader import histograms
from rankscope.agent.loader.maps import entries
from rankscope.agent.sources.deltas import Deltas
from rankscope.agent.sources.probes.base import ProbeKind
from rankscope.schema.patterns import Neighbour, ThreadTimes

THREAD_STATS = "thread_stats"  # BPF map: (pid, tid) -> the thread's scheduler counters
THIEVES = "thieves"  # BPF map: (pid, another process) -> the CPU it held while a watched thread waited
SCHED = ProbeKind(name="sched", library=None, source="sched.bpf.c", maps=(THREAD_STATS, THIEVES))

# Thread names of communication back ends (NCCL proxy/watchdog, gloo, c10d's process groups).
_COMM_THREAD = re.compile(r"nccl|gloo|ProcessGroup|pt_nccl|c10d", re.IGNORECASE)


def thread_role(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "main"
    return "comm" if _COMM_THREAD.search(name) else "other"


@dataclass(frozen=True)
class ThreadCounters:
    """Cumulative scheduler counters of one thread since it was first seen."""

    on_cpu_ns: int
    runq_ns: int
    sleep_ns: int
    io_ns: int
    reclaim_ns: int
    preempted: int
    runq_hist: tuple[int, ...]


@dataclass(frozen=True)
class ThiefCounters:
    name: str
    waited_ns: int
    count: int


def threads(bpf) -> dict[int, dict[int, ThreadCounters]]:
    """pid -> tid -> cumulative counters."""
    out: dict[int, dict[int, ThreadCounters]] = {}
    for key, v in entries(bpf[THREAD_STATS]):
        out.setdefault(key.pid, {})[key.tid] = ThreadCounters(
            v.on_cpu_ns, v.runq_ns, v.sleep_ns, v.io_ns, v.reclaim_ns, v.preempted, tuple(v.runq_hist))
    return out


def thieves(bpf) -> dict[int, dict[int, ThiefCounters]]:
    """pid (the watched process that waited) -> the other process's pid -> cumulative counters."""
    out: dict[int, dict[int, ThiefCounters]] = {}
    for key, v in entries(bpf[THIEVES]):
        out.setdefault(key.pid, {})[key.thief_tgid] = ThiefCounters(
            v.comm.decode(errors="replace"), v.waited_ns, v.count)
    return out


NEIGHBOURS = 3  # per pattern: who took the CPU, the few that matter


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # exited since
        return ""


def cgroup_of(pid: int) -> str:
    """The last two components of the process's (v2) cgroup path: enough to name a container or pod."""
    try:
        text = procfs.cgroup(pid)
    except OSError:  # exited since
        return ""
    for line in text.splitlines():
        if line.startswith("0::"):
            return "/".join(line[3:].strip("/").split("/")[-2:])
    return ""


def of_job(pid: int, job: frozenset[int]) -> bool:
    """Whether `pid` is one of `job`'s ranks or a child or grandchild of one (DataLoader workers, a worker's
    own pool): a job that runs more busy processes than its host has CPUs waits for itself, which is not
    contention from other work. Two /proc reads at most, for the few neighbours a window names."""
    for _ in range(2):  # the process, then its parent, then its grandparent
        if pid in job:
            return True
        try:
            pid = parent_pid(pid)
        except TargetError:  # exited since the window: a stranger now
            return False
        if pid <= 1:  # init: no rank's descendant
            return False
    return pid in job


class SchedReader:
    """Turns one process's cumulative thread and thief counters into a window's ThreadTimes and neighbours."""

    def __init__(self, pid: int):
        self.pid = pid
        self._threads: Deltas[int] = Deltas()  # tid -> the six counters of ThreadTimes, runq_hist
        self._thieves: Deltas[int] = Deltas()  # pid -> (waited_ns,)
        self._names: dict[int, str] = {}

    def _role(self, tid: int) -> str:
        if tid not in self._names:
            self._names[tid] = _read_text(f"/proc/{self.pid}/task/{tid}/comm").strip()
        return thread_role(self.pid, tid, self._names[tid])

    def thread_times(self, now: dict[int, ThreadCounters]) -> dict[str, ThreadTimes]:
        acc: dict[str, list] = {}
        added = self._threads.read((tid, (c.on_cpu_ns, c.runq_ns, c.sleep_ns, c.io_ns, c.reclaim_ns, c.preempted,
                                         c.runq_hist)) for tid, c in now.items())
        for tid, (*d, hist) in zip(now, added):
            role = acc.setdefault(self._role(tid), [0, [0] * 6, [0] * len(hist)])
            role[0] += 1
            role[1] = [x + y for x, y in zip(role[1], d)]
            role[2] = [x + y for x, y in zip(role[2], hist)]
        return {
            name: ThreadTimes(role=name, threads=n, on_cpu_s=d[0] / 1e9, runq_s=d[1] / 1e9, sleep_s=d[2] / 1e9,
                              io_s=d[3] / 1e9, reclaim_s=d[4] / 1e9, preempted=d[5],
                              runq_p99_s=histograms.percentile_s(hist, 0.99))
            for name, (n, d, hist) in acc.items()
        }

    def neighbours(self, now: dict[int, ThiefCounters], job: frozenset[int]) -> list[Neighbour]:
        """The processes that held the CPU longest while this one waited; `job`: the pids of its job's ranks."""
        waited = []
        added = self._thieves.read((pid, (c.waited_ns,)) for pid, c in now.items())
        for (pid, c), (ns,) in zip(now.items(), added):
            if ns > 0:
                waited.append((ns, pid, c.name))
        waited.sort(reverse=True)
        return [Neighbour(name=name, pid=pid, cgroup=cgroup_of(pid), waited_s=ns / 1e9, job=of_job(pid, job))
                for ns, pid, name in waited[:NEIGHBOURS]]
