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
A kernel that refuses the link (before 6.6) gets perf_event uprobes instead (the uprobe PMU, each event
linked to its program by a BPF perf_event link): decided at the first attach, logged once.

Each offset may carry a BPF cookie (bpf_get_attach_cookie in the program): one program then serves many
functions, told apart by their cookies, and the kernel's verifier checks it once (Linux 5.15+ for perf
event links with cookies).
"""
from __future__ import annotations

import ctypes
import errno
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

BPF_PERF_EVENT = 41
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
UPROBE_PMU = "/sys/bus/event_source/devices/uprobe"  # the kernel's uprobe PMU: its type and config bits
PERF_FLAG_FD_CLOEXEC = 8
SYS_PERF_EVENT_OPEN = 298  # x86-64
ENOTSUPP = 524  # the kernel's own "not supported", which errno does not name
REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, ENOTSUPP}  # what a kernel without uprobe_multi answers
MAX_CLOSERS = 64  # links closed at once, a thread each, asleep in the kernel for one grace period

_links: bool | None = None  # whether the kernel takes uprobe_multi links; None until the first attach


class UprobeError(Exception):
    """The kernel refused a uprobe; one line naming the program and the file."""


class _LinkCreate(ctypes.Structure):
    """union bpf_attr's link_create as include/uapi/linux/bpf.h lays it out for uprobe_multi (64 bytes)."""

    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("path", ctypes.c_uint64), ("offsets", ctypes.c_uint64),
                ("ref_ctr_offsets", ctypes.c_uint64), ("cookies", ctypes.c_uint64), ("cnt", ctypes.c_uint32),
                ("multi_flags", ctypes.c_uint32), ("pid", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


class _PerfLinkCreate(ctypes.Structure):
    """union bpf_attr's link_create for a perf event (BPF_PERF_EVENT), with its BPF cookie."""

    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("bpf_cookie", ctypes.c_uint64), ("_pad", ctypes.c_uint64 * 5)]


class _PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to sample_max_stack (PERF_ATTR_SIZE_VER5, 112 bytes); a uprobe's path in
    config1, its offset in config2, the retprobe bit and the semaphore's offset in config."""

    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64), ("read_format", ctypes.c_uint64),
                ("flags", ctypes.c_uint64), ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64), ("_rest", ctypes.c_uint8 * 48)]


@dataclass
class Uprobes:
    """One program attached at offsets of one file: one link, or (older kernels) a perf event per offset."""

    link: int | None = None  # the link's file descriptor
    perf: list[tuple[int, int]] = field(default_factory=list)  # (perf event fd, its link's fd)


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
           ref_ctr_offsets: list[int] | None = None, cookies: list[int] | None = None) -> Uprobes:
    """Attaches bcc program `fn_name` of `bpf` to file offsets `offsets` of `path`: on entry, or with
    `returns` on return; in process `pid` only, or every process mapping the file. `ref_ctr_offsets` (one
    per offset, 0: none) are USDT semaphores the kernel raises while the probe is installed; `cookies` (one
    per offset) what bpf_get_attach_cookie gives the program there."""
    global _links
    prog_fd = _program_fd(bpf, fn_name)
    site = _Sites(path, offsets, returns, pid, ref_ctr_offsets or [0] * len(offsets), cookies or [0] * len(offsets))
    if _links is not False:
        try:
            probes = Uprobes(link=_link_create(prog_fd, site))
        except OSError as e:
            if _links or e.errno not in REFUSED:
                raise UprobeError(f"cannot attach {fn_name} to {path}: {e.strerror}") from e
            probes = _perf_events(prog_fd, fn_name, site)
            _links = False  # decided only once the older way worked: a bad first probe decides nothing
            log.warning("this kernel refuses uprobe_multi links (%s): uprobes are perf events, which take "
                        "~0.1 s each to remove", e.strerror)
            return probes
        if _links is None:
            log.info("uprobes attached as uprobe_multi links")
            _links = True
        return probes
    return _perf_events(prog_fd, fn_name, site)


def detach(probes: list[Uprobes]) -> list[Uprobes]:
    """Removes every probe of `probes`: links closed all at once (their grace periods overlap), perf events
    one by one (the kernel serializes them anyway). Returns the empty list that replaces `probes`."""
    links = [p.link for p in probes if p.link is not None]
    if len(links) > 1:
        with ThreadPoolExecutor(min(len(links), MAX_CLOSERS), thread_name_prefix="uprobe-detach") as pool:
            list(pool.map(os.close, links))
    elif links:
        os.close(links[0])
    for p in probes:
        for event, link in p.perf:
            os.close(link)
            os.close(event)
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


@dataclass(frozen=True)
class _Sites:
    """Where a program goes: offsets of a file, each with its semaphore (0: none) and cookie."""

    path: str
    offsets: list[int]
    returns: bool
    pid: int | None
    ref_ctr_offsets: list[int]
    cookies: list[int]


def _link_create(prog_fd: int, site: _Sites) -> int:
    """bpf(BPF_LINK_CREATE) of a uprobe_multi link; the link's fd, or OSError with the kernel's errno."""
    n = len(site.offsets)
    raw_path = ctypes.create_string_buffer(site.path.encode())
    offs = (ctypes.c_uint64 * n)(*site.offsets)
    refs = (ctypes.c_uint64 * n)(*site.ref_ctr_offsets)
    cookies = (ctypes.c_uint64 * n)(*site.cookies)
    attr = _LinkCreate(prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI, path=ctypes.addressof(raw_path),
                       offsets=ctypes.addressof(offs), ref_ctr_offsets=ctypes.addressof(refs),
                       cookies=ctypes.addressof(cookies), cnt=n,
                       multi_flags=BPF_F_UPROBE_MULTI_RETURN if site.returns else 0, pid=site.pid or 0)
    return bpf_syscall.bpf(bpf_syscall.BPF_LINK_CREATE, attr)


def _perf_events(prog_fd: int, fn_name: str, site: _Sites) -> Uprobes:
    """The older way: a perf_event uprobe per offset, each linked to the program with its cookie; all or none."""
    probes = Uprobes()
    for offset, ref_ctr, cookie in zip(site.offsets, site.ref_ctr_offsets, site.cookies):
        try:
            event = _perf_uprobe(site.path, offset, site.returns, site.pid, ref_ctr)
        except OSError as e:
            detach([probes])
            raise UprobeError(f"cannot attach {fn_name} to {site.path} at offset {offset:#x}: {e.strerror}") from e
        try:
            link = bpf_syscall.bpf(bpf_syscall.BPF_LINK_CREATE, _PerfLinkCreate(
                prog_fd=prog_fd, target_fd=event, attach_type=BPF_PERF_EVENT, bpf_cookie=cookie))
        except OSError as e:
            os.close(event)
            detach([probes])
            raise UprobeError(f"cannot link {fn_name} to its uprobe on {site.path}: {e.strerror}") from e
        probes.perf.append((event, link))
    return probes


def _perf_uprobe(path: str, offset: int, returns: bool, pid: int | None, ref_ctr: int) -> int:
    """perf_event_open(2) of a uprobe through the kernel's uprobe PMU: the event's fd, or OSError."""
    pmu_type, retprobe_bit = _uprobe_pmu()
    raw_path = ctypes.create_string_buffer(path.encode())
    attr = _PerfEventAttr(type=pmu_type, size=ctypes.sizeof(_PerfEventAttr),
                          config=(1 << retprobe_bit if returns else 0) | ref_ctr << 32, sample_period=1,
                          wakeup_events=1, config1=ctypes.addressof(raw_path), config2=offset)
    # Every process (pid -1) is watched through one CPU's event: the program runs on whichever CPU traps.
    fd = _syscall()(SYS_PERF_EVENT_OPEN, ctypes.byref(attr), -1 if pid is None else pid, 0 if pid is None else -1,
                    -1, PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


@cache
def _uprobe_pmu() -> tuple[int, int]:
    """The uprobe PMU's perf type and the config bit that makes a uprobe a uretprobe."""
    try:
        with open(f"{UPROBE_PMU}/type") as f:
            pmu_type = int(f.read())
        with open(f"{UPROBE_PMU}/format/retprobe") as f:
            retprobe_bit = int(f.read().strip().removeprefix("config:"))
    except (OSError, ValueError) as e:
        raise UprobeError(f"this kernel has no uprobe PMU ({UPROBE_PMU}): {e}") from e
    return pmu_type, retprobe_bit


@cache
def _syscall():
    """libc's syscall(2), typed for perf_event_open(2)."""
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_ulong]
    return fn
