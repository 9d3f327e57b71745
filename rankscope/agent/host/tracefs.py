"""The kernel's tracing filesystem, mounted when nothing is. bcc reads a tracepoint's format there to type a
TRACEPOINT_PROBE's `args`, and its id to attach it, so without it every program with a tracepoint fails to
compile, with an error that names the tracepoints rather than the mount (a machine image that boots without
tracefs gives "5 warnings and 5 errors generated" for sched.bpf.c). One mount, as root, is all it lacks."""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


class TracefsError(RuntimeError):
    """No tracefs, and it could not be mounted (the message says how to mount it)."""


def root() -> Path:
    """Where tracefs is mounted; mounted at /sys/kernel/tracing first if it is nowhere (needs root)."""
    for path in ROOTS:
        if (path / "events").is_dir():
            return path
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tracefs", str(ROOTS[0]).encode(), b"tracefs", 0, None) != 0:
        err = ctypes.get_errno()
        raise TracefsError(f"tracefs is not mounted and mounting it at {ROOTS[0]} failed ({os.strerror(err)}); "
                           f"as root: mount -t tracefs tracefs {ROOTS[0]}")
    log.info("mounted tracefs at %s", ROOTS[0])
    return ROOTS[0]


def has_event(category: str, event: str) -> bool:
    """The running kernel has this tracepoint."""
    return (root() / "events" / category / event).is_dir()
