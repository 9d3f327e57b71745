"""Which Python function every thread of a watched process is in: a CPython frame sampler in eBPF.

A software CPU-clock perf event fires `frequency` times a second on every CPU; `bpf/python.bpf.c` ignores
the tick unless the interrupted task belongs to a watched process, then finds that thread's Python thread
state, walks its frames and counts the stack of code-object addresses in a kernel map. Samples fire only
while a thread is on a CPU (like py-spy without --idle): the counts are where CPU time goes.

The program is compiled per interpreter layout (offsets as -D macros from
`rankscope.agent.interpreters.cpython`), so each CPython version in use costs one small BPF object and one
perf event per CPU; processes of the same version share it. Code objects are named in user space, from
/proc/PID/mem, cached per address.

    sampler = PythonSampler()            # 49 Hz
    sampler.attach(pid)                  # -> "3.12.1"; UnsupportedInterpreter if it cannot be read
    ...
    counts = sampler.read()              # {pid: {(Frame(main), Frame(outer), Frame(hot_a)): 97, ...}}

Stacks are tuples of `Frame`, outermost (root) first, innermost (the running function) last. Samples that
are not a Python stack count too, under one-frame stacks of the stand-ins in
`rankscope.agent.interpreters` (`<native thread>`, `<native>`, `<unreadable>`), so shares are honest; a
stack cut at `max_depth` starts with `<truncated>`.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from importlib import resources

from .interpreters import NATIVE_THREAD, NO_PYTHON_FRAME, TRUNCATED, UNKNOWN_CODE, UNREADABLE, Frame
from .interpreters.cpython import (
    CodeResolver,
    Interpreter,
    InterpreterNotReady,
    Layout,
    PythonAttachError,
    UnsupportedInterpreter,
    inspect,
)
from .kernel_btf import BTFError, kernel_offset

__all__ = [
    "Frame",
    "InterpreterNotReady",
    "PythonAttachError",
    "PythonSampler",
    "SamplerError",
    "UnsupportedInterpreter",
]

log = logging.getLogger(__name__)

DEFAULT_FREQUENCY = 49  # Hz per CPU; off the 50/100 Hz beat of timers and loops
DEFAULT_MAX_DEPTH = 48

# Must match bpf/python.bpf.c.
KIND_FRAMES, KIND_NO_TSTATE, KIND_NO_FRAME, KIND_UNREADABLE = 0, 1, 2, 3
FLAG_TRUNCATED, FLAG_PARTIAL = 1, 2
COUNTER_NAMES = ("samples", "dropped", "thread_search_exhausted")


class SamplerError(PythonAttachError):
    """The BPF program cannot be built, loaded or attached."""


@dataclass
class _Program:
    """One compiled sampler for one interpreter layout."""

    bpf: object
    layout: Layout
    pids: set[int] = field(default_factory=set)


class PythonSampler:
    """Samples the Python stacks of watched CPython processes (3.10-3.14, x86-64) in the kernel.

    `read()` returns the counts since the previous `read()` (or since attach): per pid, stack -> samples,
    stacks root first. Not thread-safe: one caller.
    """

    def __init__(self, frequency: int = DEFAULT_FREQUENCY, max_depth: int = DEFAULT_MAX_DEPTH):
        if not 1 <= frequency <= 10_000:
            raise ValueError(f"frequency must be 1..10000 Hz, not {frequency}")
        if not 1 <= max_depth <= 127:
            raise ValueError(f"max_depth must be 1..127, not {max_depth}")
        self.frequency = frequency
        self.max_depth = max_depth
        self._programs: dict[tuple[str, ...], _Program] = {}
        self._targets: dict[int, tuple[Interpreter, _Program, CodeResolver]] = {}
        self._retired: dict[int, CodeResolver] = {}  # detached; their last samples are named at the next read

    # -- watching ------------------------------------------------------------------------------------------

    def attach(self, pid: int) -> str:
        """Start sampling `pid`; returns its CPython version ("3.12.1").

        Raises UnsupportedInterpreter (InterpreterNotReady while it starts up) or PythonAttachError.
        """
        if pid in self._targets:
            return self._targets[pid][0].version
        interp = inspect(pid)
        resolver = self._retired.pop(pid, None)
        if resolver is not None and resolver.interp != interp:
            resolver.close()
            resolver = None
        resolver = resolver or CodeResolver(interp)
        try:
            prog = self._program(interp.layout)
            watched = prog.bpf["py_watched"]
            leaf = watched.Leaf()
            leaf.runtime, leaf.ns_dev, leaf.ns_ino = interp.runtime, interp.ns_dev, interp.ns_ino
            watched[ctypes.c_uint32(pid)] = leaf
        except BaseException:
            resolver.close()
            raise
        prog.pids.add(pid)
        self._targets[pid] = (interp, prog, resolver)
        log.info("sampling pid %d: CPython %s, _PyRuntime at %#x (%s), offsets from %s", pid, interp.version,
                 interp.runtime, interp.elf_path, interp.layout.source)
        return interp.version

    def detach(self, pid: int) -> None:
        """Stop sampling `pid` (alive or not). Samples already counted are still returned by the next read."""
        entry = self._targets.pop(pid, None)
        if entry is None:
            return
        _, prog, resolver = entry
        prog.pids.discard(pid)
        try:
            prog.bpf["py_watched"].pop(ctypes.c_uint32(pid), None)
        except Exception as e:  # bcc raises bare Exception
            log.warning("pid %d: cannot unwatch: %s", pid, e)
        self._retired[pid] = resolver

    def attached(self) -> dict[int, str]:
        """pid -> CPython version of every process being sampled."""
        return {pid: entry[0].version for pid, entry in self._targets.items()}

    def _program(self, layout: Layout) -> _Program:
        """The program for `layout`, compiled and attached to every CPU's clock on first use."""
        key = tuple(layout.cflags()) + (f"-DPY_MAX_DEPTH={self.max_depth}",)
        prog = self._programs.get(key)
        if prog is not None:
            return prog
        flags = list(key)
        if layout.match_pthread:  # 3.10: threads are told apart by pthread_self(), the TLS base
            try:
                flags.append(f"-DPY_TASK_FSBASE={kernel_offset('task_struct', 'thread.fsbase')}")
            except BTFError as e:
                raise SamplerError(f"cannot sample CPython {layout.version[0]}.{layout.version[1]}: {e}") from e
        try:
            from bcc import BPF, PerfSWConfig, PerfType
        except ImportError as e:
            raise SamplerError("bcc is not importable: run scripts/install (Debian's python3-bpfcc)") from e
        text = (resources.files("rankscope.bpf") / "python.bpf.c").read_text()
        try:
            bpf = BPF(text=text, cflags=flags)
        except Exception as e:  # bcc raises bare Exception for compile and load failures
            raise SamplerError(f"cannot build the Python sampler (root, kernel headers?): {e}") from e
        try:
            # System-wide, one event per CPU: threads created later are covered, and the program itself
            # filters by py_watched (a per-task event would need one per thread).
            bpf.attach_perf_event(ev_type=PerfType.SOFTWARE, ev_config=PerfSWConfig.CPU_CLOCK,
                                  fn_name=b"py_sample", sample_freq=self.frequency)
        except Exception as e:
            bpf.cleanup()
            raise SamplerError(f"cannot load or attach the Python sampler: {e}") from e
        prog = _Program(bpf, layout)
        self._programs[key] = prog
        return prog

    # -- reading -------------------------------------------------------------------------------------------

    def read(self) -> dict[int, dict[tuple[Frame, ...], int]]:
        """Samples since the previous read: {pid: {stack (root first): count}}."""
        out: dict[int, dict[tuple[Frame, ...], int]] = {}
        for prog in self._programs.values():
            for key, count in self._drain(prog):
                stack = self._stack(key)
                per_pid = out.setdefault(key.pid, {})
                per_pid[stack] = per_pid.get(stack, 0) + count
        for resolver in self._retired.values():
            resolver.close()
        self._retired.clear()
        return out

    @staticmethod
    def _drain(prog: _Program) -> list[tuple[object, int]]:
        """Switch the program to the other generation of counts, then empty the one it was adding to."""
        ctl = prog.bpf["py_ctl"]
        zero = ctypes.c_uint32(0)
        gen = ctl[zero].value & 1
        ctl[zero] = ctypes.c_uint32(gen ^ 1)
        table = prog.bpf[f"py_stacks_{gen}"]
        items = [(k, v.value) for k, v in table.items()]
        for k, _ in items:
            try:
                del table[k]
            except KeyError:
                pass
        return items

    def _resolver(self, pid: int) -> CodeResolver | None:
        entry = self._targets.get(pid)
        return entry[2] if entry is not None else self._retired.get(pid)

    def _stack(self, key) -> tuple[Frame, ...]:
        if key.kind == KIND_NO_TSTATE:
            return (NATIVE_THREAD,)
        if key.kind == KIND_NO_FRAME:
            return (NO_PYTHON_FRAME,)
        if key.kind != KIND_FRAMES:
            return (UNREADABLE,)
        codes = []
        for c in key.code:
            if not c:
                break
            codes.append(c)
        resolver = self._resolver(key.pid)
        frames = [resolver.resolve(c) if resolver else UNKNOWN_CODE for c in reversed(codes)]
        if key.flags & FLAG_PARTIAL:
            frames.insert(0, UNREADABLE)
        elif key.flags & FLAG_TRUNCATED:
            frames.insert(0, TRUNCATED)
        return tuple(frames)

    def counters(self) -> dict[str, int]:
        """Totals since the programs were loaded: samples of watched processes, samples dropped because the
        stack map was full, and samples whose thread was not found within the thread-state search bound."""
        totals = dict.fromkeys(COUNTER_NAMES, 0)
        for prog in self._programs.values():
            table = prog.bpf["py_counters"]
            for i, name in enumerate(COUNTER_NAMES):
                totals[name] += sum(v for v in table[ctypes.c_int(i)])
        return totals

    # -- lifetime ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Detach everything and unload the programs (the perf events go with them)."""
        for pid in list(self._targets):
            self.detach(pid)
        for resolver in self._retired.values():
            resolver.close()
        self._retired.clear()
        for prog in self._programs.values():
            try:
                prog.bpf.cleanup()
            except Exception as e:
                log.warning("unloading the Python sampler: %s", e)
        self._programs.clear()

    def __enter__(self) -> PythonSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
