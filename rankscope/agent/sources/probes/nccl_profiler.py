"""NCCL's own view of communication, from rankscope's NCCL profiler plugin (cupti_shim/nccl_profiler.c, in the
shim library) through its USDT probes rankscope:nccl_coll and rankscope:nccl_link; BPF side:
bpf/nccl_profiler.bpf.c. The probes are attached by the shim's reader (probes/cupti.py: one program per
process for all of the shim's probes); this module turns the cumulative in-kernel sums into a window's
pattern fields: per-collective GPU time and per-peer link timing."""
from __future__ import annotations

from dataclasses import dataclass

from rankscope.agent.loader.histograms import percentile_s
from rankscope.agent.sources.deltas import Deltas
from rankscope.schema.patterns import MAX_LINKS, CollectiveGpu, LinkStats

COLL_PROBE, LINK_PROBE = "nccl_coll", "nccl_link"


@dataclass(frozen=True)
class CollTotals:
    """Cumulative GPU-side spans of one NCCL function in one process."""

    func: str  # NCCL's name: "AllReduce", "Send", ...
    count: int
    total_ns: int
    hist: tuple[int, ...]


@dataclass(frozen=True)
class LinkTotals:
    """Cumulative network steps of one process with one peer of one communicator, one direction."""

    comm: int
    rank: int
    peer: int
    send: bool
    steps: int
    bytes: int
    wire_ns: int
    peer_wait_ns: int


class CommWindow:
    """Turns a reader's cumulative totals into one window's pattern fields (the kernel maps only grow)."""

    def __init__(self) -> None:
        self._colls: Deltas[str] = Deltas()  # func -> (count, total_ns, hist)
        self._links: Deltas[tuple[int, int, int, bool]] = Deltas()  # (comm, rank, peer, send) -> the four sums

    def next(self, colls: list[CollTotals], links: list[LinkTotals]) -> tuple[list[CollectiveGpu], list[LinkStats]]:
        gpu = []
        added = self._colls.read((c.func, (c.count, c.total_ns, c.hist)) for c in colls)
        for c, (count, total_ns, hist) in zip(colls, added):
            if count > 0:
                gpu.append(CollectiveGpu(op=f"nccl{c.func}", count=count, total_s=total_ns / 1e9,
                                         p99_s=percentile_s(hist, 0.99)))
        rows = []
        added = self._links.read(((k.comm, k.rank, k.peer, k.send), (k.steps, k.bytes, k.wire_ns, k.peer_wait_ns))
                                for k in links)
        for k, (steps, nbytes, wire_ns, peer_wait_ns) in zip(links, added):
            if steps > 0:
                rows.append(LinkStats(comm=k.comm, rank=k.rank, peer=k.peer, send=k.send, steps=steps, bytes=nbytes,
                                      wire_s=wire_ns / 1e9, peer_wait_s=peer_wait_ns / 1e9))
        gpu.sort(key=lambda c: -c.total_s)
        rows.sort(key=lambda k: -k.bytes)
        return gpu, rows[:MAX_LINKS]
