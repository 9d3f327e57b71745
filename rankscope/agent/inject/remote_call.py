"""Functions of another process called on one of its threads, held with ptrace (tracee.py), and the thread put
back exactly as it was interrupted.

The thread's registers and FPU/vector state are saved at the interrupt; each call sets up the System V x86_64
ABI by hand (arguments in rdi/rsi/..., a 16-byte aligned stack below the interrupted code's red zone, the
direction flag clear) with return address 0: the function's `ret` faults at address 0, which the tracer sees
as a SIGSEGV stop before any handler of the process runs, and never delivers. Nothing but the few bytes of
arguments below the red zone is written, and those are put back.

A thread interrupted inside a blocking system call reports -ERESTART* in rax with the call number in orig_rax:
the calls run with orig_rax = -1 (no restart of anything), and the saved registers, put back at the last
stop, let the kernel restart the interrupted call as if a signal had been ignored. Signals the process
receives on this thread during a call are held back and sent again once it is released.
"""
from __future__ import annotations

import errno
import signal
import time

from rankscope.agent.inject.tracee import PTRACE_EVENT_STOP, Regs, Stop, TraceError, Tracee, tgkill

RED_ZONE = 128  # bytes below rsp the interrupted function may be using (System V x86_64)
ARGUMENT_REGISTERS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
DIRECTION_FLAG = 1 << 10  # eflags.DF: the ABI wants it clear on entry
STOP_WAIT_S = 1.0  # for a thread past the deadline to stop again
EINTR = 4
SYSCALL_INSN = b"\x0f\x05"
# System calls that a stop ends with -EINTR instead of restarting them (man 7 signal, "Interruption of system
# calls ... by stop signals": epoll, semaphores, sigtimedwait, sockets with a timeout), and that did nothing
# when they return EINTR, so running them again is what the thread would have seen without the interrupt (a
# relative timeout starts again). x86_64 numbers.
RESTARTED_AFTER_EINTR = {
    0: "read", 1: "write", 19: "readv", 20: "writev", 43: "accept", 44: "sendto", 45: "recvfrom", 46: "sendmsg",
    47: "recvmsg", 65: "semop", 69: "msgsnd", 70: "msgrcv", 128: "rt_sigtimedwait", 208: "io_getevents",
    220: "semtimedop", 232: "epoll_wait", 281: "epoll_pwait", 288: "accept4", 299: "recvmmsg", 307: "sendmmsg",
    441: "epoll_pwait2",
}
ERESTART = (512, 513, 514, 516)  # -ERESTARTSYS, -ERESTARTNOINTR, -ERESTARTNOHAND, -ERESTART_RESTARTBLOCK


class CallError(TraceError):
    """A called function faulted, or did not return in time (the thread is stopped again)."""


def in_blocking_syscall(regs: Regs) -> bool:
    """Interrupted while blocked in a system call (which will restart): it holds no lock of the C library's
    own user-space code (malloc, the loader) at that point, unlike a thread stopped in the middle of it."""
    return regs.syscall >= 0 and -regs.result in ERESTART


class RemoteCaller:
    """Calls on a stopped tracee; `restore` puts the thread and the bytes written back."""

    def __init__(self, tracee: Tracee):
        self.tracee = tracee
        self.saved = tracee.regs()
        self.resume = self._restarting(self.saved)  # what the thread is put back with
        self.fpu = tracee.fpu()
        self.signals: list[int] = []  # the process's own signals that stopped the thread mid-call
        self._scratch: tuple[int, bytes] | None = None  # (address, bytes that were there)
        self._called = False  # registers changed: restore has work
        self._stack = 0  # where the placed data begins; the return-address slot is the 8 bytes below

    def _restarting(self, regs: Regs) -> Regs:
        """`regs`, or, when the interrupt ended one of the RESTARTED_AFTER_EINTR calls with EINTR, the registers
        that run it again: rax back to the call's number and rip back onto its `syscall` instruction, as the
        kernel restarts a call itself."""
        if regs.result != -EINTR or regs.syscall not in RESTARTED_AFTER_EINTR:
            return regs
        if self.tracee.read(regs.rip - len(SYSCALL_INSN), len(SYSCALL_INSN)) != SYSCALL_INSN:
            return regs  # not entered through `syscall` (vsyscall, int 0x80): left as the kernel left it
        again = regs.copy()
        again.rax, again.rip = regs.orig_rax, regs.rip - len(SYSCALL_INSN)
        again.orig_rax = (1 << 64) - 1  # no second restart by the kernel
        return again

    def place(self, data: bytes) -> int:
        """Writes `data` below the red zone (once per caller, before the calls); its address. The calls'
        return-address slot is kept just below it, so every byte written is among those put back."""
        assert self._scratch is None, "one block of arguments per caller"
        top = (self.saved.rsp - RED_ZONE) & ~15
        addr = (top - len(data)) & ~15
        low = addr - 16
        self._scratch = (low, self.tracee.read(low, top - low))
        self._called = True  # the bytes go back with the registers
        self.tracee.write(addr, data)
        self._stack = addr
        return addr

    def call(self, function: int, *args: int, deadline: float) -> int:
        """function(*args) on the thread; its return value (rax). CallError if it faults or is still running
        at `deadline` (the thread is then interrupted, so `restore` can run)."""
        if self._scratch is None:
            self.place(b"")
        regs = self.saved.copy()
        for name, value in zip(ARGUMENT_REGISTERS, args, strict=False):
            setattr(regs, name, value & (1 << 64) - 1)
        regs.rsp = self._stack - 8  # the return address (in the saved slot): rsp + 8 is 16-byte aligned at entry
        self.tracee.write(regs.rsp, bytes(8))
        regs.rip, regs.rax, regs.orig_rax = function, 0, (1 << 64) - 1
        regs.eflags &= ~DIRECTION_FLAG
        self._called = True
        self.tracee.set_regs(regs)
        self.tracee.resume()
        while True:
            try:
                stop = self.tracee.wait(deadline)
            except TraceError as e:
                if e.errno != errno.ETIMEDOUT:
                    raise
                stop = self.tracee.stop(time.monotonic() + STOP_WAIT_S)  # stopped again, to be restored
                if not self._returned(stop):
                    self._hold_back(stop)
                    raise CallError(errno.ETIMEDOUT, f"the call at {function:#x} did not return in time") from None
            if self._returned(stop):
                return self.tracee.regs().rax
            if stop.signal == signal.SIGSEGV and stop.event == 0:
                raise CallError(errno.EFAULT, f"the call at {function:#x} faulted at {self.tracee.regs().rip:#x}")
            self._hold_back(stop)
            self.tracee.resume()

    def _returned(self, stop: Stop) -> bool:
        """The stop is the called function returning to address 0."""
        return stop.signal == signal.SIGSEGV and stop.event == 0 and self.tracee.regs().rip == 0

    def _hold_back(self, stop: Stop) -> None:
        """A signal of the process's own (or a group stop) that arrived during a call: sent after the release."""
        if stop.event == 0 or (stop.event == PTRACE_EVENT_STOP and stop.signal in _STOP_SIGNALS):
            self.signals.append(stop.signal)

    def restore(self) -> None:
        """The thread's registers, vector state and the bytes written, as at the interrupt (each put back even
        if an earlier one failed). The scratch bytes go back before the registers, which point the thread at
        its own code again. Nothing to do when no call was made and no system call is to run again."""
        if not self._called:
            if self.resume is not self.saved:
                self.tracee.set_regs(self.resume)
            return
        try:
            if self._scratch is not None:
                self.tracee.write(*self._scratch)
        finally:
            try:
                self.tracee.set_fpu(self.fpu)
            finally:
                self.tracee.set_regs(self.resume)

    def resend(self) -> None:
        """After the release: the signals held back during the calls, to the same thread (their siginfo, e.g.
        a SIGCHLD's sender, is not kept)."""
        for sig in self.signals:
            if not tgkill(self.tracee.pid, self.tracee.tid, sig):
                return


_STOP_SIGNALS = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
