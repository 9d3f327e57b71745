"""Reading a whole BPF hash map in a few system calls.

bcc's `table.items()` walks a map one key at a time: get_next_key, then lookup, two system calls a key. Once
a window, over the maps of 64 busy ranks (each thread's scheduler counters, who took each rank's CPU, each
probed function), that was the largest share of a busy node agent's CPU (scripts/bench busy). A batch read
(BPF_MAP_LOOKUP_BATCH, Linux 5.6+) copies up to BATCH entries a call, and walks the table bucket by bucket,
where get_next_key starts over when the program deletes the key it stands on. bcc's own items_lookup_batch
passes one variable as both its batch cursor and its count, so it is not used.
"""
from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

BATCH = 256  # entries a call; a hash bucket holding more (never seen) doubles it


class MapReadError(Exception):
    """The kernel refused to list a map."""


def entries(table) -> list[tuple[Any, Any]]:
    """(key, value) of every entry of the bcc hash table `table` (copies, not views of the map). Entries
    the program adds or deletes during the read may or may not be in it, as with a key-by-key walk."""
    from bcc.libbcc import lib

    out: list[tuple[Any, Any]] = []
    size = BATCH
    cursor, next_cursor, count = ctypes.c_uint32(), ctypes.c_uint32(), ctypes.c_uint32()
    first = True
    while True:
        keys, values = (table.Key * size)(), (table.Leaf * size)()  # fresh: the rows returned keep them
        count.value = size
        res = lib.bpf_lookup_batch(table.map_fd, None if first else ctypes.byref(cursor), ctypes.byref(next_cursor),
                                   ctypes.byref(keys), ctypes.byref(values), ctypes.byref(count))
        err = ctypes.get_errno() if res != 0 else 0
        out.extend(zip(_rows(keys, count.value, table.Key), _rows(values, count.value, table.Leaf)))
        if err == errno.ENOSPC and count.value == 0:  # one bucket holds more than `size` entries
            size *= 2
            continue
        if err == errno.ENOENT:  # the end
            return out
        if err in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP) and first and not out:  # before 5.6
            return list(table.items())
        if err:
            raise MapReadError(f"cannot read the BPF map {table.name!r}: {os.strerror(err)}")
        cursor.value, first = next_cursor.value, False


def _rows(array, n: int, ctype) -> list:
    """The first n of a ctypes array as bcc's items() gives them: a simple type's elements come out of an
    array as Python ints, so they are wrapped again (callers read `.value`)."""
    if issubclass(ctype, ctypes._SimpleCData):
        return [ctype(x) for x in array[:n]]
    return array[:n]
