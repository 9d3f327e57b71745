"""The pure parts of loading a library into a running process (agent/inject/): the register layout ptrace
hands over, when an interrupted thread may be borrowed, a C int out of rax, the job's CUDA line, which
processes --inject-allow admits."""
from __future__ import annotations

import ctypes
import os

import pytest

from rankscope.agent.cli import UsageError, build_parser, make_session
from rankscope.agent.detail import DEEP
from rankscope.agent.host import procfs
from rankscope.agent.inject.inject import ctypes_int
from rankscope.agent.inject.loader import LOCKING, LoaderCalls
from rankscope.agent.inject.remote_call import in_blocking_syscall
from rankscope.agent.inject.shim import CUDA_MAJOR_OF, allowed
from rankscope.agent.inject.tracee import Regs


def regs(**values: int) -> Regs:
    r = Regs()
    for name, value in values.items():
        setattr(r, name, value & (1 << 64) - 1)
    return r


def test_regs_match_the_kernels_user_regs_struct():
    assert ctypes.sizeof(Regs) == 27 * 8  # x86_64 struct user_regs_struct
    assert Regs.orig_rax.offset == 15 * 8 and Regs.rip.offset == 16 * 8 and Regs.rsp.offset == 19 * 8


@pytest.mark.parametrize("orig_rax,rax,blocked", [
    (202, -512, True),  # futex, -ERESTARTSYS: interrupted while waiting
    (230, -516, True),  # clock_nanosleep, -ERESTART_RESTARTBLOCK
    (0, -514, True),  # read, -ERESTARTNOHAND
    (0, 5, False),  # read returned 5: stopped on the way out, in libc's wrapper
    (0, -4, False),  # -EINTR: the call is over
    (-1, -512, False),  # not in a system call at all
])
def test_a_thread_blocked_in_a_restarting_system_call_is_borrowable(orig_rax, rax, blocked):
    assert in_blocking_syscall(regs(orig_rax=orig_rax, rax=rax)) is blocked


def test_c_int_from_rax():
    assert ctypes_int(42) == 42
    assert ctypes_int(0xFFFFFFFF) == -1
    assert ctypes_int(0xDEADBEEF_0000000B) == 11  # the upper half of rax is not part of an int


def test_code_that_may_hold_the_loaders_locks():
    calls = LoaderCalls(dlopen=0x1000, dlerror=None, syscall=0x1100, locking_ranges=((0x7000, 0x8000), (0x9000, 0xA000)))
    assert calls.may_hold_locks(0x7000) and calls.may_hold_locks(0x9FFF)
    assert not calls.may_hold_locks(0x8000) and not calls.may_hold_locks(0x6FFF)


@pytest.mark.parametrize("name,locking", [("libc.so.6", True), ("ld-linux-x86-64.so.2", True),
                                          ("libtcmalloc_minimal.so.4", True), ("libjemalloc.so.2", True),
                                          ("libpython3.11.so.1.0", False), ("libcuda.so.1", False)])
def test_libraries_whose_code_may_hold_the_loaders_locks(name, locking):
    assert any(p.match(name) for p in LOCKING) is locking


@pytest.mark.parametrize("name,major", [("libcudart.so.12", "12"), ("libcupti.so.13", "13"),
                                        ("libcudart.so.12.8.90", "12"), ("libcuda.so.1", None),
                                        ("libcudart_static.a", None)])
def test_the_jobs_cuda_line_from_its_libraries(name, major):
    m = CUDA_MAJOR_OF.match(name)
    assert (m.group(1) if m else None) == major


def test_inject_allow_matches_a_cgroup_path_or_nothing():
    own = procfs.cgroup(os.getpid()).splitlines()[0].split(":", 2)[2]
    assert allowed(os.getpid(), ()) and allowed(os.getpid(), (own,)) and allowed(os.getpid(), ("*",))
    assert not allowed(os.getpid(), ("/no/such/cgroup/*",))


def test_inject_allow_without_inject_shim_is_a_usage_error():
    args = build_parser().parse_args(["diagnose", "--pid", "1", "--inject-allow", "*"])
    with pytest.raises(UsageError, match="give --inject-shim too"):
        make_session(args, DEEP)
