"""The one BPF program of an agent: composed from every probe kind's source, attached per library file.

Uprobes live on a file (inode), not a process: the program attaches each probed library once, whatever
number of ranks map it, and every handler first checks the `watched` map, so only watched processes are
accounted. Attaching is cheap; removing a uprobe costs the kernel a grace period (~0.1 s here), which is
why probes are not multiplied by the number of ranks, and why they are links removed all at once
(loader/uprobe_links.py). The probes vanish with the agent's file descriptors, so even a SIGKILLed agent
leaves nothing behind in the traced job.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from rankscope.agent.host import procfs
from rankscope.agent.host.symbols import SymbolError, file_offset, functions
from rankscope.agent.host.targets import Target
from rankscope.agent.loader import uprobe_links
from rankscope.agent.loader.bcc import compile_bpf
from rankscope.agent.loader.trace_stream import TraceStream
from rankscope.agent.loader.uprobe_links import Uprobes
from rankscope.agent.sources.probes import KINDS, KindUnavailable, Probe, ProbeKind
from rankscope.agent.sources.probes.base import bpf_text

log = logging.getLogger(__name__)


# Maps of bpf/common.h that user space reads (here and in sources/program.py).
WATCHED = "watched"  # pid -> its collective bookkeeping; a process is accounted while a key
FN_STATS = "fn_stats"  # (pid, fn) -> calls, time, bytes, histogram
INFLIGHT = "inflight"  # (tid, fn) -> a timed call's entry
COLL_RING = "coll_ring"  # (pid, slot) -> one of the last collectives
UPPER_CALL = "upper_call"  # (pid, tid) -> the upper layer's call in flight
COLL_DONE = "coll_done"  # stream of completed collectives (DONE_RECORD)
DONE_LOST = "done_lost"  # completed collectives the stream had no room for


class ProbeError(Exception):
    """The probes cannot be loaded or attached; one line a user can act on."""


@dataclass
class LibraryProbes:
    """The probes on one library file, and the watched processes that map it."""

    kind: str
    path: str  # as first reached (procfs.mapped_path of the first process that maps it)
    fd: int = -1  # the file, opened as procfs.open_regular opens it, held while its probes are
    probes: list[str] = field(default_factory=list)  # probe names attached
    skipped: list[str] = field(default_factory=list)  # probe names whose function this version does not export
    attached: list[Uprobes] = field(default_factory=list)  # the probes' entry and return programs
    hot: list[tuple[Probe, int]] = field(default_factory=list)  # hot probes (and their file offset), deep detail only
    hot_attached: list[Uprobes] = field(default_factory=list)  # of the hot probes, while attached
    users: set[int] = field(default_factory=set)

    @property
    def file(self) -> str:
        """The path the agent reads the library and attaches its uprobes through: its own descriptor, so
        what is read and what is probed are the one file opened, whatever becomes of the path."""
        return f"/proc/self/fd/{self.fd}"


# One completed collective as the kernel streams it (bpf/common.h: struct coll_done_rec); times monotonic ns.
DONE_RECORD = np.dtype([("pid", "<u4"), ("fn", "<u4"), ("seq", "<u8"), ("enter_ns", "<u8"), ("done_ns", "<u8"),
                        ("bytes", "<u8")])


def function_ids(kinds: tuple[ProbeKind, ...]) -> dict[str, int]:
    """Stable small ids for every probe (by name): each probe's BPF cookie, which its handler shape's program
    keys the kernel's per-function stats by."""
    ids: dict[str, int] = {}
    for kind in kinds:
        for probe in kind.probes:
            ids.setdefault(probe.name, len(ids) + 1)
    return ids


def hostable(kinds: tuple[ProbeKind, ...]) -> tuple[tuple[ProbeKind, ...], list[str]]:
    """The kinds this kernel can host, and the -D defines they need from it. A kind it cannot host is left
    out with a warning: the rest still trace."""
    kept, defines = [], []
    for kind in kinds:
        try:
            defines += [f"-D{name}={value}" for name, value in (kind.kernel_defines or dict)().items()]
        except KindUnavailable as e:
            log.warning("leaving out the %s probes: %s", kind.name, e)
            continue
        kept.append(kind)
    return tuple(kept), defines


class ProbeProgram:
    def __init__(self, kinds: tuple[ProbeKind, ...] = KINDS):
        self.kinds = kinds
        self.ids = function_ids(kinds)
        self.probe_of = {p.name: p for k in kinds for p in k.probes}
        self.symbol_of = {i: s for s, i in self.ids.items()}
        self._bpf = None
        self.libraries: dict[tuple[int, int], LibraryProbes] = {}  # (st_dev, st_ino) -> probes
        self.watched: set[int] = set()
        self.hot = False  # whether hot probes (Probe.hot) are attached
        self._done: list[bytes] = []  # completed-collective records since the last drain, raw
        self._lost = 0  # completed collectives the stream had no room for, so far
        self._trace: TraceStream | None = None  # a capture's stream of per-call events, with the program
        # The streams are read by the window's thread and a capture's: libbpf's consume is not reentrant.
        self._consuming = threading.Lock()

    @property
    def bpf(self):
        """The compiled program, built on first use (about a second of clang)."""
        if self._bpf is None:
            # Decided here, not in __init__: a user who may not load BPF hears that first, not a warning.
            self.kinds, defines = hostable(self.kinds)
            try:
                self._bpf = compile_bpf(bpf_text(self.kinds), defines)
            except Exception as e:  # bcc raises bare Exception for compile and load failures
                raise ProbeError(f"cannot load the BPF program (root, kernel headers?): {e}") from e
            self._bpf[COLL_DONE].open_ring_buffer(self._on_done)
            self._trace = TraceStream(self._bpf, self._consuming)
        return self._bpf

    @property
    def trace_stream(self) -> TraceStream:
        """The program's capture stream: probed calls, collectives, the main thread's scheduler states."""
        _ = self.bpf
        return self._trace

    def _on_done(self, _ctx, data, size) -> None:
        self._done.append(ctypes.string_at(data, size))  # parsed in bulk by completed(): ~1 us a record here

    def consume(self) -> None:
        """Read the kernel's streams (completed collectives, a capture's events) into their readers."""
        with self._consuming:
            self.bpf.ring_buffer_consume()

    @property
    def lost_collectives(self) -> int:
        """Completed collectives the kernel's stream had no room for, so far (as of the last completed())."""
        return self._lost

    def completed(self) -> dict[int, np.ndarray]:
        """pid -> the collectives completed since the last call (DONE_RECORD rows, in order). One read of the
        kernel's stream; a stream that overflowed since is logged, never fatal."""
        if self._bpf is None:
            return {}
        self.consume()
        lost = self._bpf[DONE_LOST][ctypes.c_int(0)].value
        if lost > self._lost:
            log.warning("%d completed collectives found the kernel's stream full: read it more often",
                        lost - self._lost)
            self._lost = lost
        done, self._done = self._done, []  # a capture's consume() may append meanwhile: to the new list
        raw = b"".join(done)
        recs = np.frombuffer(raw, DONE_RECORD)
        recs = recs[np.lexsort((recs["seq"], recs["pid"]))]  # the stream interleaves CPUs
        pids, starts = np.unique(recs["pid"], return_index=True)
        return {int(pid): part for pid, part in zip(pids, np.split(recs, starts[1:]))}

    def attach(self, target: Target) -> list[LibraryProbes]:
        """Watch `target`: probe each of its libraries not probed yet, and account its calls from now on."""
        bpf = self.bpf
        used = []
        for kind in self.kinds:
            path = target.libraries.get(kind.name)
            if path is None:
                continue
            try:
                fd = procfs.open_regular(path)
            except OSError as e:
                raise ProbeError(f"pid {target.pid}: cannot open its {kind.name} library {path}: {e.strerror}") from e
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            lib = self.libraries.get(key)
            if lib is not None:
                os.close(fd)
            else:
                lib = self.libraries[key] = LibraryProbes(kind=kind.name, path=path, fd=fd)
                try:
                    self._attach_library(bpf, kind, lib)
                except ProbeError:
                    self._remove_libraries([key])
                    raise
            lib.users.add(target.pid)
            used.append(lib)
        bpf[WATCHED][ctypes.c_uint32(target.pid)] = bpf[WATCHED].Leaf()
        self.watched.add(target.pid)
        return used

    def _attach_library(self, bpf, kind: ProbeKind, lib: LibraryProbes) -> None:
        try:
            exported = functions(lib.file, local=kind.local_symbols)
        except SymbolError as e:
            raise ProbeError(str(e)) from e
        seen_addrs: set[int] = set()
        steady: list[tuple[Probe, int]] = []
        for probe in kind.probes:
            symbol = probe.resolve(exported)
            addr = None if symbol is None else exported[symbol]
            if addr is None or addr in seen_addrs:  # absent in this version, or an alias of one probed
                lib.skipped.append(probe.name)
                continue
            seen_addrs.add(addr)
            lib.probes.append(probe.name)
            try:
                offset = file_offset(lib.file, addr)
            except SymbolError as e:
                raise ProbeError(str(e)) from e
            (lib.hot if probe.hot else steady).append((probe, offset))
        self._attach_probes(bpf, lib.file, steady, lib.attached)
        if self.hot:
            self._attach_hot(bpf, lib)

    def set_hot(self, on: bool) -> None:
        """Attach (on) or remove the hot probes of every probed library."""
        if on == self.hot or self._bpf is None:
            self.hot = on
            return
        self.hot = on
        if not on:  # every library's at once: their removals overlap
            uprobe_links.detach([p for lib in self.libraries.values() for p in lib.hot_attached])
            for lib in self.libraries.values():
                lib.hot_attached = []
            return
        for lib in self.libraries.values():
            try:
                self._attach_hot(self._bpf, lib)
            except ProbeError as e:  # the library's other probes go on
                log.warning("%s", e)

    def _attach_hot(self, bpf, lib: LibraryProbes) -> None:
        self._attach_probes(bpf, lib.file, lib.hot, lib.hot_attached)

    def _attach_probes(self, bpf, path: str, probes: list[tuple[Probe, int]], into: list[Uprobes]) -> None:
        """Attaches the probes' entry (and return) programs at their offsets of `path`, each with its function
        id as cookie: one link per program, for all of its offsets. Each link is appended to `into` as it
        attaches, so a failure half-way still detaches what did."""
        sites: dict[tuple[str, bool], list[tuple[int, int]]] = {}  # (program, on return) -> (offset, cookie)
        for probe, offset in probes:
            sites.setdefault((probe.enter_program, False), []).append((offset, self.ids[probe.name]))
            if probe.returns:
                sites.setdefault((probe.return_program, True), []).append((offset, self.ids[probe.name]))
        try:
            for (program, returns), at in sites.items():
                into.append(uprobe_links.attach(bpf, program, path, [o for o, _ in at], returns=returns,
                                                cookies=[c for _, c in at]))
        except uprobe_links.UprobeError as e:
            raise ProbeError(str(e)) from e

    def detach(self, pid: int) -> None:
        """Stop accounting `pid` (alive or not); a library's probes go with its last watched user.
        The process's map entries are left for the last read (see purge)."""
        if pid not in self.watched or self._bpf is None:
            return
        self.watched.discard(pid)
        self._bpf[WATCHED].pop(ctypes.c_uint32(pid), None)
        for lib in self.libraries.values():
            lib.users.discard(pid)
        self._remove_libraries([key for key, lib in self.libraries.items() if not lib.users])

    def _remove_libraries(self, keys: list[tuple[int, int]]) -> None:
        """Removes the probes of libraries `keys`, all at once: their removals overlap."""
        libs = [self.libraries.pop(key) for key in keys]
        uprobe_links.detach([p for lib in libs for p in lib.attached + lib.hot_attached])
        for lib in libs:
            os.close(lib.fd)

    def purge(self, pid: int) -> None:
        """Drop a forgotten process's entries from every per-process map (after its last read)."""
        if self._bpf is None:
            return
        for name in (FN_STATS, COLL_RING, UPPER_CALL, *(m for kind in self.kinds for m in kind.maps)):
            table = self._bpf[name]
            for key in [k for k in table.keys() if k.pid == pid]:
                table.pop(key, None)

    def close(self) -> None:
        """Detach everything. Accounting stops at once; removing the probes takes the kernel a while."""
        if self._bpf is None:
            return
        for pid in list(self.watched):
            self._bpf[WATCHED].pop(ctypes.c_uint32(pid), None)
        self.watched.clear()
        self._remove_libraries(list(self.libraries))
        self._bpf.cleanup()
        self._bpf = None
