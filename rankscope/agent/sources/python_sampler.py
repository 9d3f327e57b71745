"""Where every thread of a watched Python process spends its wall time, per Python stack, in eBPF.

On CPU: a software CPU-clock perf event fires `frequency` times a second on every CPU; `bpf/python.bpf.c`
ignores the tick unless the interrupted task belongs to a watched process, then finds that thread's Python
thread state, walks its frames and counts the stack of code-object addresses in a kernel map. Samples fire
only while a thread is on a CPU: `samples / frequency` estimates the CPU seconds of a stack.

Off CPU: on every context switch, a thread of a watched process that goes to sleep (blocks on a lock, a
queue, I/O, a timer; not one that is merely preempted) has its stack walked the same way; when it runs
again, the time it was away is added to that stack (like bcc's offcputime, with Python stacks). Time off
CPU includes the wait for a CPU after the wake-up. A thread still asleep at a read is counted up to the read,
and one already asleep when the process is attached is found from user space and counted from the attach,
so a thread blocked for good shows in every window.

The program is compiled per interpreter layout (offsets as -D macros from
`rankscope.agent.interpreters.cpython`), so each CPython version in use costs one small BPF object and one
perf event per CPU; processes of the same version share it. Code objects are named in user space, from
/proc/PID/mem, cached per address.

    sampler = PythonSampler()            # 49 Hz
    sampler.attach(pid)                  # -> "3.12.1"; UnsupportedInterpreter if it cannot be read
    ...
    stacks = sampler.read()              # {pid: {(Frame(main), Frame(outer), Frame(hot_a)):
                                         #          StackTime(samples=97, off_cpu_s=0.0), ...}}

Stacks are tuples of `Frame`, outermost (root) first, innermost (the running function) last. Samples and
off-CPU time that are not a Python stack count too, under one-frame stacks of the stand-ins in
`rankscope.agent.interpreters` (`<native thread>`, `<native>`, `<unreadable>`), so shares are honest; a
stack cut at `max_depth` starts with `<truncated>`. Off-CPU time adds up over threads: ten idle native
threads give `<native thread>` ten seconds per second.
"""
from __future__ import annotations

import ctypes
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rankscope import bpf as bpf_sources
from rankscope.agent.host import procfs
from rankscope.agent.host.kernel_btf import BTFError, kernel_offset
from rankscope.agent.interpreters import NATIVE_THREAD, NO_PYTHON_FRAME, UNREADABLE, Frame
from rankscope.agent.interpreters.cpython.code import CodeResolver, stack_frames
from rankscope.agent.interpreters.cpython.errors import InterpreterNotReady, PythonAttachError, UnsupportedInterpreter
from rankscope.agent.interpreters.cpython.layout import Layout
from rankscope.agent.interpreters.cpython.process import Interpreter, inspect, open_memory
from rankscope.agent.interpreters.cpython.threads import stacks_by_tid, thread_stacks
from rankscope.agent.loader import bpf_syscall
from rankscope.agent.loader.bcc import compile_bpf
from rankscope.agent.loader.maps import MapReadError, entries
from rankscope.agent.loader.trace_stream import TRACE_PY_SAMPLE, TRACE_RECORD, Labels, TraceStream

__all__ = [
    "Frame",
    "InterpreterNotReady",
    "PythonAttachError",
    "PythonSampler",
    "SamplerError",
    "StackTime",
    "UnsupportedInterpreter",
]

log = logging.getLogger(__name__)

DEFAULT_FREQUENCY = 49  # Hz per CPU; off the 50/100 Hz beat of timers and loops
DEFAULT_MAX_DEPTH = 48

# Must match bpf/python.bpf.c.
KIND_FRAMES, KIND_NO_TSTATE, KIND_NO_FRAME, KIND_UNREADABLE = 0, 1, 2, 3
FLAG_TRUNCATED, FLAG_PARTIAL = 1, 2
COUNTER_NAMES = ("samples", "dropped", "thread_search_exhausted", "sleeps", "off_cpu_dropped")
FLUSH_BATCH = 12  # thread ids per py_flush run (PY_FLUSH_BATCH)
# BPF maps read here (their C declarations: bpf/*.bpf.c).
PY_WATCHED = "py_watched"  # pid -> the interpreter to walk (sampled while a key)
PY_SLEEPING = "py_sleeping"  # tid -> the stack it went to sleep in, and when
PY_CTL = "py_ctl"  # [0]: the generation of the stack maps the programs add to (user space reads the other)
PY_COUNTERS = "py_counters"  # per CPU: COUNTER_NAMES
# Two generations of each (0 and 1: the programs add to one while user space drains the other, see _drain).
PY_STACKS = "py_stacks_{}"  # on-CPU stack -> samples
PY_OFFCPU = "py_offcpu_{}"  # stack slept in -> time asleep
MAX_TRACE_STACKS = 20_000  # distinct stacks kept by one capture, each program (~8 MB at most)


@dataclass(frozen=True)
class StackTime:
    """A stack's time in one read window: on-CPU samples (CPU seconds = samples / frequency) and seconds
    spent off CPU (asleep, then waiting for a CPU) by threads whose stack it was when they went to sleep."""

    samples: int = 0
    off_cpu_s: float = 0.0


class SamplerError(PythonAttachError):
    """The BPF program cannot be built, loaded or attached."""


@dataclass
class _Program:
    """One compiled sampler for one interpreter layout."""

    bpf: object
    layout: Layout
    flush_fd: int
    trace: _SampleStream
    pids: set[int] = field(default_factory=set)


class _SampleStream(TraceStream):
    """A capture's samples of one program (bpf/python.bpf.c: py_trace_sample): each record's stack is
    interned, its id in the record's `seq`; its frames (root first) are its label. At most MAX_TRACE_STACKS stacks a
    capture (~400 bytes each): samples of further stacks are counted as refused."""

    def __init__(self, bpf, frames: Callable[[object], tuple[Frame, ...]]):
        super().__init__(bpf)
        self._frames = frames  # a stack key -> its frames (PythonSampler._stack)
        self._key = bpf[PY_STACKS.format(0)].Key  # struct py_stack
        self._ids: dict[bytes, int] = {}

    def start(self, pids: list[int], sink) -> None:
        self._ids = {}
        super().start(pids, sink)

    def intern(self, raw: bytes) -> bytes | None:
        head, stack = raw[:TRACE_RECORD.itemsize], raw[TRACE_RECORD.itemsize:]
        sid = self._ids.get(stack)
        if sid is None:
            if len(self._ids) >= MAX_TRACE_STACKS:
                return None
            sid = self._ids[stack] = len(self._ids) + 1
        return head[:-8] + sid.to_bytes(8, "little")

    def labels(self, pid: int, recs: np.ndarray) -> Labels:
        wanted = set(recs["seq"][recs["kind"] == TRACE_PY_SAMPLE].tolist())
        return {(TRACE_PY_SAMPLE, sid): self._frames(key)
                for stack, sid in self._ids.items() if sid in wanted
                for key in [self._key.from_buffer_copy(stack)] if key.pid == pid}


class PythonSampler:
    """Samples the Python stacks of watched CPython processes (3.10-3.14, x86-64) in the kernel, on CPU and
    off CPU.

    `read()` returns what happened since the previous `read()` (or since attach): per pid, stack (root first)
    -> StackTime. Not thread-safe: one caller.
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
            watched = prog.bpf[PY_WATCHED]
            leaf = watched.Leaf()
            leaf.runtime, leaf.ns_dev, leaf.ns_ino = interp.runtime, interp.ns_dev, interp.ns_ino
            watched[ctypes.c_uint32(pid)] = leaf
        except BaseException:
            resolver.close()
            raise
        prog.pids.add(pid)
        self._targets[pid] = (interp, prog, resolver)
        try:
            self._seed(prog, interp)
        except Exception as e:  # the kernel still sees every sleep from now on
            log.warning("pid %d: threads already asleep are not counted until they wake: %s", pid, e)
        log.info("sampling pid %d: CPython %s, _PyRuntime at %#x (%s), offsets from %s", pid, interp.version,
                 interp.runtime, interp.elf_path, interp.layout.source)
        return interp.version

    def detach(self, pid: int) -> None:
        """Stop sampling `pid` (alive or not). What was already counted, and the time its sleeping threads
        spent off CPU up to now, is still returned by the next read."""
        entry = self._targets.pop(pid, None)
        if entry is None:
            return
        _, prog, resolver = entry
        prog.pids.discard(pid)
        sleeping = prog.bpf[PY_SLEEPING]
        try:
            _flush(prog.flush_fd, [tid for tid, owner in _sleeping(sleeping) if owner == pid])
            prog.bpf[PY_WATCHED].pop(ctypes.c_uint32(pid), None)
            # Its sleeps would not be counted any more (the wake-up checks py_watched); free their room now.
            for tid, owner in _sleeping(sleeping):
                if owner == pid:
                    sleeping.pop(ctypes.c_uint32(tid), None)
        except Exception as e:  # bcc raises bare Exception
            log.warning("pid %d: cannot unwatch: %s", pid, e)
        self._retired[pid] = resolver

    def _seed(self, prog: _Program, interp: Interpreter) -> None:
        """Threads of a newly watched process that are already asleep: the kernel would see them only when
        they wake, so a thread blocked for good would never show. Their stacks are read from user space and
        entered as asleep since now. An entry is kept only if its thread provably stayed asleep while it was
        made (same state and context-switch counts before and after); else its own wake-up or sleep has
        been, or will be, seen by the kernel."""
        pid = interp.pid
        since = time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # bpf_ktime_get_ns's clock
        asleep = {tid: st for tid, st in _thread_states(pid).items() if st[0] in _ASLEEP}
        if not asleep:
            return
        mem = open_memory(pid)
        try:
            stacks = thread_stacks(mem, interp.runtime, interp.layout, self.max_depth)
            by_tid = stacks_by_tid(mem, pid, stacks, interp.layout) if stacks is not None else {}
        finally:
            mem.close()
        if by_tid is None:
            log.info("pid %d: no glibc thread descriptor; threads already asleep are not counted", pid)
            return

        from bcc.libbcc import lib

        table = prog.bpf[PY_SLEEPING]
        for tid in asleep:
            leaf = table.Leaf()
            leaf.ts = since
            key = leaf.stack
            key.pid = pid
            st = by_tid.get(tid)
            if stacks is None:
                key.kind = KIND_UNREADABLE
            elif st is None:
                key.kind = KIND_NO_TSTATE
            elif not st.codes:
                key.kind = KIND_NO_FRAME
            else:
                key.kind = KIND_FRAMES
                key.flags = FLAG_PARTIAL if st.partial else FLAG_TRUNCATED if st.truncated else 0
                key.depth = len(st.codes)
                for i, code in enumerate(st.codes):
                    key.code[i] = code
            # BPF_NOEXIST: a sleep the kernel saw itself wins.
            lib.bpf_update_elem(table.map_fd, ctypes.byref(ctypes.c_uint32(tid)), ctypes.byref(leaf), 1)
        after = _thread_states(pid)
        for tid, st in asleep.items():
            if after.get(tid) != st:
                k = ctypes.c_uint32(tid)
                try:
                    if table[k].ts == since:
                        del table[k]
                except KeyError:
                    pass

    def interpreter(self, pid: int) -> Interpreter | None:
        """The verified interpreter of a sampled process."""
        entry = self._targets.get(pid)
        return entry[0] if entry is not None else None

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
        text = bpf_sources.text("python.bpf.c")
        try:
            # Loading also attaches the sched_switch tracepoint program (bcc's TRACEPOINT_PROBE).
            bpf = compile_bpf(text, flags)
        except Exception as e:  # bcc raises bare Exception for compile and load failures
            raise SamplerError(f"cannot build the Python sampler (root, kernel headers?): {e}") from e
        try:
            from bcc import BPF

            self._attach_clock(bpf)
            flush_fd = bpf.load_func(b"py_flush", BPF.RAW_TRACEPOINT).fd  # run on demand, never attached
        except Exception as e:
            bpf.cleanup()
            raise SamplerError(f"cannot load or attach the Python sampler: {e}") from e
        prog = _Program(bpf, layout, flush_fd, _SampleStream(bpf, self._stack))
        self._programs[key] = prog
        return prog

    def _attach_clock(self, bpf) -> None:
        from bcc import PerfSWConfig, PerfType

        # System-wide, one event per CPU: threads created later are covered, and the program itself
        # filters by py_watched (a per-task event would need one per thread).
        bpf.attach_perf_event(ev_type=PerfType.SOFTWARE, ev_config=PerfSWConfig.CPU_CLOCK,
                              fn_name=b"py_sample", sample_freq=self.frequency)

    def set_frequency(self, frequency: int) -> None:
        """Sample `frequency` times a second from now on. Call it right after a read(): samples already
        counted are converted to seconds with the frequency of the next read."""
        if not 1 <= frequency <= 10_000:
            raise ValueError(f"frequency must be 1..10000 Hz, not {frequency}")
        if frequency == self.frequency:
            return
        from bcc import PerfSWConfig, PerfType

        self.frequency = frequency
        for prog in self._programs.values():
            prog.bpf.detach_perf_event(ev_type=PerfType.SOFTWARE, ev_config=PerfSWConfig.CPU_CLOCK)
            self._attach_clock(prog.bpf)

    # -- reading -------------------------------------------------------------------------------------------

    def read(self) -> dict[int, dict[tuple[Frame, ...], StackTime]]:
        """Time since the previous read: {pid: {stack (root first): StackTime(samples, off_cpu_s)}}."""
        samples: dict[int, dict[tuple[Frame, ...], int]] = {}
        off_ns: dict[int, dict[tuple[Frame, ...], int]] = {}
        for prog in self._programs.values():
            on_items, off_items = self._drain(prog)
            for items, out in ((on_items, samples), (off_items, off_ns)):
                for key, value in items:
                    stack = self._stack(key)
                    per_pid = out.setdefault(key.pid, {})
                    per_pid[stack] = per_pid.get(stack, 0) + value
        result: dict[int, dict[tuple[Frame, ...], StackTime]] = {}
        for pid in samples.keys() | off_ns.keys():
            on, off = samples.get(pid, {}), off_ns.get(pid, {})
            result[pid] = {stack: StackTime(on.get(stack, 0), off.get(stack, 0) / 1e9)
                           for stack in on.keys() | off.keys()}
        for resolver in self._retired.values():
            resolver.close()
        self._retired.clear()
        return result

    @staticmethod
    def _drain(prog: _Program) -> tuple[list[tuple[object, int]], list[tuple[object, int]]]:
        """Count the time so far of the threads still asleep, switch the programs to the other generation of
        counts, then empty the one they were adding to: (samples, off-CPU nanoseconds) per stack key."""
        try:
            _flush(prog.flush_fd, [tid for tid, _ in _sleeping(prog.bpf[PY_SLEEPING])])
        except SamplerError as e:  # long sleeps then show when they end
            log.warning("%s", e)
        ctl = prog.bpf[PY_CTL]
        zero = ctypes.c_uint32(0)
        gen = ctl[zero].value & 1
        ctl[zero] = ctypes.c_uint32(gen ^ 1)
        out = []
        for name in (PY_STACKS.format(gen), PY_OFFCPU.format(gen)):
            table = prog.bpf[name]
            items = [(k, v.value) for k, v in entries(table)]
            for k, _ in items:
                try:
                    del table[k]
                except KeyError:
                    pass
            out.append(items)
        return out[0], out[1]

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
        return stack_frames(self._resolver(key.pid), codes, bool(key.flags & FLAG_TRUNCATED),
                            bool(key.flags & FLAG_PARTIAL))

    def trace_streams(self) -> list[TraceStream]:
        """The programs' capture streams: on-CPU samples with their stacks."""
        return [prog.trace for prog in self._programs.values()]

    def counters(self) -> dict[str, int]:
        """Totals since the programs were loaded: samples of watched processes, samples dropped because the
        stack map was full, samples (or sleeps) whose thread was not found within the thread-state search
        bound, sleeps of watched threads (switch-outs walked), and sleeps or off-CPU time lost because a map
        was full."""
        totals = dict.fromkeys(COUNTER_NAMES, 0)
        for prog in self._programs.values():
            table = prog.bpf[PY_COUNTERS]
            for i, name in enumerate(COUNTER_NAMES):
                totals[name] += sum(v for v in table[ctypes.c_int(i)])
        return totals

    # -- lifetime ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Detach everything and unload the programs (the perf events and the tracepoint go with them)."""
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


_ASLEEP = frozenset("SDITt")  # /proc states of a thread off CPU by its own doing (or stopped)


def _thread_states(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (state letter, voluntary and involuntary context switches) of every thread of `pid`."""
    out = {}
    for tid, fields in procfs.task_status(pid).items():
        try:
            out[tid] = (fields["State"].split()[0], int(fields["voluntary_ctxt_switches"]),
                        int(fields["nonvoluntary_ctxt_switches"]))
        except (KeyError, ValueError, IndexError):
            continue
    return out


# -- threads asleep, and running py_flush ----------------------------------------------------------------------------------------

def _sleeping(table) -> list[tuple[int, int]]:
    """(tid, pid) of every thread in py_sleeping, read in batches (loader/maps.py): a batch walks the hash
    bucket by bucket, where get_next_key would start over each time the program deletes the key it stands on."""
    try:
        return [(tid.value, v.stack.pid) for tid, v in entries(table)]
    except MapReadError as e:
        raise SamplerError(f"cannot list the threads off CPU: {e}") from e


def _flush(fd: int, tids) -> None:
    """Run py_flush over `tids`, FLUSH_BATCH at a time (BPF_PROG_TEST_RUN: the context is the thread ids)."""
    tids = list(tids)
    ctx = (ctypes.c_uint64 * FLUSH_BATCH)()
    # union bpf_attr, test: prog_fd @0, ctx_size_in @40, ctx_in @48; everything else 0.
    attr = ctypes.create_string_buffer(80)
    struct.pack_into("<I", attr, 0, fd)
    struct.pack_into("<IIQ", attr, 40, ctypes.sizeof(ctx), 0, ctypes.addressof(ctx))
    for i in range(0, len(tids), FLUSH_BATCH):
        batch = tids[i : i + FLUSH_BATCH]
        for j in range(FLUSH_BATCH):
            ctx[j] = batch[j] if j < len(batch) else 0
        try:
            bpf_syscall.bpf(bpf_syscall.BPF_PROG_TEST_RUN, attr)
        except OSError as e:
            raise SamplerError(f"cannot run the off-CPU flush: {e.strerror}") from e
