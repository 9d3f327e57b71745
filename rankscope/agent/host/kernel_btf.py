"""Offsets of the running kernel's own structures, from its BTF (/sys/kernel/btf/vmlinux).

The kernel headers bcc compiles against may belong to another kernel version than the one running, so a
field a BPF program reads out of a kernel structure is read at an offset taken from here, not from them.
"""
from __future__ import annotations

import struct
from functools import cache

VMLINUX = "/sys/kernel/btf/vmlinux"

# BTF kinds and the size of what follows each type's 12-byte header (vlen entries where noted).
_INT, _PTR, _ARRAY, _STRUCT, _UNION, _ENUM, _FWD, _TYPEDEF, _VOLATILE, _CONST, _RESTRICT = range(1, 12)
_FUNC, _FUNC_PROTO, _VAR, _DATASEC, _FLOAT, _DECL_TAG, _TYPE_TAG, _ENUM64 = range(12, 20)
_FIXED_EXTRA = {_INT: 4, _ARRAY: 12, _VAR: 4, _DECL_TAG: 4}
_PER_VLEN = {_STRUCT: 12, _UNION: 12, _ENUM: 8, _FUNC_PROTO: 8, _DATASEC: 12, _ENUM64: 12}
_MODIFIERS = {_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG}


class BTFError(OSError):
    """The kernel's BTF is missing, unreadable, or lacks the asked-for field."""


class _BTF:
    def __init__(self, data: bytes):
        magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data)
        if magic != 0xEB9F:
            raise BTFError("not BTF data")
        types = data[hdr_len + type_off : hdr_len + type_off + type_len]
        self.strings = data[hdr_len + str_off : hdr_len + str_off + str_len]
        self.types: list[tuple[int, str, int, int, list[tuple[str, int, int]]]] = [(0, "", 0, 0, [])]
        pos = 0
        while pos < len(types):
            name_off, info, size_or_type = struct.unpack_from("<III", types, pos)
            pos += 12
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            members: list[tuple[str, int, int]] = []
            if kind in (_STRUCT, _UNION):
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", types, pos + 12 * i)
                    bit = m_off & 0xFFFFFF if kflag else m_off
                    members.append((self._str(m_name), m_type, bit))
            pos += _FIXED_EXTRA.get(kind, 0) + _PER_VLEN.get(kind, 0) * vlen
            self.types.append((kind, self._str(name_off), size_or_type, kflag, members))

    def _str(self, off: int) -> str:
        end = self.strings.index(b"\x00", off)
        return self.strings[off:end].decode()

    def _resolve(self, type_id: int) -> int:
        while self.types[type_id][0] in _MODIFIERS:
            type_id = self.types[type_id][2]
        return type_id

    def bit_offset(self, struct_name: str, path: str) -> int:
        """Bit offset of `path` ("thread.fsbase") in `struct struct_name`."""
        tid = next((i for i, t in enumerate(self.types) if t[0] == _STRUCT and t[1] == struct_name), None)
        if tid is None:
            raise BTFError(f"no struct {struct_name} in the kernel's BTF")
        total = 0
        for name in path.split("."):
            _, sname, _, _, members = self.types[self._resolve(tid)]
            found = _find_member(self, members, name)
            if found is None:
                where = sname or "an anonymous struct"
                raise BTFError(f"no field {name} in {where} (looking for {struct_name}.{path})")
            bit, tid = found
            total += bit
        return total


def _find_member(btf: _BTF, members, name: str):
    """(bit offset, type id) of `name`, looking through anonymous structs and unions."""
    for m_name, m_type, bit in members:
        if m_name == name:
            return bit, m_type
        if not m_name:
            inner = btf.types[btf._resolve(m_type)]
            if inner[0] in (_STRUCT, _UNION):
                found = _find_member(btf, inner[4], name)
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


@cache
def kernel_bit_offset(struct_name: str, path: str) -> int:
    """Bit offset of a (possibly nested, possibly bit) field in one of the running kernel's structures."""
    return _vmlinux().bit_offset(struct_name, path)


def kernel_offset(struct_name: str, path: str) -> int:
    """Byte offset of a (possibly nested) field in one of the running kernel's structures."""
    bit = kernel_bit_offset(struct_name, path)
    if bit % 8:
        raise BTFError(f"{struct_name}.{path} is a bit field")
    return bit // 8
