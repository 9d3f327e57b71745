"""The few pieces of the protocol buffers wire format that writing a pprof profile needs (varints,
length-delimited fields, packed repeated integers), so that no protobuf package is needed."""
from __future__ import annotations

from collections.abc import Iterable

VARINT, LENGTH_DELIMITED = 0, 2


def varint(n: int) -> bytes:
    if n < 0:
        raise ValueError("only non-negative integers are written")
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def key(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def uint(field: int, n: int) -> bytes:
    """An integer field (int64, uint64): omitted when 0, proto3's default."""
    return key(field, VARINT) + varint(n) if n else b""


def message(field: int, body: bytes) -> bytes:
    """A length-delimited field: an embedded message, a string, bytes."""
    return key(field, LENGTH_DELIMITED) + varint(len(body)) + body


def packed(field: int, values: Iterable[int]) -> bytes:
    """A repeated integer field, packed (proto3's encoding of repeated scalars)."""
    return message(field, b"".join(varint(v) for v in values))
