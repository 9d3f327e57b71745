"""The GPU's own view of each rank, added to its pattern: kernel time from the CUPTI shim and NCCL's
collective and link timing from the same library as NCCL's profiler plugin (for processes that load it), and
health of the rank's GPU from NVML (when the machine has it). All are optional: a rank without them keeps
its CPU-side pattern."""
from __future__ import annotations

import logging

from rankscope.agent.detail import Detail
from rankscope.agent.host.targets import Target
from rankscope.agent.loader.program import ProbeError
from rankscope.agent.loader.trace_stream import TraceStream
from rankscope.agent.sources.nvml import GpuHealthReader
from rankscope.agent.sources.probes.cupti import ActivityWindow, CuptiReader, shim_path
from rankscope.agent.sources.probes.nccl_profiler import CommWindow
from rankscope.agent.sources.source import Source
from rankscope.schema.patterns import RankPattern

log = logging.getLogger(__name__)


class GpuViews(Source):
    def __init__(self, health: GpuHealthReader | None = None, launches: bool = False):
        self._shim: dict[int, tuple[CuptiReader, ActivityWindow, CommWindow]] = {}
        self._launches = launches  # join kernels to their launches (deep mode: CUPTI then records each API call)
        self._refused: set[int] = set()  # processes whose shim could not be attached: said once
        self._health = health
        self._device_of: dict[int, int] = {}
        self._lost_gone = 0  # records lost by the shims of processes no longer read

    def attach(self, target: Target) -> None:
        self.watch(target.pid)

    def watch(self, pid: int) -> bool:
        """Reads the shim's records of `pid` if it loads the shim; True when attached. Called every window:
        CUDA loads the shim at cuInit, which may come after the agent attached."""
        if pid in self._shim or pid in self._refused or shim_path(pid) is None:
            return pid in self._shim
        try:
            reader = CuptiReader(pid)
        except ProbeError as e:
            self._refused.add(pid)
            log.warning("pid %d: no GPU kernel times: %s", pid, e)
            return False
        self._shim[pid] = (reader, ActivityWindow(), CommWindow())
        self._follow(pid, reader)
        return True

    def set_detail(self, detail: Detail) -> None:
        self.set_launches(detail.hot_probes)

    def set_launches(self, on: bool) -> None:
        """Deep mode on or off: the shims of every process hand over kernel launches, or stop."""
        self._launches = on
        for pid, (reader, *_) in self._shim.items():
            self._follow(pid, reader)

    def _follow(self, pid: int, reader: CuptiReader) -> None:
        try:
            reader.set_launches(self._launches)
        except ProbeError as e:  # kernel times go on without the join
            log.warning("pid %d: kernel launches not joined: %s", pid, e)

    @property
    def health(self) -> GpuHealthReader:
        if self._health is None:  # NVML is loaded on first use: diagnose runs without a GPU pay nothing
            self._health = GpuHealthReader()
        return self._health

    def fill(self, patterns: list[RankPattern]) -> None:
        """Adds this window's GPU activity and GPU health to each pattern it has them for."""
        for p in patterns:
            if p.state == "running":
                self.watch(p.pid)
            if p.pid in self._shim:
                reader, window, comm = self._shim[p.pid]
                p.gpu = window.next(reader.activity(), reader.busy_ns(),
                                    reader.launches() if reader.launches_on else None)
                p.collectives_gpu, p.links = comm.next(reader.nccl_colls(), reader.nccl_links())
        health = self.health
        if not health.available:
            return
        health.sample()
        by_index = health.window()
        missing = [p.pid for p in patterns if p.pid not in self._device_of]
        if missing:
            self._device_of.update(health.device_of())
        for p in patterns:
            index = self._device_of.get(p.pid)
            if index is not None:
                p.gpu_health = by_index.get(index)

    def trace_streams(self) -> list[TraceStream]:
        """The shim readers' streams: GPU kernels, copies and sets, NCCL's GPU spans."""
        return [reader.trace for reader, *_ in self._shim.values()]

    def records_lost(self) -> int:
        """GPU activity records the shims of the processes read lost since they were first read (CUPTI's full
        buffers, a shim's rate limit), as of their latest batches."""
        return self._lost_gone + sum(reader.lost() for reader, *_ in self._shim.values())

    def forget(self, pid: int) -> None:
        self._device_of.pop(pid, None)
        self._refused.discard(pid)
        if pid in self._shim:
            reader = self._shim.pop(pid)[0]
            self._lost_gone += reader.lost()
            reader.close()

    def close(self) -> None:
        for pid in list(self._shim):
            self.forget(pid)
        if self._health is not None:
            self._health.close()
