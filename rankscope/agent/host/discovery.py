"""Node-wide discovery: every process that maps a library of a training job (CUDA, NCCL, torch), in any
container, less the ones that run no collectives of their own: torchrun's launcher (the elastic agent, a
parent without RANK) and DataLoader workers (children of a rank that inherit its RANK)."""
from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from rankscope.agent.host.targets import TargetError, environment, job_of, mapped_libraries, parent_pid, read_cmdline

LAUNCHER = re.compile(r"torch\.distributed\.(?:run|launch)\b|\btorchrun\b|torchelastic")


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    env: dict[str, str]
    cmdline: str


def skip_reason(p: Process, parent_env: dict[str, str] | None, children: Iterable[Process]) -> str | None:
    """Why `p`, which maps a training library, is not a rank to watch; None when it is one."""
    if "RANK" not in p.env:
        if LAUNCHER.search(p.cmdline):
            return "torchrun launcher (no RANK)"
        if any("RANK" in c.env for c in children):
            return "launcher of ranks (no RANK of its own)"
        return None  # a single-process job: watched under its PID's identity
    if parent_env is not None and parent_env.get("RANK") == p.env["RANK"] and job_of(parent_env) == job_of(p.env):
        return f"worker of rank {p.env['RANK']} (pid {p.ppid}), e.g. a DataLoader worker"
    return None


def _process(pid: int) -> Process:
    return Process(pid=pid, ppid=parent_pid(pid), env=environment(pid), cmdline=read_cmdline(pid))


def training_processes(patterns: dict[str, re.Pattern[str]], exclude: set[int]) -> tuple[list[int], dict[int, str]]:
    """(PIDs of ranks to watch, {PID: why skipped}) among processes mapping a library of `patterns` (kind ->
    basename pattern: the job-identifying kinds only) and not in `exclude`."""
    found: dict[int, Process] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            if mapped_libraries(int(entry), patterns):
                found[int(entry)] = _process(int(entry))
        except TargetError:  # exited or unreadable since the listing
            continue
    watch, skipped = [], {}
    for pid, p in sorted(found.items()):
        try:
            parent_env = found[p.ppid].env if p.ppid in found else environment(p.ppid) if p.ppid > 1 else None
        except TargetError:
            parent_env = None
        why = skip_reason(p, parent_env, (c for c in found.values() if c.ppid == pid))
        if why is None:
            watch.append(pid)
        else:
            skipped[pid] = why
    return watch, skipped
