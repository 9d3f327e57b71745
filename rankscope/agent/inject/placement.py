"""The library handed to another process without any file of its: the process creates a memfd (an anonymous
file in its own memory, memfd_create(2), called on its held thread), the agent fills it through
/proc/PID/fd/N, seals it against any change and checks its content, and the process dlopens
/proc/self/fd/N. No name in the process's mount namespace is looked up, created or followed, so nothing a
container plants (a symlink at a path, a copy of its own) can redirect the agent to a host file or have it
load something else; the container's /proc must be mounted (it is in every runtime's default).

The process keeps the descriptor open (close-on-exec): bcc finds a memfd's USDT probes through it, and maps
show the library as "/memfd:NAME (deleted)", which the agent recognizes by NAME."""
from __future__ import annotations

import fcntl
import os
import stat

from rankscope.agent.inject.remote_call import RemoteCaller

SYS_CLOSE = 3
SYS_MEMFD_CREATE = 319  # x86_64
MFD_FLAGS = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
PATH_ROOM = 32  # bytes kept beside the name for "/proc/self/fd/N"


class PlacementError(Exception):
    """The library cannot be handed to the process."""


def read_library(library: str) -> bytes:
    """The host's `library` (the agent's own file), read once: what is written is what is checked."""
    try:
        with open(library, "rb") as f:
            return f.read()
    except OSError as e:
        raise PlacementError(f"no such library: {library} ({e.strerror})") from None


def _signed(rax: int) -> int:
    return rax - (1 << 64) if rax >> 63 else rax


def deliver(caller: RemoteCaller, libc_syscall: int, name: str, data: bytes, deadline: float) -> tuple[int, int]:
    """(the descriptor in the process, the address of "/proc/self/fd/N" in its memory) of a sealed memfd
    called `name` holding `data`. PlacementError when it cannot be made or its content is not `data` (the
    descriptor is closed in the process first)."""
    tracee = caller.tracee
    block = caller.place(name.encode() + b"\0" + bytes(PATH_ROOM))
    fd = _signed(caller.call(libc_syscall, SYS_MEMFD_CREATE, block, MFD_FLAGS, deadline=deadline))
    if fd < 0:
        raise PlacementError(f"process {tracee.pid} could not create a memfd: {os.strerror(-fd)}")
    try:
        _fill(tracee.pid, fd, name, data)
    except (OSError, PlacementError) as e:
        close(caller, libc_syscall, fd, deadline)
        if isinstance(e, PlacementError):
            raise
        raise PlacementError(f"cannot write the library into process {tracee.pid}'s memfd: {e.strerror or e}") from e
    path = block + len(name) + 1
    tracee.write(path, f"/proc/self/fd/{fd}".encode() + b"\0")
    return fd, path


def close(caller: RemoteCaller, libc_syscall: int, fd: int, deadline: float) -> None:
    """Closes the process's descriptor `fd` (a library it failed to load)."""
    caller.call(libc_syscall, SYS_CLOSE, fd, deadline=deadline)


def _fill(pid: int, fd: int, name: str, data: bytes) -> None:
    """Writes `data` into the process's memfd `fd`, seals it and reads it back. Its other threads run
    meanwhile and could put another file at that number: only an empty, sealable, unlinked memfd of that
    name is written (never a file with a name anywhere), and the content is checked once sealed."""
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    try:
        st = os.fstat(handle)
        shown = os.readlink(f"/proc/self/fd/{handle}")
        if not stat.S_ISREG(st.st_mode) or st.st_nlink or st.st_size or shown != f"/memfd:{name} (deleted)":
            raise PlacementError(f"process {pid}'s descriptor {fd} is not the empty memfd it just made: not written")
        memfd = os.open(f"/proc/self/fd/{handle}", os.O_RDWR | os.O_CLOEXEC)
    finally:
        os.close(handle)
    try:
        if fcntl.fcntl(memfd, fcntl.F_GET_SEALS) != 0:  # a memfd made without MFD_ALLOW_SEALING, or sealed
            raise PlacementError(f"process {pid}'s descriptor {fd} is not the sealable memfd it just made")
        os.pwrite(memfd, data, 0)
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, SEALS)
        written = os.pread(memfd, len(data) + 1, 0)
    finally:
        os.close(memfd)
    if written != data:
        raise PlacementError(f"process {pid}'s memfd does not hold the library once sealed: not loaded")
