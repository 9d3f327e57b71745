"""Where a process's main thread is right now, read from /proc without stopping it.

Used when a job stops making progress: ranks that wait in the collective share one state, and the rank
that never reached it is in another (C4D's non-communication hang). The kernel tells which system call
the thread is blocked in (or that it is running) and the kernel function it sleeps in.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

# x86-64 numbers of the calls a blocked training thread is found in.
_SYSCALLS = {
    0: "read", 1: "write", 7: "poll", 16: "ioctl", 23: "select", 24: "sched_yield", 35: "nanosleep",
    42: "connect", 43: "accept", 44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 61: "wait4",
    202: "futex", 208: "io_getevents", 230: "clock_nanosleep", 232: "epoll_wait", 270: "pselect6",
    271: "ppoll", 281: "epoll_pwait", 426: "io_uring_enter",
}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def where(pids: Iterable[int], samples: int = 1, interval_s: float = 0.01) -> dict[int, str]:
    """pid -> e.g. "futex (futex_wait_queue)", "clock_nanosleep (hrtimer_nanosleep)", "running"; "" if unknown.

    With several samples, the most frequent answer: a thread polling in a wait loop is briefly running. Every
    process is read in each round, so a window with many stalled processes waits `samples` intervals, not
    that many per process (64 processes one after another held each window 2.6 s).
    """
    seen: dict[int, list[str]] = {pid: [] for pid in pids}
    for i in range(samples if seen else 0):
        if i:
            time.sleep(interval_s)
        for pid, states in seen.items():
            states.append(_where_now(pid))
    return {pid: Counter(states).most_common(1)[0][0] for pid, states in seen.items()}


def _where_now(pid: int) -> str:
    call = _read(f"/proc/{pid}/syscall").split()
    if not call:
        return ""
    if not call[0].lstrip("-").isdigit():
        return call[0]  # "running"
    name = _SYSCALLS.get(int(call[0]), f"syscall {call[0]}")
    wchan = _read(f"/proc/{pid}/wchan")
    return f"{name} ({wchan})" if wchan and wchan != "0" else name
