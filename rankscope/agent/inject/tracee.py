"""One thread of another process held with ptrace (x86_64 Linux, through libc with ctypes): seized, stopped,
its registers (general and the whole FPU/SSE/AVX state) read and written, resumed and waited for with a
deadline, released. Memory goes through /proc/PID/mem, which the tracer may write.

PTRACE_SEIZE, unlike PTRACE_ATTACH, sends no SIGSTOP: the thread stops only when interrupted, and nothing of
the stop is visible to the process (no group stop, no SIGCHLD to its parent)."""
from __future__ import annotations

import ctypes
import errno
import os
import time
from dataclasses import dataclass

PTRACE_CONT = 7
PTRACE_GETREGS, PTRACE_SETREGS = 12, 13
PTRACE_DETACH = 17
PTRACE_GETREGSET, PTRACE_SETREGSET = 0x4204, 0x4205
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_EVENT_STOP = 128
NT_X86_XSTATE = 0x202  # XSAVE area: x87, SSE, AVX, AVX-512 registers
NT_PRFPREG = 2  # FXSAVE area (x87 and SSE only): CPUs without XSAVE
XSTATE_MAX = 1 << 14  # bytes; AVX-512's area is ~2.7 KiB, AMX's ~11 KiB
WALL = 0x40000000  # waitpid's __WALL: a thread other than the leader is a "clone" child
RELEASE_WAIT_S = 30.0  # for a thread still in the kernel when released (it cannot be let go running)
# A stop is polled for (a blocking wait could not honor the deadline): yielding the CPU between polls for the
# first SPIN_S (a stop usually comes within a millisecond; a sleep would add a wake-up's scheduling delay on a
# busy machine), then sleeping POLL_S between them.
SPIN_S = 0.002
POLL_S = 50e-6

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)


SYS_TGKILL = 234


def tgkill(pid: int, tid: int, sig: int) -> bool:
    """Sends `sig` to thread `tid` of `pid`; False when it is gone."""
    return _libc.syscall(SYS_TGKILL, pid, tid, sig) == 0


class TraceError(OSError):
    """A ptrace request failed, or the thread did not stop in time."""


class Gone(TraceError):
    """The thread (or its whole process) exited while held."""


class Regs(ctypes.Structure):
    """struct user_regs_struct of x86_64 (sys/user.h), in its order."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
        "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs")]

    def copy(self) -> Regs:
        return Regs.from_buffer_copy(self)

    @property
    def syscall(self) -> int:
        """The system call the thread is in (orig_rax, signed), -1 when none."""
        return ctypes.c_int64(self.orig_rax).value

    @property
    def result(self) -> int:
        """rax as a signed value: a system call's return, or -errno."""
        return ctypes.c_int64(self.rax).value


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@dataclass(frozen=True)
class Stop:
    """Why a held thread stopped: `signal` is the signal about to be delivered (0 for an interrupt or group
    stop, `event` PTRACE_EVENT_STOP then)."""

    signal: int
    event: int


def _ptrace(request: int, tid: int, addr: int = 0, data: int | ctypes.c_void_p | None = 0) -> None:
    if _libc.ptrace(request, tid, ctypes.c_void_p(addr), data) == -1:
        err = ctypes.get_errno()
        if err == errno.ESRCH and not os.path.exists(f"/proc/{tid}"):
            raise Gone(err, f"thread {tid} exited")
        raise TraceError(err, f"ptrace request {request:#x} on thread {tid}: {os.strerror(err)}")


class Tracee:
    """A thread seized by this (Python) thread; every request must come from the same thread."""

    def __init__(self, pid: int, tid: int):
        self.pid, self.tid = pid, tid
        _ptrace(PTRACE_SEIZE, tid)
        self.attached = True
        self.stopped = False
        self._mem = -1

    def interrupt(self, deadline: float) -> bool:
        """Stops the thread (inside a blocking system call too: it then reports -ERESTART* in rax). False when
        a signal of the process's stopped it first: the thread is then released, the signal delivered."""
        stop = self.stop(deadline)
        if stop.event != PTRACE_EVENT_STOP:
            self.release(stop.signal)
            return False
        return True

    def stop(self, deadline: float) -> Stop:
        """Interrupts the running thread and returns its next stop (the interrupt's, or a signal's first)."""
        _ptrace(PTRACE_INTERRUPT, self.tid)
        return self.wait(deadline)

    def wait(self, deadline: float) -> Stop:
        """The next stop of the running thread, polled until `deadline` (time.monotonic)."""
        spin_until = time.monotonic() + SPIN_S
        while True:
            try:
                got, status = os.waitpid(self.tid, os.WNOHANG | WALL)
            except ChildProcessError:
                self.attached = False
                raise Gone(errno.ECHILD, f"thread {self.tid} exited") from None
            if got:
                if os.WIFSTOPPED(status):
                    self.stopped = True
                    return Stop(os.WSTOPSIG(status), status >> 16)
                self.attached = False  # exited or killed: the kernel released it
                raise Gone(errno.ESRCH, f"process {self.pid} exited")
            now = time.monotonic()
            if now > deadline:
                raise TraceError(errno.ETIMEDOUT, f"thread {self.tid} did not stop in time")
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(POLL_S)

    def regs(self) -> Regs:
        r = Regs()
        _ptrace(PTRACE_GETREGS, self.tid, 0, ctypes.addressof(r))
        return r

    def set_regs(self, r: Regs) -> None:
        _ptrace(PTRACE_SETREGS, self.tid, 0, ctypes.addressof(r))

    def fpu(self) -> tuple[int, bytes]:
        """The FPU/vector state (XSAVE area, else FXSAVE): a called function may use any vector register, and
        the interrupted code may have live values in all of them (it was not stopped at a call)."""
        buf = ctypes.create_string_buffer(XSTATE_MAX)
        for note in (NT_X86_XSTATE, NT_PRFPREG):
            iov = _Iovec(ctypes.addressof(buf), XSTATE_MAX)
            try:
                _ptrace(PTRACE_GETREGSET, self.tid, note, ctypes.addressof(iov))
            except TraceError as e:
                if isinstance(e, Gone):
                    raise
                continue
            return note, buf.raw[:iov.len]
        raise TraceError(errno.EIO, f"cannot read the FPU state of thread {self.tid}")

    def set_fpu(self, state: tuple[int, bytes]) -> None:
        note, raw = state
        buf = ctypes.create_string_buffer(raw, len(raw))
        iov = _Iovec(ctypes.addressof(buf), len(raw))
        _ptrace(PTRACE_SETREGSET, self.tid, note, ctypes.addressof(iov))

    def resume(self, signal: int = 0) -> None:
        _ptrace(PTRACE_CONT, self.tid, 0, signal)
        self.stopped = False

    def read(self, addr: int, size: int) -> bytes:
        data = os.pread(self._memory(), size, addr)
        if len(data) != size:
            raise TraceError(errno.EFAULT, f"short read at {addr:#x} in process {self.pid}")
        return data

    def read_string(self, addr: int, limit: int) -> str:
        return os.pread(self._memory(), limit, addr).split(b"\0", 1)[0].decode(errors="replace")

    def write(self, addr: int, data: bytes) -> None:
        if os.pwrite(self._memory(), data, addr) != len(data):
            raise TraceError(errno.EFAULT, f"short write at {addr:#x} in process {self.pid}")

    def _memory(self) -> int:
        if self._mem < 0:
            self._mem = os.open(f"/proc/{self.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        return self._mem

    def release(self, signal: int = 0) -> None:
        """Detach, delivering `signal` (0: none; a pending signal of ours is suppressed, the process's own
        stay queued). A thread that has not stopped yet (an interrupt still pending, e.g. while it sleeps
        uninterruptibly in a driver) is waited for first: only a stopped thread can be let go."""
        if self._mem >= 0:
            os.close(self._mem)
            self._mem = -1
        if not self.attached:
            return
        if not self.stopped:
            stop = self.wait(time.monotonic() + RELEASE_WAIT_S)
            if stop.event == 0:  # a signal of the process's own stopped it: delivered
                signal = stop.signal
        self.attached = False
        _ptrace(PTRACE_DETACH, self.tid, 0, signal)
