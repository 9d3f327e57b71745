"""A path to a library that another process can open in its own mount namespace (a container's): the host's
path when the process sees that very file there, else a copy under the process's /tmp, reached from the host
through /proc/PID/root. The copy keeps the library's name (the agent recognizes the shim by it) and is left in
place: the process maps it for the rest of its life."""
from __future__ import annotations

import hashlib
import os
import shutil

from rankscope.agent.host import procfs

COPY_FOLDER = "/tmp/rankscope-{digest}"  # in the target's namespace; one per library content


class PlacementError(Exception):
    """The library cannot be made reachable from the process."""


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def reachable_path(pid: int, library: str) -> str:
    """The path `pid` should dlopen to load the host's `library`."""
    library = os.path.abspath(library)
    if not os.path.isfile(library):
        raise PlacementError(f"no such library: {library}")
    if _same_file(library, procfs.host_path(pid, library)):
        return library
    try:
        folder = COPY_FOLDER.format(digest=_digest(library))
        inside = f"{folder}/{os.path.basename(library)}"
        host_copy = procfs.host_path(pid, inside)
        if not os.path.isfile(host_copy):
            os.makedirs(procfs.host_path(pid, folder), mode=0o755, exist_ok=True)
            tmp = f"{host_copy}.{os.getpid()}.tmp"
            shutil.copyfile(library, tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, host_copy)  # a concurrent injector never sees half a file
    except OSError as e:
        raise PlacementError(f"{library} is not visible in process {pid}'s mount namespace and cannot be copied "
                             f"to its /tmp: {e.strerror or e}") from e
    return inside
