"""Functions a shared library defines, read from its ELF file (no target process involved)."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from rankscope.agent.host import procfs


class SymbolError(OSError):
    """The library cannot be read as an ELF file."""


def exported_functions(path: str) -> dict[str, int]:
    """Defined function symbols of `path`'s dynamic symbol table, name -> address."""
    return functions(path, local=False)


def functions(path: str, local: bool) -> dict[str, int]:
    """Defined functions of `path`, name -> address: exported ones, and with `local` also the static ones
    of `.symtab` (present in unstripped builds, e.g. CPython's gc_collect_main).

    Cached per file identity (device, inode, mtime), so many ranks mapping one library cost one read.
    """
    return _functions(path, local, *_identity(path))


def _identity(path: str) -> tuple[int, int, int]:
    """(device, inode, mtime) of `path`: what the readers below are cached by."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SymbolError(f"cannot stat {path}: {e.strerror}") from e
    return st.st_dev, st.st_ino, st.st_mtime_ns


# An ELF64 symbol (Elf64_Sym), read a whole table at a time: pyelftools parses a symbol in ~20 us, which is
# 1.3 s for libtorch_cpu's 60k functions in every process that attaches to a torch job; numpy takes ~30 ms.
ELF64_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"),
                      ("size", "<u8")])
STT_FUNC = 2  # not STT_GNU_IFUNC (10): its address is the resolver's, which a probe or a remote call must not take
SHN_UNDEF = 0


@lru_cache(maxsize=64)
def _functions(path: str, local: bool, _dev: int, _ino: int, _mtime: int) -> dict[str, int]:
    found: dict[str, int] = {}
    for section in (".symtab", ".dynsym") if local else (".dynsym",):
        found.update(_defined(path, section, STT_FUNC))
    return found


def dynamic_symbols(path: str) -> dict[str, int]:
    """Every defined symbol of `path`'s dynamic symbol table (functions, objects), name -> st_value. Cached per
    file identity, as functions() is."""
    return _dynamic_symbols(path, *_identity(path))


@lru_cache(maxsize=16)
def _dynamic_symbols(path: str, _dev: int, _ino: int, _mtime: int) -> dict[str, int]:
    return _defined(path, ".dynsym", None)


def _defined(path: str, section: str, kind: int | None) -> dict[str, int]:
    """name -> value of the symbols of `section` defined in `path` (not undefined), of type `kind` (None:
    any); empty when it has no such section."""
    found: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            if elf.elfclass != 64 or not elf.little_endian:
                raise SymbolError(f"{path} is not a 64-bit little-endian ELF file")
            table = elf.get_section_by_name(section)
            if not isinstance(table, SymbolTableSection):
                return found
            data = table.data()
            syms = np.frombuffer(data, ELF64_SYM, len(data) // ELF64_SYM.itemsize)
            keep = syms["shndx"] != SHN_UNDEF
            if kind is not None:
                keep &= (syms["info"] & 0xF) == kind
            defined = syms[keep]
            names = elf.get_section(table["sh_link"]).data()
            for at, value in zip(defined["name"].tolist(), defined["value"].tolist()):
                found[names[at : names.index(b"\0", at)].decode(errors="replace")] = value
    except (OSError, ELFError, ValueError) as e:
        raise SymbolError(f"cannot read symbols of {path}: {e}") from e
    return found


def loaded_offset(elf: ELFFile, vaddr: int, size: int = 1) -> int | None:
    """File offset of the `size` bytes at link-time address `vaddr`, where a loaded segment holds them
    from the file (None: in no PT_LOAD, or in its zero-filled tail)."""
    for seg in elf.iter_segments():
        if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= vaddr and vaddr + size <= seg["p_vaddr"] + seg["p_filesz"]:
            return seg["p_offset"] + vaddr - seg["p_vaddr"]
    return None


def file_offset(path: str, vaddr: int) -> int:
    """The file offset of link-time address `vaddr` of `path` (what uprobes and their counters take)."""
    try:
        with open(path, "rb") as f:
            offset = loaded_offset(ELFFile(f), vaddr)
    except (OSError, ELFError) as e:
        raise SymbolError(f"cannot read {path}: {e}") from e
    if offset is None:
        raise SymbolError(f"{path}: address {vaddr:#x} is in no loaded part of the file")
    return offset


@dataclass(frozen=True)
class SdtProbe:
    """A USDT (SystemTap SDT) probe site: where to put a uprobe, and the semaphore that arms the site."""

    address: int  # of the probe's instruction, as a link-time address of the file (bcc's `addr`)
    semaphore: int  # link-time address of its unsigned short counter; 0 when the site is always live
    args: str = ""  # the note's argument locations, e.g. "8@%rdx 8@16(%rax) 8@$0" (size@operand, AT&T syntax)


def sdt_probes(path: str) -> dict[tuple[str, str], SdtProbe]:
    """(provider, name) -> SdtProbe of every SDT note of `path` (e.g. CPython's python:gc__start); of a probe
    with several sites, one (they share the semaphore)."""
    return {(provider, name): site for provider, name, site in sdt_sites(path)}


def sdt_sites(path: str) -> list[tuple[str, str, SdtProbe]]:
    """(provider, name, site) of every SDT note of `path`: a probe the compiler placed at several sites (an
    inlined macro) has one entry each."""
    return _sdt_sites(path, *_identity(path))


@lru_cache(maxsize=16)
def _sdt_sites(path: str, _dev: int, _ino: int, _mtime: int) -> list[tuple[str, str, SdtProbe]]:
    out: list[tuple[str, str, SdtProbe]] = []
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            notes, base = elf.get_section_by_name(".note.stapsdt"), elf.get_section_by_name(".stapsdt.base")
            if notes is None:
                return out
            for note in notes.iter_notes():
                desc = note["n_desc"]
                if note["n_name"] != "stapsdt" or not isinstance(desc, bytes) or len(desc) < 26:
                    continue
                pc, note_base, sem = struct.unpack_from("<QQQ", desc)
                provider, name, args = (desc[24:].split(b"\0") + [b""])[:3]
                # A prelinked file moved .stapsdt.base: the note's addresses move with it.
                shift = base["sh_addr"] - note_base if base is not None and note_base else 0
                out.append((provider.decode(), name.decode(),
                            SdtProbe(pc + shift, sem + shift if sem else 0, args.decode(errors="replace"))))
    except (OSError, ELFError, ValueError) as e:
        raise SymbolError(f"cannot read the SDT notes of {path}: {e}") from e
    return out


def code_byte(pid: int, library: str, symbol: str) -> int:
    """The first instruction byte of `symbol` as mapped in `pid` (0xCC while a uprobe is armed there):
    lets tests and benchmarks check that probes really are, or are no longer, in a process."""
    first = next((m for m in procfs.maps(pid) if m.path.endswith(library) and m.offset == 0), None)
    if first is None:
        raise SymbolError(f"{library} is not mapped in pid {pid}")
    with procfs.ProcessMemory(pid) as mem:
        return mem.read(first.start + exported_functions(procfs.host_path(pid, first.path))[symbol], 1)[0]
