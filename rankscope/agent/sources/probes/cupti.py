"""GPU activity from the rankscope CUPTI shim, read through its USDT probes. BPF side: bpf/cupti.bpf.c, and
bpf/cupti_launch.bpf.c for kernel launches joined to their kernels (deep mode only: the shim enables CUPTI's
API records, which cost time on every launch, only while the launch probe is attached). The same library is
also NCCL's profiler plugin: its probes are attached here too (one program per process), their maps read by
probes/nccl_profiler.py's types.

Unlike the uprobe kinds (one program for every library file), a USDT probe with a semaphore is enabled per
process: attaching raises the process's semaphore, which is what turns the shim's hand-off on. So each
process that maps the shim gets its own small program (about a second of clang to build).

The semaphore is left to the kernel (agent/loader/usdt.py): it is raised while the probe is attached and lowered
when the agent's file descriptors close, even if the agent is SIGKILLed. bcc's own USDT attach writes the
semaphore through /proc/PID/mem instead, and a killed agent would leave it raised: bcc is used only to
generate the argument readers.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

import numpy as np

from rankscope import bpf as bpf_sources
from rankscope.agent.host import procfs
from rankscope.agent.host.symbols import SymbolError, sdt_probes
from rankscope.agent.host.targets import TargetError, mapped_libraries
from rankscope.agent.loader import uprobe_links, usdt
from rankscope.agent.loader.bcc import compile_bpf
from rankscope.agent.loader.histograms import percentile_s
from rankscope.agent.loader.maps import entries
from rankscope.agent.loader.program import ProbeError
from rankscope.agent.loader.trace_stream import TRACE_GPU, TRACE_NCCL, Labels, TraceStream
from rankscope.agent.loader.uprobe_links import Uprobes
from rankscope.agent.sources.deltas import Deltas
from rankscope.agent.sources.probes.nccl_profiler import COLL_PROBE, LINK_PROBE, CollTotals, LinkTotals
from rankscope.schema.patterns import KERNEL_NAME_CHARS, NCCL_KERNELS, TOP_KERNELS, GpuActivity, GpuKernel

# One shim per CUDA major (librankscope_cupti12.so, ...13.so); the same probes in each. Unnumbered: a shim built
# before there were two lines, still loaded by a running job.
SHIM_LIBRARY = re.compile(r"^librankscope_cupti(\d+)?\.so$")
PROVIDER, PROBE, LAUNCH_PROBE, BATCH_PROBE = "rankscope", "activity", "launch", "activities"
BPF_SOURCES = ("cupti_launch.bpf.c", "cupti.bpf.c", "nccl_profiler.bpf.c")  # one program of the three
# The shim's probes and their BPF functions. All but the launch probe (deep mode only) are attached for the
# life of the reader; all but the activity probe may be absent from shims built before them. The records come
# in batches (one trap per batch) where the shim has the batch probe, else one trap per record: one of the two.
PROBE_FUNCTIONS = {PROBE: "on_activity", LAUNCH_PROBE: "on_launch", COLL_PROBE: "on_nccl_coll",
                   LINK_PROBE: "on_nccl_link", BATCH_PROBE: "on_activities"}
ALWAYS_ATTACHED = (COLL_PROBE, LINK_PROBE)

# CUpti_ActivityKind values of the records the shim enables.
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_CONCURRENT_KERNEL = 10
KERNEL_KINDS = (KIND_KERNEL, KIND_CONCURRENT_KERNEL)
MAX_NAME = 512  # bytes read of a kernel name (mangled C++ names can be long; patterns truncate further)
# BPF maps read here (their C declarations: bpf/*.bpf.c).
RAW_ACTIVITY = "raw_activity"  # ring buffer: every activity record, while raw_on (deep detail)
RAW_ON = "raw_on"  # [0] = 1: stream raw records
JOIN_ON = "join_on"  # [0] = 1: kernels are joined to their launches (the launch probe is attached)
GPU_ACTIVITY = "gpu_activity"  # (pid, kind, name) -> count, GPU time, histogram
GPU_BUSY = "gpu_busy"  # (pid, device) -> time any kernel ran
SHIM_LOST = "shim_lost"  # pid -> records the shim lost (CUPTI's drops, its rate limits), as it last said
LAUNCH_QUEUE = "launch_queue"  # pid -> launches joined to their kernels, total launch-to-start delay
LAUNCH_QUEUE_HIST = "launch_queue_hist"  # (pid, log2 slot) -> launches
NCCL_COLL_GPU = "nccl_coll_gpu"  # (pid, NCCL function name) -> GPU spans of its collectives
NCCL_LINKS = "nccl_links"  # (pid, rank, comm, peer, send) -> steps, bytes, wire and peer-wait time


@dataclass(frozen=True)
class ActivityStats:
    """Cumulative totals of one record kind and kernel in one process."""

    kind: int
    name: str  # kernel name, "" for copies and sets
    count: int
    total_ns: int
    bytes: int
    hist: tuple[int, ...]


@dataclass(frozen=True)
class LaunchStats:
    """Cumulative launches of one process joined to their kernels, and their queue delays (kernel GPU start
    - launch API end) as a log2 histogram."""

    joined: int
    total_ns: int
    hist: tuple[int, ...]


@dataclass(frozen=True)
class RawActivity:
    """One record as the shim emitted it (deep mode only)."""

    pid: int
    kind: int
    start_ns: int  # GPU timestamps (CUPTI's clock)
    end_ns: int
    device: int
    stream: int
    correlation: int
    name: str
    bytes: int


class _RawRecord(ctypes.Structure):
    """struct raw_activity of bpf/cupti.bpf.c, as the ring buffer hands it over. Declared here rather than
    derived from the compiled module by bcc (RingBuf.event), which a program from the cache has not."""

    _fields_ = [("pid", ctypes.c_uint32), ("kind", ctypes.c_uint32), ("start", ctypes.c_uint64),
                ("end", ctypes.c_uint64), ("device", ctypes.c_uint32), ("stream", ctypes.c_uint32),
                ("correlation", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("name", ctypes.c_uint64),
                ("bytes", ctypes.c_uint64)]


def shim_path(pid: int) -> str | None:
    """The shim as mapped by `pid`, reached through /proc/PID/root; None when the process does not load it."""
    try:
        return mapped_libraries(pid, {"shim": SHIM_LIBRARY}).get("shim")
    except TargetError:  # exited, or not readable
        return None


def semaphore_address(path: str, probe_name: str = PROBE) -> int:
    """Link-time address of the semaphore of the shim's probe `probe_name`, from its SDT note; 0 for an
    optional probe of a shim built before it had one."""
    try:
        probe = sdt_probes(path).get((PROVIDER, probe_name))
    except SymbolError as e:
        raise ProbeError(str(e)) from e
    if probe_name != PROBE and probe is None:
        return 0
    if probe is None or not probe.semaphore:
        raise ProbeError(f"{path} has no guarded {PROVIDER}:{probe_name} probe: not the rankscope CUPTI shim")
    return probe.semaphore


def _probe_sites(usdt_class, pid: int, probes: dict[str, str]) -> tuple[str, dict[str, list[tuple[bytes, int]]]]:
    """bcc's generated argument readers for `probes` (probe -> BPF function), and each function's sites
    (binary, address). bcc raises the semaphores when it enables the probes and lowers them when its context
    is freed, on return from here."""
    ctx = usdt_class(pid=pid)
    for probe, fn in probes.items():
        ctx.enable_probe(probe=probe, fn_name=fn)
    sites: dict[str, list[tuple[bytes, int]]] = {fn: [] for fn in probes.values()}
    for binpath, fn, addr, _pid in ctx.enumerate_active_probes():
        sites[fn.decode() if isinstance(fn, bytes) else fn].append((binpath, addr))
    return ctx.get_text(), sites


class _GpuStream(TraceStream):
    """A capture's GPU records of one process (bpf/cupti.bpf.c, bpf/nccl_profiler.bpf.c): each names its
    kernel or NCCL function by a pointer into the process."""

    def __init__(self, bpf, reader: CuptiReader):
        super().__init__(bpf)
        self._reader = reader

    def labels(self, pid: int, recs: np.ndarray) -> Labels:
        if pid != self._reader.pid:
            return {}
        named = recs[(recs["kind"] == TRACE_GPU) | (recs["kind"] == TRACE_NCCL)]
        return {(kind, ptr): self._reader.name(ptr) for kind, ptr in set(zip(named["kind"].tolist(),
                                                                             named["seq"].tolist()))}


class CuptiReader:
    """The shim's records of one process: in-kernel aggregates, and raw records on demand."""

    def __init__(self, pid: int, batches: bool = True):
        """`batches`: take the shim's records in batches where it can (False: one trap per record, as from a
        shim without batches; for comparing the two)."""
        try:
            from bcc import USDT
        except ImportError as e:
            raise ProbeError("bcc is not importable: run scripts/install (Debian's python3-bpfcc)") from e
        path = shim_path(pid)
        if path is None:
            raise ProbeError(f"pid {pid} does not load the rankscope CUPTI shim")
        self.pid = pid
        self._names: dict[int, str] = {0: ""}
        self._raw: list[RawActivity] = []
        self._probes: list[Uprobes] = []
        self._launch_probes: list[Uprobes] = []
        self._semaphores = {probe: semaphore_address(path, probe) for probe in PROBE_FUNCTIONS}  # 0: absent
        if not batches:
            self._semaphores[BATCH_PROBE] = 0
        probes = {probe: fn for probe, fn in PROBE_FUNCTIONS.items() if self._semaphores[probe]}
        try:
            readers, self._sites = _probe_sites(USDT, pid, probes)
            self._bpf = compile_bpf(readers + bpf_sources.text(*BPF_SOURCES), [])
        except Exception as e:  # bcc raises bare Exception for USDT and compile failures
            raise ProbeError(f"cannot load the CUPTI shim probe for pid {pid}: {e}") from e
        self.trace = _GpuStream(self._bpf, self)
        try:  # NCCL's plugin, like the shim, hands over nothing until its probes' semaphores are up
            self._probes += self._attach_records()
            for probe in ALWAYS_ATTACHED:
                if self._semaphores[probe]:
                    self._probes += self._attach(probe)
        except ProbeError:
            self.close()
            raise
        self._bpf[RAW_ACTIVITY].open_ring_buffer(self._on_raw)

    def _attach(self, probe: str) -> list[Uprobes]:
        """Attaches the probe's function at each of its sites, the kernel raising its semaphore; all or none."""
        fn = PROBE_FUNCTIONS[probe]
        attached: list[Uprobes] = []
        for binpath, addr in self._sites[fn]:
            try:
                attached.append(usdt.attach(self._bpf, fn, binpath.decode(), addr, self._semaphores[probe], self.pid))
            except usdt.UsdtError as e:
                uprobe_links.detach(attached)
                raise ProbeError(f"cannot attach to the CUPTI shim of pid {self.pid}: {e}") from e
        return attached

    def _attach_records(self) -> list[Uprobes]:
        """The batch probe where the shim has it and this kernel's verifier takes its loop, else one trap a
        record. Attaching one raises its semaphore, which selects the shim's hand-over."""
        if self._semaphores[BATCH_PROBE]:
            try:
                return self._attach(BATCH_PROBE)
            except ProbeError:
                pass
        return self._attach(PROBE)

    @property
    def launches_on(self) -> bool:
        return bool(self._launch_probes)

    def set_launches(self, on: bool) -> None:
        """Deep mode: attach the launch probe, which has the shim enable CUPTI's API records (a cost on
        every launch of the job) and hand over kernel launches to be joined to their kernels. A shim
        without the probe stays without launches."""
        if on and not self._launch_probes and self._semaphores[LAUNCH_PROBE]:
            self._launch_probes = self._attach(LAUNCH_PROBE)
        elif not on:
            self._launch_probes = uprobe_links.detach(self._launch_probes)
        self._bpf[JOIN_ON][ctypes.c_int(0)] = ctypes.c_uint32(int(self.launches_on))

    def set_raw(self, on: bool) -> None:
        """Deep mode: also send every record to user space (collected by poll_raw)."""
        table = self._bpf[RAW_ON]
        table[ctypes.c_int(0)] = ctypes.c_uint32(int(on))

    def poll_raw(self, timeout_ms: int = 0) -> list[RawActivity]:
        self._bpf.ring_buffer_poll(timeout_ms)
        out, self._raw = self._raw, []
        return out

    def _on_raw(self, _ctx, data, _size) -> None:
        r = ctypes.cast(data, ctypes.POINTER(_RawRecord)).contents
        self._raw.append(RawActivity(r.pid, r.kind, r.start, r.end, r.device, r.stream, r.correlation,
                                     self.name(r.name), r.bytes))

    def activity(self) -> list[ActivityStats]:
        """Cumulative totals per record kind and kernel since attach."""
        return [ActivityStats(k.kind, self.name(k.name), v.count, v.total_ns, v.bytes, tuple(v.hist))
                for k, v in entries(self._bpf[GPU_ACTIVITY]) if k.pid == self.pid]

    def launches(self) -> LaunchStats:
        """Cumulative launches joined to their kernels since attach (counting while the probe was on)."""
        v = self._bpf[LAUNCH_QUEUE].get(ctypes.c_uint32(self.pid))
        if v is None:
            return LaunchStats(0, 0, ())
        slots = {k.slot: n.value for k, n in entries(self._bpf[LAUNCH_QUEUE_HIST]) if k.pid == self.pid}
        return LaunchStats(v.joined, v.total_ns, tuple(slots.get(s, 0) for s in range(max(slots, default=-1) + 1)))

    def nccl_colls(self) -> list[CollTotals]:
        """Cumulative GPU-side spans of NCCL collectives per function since attach (NCCL profiler plugin)."""
        return [CollTotals(self.name(k.func), v.count, v.total_ns, tuple(v.hist))
                for k, v in entries(self._bpf[NCCL_COLL_GPU]) if k.pid == self.pid]

    def nccl_links(self) -> list[LinkTotals]:
        """Cumulative network steps per (communicator, peer, direction) since attach (NCCL profiler plugin)."""
        return [LinkTotals(k.comm, k.rank, k.peer, bool(k.send), v.steps, v.bytes, v.wire_ns, v.peer_wait_ns)
                for k, v in entries(self._bpf[NCCL_LINKS]) if k.pid == self.pid]

    def lost(self) -> int:
        """Records the shim lost since the process started (CUPTI's full buffers, the shim's rate limits), as
        of its latest batch; 0 for a shim without batches."""
        v = self._bpf[SHIM_LOST].get(ctypes.c_uint32(self.pid))
        return v.value if v is not None else 0

    def busy_ns(self) -> dict[int, int]:
        """Cumulative GPU busy time per device (union of activity intervals) since attach."""
        return {k.device: v.busy_ns for k, v in entries(self._bpf[GPU_BUSY]) if k.pid == self.pid}

    def name(self, pointer: int) -> str:
        """A kernel name from CUPTI's string in the process, read once per pointer (CUPTI keeps one string
        per kernel for the life of the process; NCCL's function names are constants)."""
        if pointer not in self._names:
            try:
                with procfs.ProcessMemory(self.pid) as mem:
                    raw = mem.read_upto(pointer, MAX_NAME)
            except OSError:
                return "?"  # not cached: the process may be gone, or the pointer bad
            self._names[pointer] = raw.split(b"\0", 1)[0].decode(errors="replace")
        return self._names[pointer]

    def close(self) -> None:
        """Detach: removing the probes lowers the process's semaphores (the kernel does it)."""
        self._launch_probes = self._probes = uprobe_links.detach(self._launch_probes + self._probes)
        self.trace.close()
        self._bpf.cleanup()


_MANGLED_PART = re.compile(r"(\d+)")


def short_kernel_name(name: str) -> str:
    """A readable name that fits a pattern: the innermost identifier of an Itanium-mangled name
    (`_ZN2at6native29vectorized_elementwise_kernelILi4E...` -> `vectorized_elementwise_kernel`), with its
    enclosing one when it is a generic word like `Kernel`; plain C names as they are. Not a demangler."""
    if not name.startswith("_Z"):
        return name[:KERNEL_NAME_CHARS]
    nested = name.startswith("_ZN")  # `_ZN<len><id>...E`: qualified; `_Z<len><id>`: a free function
    i = 3 if nested else 2
    parts: list[str] = []
    while i < len(name) and name[i].isdigit() and (nested or not parts):
        digits = _MANGLED_PART.match(name, i).group(1)
        start = i + len(digits)
        parts.append(name[start:start + int(digits)])
        i = start + int(digits)
    if not parts:
        return name[:KERNEL_NAME_CHARS]
    short = "::".join(parts[-2:]) if parts[-1].lower() in ("kernel", "device_kernel") and len(parts) > 1 else parts[-1]
    return short[:KERNEL_NAME_CHARS]


class ActivityWindow:
    """Turns a reader's cumulative totals into one window's GpuActivity (the kernel maps only grow)."""

    def __init__(self) -> None:
        self._activity: Deltas[tuple[int, str]] = Deltas()  # (kind, name) -> (count, total_ns)
        self._busy: Deltas[int] = Deltas()  # device -> (busy_ns,)
        self._launches: Deltas[None] = Deltas()  # one key: (joined, hist), while launches are measured

    def next(self, activity: list[ActivityStats], busy: dict[int, int],
             launches: LaunchStats | None = None) -> GpuActivity:
        """`launches`: the reader's joined launches while its launch probe is on, else None (not measured)."""
        kernel_ns: dict[str, list[int]] = {}  # short name -> [count, ns]
        copy_ns = comm_ns = 0
        added = self._activity.read(((a.kind, a.name), (a.count, a.total_ns)) for a in activity)
        for a, (count, ns) in zip(activity, added):
            if a.kind in KERNEL_KINDS:
                name = short_kernel_name(a.name)
                entry = kernel_ns.setdefault(name, [0, 0])
                entry[0] += count
                entry[1] += ns
                if name.startswith(NCCL_KERNELS):
                    comm_ns += ns
            else:
                copy_ns += ns
        busy_ns = sum(b for b, in self._busy.read((dev, (b,)) for dev, b in busy.items()))
        top = sorted(((ns, name, count) for name, (count, ns) in kernel_ns.items() if count), reverse=True)
        gpu = GpuActivity(busy_s=busy_ns / 1e9, kernel_s=sum(ns for _, ns in kernel_ns.values()) / 1e9,
                          copy_s=copy_ns / 1e9, kernels=sum(c for c, _ in kernel_ns.values()),
                          top=[GpuKernel(name, count, ns / 1e9) for ns, name, count in top[:TOP_KERNELS]],
                          comm_kernel_s=comm_ns / 1e9)
        if launches is not None:
            gpu.launches, hist = self._launches.step(None, (launches.joined, launches.hist))
            gpu.queue_p50_s, gpu.queue_p99_s = percentile_s(hist, 0.5), percentile_s(hist, 0.99)
        return gpu
