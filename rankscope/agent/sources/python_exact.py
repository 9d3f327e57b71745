"""Exact call counts and durations of chosen Python functions, in eBPF (BPF side: bpf/python_exact.bpf.c).

Which functions: every `forward` (nn.Module's, entered from `Module.__call__` through C), the `__next__` of
data loaders (a qualname with `DataLoaderIter`, or any `__next__` under torch/utils/data), and the
functions the user names (`--trace-function module:qualname`).

How: a uprobe and a uretprobe on `_PyEval_EvalFrameDefault` of each watched process (attached per process,
so nothing else running the same interpreter pays). From 3.11 that function is entered only by calls that
pass through C (a module called as `module(x)`, an iterator's `__next__` driven by a `for` loop, `map`,
callbacks), not by plain Python-to-Python calls, which are invisible here; on 3.10 every call enters it.
The kernel picks code objects by their `co_name` alone, once per code object (cheap, and exact from the
first call: no learning phase); user space then resolves each timed code object to its qualified name and
file and turns off the ones that do not match (their calls until then are dropped).

Cost: every eval entry of a watched process takes the uprobe and the uretprobe trap (~1.5 us); the BPF
work of a call that is not timed is two map lookups. Keep it to processes that enter eval at most some
thousand times a second (3.11+ training loops do). That is too much for always-on: the agent times
forward and __next__ in deep mode only (agent/detail.py); functions the user names are always timed, and
garbage collections whenever the process is watched (USDT, a few per second at most).

    timer = PythonTimer([TracedFunction.parse("train:Trainer.step")])
    timer.attach(interp, job)              # an Interpreter from the sampler's inspect; its job's id
    timer.set_functions(True)              # forward and loader __next__ too, not only named functions
    timed = timer.read()                   # {pid: [PyTimed(name, count, total_s, max_s), ...]}
"""
from __future__ import annotations

import ctypes
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rankscope import bpf as bpf_sources
from rankscope.agent.detail import Detail
from rankscope.agent.host import procfs
from rankscope.agent.host.symbols import SymbolError, exported_functions, file_offset, functions, sdt_probes
from rankscope.agent.host.targets import Target
from rankscope.agent.interpreters import SPECIAL_FRAMES, Frame
from rankscope.agent.interpreters.cpython.code import CodeResolver
from rankscope.agent.interpreters.cpython.errors import PythonAttachError
from rankscope.agent.interpreters.cpython.process import Interpreter
from rankscope.agent.loader import histograms, uprobe_links, usdt
from rankscope.agent.loader.bcc import compile_bpf
from rankscope.agent.loader.maps import entries
from rankscope.agent.loader.trace_stream import TRACE_PY_CALL, Labels, TraceStream
from rankscope.agent.loader.uprobe_links import UprobeError, Uprobes
from rankscope.agent.sources.deltas import Deltas
from rankscope.agent.sources.python_profile import function_name
from rankscope.agent.sources.python_sampler import PythonSampler
from rankscope.agent.sources.source import Source
from rankscope.schema.patterns import FunctionStats, PyTimed, RankPattern, Role

log = logging.getLogger(__name__)

EVAL = "_PyEval_EvalFrameDefault"
TOP_TIMED = 5  # per pattern, by total time
NAME_SLOTS, NAME_BYTES = 8, 32  # PYX_NAMES, PYX_NAME_WORDS * 8
VERDICT_TIMED, VERDICT_SKIP = 1, 2
COUNTER_NAMES = ("too_deep", "unreadable_name")
# Every eval entry of a timed process traps twice (~1.3 us): above this rate (~2.6% of a core) a process
# stops being timed at the next read, and so do its peers (the ranks of its job): timed ranks beside untimed
# ones would look slower by the probes' cost (a 2-rank MLP entering eval 87,000 times a second ran 45% slower
# timed), and differential diagnosis would blame it. CPython 3.10 enters eval on every call, so it is timed
# only on request.
MAX_ENTRIES_PER_S = 20_000
GC_START, GC_DONE = ("python", "gc__start"), ("python", "gc__done")  # USDT probes of CPython's GC
GC_LABEL = "gc (collection)"  # a capture's collections, timed through USDT
GC_NAME = "gc__start"  # the GC's FunctionStats where it is timed through USDT (else libpython's gc_collect_main)
# BPF maps read here (their C declarations: bpf/*.bpf.c).
PYX_TARGETS = "pyx_targets"  # pid -> what to time in it, and the entries probed
PYX_NAMES = "pyx_names"  # slot -> a function name to time
PYX_STATS = "pyx_stats"  # (pid, code object) -> calls, time, histogram
PYX_VERDICT = "pyx_verdict"  # (pid, code object) -> timed or not (LRU)
PYX_GC = "pyx_gc"  # pid -> GC collections through USDT
PYX_COUNTERS = "pyx_counters"  # per CPU: COUNTER_NAMES


class TimerError(PythonAttachError):
    """Exact timing cannot be set up for a process (or at all)."""


@dataclass(frozen=True)
class TracedFunction:
    """A function the user asks to time: `module:qualname` ("train:Trainer.step", "pkg.data:load")."""

    module: str
    qualname: str

    @classmethod
    def parse(cls, text: str) -> TracedFunction:
        module, sep, qualname = text.partition(":")
        parts = qualname.split(".")
        if not sep or not module or not all(p.isidentifier() or p == "<locals>" for p in parts) \
                or not all(m.isidentifier() for m in module.split(".")):
            raise ValueError(f"a traced function is module:qualname (e.g. train:Model.forward), not {text!r}")
        return cls(module, qualname)

    @property
    def name(self) -> str:
        """The code object's co_name: the last part of the qualified name."""
        return self.qualname.rsplit(".", 1)[-1]

    def matches(self, frame: Frame, has_qualname: bool) -> bool:
        """Whether `frame` is this function. The script run as __main__ is named by its file's stem
        ("train" for train.py). Without qualnames (3.10) only the last part of the name can be compared."""
        wanted = self.qualname if has_qualname else self.name
        if frame.qualname != wanted:
            return False
        path = os.path.splitext(frame.filename)[0]
        suffix = "/" + self.module.replace(".", "/")
        return self.module == "__main__" or ("/" + path).endswith(suffix) or path.endswith(suffix + "/__init__")


def _is_loader_next(frame: Frame) -> bool:
    return frame.qualname.endswith("__next__") and (
        "DataLoaderIter" in frame.qualname or "/torch/utils/data/" in frame.filename)


@dataclass(frozen=True)
class Selection:
    """Which code objects are timed: the built-in choice plus the user's functions."""

    traced: tuple[TracedFunction, ...] = ()

    def names(self) -> list[str]:
        """The co_names the kernel looks for."""
        return list(dict.fromkeys(["forward", "__next__", *(t.name for t in self.traced)]))

    def wants(self, frame: Frame, has_qualname: bool) -> bool:
        if frame in SPECIAL_FRAMES:
            return False
        if any(t.matches(frame, has_qualname) for t in self.traced):
            return True
        last = frame.qualname.rsplit(".", 1)[-1]
        return last == "forward" or (last == "__next__" and _is_loader_next(frame))


@dataclass
class _Watched:
    interp: Interpreter
    resolver: CodeResolver
    peers: str  # the group timed all together or not at all (its job)
    eval_probes: list[Uprobes] = field(default_factory=list)  # the eval loop's uprobe and uretprobe, while timed
    gc_probes: list[Uprobes] = field(default_factory=list)  # the GC's USDT sites, where used
    seen: Deltas[int] = field(default_factory=Deltas)  # code -> (count, total_ns, hist) at the last read
    skipped: set[int] = field(default_factory=set)  # code objects turned off (name matched, function did not)
    gc: Deltas[None] = field(default_factory=Deltas)  # one key: the process's collections
    entries: int = 0  # eval entries probed, at the last read (or 0 when the probes went in)
    read_at: float = field(default_factory=time.monotonic)  # ... and when


class _CallStream(TraceStream):
    """A capture's timed calls (bpf/python_exact.bpf.c): each names its code object; collections name none."""

    def __init__(self, bpf, function: Callable[[int, int], Frame | None]):
        super().__init__(bpf)
        self._function = function  # (pid, code object) -> the timed function (PythonTimer.function)

    def labels(self, pid: int, recs: np.ndarray) -> Labels:
        codes = set(recs["seq"][recs["kind"] == TRACE_PY_CALL].tolist()) - {0}
        named = {(TRACE_PY_CALL, code): self._function(pid, code) for code in codes}
        return {(TRACE_PY_CALL, 0): GC_LABEL} | {k: f for k, f in named.items() if f is not None}


class PythonTimer:
    """Times the chosen functions of watched CPython processes. Not thread-safe: one caller."""

    def __init__(self, traced: tuple[TracedFunction, ...] | list[TracedFunction] = ()):
        self.selection = Selection(tuple(traced))
        names = self.selection.names()
        if len(names) > NAME_SLOTS:
            raise ValueError(f"at most {NAME_SLOTS - 2} functions can be traced by name, not {len(names) - 2}")
        self._names = names
        self._bpf = None
        self._trace: _CallStream | None = None
        self._watched: dict[int, _Watched] = {}
        # peers -> why that group is not timed (PythonTimer.stop): never probed again while one of it is known
        self._stopped: dict[str, str] = {}
        # pid -> its peers, for every process watched or stopped before it could be: the group's _stopped entry
        # leaves with the last of them (a job none of whose processes could be watched would keep it for good)
        self._members: dict[int, str] = {}
        self.functions = bool(self.selection.traced)  # eval loop probed; named functions keep it on

    @property
    def bpf(self):
        if self._bpf is None:
            try:
                bpf = compile_bpf(bpf_sources.text("python_exact.bpf.c"), [])
            except Exception as e:  # bcc raises bare Exception for compile and load failures
                raise TimerError(f"cannot build the Python timer (root, kernel headers?): {e}") from e
            table = bpf[PYX_NAMES]
            for i, name in enumerate(self._names):
                raw = name.encode()
                leaf = table.Leaf()
                leaf.len = len(raw)
                padded = raw[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
                for w in range(NAME_BYTES // 8):
                    leaf.w[w] = struct.unpack_from("<Q", padded, 8 * w)[0]
                table[ctypes.c_int(i)] = leaf
            self._bpf = bpf
            self._trace = _CallStream(bpf, self.function)
        return self._bpf

    def trace_streams(self) -> list[TraceStream]:
        """The timer's capture stream (timed calls, collections), once it has a program."""
        return [self._trace] if self._bpf is not None else []

    def attach(self, interp: Interpreter, peers: str | None = None) -> None:
        """Time `interp`'s process from now on: its garbage collections, and its chosen functions while
        `functions` is on; TimerError says why the functions cannot be. `peers` (the job's id) names the
        processes whose functions are timed together or not at all; by default the process alone."""
        pid = interp.pid
        if pid in self._watched:
            return
        w = self._watched[pid] = _Watched(interp, CodeResolver(interp), f"pid {pid}" if peers is None else peers)
        self._members[pid] = w.peers
        try:
            self._time_gc(w, self._path(w))
        except (TimerError, OSError) as e:  # the functions can still be timed
            log.warning("pid %d: garbage collections not timed: %s", pid, e)
        if self.functions:
            self._probe_eval(w)

    def stop(self, peers: str, why: str, pid: int | None = None) -> None:
        """Stop timing the functions of every process of `peers`, and of any that joins it later, for good:
        one of them (`pid`, when it is not watched) enters eval too often, or cannot be timed at all. Timed
        beside untimed peers, a rank would look slower by the probes' cost (~1.3 us an entry: a 2-rank MLP's
        rank timed alone ran 7% longer on its CPU, and was named a straggler)."""
        self._stopped.setdefault(peers, why)
        if pid is not None:
            self._members.setdefault(pid, peers)
        for w in self._watched.values():
            if w.peers == peers:
                w.eval_probes = uprobe_links.detach(w.eval_probes)

    def set_functions(self, on: bool) -> None:
        """Probe the eval loop of every watched process (on: forward, data-loader __next__ and named
        functions are timed) or not (off; named functions keep it on)."""
        self.functions = on or bool(self.selection.traced)
        for w in self._watched.values():
            if self.functions and not w.eval_probes:
                try:
                    self._probe_eval(w)
                except TimerError as e:
                    log.warning("%s", e)
            elif not self.functions and w.eval_probes:
                w.eval_probes = uprobe_links.detach(w.eval_probes)

    @staticmethod
    def _path(w: _Watched) -> str:
        try:
            return procfs.mapped_path_of(w.interp.pid, w.interp.elf_path)
        except OSError as e:
            raise TimerError(f"pid {w.interp.pid}: cannot reach {w.interp.elf_path}: {e.strerror}") from e

    def _probe_eval(self, w: _Watched) -> None:
        """Probe the eval loop of `w`'s process (uprobe + uretprobe, for that process only)."""
        pid, interp = w.interp.pid, w.interp
        if w.peers in self._stopped:
            return
        if interp.layout.version < (3, 11) and not self.selection.traced:
            raise TimerError(f"pid {pid}: CPython {interp.version} enters the eval loop on every call; "
                             "forward and __next__ are timed there only with --trace-function")
        path = self._path(w)
        try:
            address = exported_functions(path).get(EVAL)
            if address is None:
                raise TimerError(f"pid {pid}: {interp.elf_path} does not export {EVAL}")
            offsets = [file_offset(path, address)]
        except SymbolError as e:
            raise TimerError(f"pid {pid}: {e}") from e
        bpf = self.bpf  # compiled on first use: light mode on interpreters with gc_collect_main needs none
        lay = interp.layout
        conf = bpf[PYX_TARGETS].Leaf()
        conf.frame_code, conf.code_name = lay.frame_code, lay.code_name
        conf.unicode_length, conf.unicode_ascii_size = lay.unicode_length, lay.unicode_ascii_size
        conf.code_tag_mask = lay.code_tag_mask
        # Its rate counts from the moment its entries do: after the compile above (seconds), before attaching
        # (the entry probe counts while the return probe goes in, which under load takes up to a second).
        w.entries, w.read_at = 0, time.monotonic()
        bpf[PYX_TARGETS][ctypes.c_uint32(pid)] = conf
        try:
            for fn, returns in (("pyx_enter", False), ("pyx_return", True)):
                w.eval_probes.append(uprobe_links.attach(bpf, fn, path, offsets, returns=returns, pid=pid))
        except UprobeError as e:
            w.eval_probes = uprobe_links.detach(w.eval_probes)
            raise TimerError(f"pid {pid}: cannot probe {EVAL} in {interp.elf_path}: {e}") from e
        log.info("timing forward, loader __next__%s in pid %d", "".join(
            f", {t.module}:{t.qualname}" for t in self.selection.traced), pid)

    def _time_gc(self, w: _Watched, path: str) -> None:
        """Time garbage collections with the USDT probes, where the interpreter has no gc_collect_main
        symbol for the libpython probes (stripped builds such as Debian's) but has the probes. A USDT site
        runs only while its semaphore (a counter in the process) is non-zero: the kernel raises it while
        the probes are attached (agent/loader/usdt.py), so nothing is left armed whatever happens to the agent."""
        try:
            if "gc_collect_main" in functions(path, local=True):
                return
            probes = sdt_probes(path)
        except SymbolError as e:
            raise TimerError(str(e)) from e
        start, done = probes.get(GC_START), probes.get(GC_DONE)
        if start is None or done is None:
            log.info("pid %d: %s has neither gc_collect_main nor GC USDT probes: GC not timed", w.interp.pid, path)
            return
        pid = w.interp.pid
        try:
            for site, fn in ((start, "pyx_gc_enter"), (done, "pyx_gc_return")):
                w.gc_probes.append(usdt.attach(self.bpf, fn, path, site.address, site.semaphore, pid))
        except usdt.UsdtError as e:
            w.gc_probes = uprobe_links.detach(w.gc_probes)
            raise TimerError(f"cannot probe the GC's USDT sites in {path}: {e}") from e

    def detach(self, pid: int) -> None:
        """Stop timing `pid` (alive or not); what it did since the last read is dropped."""
        peers = self._members.pop(pid, None)
        if peers is not None and peers not in self._members.values():  # its job's last: the job is gone
            self._stopped.pop(peers, None)
        w = self._watched.pop(pid, None)
        if w is None:
            return
        uprobe_links.detach(w.gc_probes + w.eval_probes)
        w.resolver.close()
        bpf = self._bpf
        if bpf is None:  # never probed anything
            return
        bpf[PYX_TARGETS].pop(ctypes.c_uint32(pid), None)
        bpf[PYX_GC].pop(ctypes.c_uint32(pid), None)
        for name in (PYX_STATS, PYX_VERDICT):
            table = bpf[name]
            for key in [k for k in table.keys() if k.pid == pid]:
                table.pop(key, None)

    def untimed(self, pid: int) -> str:
        """Why `pid`'s functions are not timed exactly ("" while they are, or were never asked for)."""
        w = self._watched.get(pid)
        return self._stopped.get(w.peers, "") if w is not None else ""

    def function(self, pid: int, code: int) -> Frame | None:
        """The function a timed code object of `pid` is; None if it is not one of the chosen (the kernel
        picks code objects by co_name alone) or the process is not watched."""
        w = self._watched.get(pid)
        if w is None:
            return None
        frame = w.resolver.resolve(code)
        return frame if self.selection.wants(frame, w.interp.layout.code_qualname is not None) else None

    def read(self) -> dict[int, list[PyTimed]]:
        """Per watched pid, the timed functions' calls completed since the previous read, most time first."""
        if self._bpf is None:
            return {}
        self._bound_cost()
        stats, verdicts = self._bpf[PYX_STATS], self._bpf[PYX_VERDICT]
        per_pid: dict[int, dict[str, PyTimed]] = {}
        for key, val in entries(stats):
            w = self._watched.get(key.pid)
            if w is None or key.code in w.skipped:
                continue
            frame = w.resolver.resolve(key.code)
            if not self.selection.wants(frame, w.interp.layout.code_qualname is not None):
                w.skipped.add(key.code)  # a __next__ that is no data loader's, ...: stop timing it
                verdicts[key] = ctypes.c_uint8(VERDICT_SKIP)
                stats.pop(key, None)
                continue
            count, total_ns, hist = w.seen.step(key.code, (val.count, val.total_ns, list(val.hist)))
            if count <= 0:
                continue
            row = PyTimed(name=function_name(frame), count=count, total_s=total_ns / 1e9,
                          max_s=histograms.window_max_s(val.max_ns, hist))
            rows = per_pid.setdefault(key.pid, {})
            if row.name in rows:  # code objects of one name (a function redefined, same-named classes)
                rows[row.name] = rows[row.name].merged(row)
            else:
                rows[row.name] = row
        return {pid: sorted(rows.values(), key=lambda r: -r.total_s)[:TOP_TIMED] for pid, rows in per_pid.items()}

    def _bound_cost(self) -> None:
        """Stop probing the eval loop of processes that entered it too often since the previous read, and
        of their peers."""
        targets = self._bpf[PYX_TARGETS]
        now = time.monotonic()
        for pid, w in list(self._watched.items()):
            try:
                probed = targets[ctypes.c_uint32(pid)].entries
            except KeyError:
                continue
            rate = (probed - w.entries) / max(now - w.read_at, 1e-3)
            w.entries, w.read_at = probed, now
            if rate > MAX_ENTRIES_PER_S and w.eval_probes:
                log.warning("pid %d enters the Python eval loop %.0f times a second: exact timing stopped for "
                            "it and its peers in %s (it would cost ~%.0f%% of a core)", pid, rate, w.peers,
                            rate * 1.3e-4)
                self.stop(w.peers, f"pid {pid} of its job entered the Python eval loop {rate:,.0f} times a second "
                                   f"(timing costs ~1.3 us an entry; stopped above {MAX_ENTRIES_PER_S:,})")

    def read_gc(self) -> dict[int, FunctionStats]:
        """Per pid whose collections are timed through USDT, its collections since the previous read."""
        if self._bpf is None:
            return {}
        out = {}
        for key, val in entries(self._bpf[PYX_GC]):
            w = self._watched.get(key.value)
            if w is None:
                continue
            count, total_ns, hist = w.gc.step(None, (val.count, val.total_ns, list(val.hist)))
            if count > 0:
                max_s = histograms.window_max_s(val.max_ns, hist)
                out[key.value] = FunctionStats(
                    name=GC_NAME, role=Role.GC, count=count, total_s=total_ns / 1e9, max_s=max_s,
                    p50_s=min(histograms.percentile_s(hist, 0.5), max_s),
                    p99_s=min(histograms.percentile_s(hist, 0.99), max_s))
        return out

    def counters(self) -> dict[str, int]:
        """Totals since load: timed calls nested too deep to be timed, code objects whose name was unreadable."""
        if self._bpf is None:
            return dict.fromkeys(COUNTER_NAMES, 0)
        table = self._bpf[PYX_COUNTERS]
        return {name: sum(table[ctypes.c_int(i)]) for i, name in enumerate(COUNTER_NAMES)}

    def close(self) -> None:
        # Every process's probes at once: their removals overlap (see loader/uprobe_links.py).
        uprobe_links.detach([p for w in self._watched.values() for p in w.gc_probes + w.eval_probes])
        for w in self._watched.values():
            w.resolver.close()
        self._watched.clear()
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf, self._trace = None, None


class PythonTiming(Source):
    """Each rank's exactly timed Python functions (`python_timed` in the pattern) and, on interpreters
    without gc_collect_main, its garbage collections (`gc__start` among its functions). Times the processes
    the frame sampler reads (it finds their interpreter), so it is listed after PythonFrames."""

    def __init__(self, sampler: PythonSampler, traced: tuple[TracedFunction, ...], detail: Detail):
        self.sampler = sampler
        self.timer = PythonTimer(traced)
        self.timer.set_functions(detail.hot_probes)

    def attach(self, target: Target) -> None:
        """Times `target` with its job's other ranks; one that cannot be timed leaves them all untimed."""
        interp = self.sampler.interpreter(target.pid)
        job = target.identity.job
        if interp is None:  # no Python frames either (PythonFrames said why)
            self.timer.stop(job, f"pid {target.pid} of its job cannot be timed: "
                                 f"{target.python_error or 'no Python interpreter'}", target.pid)
            return
        try:
            self.timer.attach(interp, job)
        except PythonAttachError as e:
            log.warning("pid %d: no exact Python timing: %s", target.pid, e)
            self.timer.stop(job, f"pid {target.pid} of its job cannot be timed: {e}", target.pid)

    def set_detail(self, detail: Detail) -> None:
        self.timer.set_functions(detail.hot_probes)

    def fill(self, patterns: list[RankPattern]) -> None:
        timed = self.timer.read()
        gc = self.timer.read_gc()
        for p in patterns:
            p.python_timed = timed.get(p.pid, [])
            p.python_untimed = self.timer.untimed(p.pid)
            if p.pid in gc:
                p.functions = p.functions.with_function(gc[p.pid])

    def trace_streams(self) -> list[TraceStream]:
        return self.timer.trace_streams()

    def forget(self, pid: int) -> None:
        self.timer.detach(pid)  # after the last read: its uprobes leave with the process anyway

    def close(self) -> None:
        self.timer.close()
