"""The one BPF program of an agent: composed from every probe kind's source, attached per process.

Uprobes are attached per PID (only watched processes take the trap) and every handler also checks the
`watched` map, which holds per-process state.  Probes created through perf_event_open vanish with the
agent's file descriptors, so even a SIGKILLed agent leaves nothing behind in the traced job.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from importlib import resources

from .probes import KINDS, Probe, ProbeKind
from .symbols import SymbolError, exported_functions
from .targets import Target

log = logging.getLogger(__name__)


class ProbeError(Exception):
    """The probes cannot be loaded or attached; one line a user can act on."""


@dataclass
class Attachment:
    pid: int
    probes: list[str] = field(default_factory=list)  # symbols attached
    events: list[bytes] = field(default_factory=list)  # bcc's uprobe event names, to detach without the file
    skipped: list[str] = field(default_factory=list)  # symbols the library does not export


def function_ids(kinds: tuple[ProbeKind, ...]) -> dict[str, int]:
    """Stable small ids for every probed symbol, the keys of the kernel's per-function stats."""
    ids: dict[str, int] = {}
    for kind in kinds:
        for probe in kind.probes:
            ids.setdefault(probe.symbol, len(ids) + 1)
    return ids


def _source(kinds: tuple[ProbeKind, ...]) -> str:
    bpf_dir = resources.files("rankscope.bpf")
    parts = [(bpf_dir / "common.h").read_text()]
    parts += [(bpf_dir / kind.source).read_text() for kind in kinds]
    return "\n".join(parts)


class ProbeProgram:
    def __init__(self, kinds: tuple[ProbeKind, ...] = KINDS):
        self.kinds = kinds
        self.ids = function_ids(kinds)
        self.probe_of = {p.symbol: p for k in kinds for p in k.probes}
        self.symbol_of = {i: s for s, i in self.ids.items()}
        self._bpf = None
        self.attachments: dict[int, Attachment] = {}

    @property
    def bpf(self):
        """The compiled program, built on first use (about a second of clang)."""
        if self._bpf is None:
            try:
                from bcc import BPF
            except ImportError as e:
                raise ProbeError("bcc is not importable: run scripts/install (Debian's python3-bpfcc)") from e
            cflags = [f"-DFN_{sym}={i}" for sym, i in self.ids.items()]
            try:
                self._bpf = BPF(text=_source(self.kinds), cflags=cflags)
            except Exception as e:  # bcc raises bare Exception for compile and load failures
                raise ProbeError(f"cannot load the BPF program (root, kernel headers?): {e}") from e
        return self._bpf

    def attach(self, target: Target) -> Attachment:
        """Watch `target` and attach every probe its libraries export."""
        bpf = self.bpf
        att = Attachment(pid=target.pid)
        self.attachments[target.pid] = att
        bpf["watched"][ctypes.c_uint32(target.pid)] = bpf["watched"].Leaf()
        try:
            self._attach_kinds(bpf, target, att)
        except ProbeError:
            self.detach(target.pid)
            raise
        return att

    def _attach_kinds(self, bpf, target: Target, att: Attachment) -> None:
        for kind in self.kinds:
            path = target.libraries.get(kind.name)
            if path is None:
                continue
            try:
                exported = exported_functions(path)
            except SymbolError as e:
                log.warning("pid %d: %s", target.pid, e)
                continue
            seen_addrs: set[int] = set()
            for probe in kind.probes:
                addr = exported.get(probe.symbol)
                if addr is None or addr in seen_addrs:  # absent in this version, or an alias of one probed
                    att.skipped.append(probe.symbol)
                    continue
                seen_addrs.add(addr)
                before = set(bpf.uprobe_fds)
                try:
                    self._attach_one(bpf, path, probe, target.pid)
                finally:  # record what did attach, so a failure half-way still detaches it
                    att.events += [ev for ev in bpf.uprobe_fds if ev not in before]
                att.probes.append(probe.symbol)

    @staticmethod
    def _attach_one(bpf, path: str, probe: Probe, pid: int) -> None:
        try:
            bpf.attach_uprobe(name=path, sym=probe.symbol, fn_name=f"enter_{probe.symbol}", pid=pid)
            if probe.returns:
                bpf.attach_uretprobe(name=path, sym=probe.symbol, fn_name=f"return_{probe.symbol}", pid=pid)
        except Exception as e:
            raise ProbeError(f"cannot attach to {probe.symbol} in {path} of pid {pid}: {e}") from e

    def detach(self, pid: int) -> None:
        """Stop watching `pid` (alive or not) and remove its probes; its map entries are left for the last read."""
        att = self.attachments.pop(pid, None)
        if att is None or self._bpf is None:
            return
        self._bpf["watched"].pop(ctypes.c_uint32(pid), None)
        for ev in att.events:
            try:
                self._bpf.detach_uprobe_event(ev)
            except Exception as e:  # bcc raises bare Exception; never let one probe stop the rest
                log.warning("pid %d: detaching %s: %s", pid, ev.decode(errors="replace"), e)

    def purge(self, pid: int) -> None:
        """Drop a forgotten process's entries from every per-process map (after its last read)."""
        if self._bpf is None:
            return
        for name in ("fn_stats", "coll_ring", "comms"):
            table = self._bpf[name]
            for key in [k for k in table.keys() if k.pid == pid]:
                table.pop(key, None)

    def close(self) -> None:
        for pid in list(self.attachments):
            self.detach(pid)
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
