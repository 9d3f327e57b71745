"""Training processes as the agent sees them: which probed libraries they map and who they are in the job.

Everything is read from /proc; a library is reached through the kernel's handle on its mapping
(procfs.mapped_path), so processes in containers work too and no name in a container can redirect the agent.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from rankscope.agent.host import procfs
from rankscope.agent.host.containers import Container, container_of

T = TypeVar("T")


class TargetError(Exception):
    """A process cannot be watched; the message is one line a user can act on."""


@dataclass(frozen=True)
class Identity:
    """Who a process is in its job: from the job's own launcher (torchrun's environment) or the PID."""

    job: str
    rank: int
    world_size: int
    local_rank: int | None
    source: str  # "env" | "pid"


@dataclass
class Target:
    pid: int
    name: str
    start_time: int  # clock ticks since boot: tells a live process from a reused PID
    libraries: dict[str, str] = field(default_factory=dict)  # kind -> path reachable from the host
    identity: Identity | None = None
    attached_at: float = 0.0  # unix s when the agent began watching it
    python: str | None = None  # CPython version whose frames are sampled
    python_error: str | None = None  # why its Python frames are not sampled
    container: Container | None = None  # its container and pod, from its cgroup

    def alive(self) -> bool:
        try:
            state, start = _stat(self.pid)
        except OSError:
            return False
        return start == self.start_time and state not in "ZX"  # a zombie has exited, unreaped


def stat_fields(pid: int, tid: int | None = None) -> list[str]:
    """/proc/PID/stat (or thread TID's, /proc/PID/task/TID/stat) from the state field on (the name before it
    may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat", "rb") as f:
        stat = f.read().decode(errors="replace")
    return stat[stat.rindex(")") + 2 :].split()


def _stat(pid: int) -> tuple[str, int]:
    """(state letter, start time)."""
    fields = stat_fields(pid)
    return fields[0], int(fields[19])


def major_faults(pid: int) -> int:
    """Major page faults so far (0 once the process is gone): page-ins that stalled the process on I/O."""
    try:
        return int(stat_fields(pid)[9])
    except OSError:
        return 0


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's unit of CPU time


def main_thread_faults(pid: int) -> tuple[int, float] | None:
    """The main thread's minor page faults and its on-CPU time in the kernel so far (None once gone). The
    kernel splits a thread's time into user and system by the tick it was running at, so the system time of a
    window is good to a few ticks (4 ms at HZ=250): enough to tell a rank that spends 10 ms more a step in the
    kernel than its peers, which is what it is for."""
    try:
        fields = stat_fields(pid, pid)
    except OSError:
        return None
    return int(fields[7]), int(fields[12]) / CLOCK_TICKS


def _proc(pid: int, what: str, read: Callable[[int], T]) -> T:
    """read(pid) of /proc/PID/`what`, its errors as a TargetError a user can act on."""
    try:
        return read(pid)
    except FileNotFoundError:
        raise TargetError(f"no such process: {pid}") from None
    except PermissionError:
        raise TargetError(f"not permitted to read /proc/{pid}/{what}: run rankscope as root") from None
    except ProcessLookupError:
        raise TargetError(f"process {pid} exited") from None


def _read(pid: int, what: str) -> bytes:
    def raw(p: int) -> bytes:
        with open(f"/proc/{p}/{what}", "rb") as f:
            return f.read()

    return _proc(pid, what, raw)


def mapped_libraries(pid: int, patterns: dict[str, re.Pattern[str]]) -> dict[str, str]:
    """kind -> host-reachable path (procfs.mapped_path) of the first mapped file whose name matches that
    kind's pattern."""
    found: dict[str, str] = {}
    for m in _proc(pid, "maps", procfs.maps):
        for kind, pattern in patterns.items():
            if kind not in found and not m.deleted and pattern.match(m.name):
                found[kind] = procfs.mapped_path(pid, m)
    return found


def environment(pid: int) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in _read(pid, "environ").split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _int(env: dict[str, str], key: str) -> int | None:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        return None


def parent_pid(pid: int) -> int:
    try:
        return int(stat_fields(pid)[1])
    except FileNotFoundError:
        raise TargetError(f"no such process: {pid}") from None
    except (OSError, IndexError, ValueError):
        raise TargetError(f"cannot read /proc/{pid}/stat") from None


def thread_group(tid: int) -> int | None:
    """The process a thread belongs to (its Tgid), None once it exited."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def read_cmdline(pid: int) -> str:
    return _read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


def job_of(env: dict[str, str]) -> str | None:
    """The job a launcher's environment names: torchrun's run id, else the rendezvous address; None if neither."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def identity_from_env(pid: int, env: dict[str, str]) -> Identity:
    """Rank and job from the variables torchrun (and most launchers) set; the PID when there are none."""
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    job = job_of(env) or f"pid-{pid}"
    if rank is None or world is None:
        return Identity(job=job, rank=0, world_size=1, local_rank=None, source="pid")
    return Identity(job=job, rank=rank, world_size=world, local_rank=_int(env, "LOCAL_RANK"), source="env")


def inspect_process(pid: int, patterns: dict[str, re.Pattern[str]], identifying: set[str]) -> Target:
    """A Target for `pid`, or TargetError saying why it cannot be watched: it must map one of the
    `identifying` kinds' libraries (the others, like libpython, are probed only in training processes)."""
    if pid <= 0:
        raise TargetError(f"not a process id: {pid}")
    try:
        state, start = _stat(pid)
    except FileNotFoundError:
        raise TargetError(f"no such process: {pid}") from None
    if state in "ZX":
        raise TargetError(f"process {pid} has exited")
    name = _read(pid, "comm").decode(errors="replace").strip()
    libraries = mapped_libraries(pid, patterns)
    if not identifying & set(libraries):
        raise TargetError(
            f"process {pid} ({name}) maps none of the libraries rankscope probes "
            f"({', '.join(sorted(identifying))}): is it a training process?"
        )
    return Target(pid=pid, name=name, start_time=start, libraries=libraries,
                  identity=identity_from_env(pid, environment(pid)), container=container_of(pid))
