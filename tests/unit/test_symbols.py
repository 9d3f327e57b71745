"""Functions of a library's ELF symbol tables, read a whole table at a time, as pyelftools reads them one by one."""
from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
from crafted_elf import HUGE, crafted, inflating
from elftools.elf.elffile import ELFFile

from rankscope.agent.host import procfs
from rankscope.agent.host.symbols import SymbolError, functions

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
SHT_NOBITS = 8


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


@pytest.mark.parametrize("section", [".dynsym", ".dynstr"])
def test_a_section_claiming_more_than_the_file_is_a_symbol_error(tmp_path, section):
    """A terabyte claimed by a tenant's library is refused before anything is allocated for it."""
    lib = crafted(LIBC, tmp_path / "libcuda.so.1", section, sh_size=HUGE)
    with pytest.raises(SymbolError, match="reaches past the end of the file"):
        functions(str(lib), local=False)


def test_a_huge_nobits_string_table_reads_as_no_names(tmp_path):
    """A string table said to take no room in the file (NOBITS) however large: nothing is read for it."""
    lib = crafted(LIBC, tmp_path / "libcuda.so.1", ".dynstr", sh_type=SHT_NOBITS, sh_size=HUGE)
    try:
        assert set(functions(str(lib), local=False)) <= {""}
    except SymbolError:
        pass  # refused outright: as good


def test_a_compressed_symbol_table_is_not_inflated(tmp_path):
    lib = inflating(LIBC, tmp_path / "libcuda.so.1", ".dynstr", 64 << 20)
    with pytest.raises(SymbolError, match="compressed"):
        functions(str(lib), local=False)


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_a_truncated_library_is_a_symbol_error(tmp_path, keep):
    data = Path(LIBC).read_bytes()
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(SymbolError):
        functions(str(lib), local=False)


def test_only_regular_files_are_opened(tmp_path):
    """A FIFO or a device at a library's name is refused at once, never opened (a FIFO's open would wait for
    a writer); through /proc/PID/root, a symlink, even one inside that root, is not followed."""
    os.mkfifo(tmp_path / "libfifo.so")
    for path in (tmp_path / "libfifo.so", Path("/dev/null"), tmp_path):
        with pytest.raises(OSError):
            os.close(procfs.open_regular(str(path)))
    with pytest.raises(SymbolError):
        functions(str(tmp_path / "libfifo.so"), local=False)
    (tmp_path / "libc.so.6").symlink_to(LIBC)
    root = f"/proc/{os.getpid()}/root"
    with pytest.raises(OSError):
        os.close(procfs.open_regular(f"{root}{tmp_path}/libc.so.6"))
    os.close(procfs.open_regular(f"{root}{os.path.realpath(LIBC)}"))  # the file itself, by its own name
