"""Stacks of threads read from user space: the frame sampler's walk, for threads that went to sleep before
the process was watched (the kernel only sees a stack when a thread leaves a CPU); thread ids across pid
namespaces."""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from elftools.elf.sections import SymbolTableSection

from rankscope.agent.host import procfs
from rankscope.agent.host.procfs import Mapping, ProcessMemory
from rankscope.agent.interpreters.cpython.errors import PythonAttachError
from rankscope.agent.interpreters.cpython.layout import Layout
from rankscope.agent.host.symbols import SymbolError, open_elf
from rankscope.agent.interpreters.cpython.process import read_maps, read_vaddr

MAX_TSTATES = 256  # thread states searched, over all interpreters (PY_MAX_TSTATES in python.bpf.c)


@dataclass(frozen=True)
class ThreadStack:
    """One thread state's stack, walked exactly as bpf/python.bpf.c walks it."""

    thread_id: int  # as the interpreter records it: native_thread_id (3.11+) or pthread_self() (3.10)
    codes: tuple[int, ...]  # code-object addresses, innermost first, at most max_depth
    truncated: bool  # more frames than max_depth (or than the walk's step bound)
    partial: bool  # a frame link could not be read: the outer part is missing


def thread_stacks(mem: ProcessMemory, runtime: int, layout: Layout, max_depth: int) -> list[ThreadStack] | None:
    """Every thread state's stack (at most MAX_TSTATES), or None if the interpreter list cannot be read.

    Meant for threads that are asleep: their frames do not move while they are read."""

    def ptr(addr: int) -> int:
        try:
            return mem.u64(addr)
        except OSError:
            return 0

    interp = ptr(runtime + layout.runtime_interp_head)
    if not interp:
        return None
    id_off = layout.tstate_thread_id if layout.match_pthread else layout.tstate_native_thread_id
    # One read per thread state and per frame, of the bytes spanning the fields, as the program reads them.
    ts_span = max(layout.tstate_next, id_off) + 8
    frame_span = max(layout.frame_previous, layout.frame_code) + 8
    if layout.frame_owner is not None:
        frame_span = max(frame_span, layout.frame_owner + 1)
    u64 = lambda raw, off: struct.unpack_from("<Q", raw, off)[0]  # noqa: E731
    out: list[ThreadStack] = []
    ts = ptr(interp + layout.interp_tstate_head)
    for _ in range(MAX_TSTATES):
        if not ts:
            interp = ptr(interp + layout.interp_next)
            if not interp:
                break
            ts = ptr(interp + layout.interp_tstate_head)
            continue
        try:
            ts_hdr = mem.read(ts, ts_span)
        except OSError:
            ts = 0
            continue
        frame = ptr(ts + layout.tstate_frame)
        if frame and layout.cframe_current_frame is not None:
            frame = ptr(frame + layout.cframe_current_frame)
        codes: list[int] = []
        truncated = partial = False
        for _ in range(max_depth + 32):
            if not frame:
                break
            try:
                hdr = mem.read(frame, frame_span)
            except OSError:
                partial = True
                break
            if layout.frame_owner is None or hdr[layout.frame_owner] < layout.owner_skip_from:
                code = u64(hdr, layout.frame_code) & ~layout.code_tag_mask
                if code:
                    if len(codes) >= max_depth:
                        truncated = True
                        break
                    codes.append(code)
            frame = u64(hdr, layout.frame_previous)
        if frame and not (truncated or partial):
            truncated = True
        out.append(ThreadStack(u64(ts_hdr, id_off), tuple(codes), truncated, partial))
        ts = u64(ts_hdr, layout.tstate_next)
    return out


def stacks_by_tid(mem: ProcessMemory, pid: int, stacks: list[ThreadStack], layout: Layout) -> dict[int, ThreadStack] | None:
    """Host thread id -> its stack. The interpreter records ids of its own pid namespace (3.11+) or
    pthread_self() (3.10: glibc's descriptor holds the id); None where 3.10's ids cannot be told (no glibc)."""
    by_ns_tid: dict[int, ThreadStack] = {}
    if layout.match_pthread:
        offset = pthread_tid_offset(pid)
        if offset is None:
            return None
        for st in stacks:
            try:
                by_ns_tid[struct.unpack("<I", mem.read(st.thread_id + offset, 4))[0]] = st
            except OSError:
                continue
    else:
        by_ns_tid = {st.thread_id: st for st in stacks}
    ns_to_host = procfs.ns_tid_map(pid)
    return {ns_to_host[ns]: st for ns, st in by_ns_tid.items() if ns in ns_to_host}


_PTHREAD_TID_OFFSETS: dict[tuple[str, int], int | None] = {}  # (libc path, inode) -> offset


def pthread_tid_offset(pid: int) -> int | None:
    """Where glibc keeps a thread's id in its `struct pthread` (pthread_self() points to it), as the target's
    own glibc tells its debuggers (`_thread_db_pthread_tid`: bits, count, offset); None where there is no
    such glibc (musl, a static binary)."""
    try:
        maps = read_maps(pid)
    except PythonAttachError:
        return None
    firsts: dict[str, Mapping] = {}
    for m in maps:
        if m.path not in firsts or m.offset < firsts[m.path].offset:
            firsts[m.path] = m
    for path, m in firsts.items():
        clean = path.removesuffix(" (deleted)")
        if not re.search(r"/lib(c|pthread)\.so(\.\d+)*$", clean):
            continue
        key = (clean, m.inode)
        if key not in _PTHREAD_TID_OFFSETS:
            try:
                _PTHREAD_TID_OFFSETS[key] = _thread_db_tid_offset(procfs.mapped_path(pid, m))
            except SymbolError:
                continue
        if _PTHREAD_TID_OFFSETS[key] is not None:
            return _PTHREAD_TID_OFFSETS[key]
    return None


def _thread_db_tid_offset(path: str) -> int | None:
    with open_elf(path) as (elf, f):
        dynsym = elf.get_section_by_name(".dynsym")
        if not isinstance(dynsym, SymbolTableSection):
            return None
        syms = dynsym.get_symbol_by_name("_thread_db_pthread_tid") or []
        sym = next((s for s in syms if s["st_shndx"] != "SHN_UNDEF"), None)
        raw = read_vaddr(elf, f, sym["st_value"], 12) if sym is not None else None
    if not raw:
        return None
    bits, count, offset = struct.unpack("<3I", raw)
    return offset if bits == 32 and count == 1 and offset < 4096 else None
