"""Offsets of a kernel structure's fields from BTF: nested, through typedefs and anonymous unions, bit fields;
on a small BTF blob built here (the running kernel's is checked by the net and sampler system tests)."""
from __future__ import annotations

import struct

import pytest

from rankscope.agent.host.kernel_btf import BTFError, _BTF

INT, STRUCT, UNION, TYPEDEF = 1, 4, 5, 8


def _blob() -> bytes:
    names = b"\0int\0inner\0a\0b\0x\0inner_t\0outer\0pad\0named\0"
    at = {n.decode(): names.index(b"\0" + n + b"\0") + 1 for n in names.strip(b"\0").split(b"\0")}

    def header(name: str, kind: int, vlen: int, size_or_type: int, kflag: int = 0) -> bytes:
        return struct.pack("<III", at[name] if name else 0, kflag << 31 | kind << 24 | vlen, size_or_type)

    def member(name: str, type_id: int, offset: int) -> bytes:
        return struct.pack("<III", at[name] if name else 0, type_id, offset)

    types = b"".join([
        header("int", INT, 0, 4) + struct.pack("<I", 32),                                          # 1
        header("inner", STRUCT, 2, 8) + member("a", 1, 0) + member("b", 1, 32),                     # 2
        header("", UNION, 1, 8) + member("x", 2, 0),                                                # 3
        header("inner_t", TYPEDEF, 0, 2),                                                           # 4
        header("outer", STRUCT, 3, 24, kflag=1)                                                     # 5
        + member("pad", 1, 3 << 24 | 0) + member("", 3, 64) + member("named", 4, 128),
    ])
    return struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(names)) + types + names


def test_fields_nested_through_anonymous_unions_and_typedefs():
    btf = _BTF(_blob())
    assert btf.bit_offset("outer", "pad") == 0
    assert btf.bit_offset("outer", "x.b") == 64 + 32  # x lives in an anonymous union at bit 64
    assert btf.bit_offset("outer", "named.b") == 128 + 32  # named is a typedef of struct inner
    assert btf.bit_offset("inner", "a") == 0


def test_a_missing_struct_or_field_names_itself():
    btf = _BTF(_blob())
    with pytest.raises(BTFError, match="no struct nosuch"):
        btf.bit_offset("nosuch", "a")
    with pytest.raises(BTFError, match=r"no field c in inner \(looking for outer.named.c\)"):
        btf.bit_offset("outer", "named.c")
    with pytest.raises(BTFError, match="not BTF data"):
        _BTF(b"\0" * 32)
