"""Attaching a bcc program to uprobes as a BPF uprobe_multi link (Linux 6.6+), which the kernel removes fast.

Why: a uprobe made through perf_event_open (bcc's attach_uprobe) is removed under the kernel's global
event_mutex, each removal waiting for an RCU-tasks-trace grace period: ~110-200 ms a probe here (6.18, 2
vCPUs, under load), 7-9 s for the 45 probes on one rank, and closing from several threads gains nothing. A
link (BPF_LINK_CREATE, BPF_TRACE_UPROBE_MULTI) is released without that mutex: 45 links took 7.1 s closed one
after another and 0.19 s closed from 45 threads at once (their grace periods overlap); one link may also carry
many offsets of one file for a single grace period.
Cost: programs are loaded with expected_attach_type BPF_TRACE_UPROBE_MULTI (still attachable as perf events),
and detach runs up to MAX_CLOSERS threads for one grace period. Like perf events, links go with the agent's
file descriptors (a SIGKILLed agent leaves no probe and no raised semaphore), and they leave nothing in tracefs.
A kernel that refuses the link (before 6.6) gets libbcc's perf_event uprobes instead: decided at the first
attach, logged once.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from rankscope.agent.loader import bpf_syscall

log = logging.getLogger(__name__)

BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
BPF_PROBE_ENTRY, BPF_PROBE_RETURN = 0, 1  # libbcc's bpf_probe_attach_type
ENOTSUPP = 524  # the kernel's own "not supported", which errno does not name
REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, ENOTSUPP}  # what a kernel without uprobe_multi answers
MAX_CLOSERS = 64  # links closed at once, a thread each, asleep in the kernel for one grace period

_links: bool | None = None  # whether the kernel takes uprobe_multi links; None until the first attach
_event_ids = itertools.count()


class UprobeError(Exception):
    """The kernel refused a uprobe; one line naming the program and the file."""


class _LinkCreate(ctypes.Structure):
    """union bpf_attr's link_create as include/uapi/linux/bpf.h lays it out for uprobe_multi (64 bytes)."""

    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("path", ctypes.c_uint64), ("offsets", ctypes.c_uint64),
                ("ref_ctr_offsets", ctypes.c_uint64), ("cookies", ctypes.c_uint64), ("cnt", ctypes.c_uint32),
                ("multi_flags", ctypes.c_uint32), ("pid", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


@dataclass
class Uprobes:
    """One program attached at offsets of one file: one link, or (older kernels) a perf event per offset."""

    link: int | None = None  # the link's file descriptor
    perf: list[tuple[int, bytes]] = field(default_factory=list)  # (perf event fd, libbcc's event name)


def using_links() -> bool | None:
    """Whether this process's uprobes are links (False: perf events; None: none attached yet)."""
    return _links


@contextmanager
def perf_events_only() -> Iterator[None]:
    """Programs loaded and uprobes attached meanwhile are perf events, as on a kernel without links (tests and
    benchmarks compare the two)."""
    global _links
    decided, _links = _links, False
    try:
        yield
    finally:
        _links = decided


def attach(bpf: Any, fn_name: str, path: str, offsets: list[int], *, returns: bool = False, pid: int | None = None,
           ref_ctr_offsets: list[int] | None = None) -> Uprobes:
    """Attaches bcc program `fn_name` of `bpf` to file offsets `offsets` of `path`: on entry, or with
    `returns` on return; in process `pid` only, or every process mapping the file. `ref_ctr_offsets` (one
    per offset, 0: none) are USDT semaphores the kernel raises while the probe is installed."""
    global _links
    prog_fd = _program_fd(bpf, fn_name)
    if _links is not False:
        try:
            probes = Uprobes(link=_link_create(prog_fd, path, offsets, returns, pid or 0, ref_ctr_offsets))
        except OSError as e:
            if _links or e.errno not in REFUSED:
                raise UprobeError(f"cannot attach {fn_name} to {path}: {e.strerror}") from e
            probes = _perf_events(prog_fd, fn_name, path, offsets, returns, pid, ref_ctr_offsets)
            _links = False  # decided only once the older way worked: a bad first probe decides nothing
            log.warning("this kernel refuses uprobe_multi links (%s): uprobes are perf events, which take "
                        "~0.1 s each to remove", e.strerror)
            return probes
        if _links is None:
            log.info("uprobes attached as uprobe_multi links")
            _links = True
        return probes
    return _perf_events(prog_fd, fn_name, path, offsets, returns, pid, ref_ctr_offsets)


def detach(probes: list[Uprobes]) -> list[Uprobes]:
    """Removes every probe of `probes`: links closed all at once (their grace periods overlap), perf events
    one by one (the kernel serializes them anyway). Returns the empty list that replaces `probes`."""
    links = [p.link for p in probes if p.link is not None]
    if len(links) > 1:
        with ThreadPoolExecutor(min(len(links), MAX_CLOSERS), thread_name_prefix="uprobe-detach") as pool:
            list(pool.map(os.close, links))
    elif links:
        os.close(links[0])
    perf = [event for p in probes for event in p.perf]
    if perf:
        from bcc.libbcc import lib
        for fd, event in perf:
            lib.bpf_close_perf_event_fd(fd)
            lib.bpf_detach_uprobe(event)
    return []


def _program_fd(bpf: Any, fn_name: str) -> int:
    """The program's fd, loaded for links (bcc keeps the first load of a name: a perf event takes it too)."""
    from bcc import BPF
    global _links
    if _links is not False:
        try:
            return bpf.load_func(fn_name.encode(), BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI).fd
        except Exception as e:  # bcc raises bare Exception: a kernel that knows no such attach type
            if _links:
                raise UprobeError(f"cannot load {fn_name}: {e}") from e
            _links = False
            log.warning("this kernel refuses programs for uprobe_multi links (%s): uprobes are perf events, "
                        "which take ~0.1 s each to remove", e)
    try:
        return bpf.load_func(fn_name.encode(), BPF.KPROBE).fd
    except Exception as e:
        raise UprobeError(f"cannot load {fn_name}: {e}") from e


def _link_create(prog_fd: int, path: str, offsets: list[int], returns: bool, pid: int,
                 ref_ctr_offsets: list[int] | None) -> int:
    """bpf(BPF_LINK_CREATE) of a uprobe_multi link; the link's fd, or OSError with the kernel's errno."""
    raw_path = ctypes.create_string_buffer(path.encode())
    offs = (ctypes.c_uint64 * len(offsets))(*offsets)
    refs = (ctypes.c_uint64 * len(offsets))(*ref_ctr_offsets) if ref_ctr_offsets else None
    attr = _LinkCreate(prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI, path=ctypes.addressof(raw_path),
                       offsets=ctypes.addressof(offs), ref_ctr_offsets=ctypes.addressof(refs) if refs else 0,
                       cnt=len(offsets), multi_flags=BPF_F_UPROBE_MULTI_RETURN if returns else 0, pid=pid)
    return bpf_syscall.bpf(bpf_syscall.BPF_LINK_CREATE, attr)


def _perf_events(prog_fd: int, fn_name: str, path: str, offsets: list[int], returns: bool, pid: int | None,
                 ref_ctr_offsets: list[int] | None) -> Uprobes:
    """The older way: a perf_event uprobe per offset through libbcc; all or none."""
    probes = Uprobes()
    for offset, ref_ctr in zip(offsets, ref_ctr_offsets or [0] * len(offsets)):
        event = f"rankscope_{os.getpid()}_{next(_event_ids)}".encode()
        fd = _bcc_attach_uprobe()(prog_fd, BPF_PROBE_RETURN if returns else BPF_PROBE_ENTRY, event, path.encode(),
                                  offset, -1 if pid is None else pid, ref_ctr)
        if fd < 0:
            detach([probes])
            raise UprobeError(f"cannot attach {fn_name} to {path} at offset {offset:#x}")
        probes.perf.append((fd, event))
    return probes


@cache
def _bcc_attach_uprobe():
    """libbcc's bpf_attach_uprobe with its last argument (ref_ctr_offset), which bcc's Python leaves out.
    A separate function object, so bcc's own argtypes stay as they are."""
    from bcc.libbcc import lib
    fn = ctypes.CDLL(lib._name).bpf_attach_uprobe
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_int,
                   ctypes.c_uint32]
    return fn
