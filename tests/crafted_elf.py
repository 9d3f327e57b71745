"""ELF files a tenant could craft, made from a real one by rewriting one section header: a section that claims
more bytes than the file has, or compressed contents that inflate far beyond it."""
from __future__ import annotations

import shutil
import struct
import zlib
from pathlib import Path

from elftools.elf.elffile import ELFFile

HUGE = 24 << 36  # bytes a crafted section claims (1.6 TB, whole symbols of 24 bytes): none could be allocated
SHF_COMPRESSED = 0x800
SHF_ALLOC = 0x2
# Elf64_Shdr fields rewritten: offset in the header, struct format
FIELDS = {"sh_type": (4, "<I"), "sh_flags": (8, "<Q"), "sh_offset": (24, "<Q"), "sh_size": (32, "<Q")}


def crafted(source: str | Path, target: Path, section: str, **fields: int) -> Path:
    """A copy of `source` at `target` with the header of `section` rewritten as `fields` say."""
    shutil.copyfile(source, target)
    with open(source, "rb") as f:
        elf = ELFFile(f)
        index = next(i for i, s in enumerate(elf.iter_sections()) if s.name == section)
        header_at = elf.header["e_shoff"] + index * elf.header["e_shentsize"]
    with open(target, "r+b") as f:
        for name, value in fields.items():
            offset, fmt = FIELDS[name]
            f.seek(header_at + offset)
            f.write(struct.pack(fmt, value))
    return target


def inflating(source: str | Path, target: Path, section: str, inflated: int) -> Path:
    """A copy of `source` whose `section` is compressed (zlib): zeros that inflate to `inflated` bytes,
    appended to the file."""
    end = Path(source).stat().st_size
    z = zlib.compressobj(9)
    chunk = bytes(min(inflated, 16 << 20))
    body = b"".join(z.compress(chunk) for _ in range(inflated // len(chunk))) + z.flush()
    payload = struct.pack("<IIQQ", 1, 0, inflated, 1) + body  # Elf64_Chdr: ELFCOMPRESS_ZLIB, size, alignment
    crafted(source, target, section, sh_flags=SHF_COMPRESSED | SHF_ALLOC, sh_offset=end, sh_size=len(payload))
    with open(target, "ab") as f:
        f.write(payload)
    return target
