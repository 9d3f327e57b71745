"""Functions of a library's ELF symbol tables, read a whole table at a time, as pyelftools reads them one by one."""
from __future__ import annotations

import glob

import pytest
from elftools.elf.elffile import ELFFile

from rankscope.agent.host.symbols import SymbolError, functions

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"


def _by_pyelftools(path: str, section: str) -> list[tuple[str, int, str]]:
    """(name, address, type) of the defined symbols, in table order (a versioned name may come twice)."""
    with open(path, "rb") as f:
        table = ELFFile(f).get_section_by_name(section)
        return [(s.name, s["st_value"], s["st_info"]["type"]) for s in table.iter_symbols()
                if s["st_shndx"] != "SHN_UNDEF"]


def test_exported_functions_are_the_defined_functions_of_dynsym():
    found = functions(LIBC, local=False)
    reference = _by_pyelftools(LIBC, ".dynsym")
    assert found == {name: addr for name, addr, kind in reference if kind == "STT_FUNC"}
    assert "getpid" in found and "malloc" in found
    # An IFUNC's address is its resolver's, not the function's: never probed nor called.
    funcs = {name for name, _, kind in reference if kind == "STT_FUNC"}
    ifuncs = {name for name, _, kind in reference if kind in ("STT_GNU_IFUNC", "STT_LOOS")} - funcs  # type 10
    assert "strlen" in ifuncs and not ifuncs & set(found)


def test_local_functions_come_from_symtab_too():
    lib = next(iter(sorted(glob.glob("/root/.pyenv/versions/3.1[0-3]*/lib/libpython3.*.so.1.0"))), None)
    if lib is None:
        pytest.skip("no unstripped libpython (pyenv's)")
    local = functions(lib, local=True)
    assert "gc_collect_main" in local and "gc_collect_main" not in functions(lib, local=False)
    assert set(functions(lib, local=False)) <= set(local)


def test_a_file_that_is_not_elf_is_a_symbol_error(tmp_path):
    bad = tmp_path / "libnot.so"
    bad.write_bytes(b"not an ELF file" * 10)
    with pytest.raises(SymbolError):
        functions(str(bad), local=False)
