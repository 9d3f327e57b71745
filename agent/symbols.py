"""Symbols a shared library exports, read with pyelftools (no target process involved)."""
from __future__ import annotations

import os
from functools import lru_cache

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection


class SymbolError(OSError):
    """The library cannot be read as an ELF file."""


def exported_functions(path: str) -> dict[str, int]:
    """Defined function symbols of `path`'s dynamic symbol table, name -> address.

    Cached per file identity (device, inode, mtime), so many ranks mapping one library cost one read.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise SymbolError(f"cannot stat {path}: {e.strerror}") from e
    return _exported(path, st.st_dev, st.st_ino, st.st_mtime_ns)


@lru_cache(maxsize=64)
def _exported(path: str, _dev: int, _ino: int, _mtime: int) -> dict[str, int]:
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            table = elf.get_section_by_name(".dynsym")
            if not isinstance(table, SymbolTableSection):
                return {}
            return {
                sym.name: sym["st_value"]
                for sym in table.iter_symbols()
                if sym["st_info"]["type"] in ("STT_FUNC", "STT_GNU_IFUNC") and sym["st_shndx"] != "SHN_UNDEF"
            }
    except (OSError, ELFError) as e:
        raise SymbolError(f"cannot read symbols of {path}: {e}") from e
