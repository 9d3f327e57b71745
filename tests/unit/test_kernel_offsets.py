"""Kernel structure offsets are kept in the node's cache under the kernel's build id: a later process on the
same kernel reads them without parsing the kernel's BTF, and another kernel build finds none of them."""
import struct

import pytest

from rankscope.agent.host import kernel_btf, node_cache


def _padded(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 4)


def _note(name: bytes, kind: int, desc: bytes) -> bytes:
    """One ELF note as the kernel's notes file holds them: sizes, type, name and description, 4-aligned."""
    return struct.pack("<III", len(name), len(desc), kind) + _padded(name) + _padded(desc)


class _CountingBTF:
    def __init__(self, offsets: dict[tuple[str, str], int]):
        self.offsets, self.asked = offsets, []

    def bit_offset(self, struct_name: str, path: str) -> int:
        self.asked.append((struct_name, path))
        return self.offsets[struct_name, path]


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernel whose notes carry build id 0xab12 after another note, and an empty node cache."""
    notes = tmp_path / "notes"
    notes.write_bytes(_note(b"Linux\0", 6, b"\x01\x01\0\0") + _note(b"GNU\0", 3, b"\xab\x12"))
    monkeypatch.setattr(kernel_btf, "NOTES", str(notes))
    monkeypatch.setenv(node_cache.ENV, str(tmp_path / "cache"))
    btf = _CountingBTF({("task_struct", "thread.fsbase"): 3128 * 8, ("tcp_sock", "chrono_type"): 12448})
    monkeypatch.setattr(kernel_btf, "_vmlinux", lambda: btf)
    kernel_btf._kept_offsets.cache_clear()
    yield notes, btf
    kernel_btf._kept_offsets.cache_clear()


def test_the_build_id_is_the_gnu_note_of_the_kernel(kernel):
    assert kernel_btf.build_id() == "ab12"


def test_a_later_process_reads_the_offsets_without_the_btf(kernel):
    _, btf = kernel
    assert kernel_btf.kernel_offset("task_struct", "thread.fsbase") == 3128
    assert kernel_btf.kernel_bit_offset("tcp_sock", "chrono_type") == 12448
    assert len(btf.asked) == 2
    kernel_btf._kept_offsets.cache_clear()  # a new process on the same kernel
    assert kernel_btf.kernel_offset("task_struct", "thread.fsbase") == 3128
    assert kernel_btf.kernel_bit_offset("tcp_sock", "chrono_type") == 12448
    assert len(btf.asked) == 2


def test_another_kernel_build_reads_its_own_btf(kernel):
    notes, btf = kernel
    kernel_btf.kernel_offset("task_struct", "thread.fsbase")
    notes.write_bytes(_note(b"GNU\0", 3, b"\xcd\x34"))
    kernel_btf._kept_offsets.cache_clear()
    kernel_btf.kernel_offset("task_struct", "thread.fsbase")
    assert btf.asked == [("task_struct", "thread.fsbase")] * 2


def test_without_a_cache_every_process_reads_the_btf(kernel, monkeypatch):
    _, btf = kernel
    monkeypatch.setenv(node_cache.ENV, "off")
    kernel_btf.kernel_offset("task_struct", "thread.fsbase")
    kernel_btf._kept_offsets.cache_clear()
    kernel_btf.kernel_offset("task_struct", "thread.fsbase")
    assert len(btf.asked) == 2
