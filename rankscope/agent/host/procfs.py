"""/proc/PID as the agent reads it, in one place: the files a process maps, its threads, its cgroup and its
memory.

Paths in /proc/PID/maps are the process's own, and its files are hostile (a tenant's container may swap a
symlink, a FIFO or a device in at any name). A mapped file is reached through the kernel's own handle on it,
/proc/PID/map_files/<range>, which no name in the container can redirect (`mapped_path`); where that is not
permitted, through /proc/PID/root with the path resolved inside that root and no symlink followed.
`open_regular` is how the agent opens any of them: regular files only, checked before any open that could
block or reach a driver. Errors are OSError as the kernel gives them (FileNotFoundError: no such process;
PermissionError: not root; ProcessLookupError: exited while read): each caller says what they mean to it.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO


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
        """Unlinked since it was mapped; a memfd (a file that never had a name) does not count."""
        return self.path.endswith(" (deleted)") and not self.path.startswith(MEMFD)

    @property
    def name(self) -> str:
        """The file's name: its basename, or the name a memfd was created with."""
        if self.path.startswith(MEMFD):
            return self.path[len(MEMFD):].removesuffix(" (deleted)")
        return os.path.basename(self.path)


MEMFD = "/memfd:"  # how maps shows a file made by memfd_create(2): "/memfd:NAME (deleted)"


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
    """A path of `pid`'s mount namespace, reachable from the host's (to be opened with `open_regular`, which
    resolves it inside that root)."""
    return f"/proc/{pid}/root{path}"


def mapped_path(pid: int, m: Mapping) -> str:
    """A path that opens the very file `m` maps: its map_files entry (the kernel's handle on the mapping,
    which needs CAP_SYS_ADMIN), else its name inside the process's root. The kernel takes the map_files
    path for a uprobe as well."""
    by_range = f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}"
    try:
        os.stat(by_range)
        return by_range
    except OSError:
        return host_path(pid, m.path.removesuffix(" (deleted)"))


def mapped_path_of(pid: int, path: str) -> str:
    """`mapped_path` of the first mapping of the file `pid` calls `path`; FileNotFoundError when it maps none."""
    for m in maps(pid):
        if m.path.removesuffix(" (deleted)") == path:
            return mapped_path(pid, m)
    raise FileNotFoundError(errno.ENOENT, f"process {pid} maps no {path}")


SYS_OPENAT2 = 437  # x86_64 and the generic table alike
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_IN_ROOT = 0x02, 0x04, 0x10
_IN_ROOT = re.compile(r"^/proc/(\d+)/root(/.*)$")
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(2): `path` resolved under `dirfd` as `resolve` says (Linux 5.6+)."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    fd = _libc.syscall(SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at `path` (a map_files entry, a /proc/PID/root path or a
    host path); OSError otherwise. The path is resolved without opening anything (O_PATH) and only a
    regular file is opened, so a FIFO cannot hang the agent nor a device see an open. A /proc/PID/root path
    is resolved inside that root, no symlink followed: a container's link cannot lead out to the host."""
    m = _IN_ROOT.match(path)
    if m:
        root = os.open(f"/proc/{m.group(1)}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            handle = openat2(root, m.group(2), os.O_PATH | os.O_NOFOLLOW,
                             RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        finally:
            os.close(root)
    else:
        handle = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(handle)


@contextmanager
def open_file(path: str) -> Iterator[BinaryIO]:
    """`open_regular(path)` as a binary file object."""
    with os.fdopen(open_regular(path), "rb") as f:
        yield f


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
