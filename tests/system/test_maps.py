"""Reading whole BPF hash maps in batches (agent/loader/maps.py) gives what bcc's key-by-key walk gives."""
from __future__ import annotations

import ctypes

import pytest

from rankscope.agent.loader.bcc import compile_bpf
from rankscope.agent.loader.maps import BATCH, entries

PROGRAM = """
struct pair_key { u32 pid; u32 tid; };
struct pair_val { u64 a; u64 b; };
BPF_HASH(pairs, struct pair_key, struct pair_val, 8192);
BPF_HASH(plain, u32, u64, 64);
"""


@pytest.fixture(scope="module")
def bpf():
    b = compile_bpf(PROGRAM, [])
    yield b
    b.cleanup()


def test_a_struct_map_of_many_batches_reads_whole_and_as_copies(bpf):
    table = bpf["pairs"]
    n = 5 * BATCH + 17  # several calls, the last partial
    for i in range(n):
        k, v = table.Key(), table.Leaf()
        k.pid, k.tid, v.a, v.b = i % 7, i, i * 3, i * 5
        table[k] = v
    rows = entries(table)
    assert len(rows) == n
    got = {(k.pid, k.tid): (v.a, v.b) for k, v in rows}  # read after every batch: copies survive the next call
    assert got == {(k.pid, k.tid): (v.a, v.b) for k, v in table.items()}
    assert got[(3, 10)] == (30, 50)


def test_simple_keys_and_values_keep_their_ctypes_and_an_empty_map_reads_empty(bpf):
    table = bpf["plain"]
    assert entries(table) == []
    for i in range(40):
        table[ctypes.c_uint32(i)] = ctypes.c_uint64(i * i)
    rows = entries(table)
    assert {k.value: v.value for k, v in rows} == {i: i * i for i in range(40)}
