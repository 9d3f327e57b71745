"""The target process: which ELF file runs its interpreter, which version and layout, verified live."""
from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass

from elftools.elf.elffile import ELFFile

from rankscope.agent.host import procfs
from rankscope.agent.host.procfs import Mapping, ProcessMemory
from rankscope.agent.host.symbols import PARSE_ERRORS, SymbolError, dynamic_symbols, loaded_offset, open_elf, section_data
from rankscope.agent.interpreters.cpython.errors import InterpreterNotReady, PythonAttachError, UnsupportedInterpreter
from rankscope.agent.interpreters.cpython.layouts import (SUPPORTED, TABLE, Layout, debug_offsets_size,
                                                          layout_from_debug_offsets, parse_debug_offsets)

log = logging.getLogger(__name__)


def open_memory(pid: int) -> ProcessMemory:
    try:
        return ProcessMemory(pid)
    except FileNotFoundError:
        raise PythonAttachError(f"no such process: {pid}") from None
    except PermissionError:
        raise PythonAttachError(f"not permitted to read the memory of pid {pid}: run as root") from None


def read_maps(pid: int) -> list[Mapping]:
    try:
        return procfs.maps(pid)
    except (FileNotFoundError, ProcessLookupError):
        raise PythonAttachError(f"no such process: {pid}") from None
    except PermissionError:
        raise PythonAttachError(f"not permitted to read /proc/{pid}/maps: run as root") from None


@dataclass(frozen=True)
class ElfFacts:
    path: str  # where the host reads it
    runtime: int | None  # st_value of _PyRuntime (None: not defined here)
    py_version: int | None  # PY_VERSION_HEX from Py_Version (3.11+)
    has_aiter_check: bool  # PyAIter_Check, new in 3.10
    version_string: str | None  # "3.10.13" from .rodata, where Py_Version is absent
    first_load_vaddr: int  # page-aligned p_vaddr of the PT_LOAD at file offset 0
    is_pie: bool


_VERSION_IN_NAME = re.compile(r"(?:^|/)(?:lib)?python(\d+)\.(\d+)")


def _elf_facts(open_path: str, shown_path: str) -> ElfFacts:
    try:
        with open_elf(open_path) as (elf, f):
            dynsym = dynamic_symbols(open_path)  # read once for every rank running this file
            runtime, py_version_addr = dynsym.get("_PyRuntime"), dynsym.get("Py_Version")
            has_aiter = "PyAIter_Check" in dynsym
            py_version = None
            if py_version_addr is not None:
                raw = read_vaddr(elf, f, py_version_addr, 4)
                py_version = struct.unpack("<I", raw)[0] if raw else None
            version_string = None
            if runtime is not None and py_version is None:
                rodata = elf.get_section_by_name(".rodata")
                if rodata is not None:
                    # PY_VERSION, possibly tail-merged into a longer string ("/versions/3.10.13")
                    found = set(re.findall(rb"(?<![\d.])(3\.\d+\.\d+(?:(?:a|b|rc)\d+)?\+?)\x00",
                                           section_data(elf, rodata)))
                    if len(found) == 1:
                        version_string = found.pop().decode()
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            first = min(loads, key=lambda s: s["p_offset"]) if loads else None
            first_vaddr = (first["p_vaddr"] - first["p_offset"]) & ~0xFFF if first is not None else 0
            return ElfFacts(shown_path, runtime, py_version, has_aiter, version_string, first_vaddr,
                            elf.header["e_type"] == "ET_DYN")
    except (*PARSE_ERRORS, SymbolError) as e:
        raise PythonAttachError(f"cannot read {shown_path} as an ELF file: {e}") from e


def read_vaddr(elf: ELFFile, f, vaddr: int, size: int) -> bytes | None:
    offset = loaded_offset(elf, vaddr, size)
    if offset is None:
        return None
    f.seek(offset)
    return f.read(size)


def _decode_hex(hexversion: int) -> tuple[tuple[int, int, int], str]:
    major, minor, micro = hexversion >> 24, (hexversion >> 16) & 0xFF, (hexversion >> 8) & 0xFF
    level, serial = (hexversion >> 4) & 0xF, hexversion & 0xF
    text = f"{major}.{minor}.{micro}" + {0xA: f"a{serial}", 0xB: f"b{serial}", 0xC: f"rc{serial}"}.get(level, "")
    return (major, minor, micro), text


@dataclass(frozen=True)
class Interpreter:
    """A CPython process, read and verified: what the sampler needs to watch it."""

    pid: int
    version: str  # "3.12.1"
    elf_path: str  # the file defining _PyRuntime, as the target names it
    runtime: int  # address of _PyRuntime in the target
    layout: Layout
    ns_dev: int  # the target's pid namespace: nsfs device (kernel encoding) and inode
    ns_ino: int
    load_bias: int = 0  # where elf_path is loaded, less its link-time addresses (0 for a non-PIE executable)

    @property
    def minor(self) -> tuple[int, int]:
        return self.layout.version


def _candidates(pid: int, maps: list[Mapping]) -> list[tuple[Mapping, str]]:
    """(first mapping, path as the target names it) of the executable and of every mapped libpython."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = None
    firsts: dict[str, Mapping] = {}
    for m in maps:
        if m.path not in firsts or m.offset < firsts[m.path].offset:
            firsts[m.path] = m
    out = []
    for path, m in firsts.items():
        clean = path.removesuffix(" (deleted)")
        if path == exe or clean == exe or re.search(r"/libpython[^/]*\.so", clean):
            out.append((m, clean))
    out.sort(key=lambda c: 0 if c[1] == exe else 1)
    return out


def inspect(pid: int) -> Interpreter:
    """Find, identify and verify the CPython interpreter of `pid`; UnsupportedInterpreter if there is none."""
    maps = read_maps(pid)
    facts: ElfFacts | None = None
    first: Mapping | None = None
    seen: list[str] = []
    for m, path in _candidates(pid, maps):
        f = _elf_facts(procfs.mapped_path(pid, m), path)
        seen.append(path)
        if f.runtime is not None:
            facts, first = f, m
            break
    if facts is None or first is None:
        named = [(int(a), int(b)) for p in seen if (mm := _VERSION_IN_NAME.search(p)) for a, b in [mm.groups()]]
        if named:
            v = ".".join(map(str, named[-1]))
            raise UnsupportedInterpreter(
                f"pid {pid} runs CPython {v}, which is not supported (3.10 to 3.14 are)")
        raise UnsupportedInterpreter(
            f"pid {pid} runs no CPython interpreter: no _PyRuntime in {', '.join(seen) or 'its executable'}")

    # The version.
    if facts.py_version is not None:
        (major, minor, _), text = _decode_hex(facts.py_version)
        if (facts.py_version >> 4) & 0xF in (0xA, 0xB):  # internal layouts still move in alphas and betas
            raise UnsupportedInterpreter(f"pid {pid} runs CPython {text}, a pre-release, which is not supported")
    elif facts.has_aiter_check:  # _PyRuntime and PyAIter_Check but no Py_Version: 3.10
        major, minor = 3, 10
        text = facts.version_string or "3.10"
        if not text.startswith("3.10."):
            text = "3.10"
    else:  # 3.7-3.9 define _PyRuntime too
        mm = _VERSION_IN_NAME.search(facts.path)
        v = f"{mm.group(1)}.{mm.group(2)}" if mm else "3.9 or older"
        raise UnsupportedInterpreter(f"pid {pid} runs CPython {v}, which is not supported (3.10 to 3.14 are)")
    mm = _VERSION_IN_NAME.search(facts.path)
    if mm and (int(mm.group(1)), int(mm.group(2))) != (major, minor):
        raise UnsupportedInterpreter(
            f"pid {pid}: {facts.path} is named for CPython {mm.group(1)}.{mm.group(2)} but holds {text}")
    if (major, minor) not in SUPPORTED:
        raise UnsupportedInterpreter(f"pid {pid} runs CPython {text}, which is not supported (3.10 to 3.14 are)")

    # Where _PyRuntime is in the process.
    bias = first.start - first.offset - facts.first_load_vaddr if facts.is_pie else 0
    runtime = facts.runtime + bias

    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
        ns_dev, ns_ino = (os.major(st.st_dev) << 20) | os.minor(st.st_dev), st.st_ino
    except OSError as e:
        raise PythonAttachError(f"cannot read the pid namespace of pid {pid}: {e.strerror}") from e

    mem = open_memory(pid)
    try:
        if minor >= 13:
            try:
                raw = mem.read(runtime, debug_offsets_size(minor))
            except OSError as e:
                raise UnsupportedInterpreter(f"pid {pid}: cannot read _PyRuntime at {runtime:#x}: {e}") from e
            d = parse_debug_offsets(raw, minor)
            if (d["version"] >> 24, (d["version"] >> 16) & 0xFF) != (major, minor):
                raise UnsupportedInterpreter(
                    f"pid {pid}: _Py_DebugOffsets says {_decode_hex(d['version'])[1]}, the binary says {text}")
            layout = layout_from_debug_offsets(d, minor)
        else:
            layout = TABLE[(major, minor)]
        for attempt in range(VERIFY_TRIES):
            try:
                verify(mem, pid, runtime, layout, text)
                break
            except InterpreterNotReady:
                raise
            except UnsupportedInterpreter:
                if attempt == VERIFY_TRIES - 1:
                    raise
    finally:
        mem.close()
    return Interpreter(pid, text, facts.path, runtime, layout, ns_dev, ns_ino, bias)


# The process runs while its frames are walked: a frame popped between two reads can fail a right layout
# once, a wrong layout fails every time.
VERIFY_TRIES = 3


def verify(mem: ProcessMemory, pid: int, runtime: int, layout: Layout, text: str) -> None:
    """Check `layout` against the live process; UnsupportedInterpreter (or InterpreterNotReady) if it fails."""
    where = f"pid {pid} (CPython {text}, offsets from {layout.source})"
    try:
        interp = mem.u64(runtime + layout.runtime_interp_head)
        if interp == 0:
            raise InterpreterNotReady(f"{where}: no interpreter yet (starting up or shutting down)")
        if layout.interp_runtime is not None and mem.u64(interp + layout.interp_runtime) != runtime:
            raise UnsupportedInterpreter(f"{where}: the layout does not verify (interpreter -> runtime)")
        ts = mem.u64(interp + layout.interp_tstate_head)
        if ts == 0:
            raise InterpreterNotReady(f"{where}: no Python thread yet (starting up or shutting down)")
        if mem.u64(ts + layout.tstate_interp) != interp:
            raise UnsupportedInterpreter(f"{where}: the layout does not verify (thread state -> interpreter)")
        tids = set(procfs.ns_tid_map(pid)) if not layout.match_pthread else set()  # as its own namespace numbers them
        code_type: int | None = None
        frames_seen = torn = 0
        for _ in range(256):  # thread states of the first interpreter
            if ts == 0:
                break
            if mem.u64(ts + layout.tstate_interp) != interp:
                raise UnsupportedInterpreter(f"{where}: the layout does not verify (thread list)")
            if layout.match_pthread:
                if mem.u64(ts + layout.tstate_thread_id) == 0:
                    raise UnsupportedInterpreter(f"{where}: the layout does not verify (thread id)")
            else:
                native = mem.u64(ts + layout.tstate_native_thread_id)
                if tids and native not in tids:
                    raise UnsupportedInterpreter(
                        f"{where}: the layout does not verify (native thread id {native} is no thread of it)")
            frame = mem.u64(ts + layout.tstate_frame)
            if frame and layout.cframe_current_frame is not None:
                frame = mem.u64(frame + layout.cframe_current_frame)
            for _ in range(64):
                if not frame:
                    break
                try:
                    skip = False
                    if layout.frame_owner is not None:
                        skip = mem.read(frame + layout.frame_owner, 1)[0] >= layout.owner_skip_from
                    if not skip:
                        code = mem.u64(frame + layout.frame_code) & ~layout.code_tag_mask
                        if code:
                            t = mem.u64(code + layout.ob_type)
                            if t != code_type:
                                if type_name(mem, t, layout) != "code":
                                    raise UnsupportedInterpreter(
                                        f"{where}: the layout does not verify (a frame's code is no code object)")
                                code_type = t
                            frames_seen += 1
                    frame = mem.u64(frame + layout.frame_previous)
                except OSError:  # the frame was popped while read (the process runs): the next thread
                    torn += 1
                    break
            ts = mem.u64(ts + layout.tstate_next)
        if torn and not frames_seen:
            raise UnsupportedInterpreter(f"{where}: the layout does not verify (no frame could be read)")
        log.debug("%s verified: %d frames checked", where, frames_seen)
    except OSError as e:
        raise UnsupportedInterpreter(f"{where}: the layout does not verify (unreadable memory: {e})") from e


def type_name(mem: ProcessMemory, type_addr: int, layout: Layout) -> str | None:
    try:
        name_addr = mem.u64(type_addr + layout.type_tp_name)
        raw = mem.read(name_addr, 32)
    except OSError:
        return None
    return raw.split(b"\x00", 1)[0].decode("ascii", "replace")
