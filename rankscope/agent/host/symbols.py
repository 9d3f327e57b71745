"""Functions a shared library defines, read from its ELF file (no target process involved).

The file may be a tenant's (a process's libcuda.so.1 is whatever its container put there): it is opened as
procfs.open_regular opens files, and every header count, offset and size is checked against the file's size
before anything is read, compressed sections are refused, so a crafted file is a SymbolError, never an
allocation the size of its claims."""
from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

import numpy as np
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import Section, SymbolTableSection

from rankscope.agent.host import procfs

T = TypeVar("T")
SHF_COMPRESSED = 0x800
MAX_SECTION = 1 << 30  # bytes of one section read (libtorch_cuda's symbol strings are ~100 MiB)
PARSE_ERRORS = (OSError, ELFError, ValueError, struct.error, KeyError)  # what a malformed file raises in pyelftools


class SymbolError(OSError):
    """The library cannot be read as an ELF file."""


@contextmanager
def open_elf(path: str) -> Iterator[tuple[ELFFile, BinaryIO]]:
    """`path` opened as procfs.open_regular does, its ELF headers checked against the file's size; SymbolError
    when it cannot be read, is not a 64-bit little-endian ELF file or its headers point past its end."""
    try:
        with procfs.open_file(path) as f:
            size = os.fstat(f.fileno()).st_size
            elf = ELFFile(f)
            if elf.elfclass != 64 or not elf.little_endian:
                raise SymbolError(f"{path} is not a 64-bit little-endian ELF file")
            header = elf.header
            if (header["e_shoff"] + elf.num_sections() * header["e_shentsize"] > size
                    or header["e_phoff"] + elf.num_segments() * header["e_phentsize"] > size):
                raise SymbolError(f"{path}: its ELF headers reach past the end of the file")
            for section in elf.iter_sections():
                _check_bounds(section, size)
            yield elf, f
    except SymbolError:
        raise
    except PARSE_ERRORS as e:
        raise SymbolError(f"cannot read {path} as an ELF file: {e}") from e


def section_data(elf: ELFFile, section: Section) -> bytes:
    """The bytes of `section` as the file holds them (none for a NOBITS one); SymbolError when it is
    compressed or lies, even in part, outside the file."""
    if section["sh_type"] == "SHT_NOBITS":
        return b""
    if section["sh_flags"] & SHF_COMPRESSED:
        raise SymbolError(f"section {section.name} is compressed")
    _check_bounds(section, os.fstat(elf.stream.fileno()).st_size)
    return section.data()


def _check_bounds(section: Section, size: int) -> None:
    if section["sh_type"] != "SHT_NOBITS" and (section["sh_size"] > MAX_SECTION
                                               or section["sh_offset"] + section["sh_size"] > size):
        raise SymbolError(f"section {section.name or section['sh_name']} reaches past the end of the file")


class _ByIdentity:
    """Results read from a file, kept per file identity (device, inode, mtime) and question: many ranks
    mapping one library cost one read."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[tuple, object] = OrderedDict()

    def get(self, path: str, question: tuple, read: Callable[[ELFFile], T]) -> T:
        with open_elf(path) as (elf, f):
            st = os.fstat(f.fileno())
            key = (st.st_dev, st.st_ino, st.st_mtime_ns, *question)
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]  # type: ignore[return-value]
            try:
                value = read(elf)
            except SymbolError:
                raise
            except PARSE_ERRORS as e:
                raise SymbolError(f"cannot read {path}: {e}") from e
        self.entries[key] = value
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


def exported_functions(path: str) -> dict[str, int]:
    """Defined function symbols of `path`'s dynamic symbol table, name -> address."""
    return functions(path, local=False)


def functions(path: str, local: bool) -> dict[str, int]:
    """Defined functions of `path`, name -> address: exported ones, and with `local` also the static ones
    of `.symtab` (present in unstripped builds, e.g. CPython's gc_collect_main)."""
    return _SYMBOLS.get(path, ("functions", local), lambda elf: _functions(elf, local))


# An ELF64 symbol (Elf64_Sym), read a whole table at a time: pyelftools parses a symbol in ~20 us, which is
# 1.3 s for libtorch_cpu's 60k functions in every process that attaches to a torch job; numpy takes ~30 ms.
ELF64_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"),
                      ("size", "<u8")])
STT_FUNC = 2  # not STT_GNU_IFUNC (10): its address is the resolver's, which a probe or a remote call must not take
SHN_UNDEF = 0
_SYMBOLS = _ByIdentity(64)  # functions() and dynamic_symbols(), told apart by their question


def _functions(elf: ELFFile, local: bool) -> dict[str, int]:
    found: dict[str, int] = {}
    for section in (".symtab", ".dynsym") if local else (".dynsym",):
        found.update(_defined(elf, section, STT_FUNC))
    return found


def dynamic_symbols(path: str) -> dict[str, int]:
    """Every defined symbol of `path`'s dynamic symbol table (functions, objects), name -> st_value. Cached per
    file identity, as functions() is."""
    return _SYMBOLS.get(path, ("dynamic",), lambda elf: _defined(elf, ".dynsym", None))


def _defined(elf: ELFFile, section: str, kind: int | None) -> dict[str, int]:
    """name -> value of the symbols of `section` defined in `elf` (not undefined), of type `kind` (None:
    any), read within the file's bounds; empty when it has no such section."""
    found: dict[str, int] = {}
    table = elf.get_section_by_name(section)
    if not isinstance(table, SymbolTableSection):
        return found
    data = section_data(elf, table)
    syms = np.frombuffer(data, ELF64_SYM, len(data) // ELF64_SYM.itemsize)
    keep = syms["shndx"] != SHN_UNDEF
    if kind is not None:
        keep &= (syms["info"] & 0xF) == kind
    defined = syms[keep]
    names = section_data(elf, elf.get_section(table["sh_link"]))
    for at, value in zip(defined["name"].tolist(), defined["value"].tolist()):
        found[names[at : names.index(b"\0", at)].decode(errors="replace")] = value
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
    with open_elf(path) as (elf, _):
        try:
            offset = loaded_offset(elf, vaddr)
        except PARSE_ERRORS as e:
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
    return _SDT_SITES.get(path, (), _sdt_sites)


_SDT_SITES = _ByIdentity(16)


def _sdt_sites(elf: ELFFile) -> list[tuple[str, str, SdtProbe]]:
    out: list[tuple[str, str, SdtProbe]] = []
    notes, base = elf.get_section_by_name(".note.stapsdt"), elf.get_section_by_name(".stapsdt.base")
    if notes is None:
        return out
    section_data(elf, notes)  # checks its bounds; the notes are parsed from the file
    for note in notes.iter_notes():
        desc = note["n_desc"]
        if note["n_name"] != "stapsdt" or not isinstance(desc, bytes) or len(desc) < 26:
            continue
        pc, note_base, sem = struct.unpack_from("<QQQ", desc)
        provider, name, args = (desc[24:].split(b"\0") + [b""])[:3]
        # A prelinked file moved .stapsdt.base: the note's addresses move with it.
        shift = base["sh_addr"] - note_base if base is not None and note_base else 0
        out.append((provider.decode(errors="replace"), name.decode(errors="replace"),
                    SdtProbe(pc + shift, sem + shift if sem else 0, args.decode(errors="replace"))))
    return out


def code_byte(pid: int, library: str, symbol: str) -> int:
    """The first instruction byte of `symbol` as mapped in `pid` (0xCC while a uprobe is armed there):
    lets tests and benchmarks check that probes really are, or are no longer, in a process."""
    first = next((m for m in procfs.maps(pid) if m.path.endswith(library) and m.offset == 0), None)
    if first is None:
        raise SymbolError(f"{library} is not mapped in pid {pid}")
    with procfs.ProcessMemory(pid) as mem:
        return mem.read(first.start + exported_functions(procfs.mapped_path(pid, first))[symbol], 1)[0]
