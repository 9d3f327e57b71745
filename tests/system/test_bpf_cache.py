"""Compiled BPF programs kept on the node (loader/bpf_cache.py): a program loaded from the cache counts what the
compiled one counts, through every map kind rankscope uses, and an entry that is damaged, changed, unsealed,
sealed for another key or with another secret, refused by the kernel or writable by others is never loaded:
the program is compiled instead."""
from __future__ import annotations

import base64
import ctypes
import json
import os
import sys
from pathlib import Path

import pytest
from bcc import BPF

from rankscope.agent.host import procfs
from rankscope.agent.host.symbols import exported_functions, file_offset
from rankscope.agent.loader import bpf_cache, uprobe_links
from rankscope.agent.loader.bcc import compile_bpf
from rankscope.agent.loader.maps import entries

# One program with a map of each kind rankscope's programs use, fed by a uprobe on libc's getpid.
PROGRAM = """
BPF_HASH(calls, u32, u64, 64);
BPF_ARRAY(total, u64, 1);
BPF_PERCPU_ARRAY(per_cpu, u64, 1);
BPF_TABLE("lru_hash", u32, u64, last, 64);
struct event { u32 pid; u32 n; u64 ts; };
BPF_RINGBUF_OUTPUT(events, 8);

int on_getpid(struct pt_regs *ctx) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    u64 zero = 0, *n = calls.lookup_or_try_init(&pid, &zero);
    if (!n)
        return 0;
    u64 now = __sync_fetch_and_add(n, 1) + 1;
    int k = 0;
    u64 *t = total.lookup(&k);
    if (t)
        __sync_fetch_and_add(t, 1);
    u64 *c = per_cpu.lookup(&k);
    if (c)
        *c += 1;
    u64 ts = bpf_ktime_get_ns();
    last.update(&pid, &ts);
    struct event e = {.pid = pid, .n = now, .ts = ts};
    events.ringbuf_output(&e, sizeof(e), 0);
    return 0;
}
"""
CALLS = 50
# Calls getpid CALLS times for each line it reads, then answers.
CALLER = ("import os, sys\nprint('ready', flush=True)\nfor line in sys.stdin:\n"
          f"    for _ in range({CALLS}): os.getpid()\n    print('done', flush=True)\n")


class Event(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint32), ("n", ctypes.c_uint32), ("ts", ctypes.c_uint64)]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "bpf"
    monkeypatch.setenv(bpf_cache.ENV, str(root))
    return root


def _entry(root: Path, text: str = PROGRAM) -> Path:
    return root / f"{bpf_cache.key(text, [])}.json"


def _body(path: Path) -> dict:
    """An entry's JSON, its seal line set aside."""
    return json.loads(path.read_bytes().partition(b"\n")[2])


def _reseal(root: Path, doc: dict) -> None:
    """Writes `doc` as PROGRAM's entry, sealed with the cache's own secret: what the kernel then makes of it
    is what is tested."""
    _entry(root).write_bytes(bpf_cache.seal(bpf_cache.secret(root), bpf_cache.key(PROGRAM, []),
                                            json.dumps(doc).encode()))


def _assert_compiled_afresh(root: Path, text: str = PROGRAM) -> None:
    """The next compile of `text` does not load its entry, and leaves a sound entry in its place."""
    bpf = compile_bpf(text, [])
    try:
        assert not isinstance(bpf, bpf_cache.CachedBPF)
        assert bpf.load_func("on_getpid", BPF.KPROBE).fd >= 0
    finally:
        bpf.cleanup()
    hit = compile_bpf(text, [])
    try:
        assert isinstance(hit, bpf_cache.CachedBPF)
    finally:
        hit.cleanup()


def _count_calls(bpf, command_process) -> tuple[int, int, int, bool, list[int]]:
    """What the program counted of one caller's CALLS getpid calls: its hash entry, the array, the per-CPU
    array summed, whether the LRU hash holds it, and the ring buffer's call numbers."""
    caller = command_process(sys.executable, "-c", CALLER)
    libc = next(m.path for m in procfs.maps(caller.pid) if "/libc.so" in m.path)
    path = procfs.host_path(caller.pid, libc)
    offset = file_offset(path, exported_functions(path)["getpid"])
    seen: list[int] = []
    bpf["events"].open_ring_buffer(lambda _ctx, data, _size: seen.append(
        ctypes.cast(data, ctypes.POINTER(Event)).contents.n))
    probes = [uprobe_links.attach(bpf, "on_getpid", path, [offset], pid=caller.pid)]
    try:
        assert caller.call("go") == ["done"]
    finally:
        uprobe_links.detach(probes)
    bpf.ring_buffer_consume()
    calls = {k.value: v.value for k, v in entries(bpf["calls"])}
    total = bpf["total"][ctypes.c_int(0)].value
    per_cpu = sum(bpf["per_cpu"][ctypes.c_int(0)])
    last = any(k.value == caller.pid for k, _ in entries(bpf["last"]))
    return calls.get(caller.pid, 0), total, per_cpu, last, seen


def test_a_program_from_the_cache_counts_what_the_compiled_one_counts(cache, command_process):
    compiled = compile_bpf(PROGRAM, [])
    try:
        assert not isinstance(compiled, bpf_cache.CachedBPF)
        assert _entry(cache).is_file()
        want = (CALLS, CALLS, CALLS, True, list(range(1, CALLS + 1)))
        assert _count_calls(compiled, command_process) == want
    finally:
        compiled.cleanup()
    cached = compile_bpf(PROGRAM, [])
    try:
        assert isinstance(cached, bpf_cache.CachedBPF)
        assert _count_calls(cached, command_process) == want
        assert len(cached["total"]) == 1  # an array's length is its max_entries, which bcc asks the module for
    finally:
        cached.cleanup()


def test_the_key_names_the_program_and_its_flags():
    assert bpf_cache.key(PROGRAM, []) != bpf_cache.key(PROGRAM + " ", [])
    assert bpf_cache.key(PROGRAM, []) != bpf_cache.key(PROGRAM, ["-DX=1"])
    assert bpf_cache.key(PROGRAM, ["-DX=1"]) == bpf_cache.key(PROGRAM, ["-DX=1"])


def test_a_damaged_entry_is_compiled_again_and_replaced(cache):
    compile_bpf(PROGRAM, []).cleanup()
    _entry(cache).write_text('{"format": 1, "maps": [')
    _assert_compiled_afresh(cache)


def _changed_instruction(path: Path) -> bytes:
    """The entry's bytes with one instruction of its program changed (r0 = 1 before its exit: a program the
    verifier would still accept), its seal line, if any, kept as it was."""
    data = path.read_bytes()
    head, newline, body = data.partition(b"\n") if data.startswith(b"hmac-sha256:") else (b"", b"", data)
    doc = json.loads(body)
    insns = bytearray(base64.b64decode(doc["functions"][0]["insns"]))
    insns[-16:] = b"\xb7" + bytes(3) + (1).to_bytes(4, "little") + b"\x95" + bytes(7)  # mov r0, 1; exit
    doc["functions"][0]["insns"] = base64.b64encode(bytes(insns)).decode()
    return head + newline + json.dumps(doc).encode()


def test_a_changed_entry_is_compiled_afresh(cache):
    compile_bpf(PROGRAM, []).cleanup()
    _entry(cache).write_bytes(_changed_instruction(_entry(cache)))
    _assert_compiled_afresh(cache)


def test_an_unsealed_entry_is_compiled_afresh(cache):
    compile_bpf(PROGRAM, []).cleanup()
    _entry(cache).write_text(json.dumps(_body(_entry(cache))))
    _assert_compiled_afresh(cache)


def test_an_entry_sealed_for_another_key_is_not_used(cache):
    other = PROGRAM + "\n// another program, toolchain or kernel: another key\n"
    compile_bpf(other, []).cleanup()
    _entry(cache).write_bytes(_entry(cache, other).read_bytes())
    _assert_compiled_afresh(cache)


def test_an_entry_sealed_with_another_secret_is_not_used(cache, tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_text("a" * 64)
    monkeypatch.setenv(bpf_cache.KEY_ENV, str(secret))
    compile_bpf(PROGRAM, []).cleanup()
    secret.write_text("b" * 64)  # the Secret rotated
    _assert_compiled_afresh(cache)


def test_maps_the_kernel_refuses_are_compiled_instead(cache):
    compile_bpf(PROGRAM, []).cleanup()
    doc = _body(_entry(cache))
    doc["maps"][0]["type"] = 0  # BPF_MAP_TYPE_UNSPEC
    _reseal(cache, doc)
    bpf = compile_bpf(PROGRAM, [])
    try:
        assert not isinstance(bpf, bpf_cache.CachedBPF)
        assert bpf.load_func("on_getpid", BPF.KPROBE).fd >= 0
        assert _body(_entry(cache))["maps"][0]["type"] != 0  # the compile's entry replaced it
    finally:
        bpf.cleanup()


def test_a_program_the_kernel_refuses_is_reported_and_compiled_next_time(cache):
    compile_bpf(PROGRAM, []).cleanup()
    doc = _body(_entry(cache))
    # Opcode 0xff (no such instruction), then exit.
    doc["functions"][0]["insns"] = base64.b64encode(b"\xff" + bytes(7) + b"\x95" + bytes(7)).decode()
    doc["functions"][0]["map_refs"] = []
    _reseal(cache, doc)
    bpf = compile_bpf(PROGRAM, [])
    try:
        assert isinstance(bpf, bpf_cache.CachedBPF)
        with pytest.raises(Exception, match="Failed to load BPF program on_getpid"):
            bpf.load_func("on_getpid", BPF.KPROBE)
        assert not _entry(cache).exists()
    finally:
        bpf.cleanup()
    _assert_compiled_afresh(cache)


def test_a_cache_others_can_write_to_is_neither_read_nor_written(cache):
    compile_bpf(PROGRAM, []).cleanup()
    os.chmod(cache, 0o777)
    bpf = compile_bpf(PROGRAM, [])
    try:
        assert not isinstance(bpf, bpf_cache.CachedBPF)
    finally:
        bpf.cleanup()
    os.chmod(cache, 0o700)
    os.chmod(_entry(cache), 0o666)
    bpf = compile_bpf(PROGRAM, [])
    try:
        assert not isinstance(bpf, bpf_cache.CachedBPF)
    finally:
        bpf.cleanup()


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(bpf_cache.ENV, "off")
    monkeypatch.chdir(tmp_path)
    compile_bpf(PROGRAM, []).cleanup()
    assert bpf_cache.directory() is None
    assert list(tmp_path.iterdir()) == []


def test_the_least_recently_used_entries_beyond_the_limit_are_removed(cache, monkeypatch):
    monkeypatch.setattr(bpf_cache, "MAX_ENTRIES", 2)
    texts = [PROGRAM + f"\n// {i}\n" for i in range(3)]
    entries = [cache / f"{bpf_cache.key(text, [])}.json" for text in texts]
    for i in range(2):
        compile_bpf(texts[i], []).cleanup()
        os.utime(entries[i], (1000 + i, 1000 + i))  # written long ago, 0 before 1
    hit = compile_bpf(texts[0], [])  # used again: now the most recently used
    assert isinstance(hit, bpf_cache.CachedBPF)
    hit.cleanup()
    compile_bpf(texts[2], []).cleanup()  # a third entry: one too many
    assert [e.exists() for e in entries] == [True, False, True]
