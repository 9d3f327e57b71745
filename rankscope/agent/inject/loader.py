"""Where another process's dynamic loader entry points are: dlopen and dlerror at their addresses in that
process, from /proc/PID/maps and the ELF symbol tables of the libraries that define them (glibc >= 2.34 has
them in libc.so.6; older ones in libdl.so.2, when the process maps it, else libc's private
__libc_dlopen_mode, which has no dlerror)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from rankscope.agent.host import procfs
from rankscope.agent.host.symbols import PARSE_ERRORS, SymbolError, exported_functions, open_elf

LIBC = re.compile(r"^libc(\.so\.6|-2\.\d+\.so)$")
LIBDL = re.compile(r"^libdl(\.so\.2|-2\.\d+\.so)$")
LD_SO = re.compile(r"^ld-(linux-x86-64\.so\.2|2\.\d+\.so)$")
# Code that may hold a lock dlopen takes too: the C library, the loader, and malloc replacements preloaded
# in its place (dlopen allocates).
LOCKING = (LIBC, LD_SO, re.compile(r"^lib(tcmalloc|jemalloc|mimalloc)[\w.-]*\.so"))
PAGE = 4096


class LoaderError(Exception):
    """The process has no dynamic loader to call (static binary, musl, unreadable libraries)."""


@dataclass(frozen=True)
class LoaderCalls:
    dlopen: int  # dlopen(path, flags), or __libc_dlopen_mode(path, flags)
    dlerror: int | None  # None: no dlerror to ask why dlopen failed
    syscall: int  # libc's syscall(number, ...): memfd_create and close, whatever the libc's age
    # Where libc, ld.so and a malloc replacement are mapped: a thread stopped in their code may hold their locks.
    locking_ranges: tuple[tuple[int, int], ...]

    def may_hold_locks(self, address: int) -> bool:
        return any(lo <= address < hi for lo, hi in self.locking_ranges)


def load_bias(path: str, start: int) -> int:
    """What to add to `path`'s link-time addresses, given where its offset-0 segment is mapped."""
    try:
        with open_elf(path) as (elf, _):
            first = next(s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD" and s["p_offset"] == 0)
    except (*PARSE_ERRORS, StopIteration) as e:
        raise LoaderError(f"cannot read the segments of {path}: {e}") from e
    return start - (first["p_vaddr"] & ~(PAGE - 1))


def _mapped(pid: int, pattern: re.Pattern[str], mappings: list[procfs.Mapping]) -> tuple[str, int] | None:
    """(host path, load bias) of the first file `pattern` names."""
    for m in mappings:
        if m.offset == 0 and not m.deleted and pattern.match(m.name):
            path = procfs.mapped_path(pid, m)
            return path, load_bias(path, m.start)
    return None


def loader_calls(pid: int) -> LoaderCalls:
    try:
        mappings = procfs.maps(pid)
    except OSError as e:
        raise LoaderError(f"cannot read /proc/{pid}/maps: {e.strerror}") from e
    ranges = tuple((m.start, m.end) for m in mappings
                   if any(pattern.match(m.name) for pattern in LOCKING))
    libc = _mapped(pid, LIBC, mappings)
    if libc is None:
        raise LoaderError(f"process {pid} maps no glibc libc.so.6 (a static or musl binary): nothing to call dlopen in")
    libc_functions = _functions(libc[0])
    if "syscall" not in libc_functions:
        raise LoaderError(f"process {pid}: its libc.so.6 exports no syscall()")
    syscall = libc[1] + libc_functions["syscall"]
    for found in (libc, _mapped(pid, LIBDL, mappings)):
        if found is None:
            continue
        functions = libc_functions if found is libc else _functions(found[0])
        if "dlopen" in functions and "dlerror" in functions:
            return LoaderCalls(found[1] + functions["dlopen"], found[1] + functions["dlerror"], syscall, ranges)
    if "__libc_dlopen_mode" in libc_functions:
        return LoaderCalls(libc[1] + libc_functions["__libc_dlopen_mode"], None, syscall, ranges)
    raise LoaderError(f"process {pid}: no dlopen in its libc.so.6 or libdl.so.2")


def _functions(path: str) -> dict[str, int]:
    try:
        return exported_functions(path)
    except SymbolError as e:
        raise LoaderError(str(e)) from e
