"""A stack dump of a job, now: every Python thread's stack of every rank, read from /proc/PID/mem without
stopping anything (no ptrace, no signal: the job never pauses), with where the kernel has the thread (the
system call it is blocked in and its wait channel, or `running`). Identical stacks are grouped with the
ranks and threads that share them: in a hang, the ranks that wait in the collective share one stack, and
the rank that never reached it stands alone.

A thread that runs while it is read can give a torn stack (its frames move under the walk); one that is
blocked, the case that matters in a hang, reads exactly. Cost: a few reads of /proc per thread and frame,
milliseconds a process; nothing is loaded into the kernel.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rankscope.agent.host import thread_state
from rankscope.agent.interpreters import Frame
from rankscope.agent.interpreters.cpython.code import CodeResolver, stack_frames
from rankscope.agent.interpreters.cpython.errors import PythonAttachError
from rankscope.agent.interpreters.cpython.process import inspect, open_memory
from rankscope.agent.interpreters.cpython.threads import stacks_by_tid, thread_stacks

MAX_DEPTH = 128  # frames per thread; deeper stacks start with <truncated>


@dataclass(frozen=True)
class ThreadDump:
    rank: int
    pid: int
    tid: int | None  # on the host; None where the interpreter's id cannot be mapped (3.10 without glibc)
    name: str  # the thread's comm
    state: str  # "running", "futex (futex_wait_queue)", ...
    stack: tuple[Frame, ...]  # root first


@dataclass
class StackGroup:
    stack: tuple[Frame, ...]
    threads: list[ThreadDump] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({t.rank for t in self.threads})


def _comm(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def dump_process(pid: int, rank: int, max_depth: int = MAX_DEPTH) -> list[ThreadDump]:
    """Every Python thread of `pid`, main thread first; PythonAttachError if its interpreter cannot be read."""
    interp = inspect(pid)
    mem = open_memory(pid)
    resolver = CodeResolver(interp)
    try:
        stacks = thread_stacks(mem, interp.runtime, interp.layout, max_depth)
        if stacks is None:
            raise PythonAttachError(f"pid {pid}: the interpreter's thread list cannot be read")
        by_tid = stacks_by_tid(mem, pid, stacks, interp.layout) or {}
        tid_of = {id(st): tid for tid, st in by_tid.items()}
        states = thread_state.where(tid_of.values())
        out = []
        for st in stacks:
            tid = tid_of.get(id(st))
            out.append(ThreadDump(rank, pid, tid, _comm(pid, tid) if tid else "?", states.get(tid, ""),
                                  stack_frames(resolver, st.codes, st.truncated, st.partial)))
    finally:
        resolver.close()
        mem.close()
    return sorted(out, key=lambda t: (t.tid != pid, t.tid or 0))


def dump(targets: Sequence[tuple[int, int]]) -> tuple[list[StackGroup], list[str]]:
    """(pid, rank) pairs -> their threads grouped by stack (most threads first), and per process that could
    not be read, why."""
    groups: dict[tuple[Frame, ...], StackGroup] = {}
    errors = []
    for pid, rank in targets:
        try:
            threads = dump_process(pid, rank)
        except PythonAttachError as e:
            errors.append(f"pid {pid} (rank {rank}): {e}")
            continue
        for t in threads:
            groups.setdefault(t.stack, StackGroup(t.stack)).threads.append(t)
    return sorted(groups.values(), key=lambda g: (-len(g.threads), g.ranks)), errors


def _frame(f: Frame) -> dict[str, Any]:
    return {"name": f.qualname, "file": f.filename, "line": f.firstlineno}


def to_json(groups: Sequence[StackGroup], errors: Sequence[str]) -> dict[str, Any]:
    """The document of `rankscope dump --json` and GET /v1/stacks; stacks root first."""
    return {"time": time.time(), "groups": [
        {"ranks": g.ranks, "stack": [_frame(f) for f in g.stack],
         "threads": [{"rank": t.rank, "pid": t.pid, "tid": t.tid, "name": t.name, "state": t.state}
                     for t in g.threads]} for g in groups], "errors": list(errors)}


def render(groups: Sequence[StackGroup], errors: Sequence[str]) -> str:
    """py-spy dump's layout, innermost frame first, one block per distinct stack."""
    lines = []
    for g in groups:
        lines.append(f"ranks {','.join(map(str, g.ranks))}: {len(g.threads)} thread(s) with this stack")
        for t in g.threads:
            lines.append(f"  rank {t.rank} pid {t.pid} thread {t.tid} ({t.name}): {t.state or '?'}")
        for f in reversed(g.stack):
            lines.append(f"    {f}")
        if not g.stack:
            lines.append("    (no Python frame)")
        lines.append("")
    lines += [f"error: {e}" for e in errors]
    return "\n".join(lines).rstrip() + "\n"
