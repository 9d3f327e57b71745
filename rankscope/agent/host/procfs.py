"""/proc/PID as the agent reads it, in one place: the files a process maps, its threads, its cgroup and its
memory.

Paths are the process's own; `host_path` reaches them from the host through /proc/PID/root, so processes in
containers work too. Errors are OSError as the kernel gives them (FileNotFoundError: no such process;
PermissionError: not root; ProcessLookupError: exited while read): each caller says what they mean to it.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    """One file-backed line of /proc/PID/maps."""

    start: int
    end: int
    offset: int
    inode: int
    path: str  # as the process sees it; ends with " (deleted)" once unlinked

    @property
    def deleted(self) -> bool:
        return self.path.endswith(" (deleted)")


def maps(pid: int) -> list[Mapping]:
    """The file-backed mappings of `pid`, in address order (anonymous, [heap], [stack]... left out)."""
    with open(f"/proc/{pid}/maps", "rb") as f:
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append(Mapping(lo, hi, int(parts[2], 16), int(parts[4]), parts[5]))
    return out


def host_path(pid: int, path: str) -> str:
    """A path of `pid`'s mount namespace, reachable from the host's."""
    return f"/proc/{pid}/root{path}"


def cgroup(pid: int) -> str:
    """/proc/PID/cgroup's text."""
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


def task_status(pid: int) -> dict[int, dict[str, str]]:
    """tid -> the fields of /proc/PID/task/TID/status, for every thread still there."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                out[int(tid)] = dict((k, v.strip()) for k, v in (line.split(":", 1) for line in f if ":" in line))
        except OSError:
            continue
    return out


def ns_tid_map(pid: int) -> dict[int, int]:
    """The process's threads: id in its own pid namespace -> id on the host (NSpid's last and first fields)."""
    out = {}
    for status in task_status(pid).values():
        ids = status.get("NSpid", "").split()
        if ids:
            out[int(ids[-1])] = int(ids[0])
    return out


class ProcessMemory:
    """Reads another process's memory through /proc/PID/mem (root), without stopping it."""

    def __init__(self, pid: int):
        self.pid = pid
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)

    def read(self, addr: int, size: int) -> bytes:
        """Exactly `size` bytes at `addr`; OSError if any of them cannot be read."""
        if addr <= 0 or addr >= 1 << 47:
            raise OSError(f"bad address {addr:#x}")
        data = os.pread(self.fd, size, addr)
        if len(data) != size:
            raise OSError(f"short read at {addr:#x}")
        return data

    def read_upto(self, addr: int, size: int) -> bytes:
        """Up to `size` bytes at `addr` (a string whose length is unknown may end before a page does)."""
        if addr <= 0 or addr >= 1 << 47:
            raise OSError(f"bad address {addr:#x}")
        return os.pread(self.fd, size, addr)

    def u64(self, addr: int) -> int:
        return struct.unpack("<Q", self.read(addr, 8))[0]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ProcessMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
