"""Offsets of the running kernel's own structures, from its BTF (/sys/kernel/btf/vmlinux).

The kernel headers bcc compiles against may belong to another kernel version than the one running, so a
field a BPF program reads out of a kernel structure is read at an offset taken from here, not from them.
Reading the BTF costs ~0.5 s of CPU (~130k types), so the offsets found are kept in the node's cache
(host/node_cache.py) under the kernel's build id: a later process on the same kernel reads a small file.
"""
from __future__ import annotations

import json
import platform
import struct
from array import array
from functools import cache

from rankscope.agent.host import node_cache

VMLINUX = "/sys/kernel/btf/vmlinux"
NOTES = "/sys/kernel/notes"  # the kernel's ELF notes: its GNU build id among them
NT_GNU_BUILD_ID = 3

# BTF kinds and the size of what follows each type's 12-byte header (vlen entries where noted).
_INT, _PTR, _ARRAY, _STRUCT, _UNION, _ENUM, _FWD, _TYPEDEF, _VOLATILE, _CONST, _RESTRICT = range(1, 12)
_FUNC, _FUNC_PROTO, _VAR, _DATASEC, _FLOAT, _DECL_TAG, _TYPE_TAG, _ENUM64 = range(12, 20)
_FIXED_EXTRA = {_INT: 4, _ARRAY: 12, _VAR: 4, _DECL_TAG: 4}
_PER_VLEN = {_STRUCT: 12, _UNION: 12, _ENUM: 8, _FUNC_PROTO: 8, _DATASEC: 12, _ENUM64: 12}
_MODIFIERS = {_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG}


class BTFError(OSError):
    """The kernel's BTF is missing, unreadable, or lacks the asked-for field."""


class _BTF:
    """The kernel's types, read where they are asked for. Only each type's place in the data is indexed
    (~0.5 MB for ~130k types): parsing every type into Python objects held ~40 MB in the agent for good."""

    def __init__(self, data: bytes):
        magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data)
        if magic != 0xEB9F:
            raise BTFError("not BTF data")
        self.data = data[hdr_len + type_off : hdr_len + type_off + type_len]
        self.strings = data[hdr_len + str_off : hdr_len + str_off + str_len]
        self.at = array("I", [0])  # type id -> its header's offset in self.data (id 0, void, has none)
        self.structs: dict[int, int] = {}  # name offset -> type id, of named structs (the first of a name)
        pos = 0
        while pos < len(self.data):
            name_off, info = struct.unpack_from("<II", self.data, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if kind == _STRUCT and name_off:
                self.structs.setdefault(name_off, len(self.at))
            self.at.append(pos)
            pos += 12 + _FIXED_EXTRA.get(kind, 0) + _PER_VLEN.get(kind, 0) * vlen

    def _header(self, type_id: int) -> tuple[int, int, int, int, int]:
        """(kind, name offset, size or referenced type, kflag, vlen) of a type."""
        name_off, info, size_or_type = struct.unpack_from("<III", self.data, self.at[type_id])
        return (info >> 24) & 0x1F, name_off, size_or_type, info >> 31, info & 0xFFFF

    def _str(self, off: int) -> str:
        end = self.strings.index(b"\x00", off)
        return self.strings[off:end].decode()

    def members(self, type_id: int) -> list[tuple[str, int, int]]:
        """(name, type id, bit offset) of each member of a struct or union."""
        kind, _, _, kflag, vlen = self._header(type_id)
        if kind not in (_STRUCT, _UNION):
            return []
        out = []
        for i in range(vlen):
            m_name, m_type, m_off = struct.unpack_from("<III", self.data, self.at[type_id] + 12 + 12 * i)
            out.append((self._str(m_name), m_type, m_off & 0xFFFFFF if kflag else m_off))
        return out

    def resolve(self, type_id: int) -> int:
        """The type behind typedefs and qualifiers."""
        while type_id:
            kind, _, referenced, _, _ = self._header(type_id)
            if kind not in _MODIFIERS:
                break
            type_id = referenced
        return type_id

    def struct_id(self, name: str) -> int | None:
        want = name.encode() + b"\x00"
        found = [tid for off, tid in self.structs.items() if self.strings[off : off + len(want)] == want]
        return min(found, default=None)

    def bit_offset(self, struct_name: str, path: str) -> int:
        """Bit offset of `path` ("thread.fsbase") in `struct struct_name`."""
        tid = self.struct_id(struct_name)
        if tid is None:
            raise BTFError(f"no struct {struct_name} in the kernel's BTF")
        total = 0
        for name in path.split("."):
            tid = self.resolve(tid)
            found = _find_member(self, tid, name)
            if found is None:
                where = self._str(self._header(tid)[1]) or "an anonymous struct"
                raise BTFError(f"no field {name} in {where} (looking for {struct_name}.{path})")
            bit, tid = found
            total += bit
        return total


def _find_member(btf: _BTF, type_id: int, name: str):
    """(bit offset, type id) of `name` in a struct or union, looking through anonymous structs and unions."""
    for m_name, m_type, bit in btf.members(type_id):
        if m_name == name:
            return bit, m_type
        if not m_name:
            found = _find_member(btf, btf.resolve(m_type), name)
            if found is not None:
                return bit + found[0], found[1]
    return None


@cache
def _vmlinux() -> _BTF:
    try:
        with open(VMLINUX, "rb") as f:
            return _BTF(f.read())
    except OSError as e:
        raise BTFError(f"cannot read the kernel's BTF ({VMLINUX}): {e.strerror or e}") from e
    except (struct.error, ValueError, IndexError) as e:
        raise BTFError(f"cannot parse the kernel's BTF ({VMLINUX}): {e}") from e


def kernel_bit_offset(struct_name: str, path: str) -> int:
    """Bit offset of a (possibly nested, possibly bit) field in one of the running kernel's structures."""
    kept = _kept_offsets()
    name = f"{struct_name}.{path}"
    if name not in kept:
        kept[name] = _vmlinux().bit_offset(struct_name, path)
        node_cache.write(_entry_name(), json.dumps(kept).encode())
    return kept[name]


def build_id() -> str:
    """The running kernel's GNU build id (hex), else its release and version: what decides its layouts."""
    try:
        with open(NOTES, "rb") as f:
            notes = f.read()
        pos = 0
        while pos + 12 <= len(notes):
            namesz, descsz, kind = struct.unpack_from("<III", notes, pos)
            name_end = pos + 12 + (namesz + 3 & ~3)
            if kind == NT_GNU_BUILD_ID and notes[pos + 12 : pos + 12 + namesz] == b"GNU\x00":
                return notes[name_end : name_end + descsz].hex()
            pos = name_end + (descsz + 3 & ~3)
    except OSError:
        pass
    uname = platform.uname()
    return f"{uname.release} {uname.version}"


def _entry_name() -> str:
    import hashlib

    return f"kernel-offsets-{hashlib.sha256(build_id().encode()).hexdigest()[:40]}.json"


@cache
def _kept_offsets() -> dict[str, int]:
    """"struct.path" -> bit offset, as kept for this kernel in the node's cache (empty: none kept yet). The
    process's own lookups are added to this dict."""
    found = node_cache.read(_entry_name())
    if found is None:
        return {}
    try:
        kept = json.loads(found[1])
    except ValueError:
        return {}
    if not isinstance(kept, dict):
        return {}
    return {k: v for k, v in kept.items() if isinstance(k, str) and isinstance(v, int)}


def kernel_offset(struct_name: str, path: str) -> int:
    """Byte offset of a (possibly nested) field in one of the running kernel's structures."""
    bit = kernel_bit_offset(struct_name, path)
    if bit % 8:
        raise BTFError(f"{struct_name}.{path} is a bit field")
    return bit // 8
