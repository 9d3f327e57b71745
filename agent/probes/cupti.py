"""GPU activity from the rankscope CUPTI shim, read through its USDT probe. BPF side: bpf/cupti.bpf.c.

Unlike the uprobe kinds (one program for every library file), a USDT probe with a semaphore is enabled per
process: attaching raises the process's semaphore, which is what turns the shim's hand-off on. So each
process that maps the shim gets its own small program (about a second of clang to build).

The semaphore is left to the kernel (agent/usdt.py): it is raised while the probe is attached and lowered
when the agent's file descriptors close, even if the agent is SIGKILLed. bcc's own USDT attach writes the
semaphore through /proc/PID/mem instead, and a killed agent would leave it raised: bcc is used only to
generate the argument readers.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from importlib import resources

from rankscope.analyzer.patterns import (
    KERNEL_NAME_CHARS,
    TOP_KERNELS,
    GpuActivity,
    GpuKernel,
)

from .. import usdt
from ..bcc_compile import compile_bpf
from ..bpf_program import ProbeError
from ..symbols import SymbolError, sdt_probes
from ..targets import TargetError, mapped_libraries

SHIM_LIBRARY = re.compile(r"^librankscope_cupti\.so$")
PROVIDER, PROBE = "rankscope", "activity"

# CUpti_ActivityKind values of the records the shim enables.
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_CONCURRENT_KERNEL = 10
KERNEL_KINDS = (KIND_KERNEL, KIND_CONCURRENT_KERNEL)
MAX_NAME = 512  # bytes read of a kernel name (mangled C++ names can be long; patterns truncate further)


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


def shim_path(pid: int) -> str | None:
    """The shim as mapped by `pid`, reached through /proc/PID/root; None when the process does not load it."""
    try:
        return mapped_libraries(pid, {"shim": SHIM_LIBRARY}).get("shim")
    except TargetError:  # exited, or not readable
        return None


def semaphore_address(path: str) -> int:
    """Link-time address of the shim's semaphore, from the probe's SDT note."""
    try:
        probe = sdt_probes(path).get((PROVIDER, PROBE))
    except SymbolError as e:
        raise ProbeError(str(e)) from e
    if probe is None or not probe.semaphore:
        raise ProbeError(f"{path} has no guarded {PROVIDER}:{PROBE} probe: not the rankscope CUPTI shim")
    return probe.semaphore


def _probe_sites(usdt_class, pid: int) -> tuple[str, list[tuple[bytes, int]]]:
    """bcc's generated argument readers for the probe, and its sites (binary, address). bcc raises the
    semaphore when it enables the probe and lowers it when its context is freed, on return from here."""
    ctx = usdt_class(pid=pid)
    ctx.enable_probe(probe=PROBE, fn_name="on_activity")
    return ctx.get_text(), [(binpath, addr) for binpath, _fn, addr, _pid in ctx.enumerate_active_probes()]


class CuptiReader:
    """The shim's records of one process: in-kernel aggregates, and raw records on demand."""

    def __init__(self, pid: int):
        try:
            from bcc import BPF, USDT
        except ImportError as e:
            raise ProbeError("bcc is not importable: run scripts/install (Debian's python3-bpfcc)") from e
        path = shim_path(pid)
        if path is None:
            raise ProbeError(f"pid {pid} does not load the rankscope CUPTI shim")
        self.pid = pid
        self._names: dict[int, str] = {0: ""}
        self._raw: list[RawActivity] = []
        self._probes: list[usdt.GuardedProbe] = []
        sem = semaphore_address(path)
        try:
            readers, sites = _probe_sites(USDT, pid)
            self._bpf = compile_bpf(readers + (resources.files("rankscope.bpf") / "cupti.bpf.c").read_text(), [])
            fn = self._bpf.load_func("on_activity", BPF.KPROBE)
        except Exception as e:  # bcc raises bare Exception for USDT and compile failures
            raise ProbeError(f"cannot load the CUPTI shim probe for pid {pid}: {e}") from e
        for binpath, addr in sites:
            try:
                self._probes.append(usdt.attach(fn.fd, binpath.decode(), addr, sem, pid,
                                                f"rankscope_cupti_{pid}_{addr:x}"))
            except usdt.UsdtError as e:
                self.close()
                raise ProbeError(f"cannot attach to the CUPTI shim of pid {pid}: {e}") from e
        self._bpf["raw_activity"].open_ring_buffer(self._on_raw)

    def set_raw(self, on: bool) -> None:
        """Deep mode: also send every record to user space (collected by poll_raw)."""
        table = self._bpf["raw_on"]
        table[ctypes.c_int(0)] = ctypes.c_uint32(int(on))

    def poll_raw(self, timeout_ms: int = 0) -> list[RawActivity]:
        self._bpf.ring_buffer_poll(timeout_ms)
        out, self._raw = self._raw, []
        return out

    def _on_raw(self, _ctx, data, _size) -> None:
        r = self._bpf["raw_activity"].event(data)
        self._raw.append(RawActivity(r.pid, r.kind, r.start, r.end, r.device, r.stream, r.correlation,
                                     self.name(r.name), r.bytes))

    def activity(self) -> list[ActivityStats]:
        """Cumulative totals per record kind and kernel since attach."""
        return [ActivityStats(k.kind, self.name(k.name), v.count, v.total_ns, v.bytes, tuple(v.hist))
                for k, v in self._bpf["gpu_activity"].items() if k.pid == self.pid]

    def busy_ns(self) -> dict[int, int]:
        """Cumulative GPU busy time per device (union of activity intervals) since attach."""
        return {k.device: v.busy_ns for k, v in self._bpf["gpu_busy"].items() if k.pid == self.pid}

    def name(self, pointer: int) -> str:
        """A kernel name from CUPTI's string in the process, read once per pointer (CUPTI keeps one string
        per kernel for the life of the process)."""
        if pointer not in self._names:
            try:
                with open(f"/proc/{self.pid}/mem", "rb") as mem:
                    mem.seek(pointer)
                    raw = mem.read(MAX_NAME)
            except (OSError, ValueError, OverflowError):
                return "?"  # not cached: the process may be gone, or the pointer bad
            self._names[pointer] = raw.split(b"\0", 1)[0].decode(errors="replace")
        return self._names[pointer]

    def close(self) -> None:
        """Detach: closing the probes' perf events lowers the process's semaphore (the kernel does it)."""
        for probe in self._probes:
            probe.close()
        self._probes = []
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
        self._activity: dict[tuple[int, str], ActivityStats] = {}
        self._busy: dict[int, int] = {}

    def next(self, activity: list[ActivityStats], busy: dict[int, int]) -> GpuActivity:
        kernel_ns: dict[str, list[int]] = {}  # short name -> [count, ns]
        copy_ns = 0
        for a in activity:
            prev = self._activity.get((a.kind, a.name))
            count = a.count - (prev.count if prev else 0)
            ns = a.total_ns - (prev.total_ns if prev else 0)
            if a.kind in KERNEL_KINDS:
                entry = kernel_ns.setdefault(short_kernel_name(a.name), [0, 0])
                entry[0] += count
                entry[1] += ns
            else:
                copy_ns += ns
        busy_ns = sum(b - self._busy.get(dev, 0) for dev, b in busy.items())
        self._activity = {(a.kind, a.name): a for a in activity}
        self._busy = dict(busy)
        top = sorted(((ns, name, count) for name, (count, ns) in kernel_ns.items() if count), reverse=True)
        return GpuActivity(busy_s=busy_ns / 1e9, kernel_s=sum(ns for _, ns in kernel_ns.values()) / 1e9,
                           copy_s=copy_ns / 1e9, kernels=sum(c for c, _ in kernel_ns.values()),
                           top=[GpuKernel(name, count, ns / 1e9) for ns, name, count in top[:TOP_KERNELS]])
