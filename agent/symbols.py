"""Functions a shared library defines, read with pyelftools (no target process involved)."""
from __future__ import annotations

import os
from functools import lru_cache

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection


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
    try:
        st = os.stat(path)
    except OSError as e:
        raise SymbolError(f"cannot stat {path}: {e.strerror}") from e
    return _functions(path, local, st.st_dev, st.st_ino, st.st_mtime_ns)


@lru_cache(maxsize=64)
def _functions(path: str, local: bool, _dev: int, _ino: int, _mtime: int) -> dict[str, int]:
    found: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            for section in (".symtab", ".dynsym") if local else (".dynsym",):
                table = elf.get_section_by_name(section)
                if isinstance(table, SymbolTableSection):
                    found.update(
                        (sym.name, sym["st_value"]) for sym in table.iter_symbols()
                        if sym["st_info"]["type"] in ("STT_FUNC", "STT_GNU_IFUNC") and sym["st_shndx"] != "SHN_UNDEF")
    except (OSError, ELFError) as e:
        raise SymbolError(f"cannot read symbols of {path}: {e}") from e
    return found


def code_byte(pid: int, library: str, symbol: str) -> int:
    """The first instruction byte of `symbol` as mapped in `pid` (0xCC while a uprobe is armed there):
    lets tests and benchmarks check that probes really are, or are no longer, in a process."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(library) and int(parts[2], 16) == 0:
                base, path = int(parts[0].split("-")[0], 16), f"/proc/{pid}/root{parts[5]}"
                break
        else:
            raise SymbolError(f"{library} is not mapped in pid {pid}")
    with open(f"/proc/{pid}/mem", "rb") as mem:
        mem.seek(base + exported_functions(path)[symbol])
        return mem.read(1)[0]
