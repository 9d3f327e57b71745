"""USDT probe sites guarded by a semaphore, attached with the kernel keeping the semaphore.

A guarded site runs only while its semaphore (an unsigned short in the process) is non-zero. Tracers usually
raise it by writing the process's memory and lower it at detach, so a tracer killed in between leaves the
job's sites armed. The kernel can keep it instead (a uprobe's reference counter, `ref_ctr_offset`, Linux
4.20+): raised while the uprobe is installed in the process, lowered when it goes, with the tracer's file
descriptor if need be. bcc's Python API does not pass that offset; libbcc's C function takes it.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from rankscope.agent.host.symbols import loaded_offset

BPF_PROBE_ENTRY = 0


class UsdtError(Exception):
    """A site or semaphore cannot be placed in its file, or the kernel refused the probe."""


def file_offset(path: str, vaddr: int) -> int:
    """The file offset of link-time address `vaddr` of `path` (what uprobes and their counters take)."""
    try:
        with open(path, "rb") as f:
            offset = loaded_offset(ELFFile(f), vaddr)
    except (OSError, ELFError) as e:
        raise UsdtError(f"cannot read {path}: {e}") from e
    if offset is None:
        raise UsdtError(f"{path}: address {vaddr:#x} is in no loaded part of the file")
    return offset


@cache
def _attach_uprobe():
    """libbcc's bpf_attach_uprobe with its last argument (ref_ctr_offset), which bcc's Python leaves out.
    A separate function object, so bcc's own argtypes stay as they are."""
    from bcc.libbcc import lib
    fn = ctypes.CDLL(lib._name).bpf_attach_uprobe
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_int,
                   ctypes.c_uint32]
    return fn


@dataclass
class GuardedProbe:
    """One attached site: its uprobe event and perf file descriptor."""

    event: bytes
    fd: int

    def close(self) -> None:
        """Detach; the kernel lowers the semaphore (once no other probe of the process holds it)."""
        from bcc.libbcc import lib
        lib.bpf_close_perf_event_fd(self.fd)
        lib.bpf_detach_uprobe(self.event)


def attach(prog_fd: int, path: str, site: int, semaphore: int, pid: int, event: str) -> GuardedProbe:
    """Attaches the loaded program `prog_fd` to the site at link-time address `site` of `path` in `pid`,
    the kernel raising the semaphore at link-time address `semaphore` (0: an unguarded site)."""
    ref_ctr = file_offset(path, semaphore) if semaphore else 0
    fd = _attach_uprobe()(prog_fd, BPF_PROBE_ENTRY, event.encode(), path.encode(), file_offset(path, site), pid,
                          ref_ctr)
    if fd < 0:
        raise UsdtError(f"cannot attach to {path} at {site:#x} in pid {pid}")
    return GuardedProbe(event.encode(), fd)


def closed(probes: list[GuardedProbe]) -> list[GuardedProbe]:
    """Detaches every probe of `probes`; returns the empty list that replaces it."""
    for probe in probes:
        probe.close()
    return []
