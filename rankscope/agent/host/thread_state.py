"""Where a process's main thread is right now, read from /proc without stopping it.

Used when a job stops making progress (analyzer/rules/hangs.py): a rank asleep on a timer, computing, or
reading a pipe or a file is not in a collective; ranks that wait in one share a state. The kernel tells
which system call the thread is blocked in (or that it is running), the kernel function it sleeps in, and
for a read what the file descriptor is ("read (pipe_read) from pipe").
"""
from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable

# x86-64 numbers of the calls a blocked training thread is found in.
_SYSCALLS = {
    0: "read", 1: "write", 7: "poll", 16: "ioctl", 17: "pread64", 19: "readv", 23: "select", 24: "sched_yield",
    35: "nanosleep", 42: "connect", 43: "accept", 44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg",
    61: "wait4", 202: "futex", 208: "io_getevents", 230: "clock_nanosleep", 232: "epoll_wait", 270: "pselect6",
    271: "ppoll", 281: "epoll_pwait", 295: "preadv", 426: "io_uring_enter",
}
_READS = frozenset({0, 17, 19, 295})  # their first argument is the file descriptor read


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


# A thread that used less of the CPU than this while it was sampled is not computing, whatever the samples say.
BUSY_CPU_SHARE = 0.05


def where(pids: Iterable[int], samples: int = 1, interval_s: float = 0.01) -> dict[int, str]:
    """pid -> e.g. "futex (futex_wait_queue)", "clock_nanosleep (hrtimer_nanosleep)", "running"; "" if unknown.

    With several samples, the most frequent answer (see `settled`): a thread polling in a wait loop is briefly
    running. Every process is read in each round, so a window with many stalled processes waits `samples`
    intervals, not that many per process (64 processes one after another held each window 2.6 s).
    """
    seen: dict[int, list[str]] = {pid: [] for pid in pids}
    if not seen:
        return {}
    timed = samples > 1  # one sample has nothing to settle
    cpu_before = {pid: _cpu_s(pid) for pid in seen} if timed else {}
    start = time.monotonic()
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        for pid, states in seen.items():
            states.append(_where_now(pid))
    span = time.monotonic() - start
    return {pid: settled(states, busy=not timed or _cpu_s(pid) - cpu_before[pid] >= BUSY_CPU_SHARE * span)
            for pid, states in seen.items()}


def settled(states: list[str], busy: bool) -> str:
    """The most frequent of a thread's sampled states. "running" counts only if the thread was `busy` (used
    the CPU meanwhile): /proc says "running" for a thread that is runnable but waits for a CPU, and a waiter
    that polls (a futex wait with a timeout, then a look at shared memory) is mostly that on a starved host,
    where it looked like a rank that never reached the collective."""
    counts = Counter(states)
    if not busy:
        blocked = [state for state, _ in counts.most_common() if state not in ("running", "")]
        if blocked:
            return blocked[0]
    return counts.most_common(1)[0][0]


def _cpu_s(pid: int) -> float:
    """The main thread's time on a CPU so far (/proc/PID/schedstat: ns on CPU, ns waiting for one, slices)."""
    fields = _read(f"/proc/{pid}/schedstat").split()
    return int(fields[0]) / 1e9 if fields else 0.0


def _where_now(pid: int) -> str:
    call = _read(f"/proc/{pid}/syscall").split()
    if not call:
        return ""
    if not call[0].lstrip("-").isdigit():
        return call[0]  # "running"
    number = int(call[0])
    name = _SYSCALLS.get(number, f"syscall {call[0]}")
    wchan = _read(f"/proc/{pid}/wchan")
    state = f"{name} ({wchan})" if wchan and wchan != "0" else name
    if number in _READS and len(call) > 1:
        state += f" from {_fd_kind(pid, int(call[1], 16))}"
    return state


def _fd_kind(pid: int, fd: int) -> str:
    """What a descriptor of the process is: "socket", "pipe", "file", an anonymous inode's name ("eventfd"),
    or "unknown" (closed meanwhile, or not ours to read)."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return "unknown"
    for kind in ("socket", "pipe"):
        if target.startswith(f"{kind}:"):
            return kind
    if target.startswith("anon_inode:"):
        return target.removeprefix("anon_inode:").strip("[]")
    return "file"
