"""Compiling a BPF program with bcc (once a node: loader/bpf_cache.py), and giving the compiler's memory back.

bcc compiles C with clang/LLVM inside this process, which costs resident memory twice over:
- the heap grows by 60-100 MB that is free again afterwards, but glibc keeps freed heap mapped:
  malloc_trim returns it to the kernel (measured: 200 MB -> 145 MB resident after the sampler's compile);
- the compiler's code (libLLVM, libclang-cpp: ~80 MB of pages touched per compile) stays mapped into the
  agent and counts in its resident set until the next compile needs it again, minutes or hours later. Those
  pages are clean copies of the library files, so they are dropped from this process's page tables
  (MADV_DONTNEED): the page cache keeps them, and a later compile faults them back in.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import re
from functools import cache
from typing import Any

from rankscope.agent.host import tracefs

log = logging.getLogger(__name__)

COMPILER_LIBRARIES = re.compile(r"/lib(LLVM|clang)[^/]*\.so[^/]*$")
MADV_DONTNEED = 4
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")


def compile_bpf(text: str, cflags: list[str]) -> Any:
    """bcc's BPF object for `text` (maps created): from the node's cache of compiled programs
    (loader/bpf_cache.py) where it holds this one, else compiled and kept there. Raises what bcc raises (a
    bare Exception, or TracefsError: no tracefs for its tracepoints)."""
    tracefs.root()  # bcc types and attaches tracepoints through it: mounted first where a machine lacks it
    try:
        from bcc import BPF

        from rankscope.agent.loader import bpf_cache
    except ImportError as e:
        raise RuntimeError("bcc is not importable: run scripts/install (Debian's python3-bpfcc)") from e
    try:
        cached = bpf_cache.load(text, cflags)
        if cached is not None:
            return cached
        bpf = BPF(text=text, cflags=cflags)
    finally:
        _trim_heap()
        # Even without a compile: loading libbcc relocates the compiler's libraries, ~45 MB resident.
        release_clean_pages(COMPILER_LIBRARIES)
    bpf_cache.store(text, cflags, bpf)
    return bpf


@cache
def _libc() -> ctypes.CDLL | None:
    """libc, found once (find_library runs ldconfig) and with madvise's argument types set."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _trim_heap() -> None:
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


def clean_mappings(path_pattern: re.Pattern[str], smaps: str = "/proc/self/smaps") -> list[tuple[int, int]]:
    """(start, end) of this process's read-only mappings of files matching `path_pattern` that hold no
    private (copy-on-write) page: what dropping gives back exactly as the file has it. Mappings the dynamic
    linker wrote to (relocations) have anonymous pages and are left alone."""
    out: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    with open(smaps) as f:
        for line in f:
            m = _MAPPING.match(line)
            if m:
                start, end, perms, path = m.groups()
                current = (int(start, 16), int(end, 16)) if "w" not in perms and path_pattern.search(path) else None
            elif current and line.startswith("Anonymous:"):
                if int(line.split()[1]) == 0:
                    out.append(current)
                current = None
    return out


def release_clean_pages(path_pattern: re.Pattern[str]) -> None:
    """Drops the resident pages of clean read-only file mappings (see clean_mappings) from this process."""
    libc = _libc()
    if libc is None:
        return
    try:
        ranges = clean_mappings(path_pattern)
    except OSError as e:
        log.debug("cannot read /proc/self/smaps: %s", e)
        return
    for start, end in ranges:
        if libc.madvise(start, end - start, MADV_DONTNEED) != 0:
            log.debug("madvise(%#x, %d): errno %d", start, end - start, ctypes.get_errno())
