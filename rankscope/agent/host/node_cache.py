"""The node's cache directory: what one rankscope process works out about this kernel and keeps for the next
(compiled BPF programs, loader/bpf_cache.py; the kernel's structure offsets, host/kernel_btf.py).

Trust: an entry may be code the kernel runs, so entries are read only from a directory that only this user
can write to, each a regular file only this user can write to, and written whole (a temporary file renamed
into place).
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "RANKSCOPE_BPF_CACHE"  # the cache's directory; "off" (or empty) keeps nothing
DEFAULT_DIR = "/var/cache/rankscope/bpf"


def directory() -> Path | None:
    """The cache's directory, or None when caching is off."""
    value = os.environ.get(ENV, DEFAULT_DIR)
    return Path(value) if value and value != "off" else None


def read(name: str, *, touch: bool = False) -> tuple[Path, bytes] | None:
    """(path, bytes) of entry `name`, None where there is none (or caching is off, or it is not trusted).
    `touch`: mark it used now, what pruning goes by."""
    root = directory()
    if root is None:
        return None
    path = root / name
    try:
        if not trusted(root):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not trusted_file(os.fstat(f.fileno())):
            log.warning("ignoring cache entry %s: writable by others", path)
            return None
        data = f.read()
        if touch:
            os.utime(f.fileno())
    return path, data


def ensure() -> Path | None:
    """The cache's directory, made if absent; None where caching is off or it is not trusted (logged)."""
    root = directory()
    if root is None:
        return None
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if trusted(root):
            return root
    except OSError as e:
        log.debug("cannot make the cache %s: %s", root, e)
    return None


def write(name: str, data: bytes) -> Path | None:
    """Keeps `data` as entry `name`, whole; its path, or None where caching is off or the directory cannot
    be written (logged)."""
    root = ensure()
    if root is None:
        return None
    try:
        path = root / name
        tmp = root / f".{name}.{os.getpid()}"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return path
    except OSError as e:
        log.debug("cannot write the cache in %s: %s", root, e)
        return None


def trusted(root: Path) -> bool:
    """Whether `root` is a directory owned by this user that nobody else may write to."""
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("ignoring the cache %s: not a directory only this user can write to", root)
        return False
    return True


def trusted_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)  # another process may have removed it first
    except OSError as e:
        log.debug("cannot remove %s: %s", path, e)
