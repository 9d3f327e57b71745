"""A minimal reader of pprof's gzipped profile.proto, written from the .proto independently of the writer
(rankscope/agent/views/pprof.py): the messages and fields the tests check, as plain dicts."""
from __future__ import annotations

import gzip


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) in order: an int for varints, bytes for length-delimited fields."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i : i + size], i + size
        else:
            raise ValueError(f"wire type {wire} not expected")
        out.append((num, value))
    return out


def _packed(value: int | bytes) -> list[int]:
    if isinstance(value, int):  # a repeated field written unpacked
        return [value]
    out, i = [], 0
    while i < len(value):
        n, i = _varint(value, i)
        out.append(n)
    return out


def _message(raw: bytes, repeated: tuple[int, ...] = ()) -> dict[int, object]:
    msg: dict[int, object] = {}
    for num, value in fields(raw):
        if num in repeated:
            msg.setdefault(num, []).extend(_packed(value))
        else:
            msg[num] = value
    return msg


def decode(data: bytes) -> dict:
    """{"strings", "sample_types": [(type, unit)], "default": type, "period_type", "period",
    "functions": {id: (name, file, start_line)}, "locations": {id: [function ids]},
    "samples": [{"stack": [names, root first], "values": [...], "labels": {key: num}}]}"""
    top = fields(gzip.decompress(data))
    strings = [v.decode() for n, v in top if n == 6]
    functions, locations, samples, sample_types = {}, {}, [], []
    scalars: dict[int, object] = {}
    for num, value in top:
        if num == 1:
            m = _message(value)
            sample_types.append((strings[m.get(1, 0)], strings[m.get(2, 0)]))
        elif num == 5:
            m = _message(value)
            functions[m[1]] = (strings[m.get(2, 0)], strings[m.get(4, 0)], m.get(5, 0))
        elif num == 4:
            m = _message(value)
            lines = [v for n, v in fields(value) if n == 4]
            locations[m[1]] = [_message(line).get(1, 0) for line in lines]
        elif num == 2:
            samples.append(value)
        elif num != 6:
            scalars[num] = value
    decoded = []
    for raw in samples:
        m = _message(raw, repeated=(1, 2))
        labels = {strings[_message(v).get(1, 0)]: _message(v).get(3, 0) for n, v in fields(raw) if n == 3}
        names = [functions[fid][0] for loc in m.get(1, []) for fid in locations[loc]]
        decoded.append({"stack": names[::-1], "values": m.get(2, []), "labels": labels})
    period_type = _message(scalars[11]) if 11 in scalars else {}
    return {"strings": strings, "sample_types": sample_types, "default": strings[scalars.get(14, 0)],
            "period_type": (strings[period_type.get(1, 0)], strings[period_type.get(2, 0)]),
            "period": scalars.get(12, 0), "functions": functions, "locations": locations, "samples": decoded}
