"""NCCL's own view of communication, from rankscope's NCCL profiler plugin (cupti_shim/nccl_profiler.c, in the
shim library) through its USDT probes rankscope:nccl_coll and rankscope:nccl_link; BPF side:
bpf/nccl_profiler.bpf.c. The probes are attached by the shim's reader (probes/cupti.py: one program per
process for all of the shim's probes); this module turns the cumulative in-kernel sums into a window's
pattern fields: per-collective GPU time and per-peer link timing."""
from __future__ import annotations

from dataclasses import dataclass

from rankscope.agent.loader.histograms import minus, percentile_s
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
        self._colls: dict[str, CollTotals] = {}
        self._links: dict[tuple[int, int, int, bool], LinkTotals] = {}

    def next(self, colls: list[CollTotals], links: list[LinkTotals]) -> tuple[list[CollectiveGpu], list[LinkStats]]:
        gpu = []
        for c in colls:
            prev = self._colls.get(c.func)
            count = c.count - (prev.count if prev else 0)
            if count > 0:
                hist = minus(c.hist, prev.hist if prev else ())
                gpu.append(CollectiveGpu(op=f"nccl{c.func}", count=count,
                                         total_s=(c.total_ns - (prev.total_ns if prev else 0)) / 1e9,
                                         p99_s=percentile_s(hist, 0.99)))
        rows = []
        for k in links:
            prev = self._links.get((k.comm, k.rank, k.peer, k.send))
            steps = k.steps - (prev.steps if prev else 0)
            if steps > 0:
                rows.append(LinkStats(comm=k.comm, rank=k.rank, peer=k.peer, send=k.send, steps=steps,
                                      bytes=k.bytes - (prev.bytes if prev else 0),
                                      wire_s=(k.wire_ns - (prev.wire_ns if prev else 0)) / 1e9,
                                      peer_wait_s=(k.peer_wait_ns - (prev.peer_wait_ns if prev else 0)) / 1e9))
        self._colls = {c.func: c for c in colls}
        self._links = {(k.comm, k.rank, k.peer, k.send): k for k in links}
        gpu.sort(key=lambda c: -c.total_s)
        rows.sort(key=lambda k: -k.bytes)
        return gpu, rows[:MAX_LINKS]
