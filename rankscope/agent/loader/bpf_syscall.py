"""The bpf(2) system call, for what libbcc's Python does not offer: uprobe_multi links, running a program on
demand, and loading a program compiled by an earlier process (loader/bpf_cache.py)."""
from __future__ import annotations

import ctypes
import os
from functools import cache

SYS_BPF = 321  # x86-64
# Commands (include/uapi/linux/bpf.h, enum bpf_cmd).
BPF_MAP_CREATE = 0
BPF_PROG_LOAD = 5
BPF_PROG_TEST_RUN = 10
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_LINK_CREATE = 28


def bpf(cmd: int, attr: ctypes.Array | ctypes.Structure) -> int:
    """bpf(cmd, &attr, sizeof attr): what the kernel returns (a new fd, or 0); OSError with its errno."""
    res = _syscall()(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


@cache
def _syscall():
    """libc's syscall(2), typed for bpf(2): long arguments (variadic: ints would leave the high halves unset)."""
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_ulong]
    return fn
