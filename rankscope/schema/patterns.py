"""Behavior patterns: the compact per-rank, per-window summary that travels from agents to analyzers.

A pattern says, for one rank and one observation window, how much time the rank spent in each probed
function and what role that function plays (launching work, waiting for its own GPU work, waiting for a
collective, ...), plus the timing of its last few collectives so that ranks can be lined up against each
other (who arrived last, who finished last).  Times are seconds; instants are unix seconds, so patterns
from different nodes compare.  Their wire encoding is wire.py.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, overload

import numpy as np

SCHEMA_VERSION = 3  # 2: roles as codes, collective ops as a table, instants as deltas; 3: scheduler view


class Role(str, Enum):
    """What the time spent in a function means for the rank; the analyzer reasons on roles, not names."""

    LAUNCH = "launch"  # host enqueues GPU work (cuLaunchKernel): cheap unless the host is launch-bound
    SYNC = "sync"  # host blocks until its own GPU work is done: the GPU's compute time as the host sees it
    COMM = "comm"  # a collective from enqueue until the host sees it complete (waiting for peers + transfer)
    COPY = "copy"  # host <-> device copies
    ALLOC = "alloc"  # device memory management
    SETUP = "setup"  # one-off calls (init, communicator set-up)
    GC = "gc"  # the Python garbage collector: the interpreter stops the rank's Python code while it runs
    # The training thread waits for collectives it started earlier (DDP's reducer, at the end of backward, for
    # its buckets' all-reduces): the communication the step could not hide. The same time is COMM on the
    # collectives' own threads, so it is no part of the step's partition into roles (analyzer/metrics.py).
    EXPOSED = "exposed"

    @property
    def component(self) -> str:
        """The component (a finding's `component`, docs/api.md) that time in a function of this role belongs to."""
        return _COMPONENT[self]


_COMPONENT = {Role.SYNC: "gpu", Role.COMM: "link", Role.LAUNCH: "host", Role.COPY: "host", Role.ALLOC: "host",
              Role.SETUP: "host", Role.GC: "python", Role.EXPOSED: "link"}


@dataclass
class FunctionStats:
    """Time one rank spent in one probed function during the window."""

    name: str
    role: Role
    count: int
    total_s: float
    max_s: float
    p50_s: float
    p99_s: float
    bytes: int = 0  # payload of collectives and copies


@dataclass(frozen=True, eq=False, slots=True)
class FunctionColumns(Mapping[str, FunctionStats]):
    """A rank's function statistics, name -> FunctionStats, as two arrays rather than an object each: the
    analyzer joins 100,000 ranks' (1.1M statistics a window) in ~75 ms, where reading the objects cost ~0.19 s
    (analyzer/functions.py; a tuple per field read ~40 ms slower, its floats scattered over the heap). Each
    FunctionStats is built on access (the few readers of single functions: the rules' evidence, Prometheus);
    it is a copy, so change a rank's functions by replacing them whole (with_function)."""

    names: tuple[str, ...]
    roles: tuple[Role, ...]
    calls: np.ndarray  # int64, functions x 2: count, bytes
    times: np.ndarray  # float64, functions x 4: total, max, p50, p99 (s)

    @classmethod
    def of(cls, functions: Mapping[str, FunctionStats]) -> FunctionColumns:
        """From name -> FunctionStats (the name is the key)."""
        stats = list(functions.values())
        return cls(tuple(functions), tuple(Role(f.role) for f in stats),
                   np.array([(f.count, f.bytes) for f in stats], np.int64).reshape(-1, 2),
                   np.array([(f.total_s, f.max_s, f.p50_s, f.p99_s) for f in stats], float).reshape(-1, 4))

    def with_function(self, f: FunctionStats) -> FunctionColumns:
        """These statistics with `f`'s set under its name (in place of the old, or added last)."""
        return FunctionColumns.of({**self, f.name: f})

    def __getitem__(self, name: str) -> FunctionStats:
        try:
            i = self.names.index(name)  # a dozen names: no index to build
        except ValueError:
            raise KeyError(name) from None
        (count, nbytes), (total, mx, p50, p99) = self.calls[i].tolist(), self.times[i].tolist()
        return FunctionStats(name, self.roles[i], count, total, mx, p50, p99, nbytes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class CollectiveRecord:
    """One collective as one rank saw it: when it was enqueued and when the host saw it complete."""

    op: str
    bytes: int
    enter: float  # unix s
    done: float  # unix s


@dataclass(frozen=True, eq=False, slots=True)
class CollectiveColumns(Sequence[CollectiveRecord]):
    """A rank's collectives, oldest first, as arrays rather than an object each: the analyzer joins 100,000
    ranks' (1.6M records a window) in ~0.1 s, where reading the objects cost ~0.28 s (analyzer/records.py).
    Two arrays of two columns, not four of one: half the arrays to allocate and to join (~30 ms less). Reads
    as a sequence of CollectiveRecord, each built on access (for the few readers of single records, tests)."""

    ops: tuple[str, ...]  # op names, which `op` indexes (the wire's table: first appearance first)
    keys: np.ndarray  # int64, records x 2: op, bytes
    instants: np.ndarray  # float64, records x 2: enter, done (unix s)

    @classmethod
    def named(cls, names: Iterable[str], nbytes: Any, enter: Any, done: Any) -> CollectiveColumns:
        """From each record's op name and the other columns (lists or arrays)."""
        index: dict[str, int] = {}
        op = [index.setdefault(name, len(index)) for name in names]
        return cls(tuple(index), np.column_stack((np.array(op, np.int64), np.asarray(nbytes, np.int64))),
                   np.column_stack((np.asarray(enter, float), np.asarray(done, float))))

    @classmethod
    def of(cls, records: Iterable[CollectiveRecord]) -> CollectiveColumns:
        recs = list(records)
        return cls.named([c.op for c in recs], [c.bytes for c in recs], [c.enter for c in recs],
                         [c.done for c in recs])

    @property
    def op(self) -> np.ndarray:
        return self.keys[:, 0]

    @property
    def bytes(self) -> np.ndarray:
        return self.keys[:, 1]

    @property
    def enter(self) -> np.ndarray:
        return self.instants[:, 0]

    @property
    def done(self) -> np.ndarray:
        return self.instants[:, 1]

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> CollectiveRecord: ...

    @overload
    def __getitem__(self, i: slice) -> CollectiveColumns: ...

    def __getitem__(self, i: int | slice) -> CollectiveRecord | CollectiveColumns:
        if isinstance(i, slice):
            return CollectiveColumns(self.ops, self.keys[i], self.instants[i])
        (op, nbytes), (enter, done) = self.keys[i].tolist(), self.instants[i].tolist()
        return CollectiveRecord(self.ops[op], nbytes, enter, done)

    def __iter__(self) -> Iterator[CollectiveRecord]:
        for (op, nbytes), (enter, done) in zip(self.keys.tolist(), self.instants.tolist()):
            yield CollectiveRecord(self.ops[op], nbytes, enter, done)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CollectiveColumns) and list(self) == list(other)


@dataclass(slots=True)
class ThreadTimes:
    """Where one group of a rank's threads spent the window, as the scheduler saw it."""

    role: str  # "main" (the training loop's thread), "comm" (NCCL/gloo/c10d threads), "other"
    threads: int
    on_cpu_s: float
    runq_s: float  # runnable but waiting for a CPU
    sleep_s: float  # asleep by choice (waiting on a lock, a condition, a timer)
    io_s: float  # blocked uninterruptibly (I/O, page faults)
    reclaim_s: float  # direct memory reclaim
    preempted: int  # involuntary context switches
    runq_p99_s: float


@dataclass
class HostCpus:
    """The CPUs a rank may run on (its affinity) and how idle they sat during the window, whoever ran there."""

    count: int
    idle: float  # share of their time, 0..1


@dataclass
class Neighbour:
    """A task that held the CPU right before a watched thread got it back after waiting for it."""

    name: str
    pid: int
    cgroup: str  # the last components of its cgroup path: which container or pod it is
    waited_s: float  # how long the rank's threads had waited before it let them run
    job: bool = False  # one of the job's own processes (a rank, or a rank's child: a DataLoader worker)


@dataclass
class PyFunction:
    """Wall time of one Python function of the rank's main thread during the window (from sampling)."""

    name: str  # "file.py:Qualified.name"
    self_s: float  # innermost: the function itself (and C code it called), on or off CPU
    total_s: float  # anywhere on the stack
    cpu_s: float  # the on-CPU part of self_s


@dataclass
class PyTimed:
    """Calls of one Python function timed exactly during the window (uprobes on the interpreter's eval loop):
    nn.Module forward, data-loader __next__, functions named with --trace-function."""

    name: str  # "file.py:Qualified.name"
    count: int  # calls completed in the window
    total_s: float
    max_s: float

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0

    def to_dict(self) -> dict[str, Any]:
        """As diagnosis evidence shows it."""
        return {"function": self.name, "count": self.count, "total_s": self.total_s, "mean_s": self.mean_s,
                "max_s": self.max_s}

    def merged(self, other: PyTimed) -> PyTimed:
        return PyTimed(self.name, self.count + other.count, self.total_s + other.total_s, max(self.max_s, other.max_s))


@dataclass
class GpuKernel:
    """One kernel's GPU time on the rank during the window (CUPTI shim)."""

    name: str  # short name (agent/sources/probes/cupti.py short_kernel_name), at most KERNEL_NAME_CHARS
    count: int
    total_s: float


@dataclass
class GpuActivity:
    """The rank's GPU work during the window, timed on the GPU by the CUPTI shim."""

    busy_s: float  # union of kernel, copy and set intervals, summed over the rank's devices
    kernel_s: float  # sum of kernel durations (overlapping kernels count twice)
    copy_s: float  # memcpy and memset durations
    kernels: int
    top: list[GpuKernel] = field(default_factory=list)  # by GPU time, largest first, at most TOP_KERNELS
    # Launches joined to their kernels by CUPTI correlation id (deep mode only; None: not measured) and their
    # queue delay, kernel GPU start - launch API end: ~0 when the GPU waits for the host, large when the host
    # runs ahead of a busy GPU.
    launches: int | None = None
    queue_p50_s: float = 0.0
    queue_p99_s: float = 0.0
    # NCCL's kernels' share of kernel_s: where collectives run on the GPU, a rank waiting for a peer waits inside
    # them, so kernel_s less this is the rank's own GPU work (None: an agent from before it was measured).
    comm_kernel_s: float | None = None


@dataclass
class GpuHealth:
    """NVML readings of the rank's GPU over the window; names follow DCGM's fields (see agent/sources/nvml.py).
    Whole units, so they pack as small integers (the pattern must stay near 1 KB)."""

    index: int  # NVML device index
    sm_clock_mhz: int  # mean of the window's samples
    max_sm_clock_mhz: int
    throttle_reasons: int  # OR of the window's clock event reason bits (idle and app settings left out)
    power_w: int
    temperature_c: int
    util_gpu_pct: int
    mem_used_mib: int
    pcie_tx_mbps: int  # MB/s
    pcie_rx_mbps: int
    nvlink_errors: int  # CRC, replay and recovery errors added during the window, all links
    ecc_dbe: int  # volatile double-bit ECC errors added during the window
    xids: list[int] = field(default_factory=list)  # XID codes seen during the window


@dataclass
class LinkStats:
    """The rank's network transfers with one peer of one NCCL communicator during the window, timed step by
    step in NCCL's proxy thread (rankscope's NCCL profiler plugin, cupti_shim/nccl_profiler.c)."""

    comm: int  # NCCL's commHash: the same on every member of the communicator
    rank: int  # this rank's rank in that communicator
    peer: int  # the peer's rank in that communicator
    send: bool  # True: this rank sends to the peer; False: it receives from the peer
    steps: int  # network transfers completed
    bytes: int
    wire_s: float  # summed over steps: on the network (send: posted until done; recv: posted until data arrived)
    peer_wait_s: float  # summed over steps, sends only: waiting for the receiver's clear-to-send credit


@dataclass
class TcpFlow:
    """One TCP connection of the rank during the window, from the kernel's own accounting (tcp_info's
    counters, bpf/net.bpf.c): how gloo and NCCL's socket transport move tensors between hosts."""

    local: str  # "address:port" of this end
    remote: str  # "address:port" of the other end: the peer's `local`
    sends: int  # send calls on it
    sent: int  # bytes this end sent that the peer acknowledged
    received: int
    wire_s: float  # the connection had data to send: busy, or held by its send buffer (jiffy resolution)
    peer_wait_s: float  # ...but the receiver's window was full: the peer did not read
    srtt_s: float  # smoothed round-trip time, last seen
    # The kernel's limit accounting beyond those (None: an agent that did not report it)
    sndbuf_s: float | None = None  # of wire_s, the time its send buffer held it: the sender's own limit
    retrans: int | None = None  # segments retransmitted: losses on the path
    min_rtt_s: float | None = None  # the connection's minimum round trip: srtt_s above it is queueing


@dataclass
class CollectiveGpu:
    """One collective op's GPU-side time on the rank during the window: from its first channel's kernel start
    to its last channel's end, on the GPU's own timer (NCCL profiler plugin)."""

    op: str  # the NCCL function, as the host-side probes name it: "ncclAllReduce", "ncclSend", ...
    count: int
    total_s: float
    p99_s: float


TOP_KERNELS = 3
# NCCL's collective kernels, by short name (ncclDevKernel_AllReduce_Sum_f32_RING_LL; ncclKernel_* before 2.19):
# the agent sums them into GpuActivity.comm_kernel_s, the analyzer leaves them out of a rank's own GPU work.
NCCL_KERNELS = ("ncclDevKernel", "ncclKernel")
KERNEL_NAME_CHARS = 30
MAX_LINKS = 8  # link rows per pattern, most bytes first (a ring or tree rank has 2-6 per communicator)


@dataclass(slots=True)
class RankPattern:
    """Everything the analyzer knows about one rank for one window. Slots, not an instance dict: the analyzer
    reads a field of 100,000 patterns ~30 times a window, each pass ~3 ms instead of ~6 (the function and
    collective columns and ThreadTimes likewise)."""

    job: str
    rank: int
    world_size: int
    pid: int
    host: str
    window_start: float  # unix s
    window_end: float  # unix s
    state: str = "running"  # "running" | "exited"
    # By name; a dict of FunctionStats (as tests and benchmarks write them) becomes columns.
    functions: FunctionColumns = field(default_factory=lambda: FunctionColumns.of({}))
    # Oldest first, bounded; a list of CollectiveRecord (as tests and benchmarks write them) becomes columns.
    collectives: CollectiveColumns = field(default_factory=lambda: CollectiveColumns.of(()))
    identity_source: str = "env"  # where rank/world/job came from: "nccl" | "env" | "pid"
    sched: dict[str, ThreadTimes] = field(default_factory=dict)  # by thread role
    neighbours: list[Neighbour] = field(default_factory=list)  # who took the CPU, most waited first
    major_faults: int = 0
    # The main thread's minor page faults and its on-CPU time in the kernel (page faults, system calls) this
    # window, from /proc (system time: tick-sampled, ~4 ms of resolution per window). None: unknown.
    minor_faults: int | None = None
    kernel_s: float | None = None
    last_progress: float | None = None  # unix s of the last collective seen completing since attach
    since: float | None = None  # unix s when the agent began watching this rank
    where: str = ""  # of a rank that completed nothing this window: e.g. "futex (futex_wait_queue)"
    python: list[PyFunction] = field(default_factory=list)  # main thread's top functions by self time
    python_timed: list[PyTimed] = field(default_factory=list)  # exactly timed functions, most time first
    python_untimed: str = ""  # why its functions are not timed exactly (too costly for this job); "" if not
    gpu: GpuActivity | None = None  # None: the job does not load the CUPTI shim
    gpu_health: GpuHealth | None = None  # None: no NVML, or the rank's GPU is unknown
    links: list[LinkStats] = field(default_factory=list)  # NCCL profiler plugin; at most MAX_LINKS
    collectives_gpu: list[CollectiveGpu] = field(default_factory=list)  # NCCL profiler plugin
    tcp: list[TcpFlow] = field(default_factory=list)  # busiest TCP connections, most bytes first
    # Recorded at a detail an agent raised for a slowdown (agent/detail.py): its probes cost the job time
    # themselves, so the window is not compared with the job's baseline (analyzer/baseline.py).
    raised_detail: bool = False
    cpus: HostCpus | None = None  # None: unknown (an older agent, or the process exited)

    def __post_init__(self) -> None:
        if not isinstance(self.collectives, CollectiveColumns):
            self.collectives = CollectiveColumns.of(self.collectives)
        if not isinstance(self.functions, FunctionColumns):
            self.functions = FunctionColumns.of(self.functions)

    @property
    def window_s(self) -> float:
        return max(self.window_end - self.window_start, 1e-9)

    def time_in(self, role: Role) -> float:
        return sum(f.total_s for f in self.functions.values() if f.role == role)
