"""Loading a shared library into a running process that did not ask for it, then calling one function of it:
one thread of the process is interrupted with ptrace, made to call the loader's dlopen and then the function,
and put back exactly as it was; the other threads never stop.

Safety before anything else (the process is someone's training job, and may be a hostile tenant's):
- the process is pinned by a pidfd before anything of it is read: a process that is not the one watched (its
  PID reused since) is refused, and one that exits meanwhile is never confused with a newcomer on its PID;
- refused unless root, on anything but x86_64, for a process another tracer (a debugger) holds, for one that
  is stopped or exiting, and for a library already mapped (a second injection is a no-op);
- the library reaches the process as a sealed memfd of its own (placement.py): no path in its mount namespace
  is written or trusted;
- the thread is taken only at a point where it holds none of the locks that dlopen needs (blocked in a
  system call, or running code outside libc, ld.so and a preloaded malloc); elsewhere it is let go at once
  and tried again a little later;
- every failure (dlopen refusing the file, the function faulting, the process exiting, the deadline) puts
  the registers, vector state and the bytes written back before the thread is released.
The thread is held for the time of dlopen and the call: `Injection.stop_s` measures it.
"""
from __future__ import annotations

import errno
import os
import platform
import signal
import time
from dataclasses import dataclass

from rankscope.agent.host import procfs
from rankscope.agent.host.symbols import SymbolError, exported_functions
from rankscope.agent.host.targets import stat_fields, thread_group
from rankscope.agent.inject import placement
from rankscope.agent.inject.loader import LoaderCalls, LoaderError, loader_calls
from rankscope.agent.inject.placement import PlacementError
from rankscope.agent.inject.remote_call import CallError, RemoteCaller, in_blocking_syscall
from rankscope.agent.inject.tracee import Gone, TraceError, Tracee

RTLD_NOW = 2
DEFAULT_TIMEOUT_S = 2.0  # to find a safe point and to run dlopen and the call
RETRY_S = 0.002  # between two tries at a safe point (each costs the thread a few microseconds)
MAIN_THREAD_S = 0.1  # tries on the main thread alone before the others are tried too
STACK_ROOM = 64 << 10  # bytes of stack below the thread's rsp that dlopen may need
MAX_ERROR = 512  # bytes read of dlerror's message


class InjectError(Exception):
    """Why nothing was loaded (the process is as it was and running), one line a user can act on."""


@dataclass(frozen=True)
class Injection:
    pid: int
    library: str  # as the process's maps show it: "/memfd:NAME", a copy in its own memory (or the mapped file)
    loaded: bool  # False: the library was already mapped, nothing was done
    stop_s: float = 0.0  # how long the thread was held for the load and the call
    tries: int = 0  # interrupts until the thread was at a safe point
    result: int = 0  # the called function's return value (int)


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict((k, v.strip()) for k, v in (line.split(":", 1) for line in f if ":" in line))
    except FileNotFoundError:
        raise InjectError(f"no such process: {pid}") from None


def _refuse(pid: int) -> None:
    """Raises InjectError when the process must not be touched."""
    if platform.machine() != "x86_64":
        raise InjectError(f"loading a library into a running process is implemented for x86_64 only, "
                          f"not {platform.machine()}")
    if os.geteuid() != 0:
        raise InjectError("loading a library into a running process needs root (ptrace)")
    status = _status(pid)
    if status.get("TracerPid", "0") != "0":
        raise InjectError(f"process {pid} is already traced by pid {status['TracerPid']} (a debugger?): not touched")
    state = status.get("State", "?")[:1]
    if state in "TtZX":
        raise InjectError(f"process {pid} is stopped or exiting (state {status.get('State')}): not touched")


def pin(pid: int, start_time: int | None) -> int:
    """A pidfd of `pid`; InjectError when there is no such process or, given the `start_time` it was watched
    with, it is another process on a reused PID."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise InjectError(f"no such process: {pid}") from None
    try:
        started = int(stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        os.close(pidfd)
        raise InjectError(f"no such process: {pid}") from None
    if start_time is not None and started != start_time:
        os.close(pidfd)
        raise InjectError(f"process {pid} is not the one watched (it exited and its PID was reused): not touched")
    return pidfd


def alive(pid: int, pidfd: int) -> bool:
    """Whether the process `pidfd` pins is still running (not a zombie): its PID then still names it."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
        return stat_fields(pid)[0] not in "ZX"
    except (ProcessLookupError, FileNotFoundError):
        return False


def is_mapped(pid: int, name: str) -> bool:
    """Whether `pid` maps a file called `name` (any folder, or a memfd of that name)."""
    try:
        return any(m.name == name for m in procfs.maps(pid))
    except OSError as e:
        raise InjectError(f"cannot read /proc/{pid}/maps: {e.strerror}") from e


def _threads(pid: int) -> list[int]:
    """The main thread first (it is the one a Python job computes in), then the others; none that exited, none
    in uninterruptible sleep (in a driver, or on I/O: it would stop only on its way out of the kernel)."""
    tids = sorted(tid for tid, status in procfs.task_status(pid).items() if status.get("State", "D")[0] not in "DZX")
    return sorted(tids, key=lambda tid: tid != pid)


def _stack_room(pid: int, rsp: int) -> int:
    """Bytes of the thread's stack mapping below `rsp`; unbounded for the main stack, which grows on demand."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= rsp < hi:
                return 1 << 62 if rest[-1] == "[stack]" else rsp - lo
    return 0


def _safe(pid: int, caller: RemoteCaller, calls: LoaderCalls) -> bool:
    regs = caller.saved
    if _stack_room(pid, regs.rsp) < STACK_ROOM:
        return False
    waiting = in_blocking_syscall(regs) or caller.resume is not regs  # blocked: restarted when put back
    return waiting or not calls.may_hold_locks(regs.rip)


def inject(pid: int, library: str, function: str, timeout_s: float = DEFAULT_TIMEOUT_S,
           start_time: int | None = None) -> Injection:
    """Loads `library` into `pid` (RTLD_NOW) and calls its exported `function()` once; InjectError says why
    not. A library of that name already mapped is left alone (Injection.loaded False). `start_time` (clock
    ticks since boot, /proc/PID/stat): the process watched, refused if its PID now names another one."""
    pidfd = pin(pid, start_time)
    try:
        return _inject(pid, pidfd, library, function, timeout_s)
    finally:
        os.close(pidfd)


def _inject(pid: int, pidfd: int, library: str, function: str, timeout_s: float) -> Injection:
    _refuse(pid)
    name = os.path.basename(library)
    if is_mapped(pid, name):
        return Injection(pid, library, loaded=False)
    try:
        data = placement.read_library(library)  # first: says when the library does not exist
        offset = exported_functions(library).get(function)
        calls = loader_calls(pid)
    except (SymbolError, PlacementError, LoaderError) as e:
        raise InjectError(str(e)) from e
    if offset is None:
        raise InjectError(f"{library} exports no function {function}")
    start = time.monotonic()
    deadline = start + timeout_s
    tries = 0
    while True:
        # The main thread alone at first: the others (a server's epoll loop, NCCL's proxy) are left alone
        # unless it stays busy in libc.
        threads = _threads(pid)
        if not alive(pid, pidfd):
            raise InjectError(f"process {pid} exited during the injection")
        for tid in threads if time.monotonic() - start > MAIN_THREAD_S else threads[:1]:
            tries += 1
            try:
                done = _try_thread(Load(pid, pidfd, name, data, offset, calls), tid, deadline)
            except Gone:
                if not alive(pid, pidfd):
                    raise InjectError(f"process {pid} exited during the injection") from None
                continue  # that thread exited: another one
            except OSError as e:  # a ptrace request refused, /proc unreadable
                if not alive(pid, pidfd):
                    raise InjectError(f"process {pid} exited during the injection") from None
                raise InjectError(f"process {pid}: {e.strerror or e}") from None
            if done is not None:
                stop_s, result = done
                return Injection(pid, f"{procfs.MEMFD}{name}", loaded=True, stop_s=stop_s, tries=tries, result=result)
        if time.monotonic() > deadline:
            raise InjectError(f"process {pid}: no thread reached a point where the loader could be called "
                              f"within {timeout_s:g} s ({tries} tries); nothing was changed")
        time.sleep(RETRY_S)


@dataclass(frozen=True)
class Load:
    """What one try loads, and into which process."""

    pid: int
    pidfd: int  # the process pinned: a thread seized is checked to be one of it
    name: str  # the library's file name, the memfd's name
    data: bytes  # its content
    offset: int  # of the function to call, from the library's load address
    calls: LoaderCalls


def _try_thread(load: Load, tid: int, deadline: float) -> tuple[float, int] | None:
    """(seconds the thread was held, from the interrupt to the release; the function's result) once done;
    None when the thread was not at a safe point (let go untouched). InjectError when the load failed, the
    thread put back first."""
    pid = load.pid
    if not _ours(load, tid):
        raise Gone(errno.ESRCH, f"thread {tid} is not one of process {pid}")
    try:
        tracee = Tracee(pid, tid)
    except TraceError as e:
        if e.errno == errno.EPERM:
            raise InjectError(f"not permitted to ptrace process {pid} (another tracer, or a security module)") from None
        raise
    held = time.perf_counter()
    caller: RemoteCaller | None = None
    try:
        if not tracee.interrupt(deadline):
            return None  # a signal came first: delivered, and the thread let go
        if not _ours(load, tid):  # stopped a newcomer's thread on a reused id: let go untouched
            raise Gone(errno.ESRCH, f"thread {tid} is not one of process {pid}")
        caller = RemoteCaller(tracee)
        if not _safe(pid, caller, load.calls):
            return None
        result = _load_and_call(caller, load, deadline)
    finally:
        if tracee.attached:
            try:
                if caller is not None:
                    caller.restore()
            finally:  # a stopped thread is let go whatever happened
                try:
                    tracee.release()
                except Gone:
                    pass
            if caller is not None:
                caller.resend()
    return time.perf_counter() - held, result


def _ours(load: Load, tid: int) -> bool:
    """Whether thread `tid` belongs to the pinned process (checked again once it is stopped)."""
    return thread_group(tid) == load.pid and alive(load.pid, load.pidfd)


def _load_and_call(caller: RemoteCaller, load: Load, deadline: float) -> int:
    tracee, calls = caller.tracee, load.calls
    try:
        fd, path = placement.deliver(caller, calls.syscall, load.name, load.data, deadline)
        handle = caller.call(calls.dlopen, path, RTLD_NOW, deadline=deadline)
        if not handle:
            why = "no reason given (this libc has no dlerror)"
            if calls.dlerror is not None:
                message = caller.call(calls.dlerror, deadline=deadline)
                why = tracee.read_string(message, MAX_ERROR) if message else "no message"
            placement.close(caller, calls.syscall, fd, deadline)
            raise InjectError(f"process {tracee.pid} could not load {load.name}: {why}")
        bias = int.from_bytes(tracee.read(handle, 8), "little")  # struct link_map's l_addr
        return ctypes_int(caller.call(bias + load.offset, deadline=deadline))
    except PlacementError as e:
        raise InjectError(str(e)) from None
    except CallError as e:
        raise InjectError(f"process {tracee.pid}: {e.strerror}; its registers were put back (if the deadline "
                          f"passed inside dlopen, the loader may stay locked)") from None


def ctypes_int(rax: int) -> int:
    """A C int return value from rax."""
    value = rax & 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value
