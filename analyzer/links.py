"""The C4-style src x dst link matrix from the NCCL profiler plugin's per-peer step timing, and the finding
that tells a slow link (one pair of ranks) from a slow node (every link of one rank: its NIC or host).

Each rank reports, per (communicator, peer, direction), the bytes its proxy thread moved and the time those
network steps took. A directed link src -> dst (global ranks) is judged on the sender's own send row: its
time is posted-until-completed on the wire. The receiver's recv row also counts the sender being late, so it
stands in only where the sender's pattern lacks the link (a pattern keeps at most MAX_LINKS rows).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .findings import Finding
from .patterns import LinkStats, RankPattern, Role

MIN_STEPS = 8  # network steps over a link in the window before its throughput is judged...
MIN_BYTES = 1 << 20  # ...and bytes: a few small steps measure latency, not bandwidth
MIN_LINKS = 3  # judged links in the job: with two, which one is "the others"?
SLOW_FACTOR = 1.5  # a link below the median of the job's links divided by this is slow
MIN_NODE_LINKS = 2  # judged links of one rank, all slow, that make the rank (not one link) the suspect
MATRIX_MAX_RANKS = 32  # up to this many ranks, evidence carries the whole dense matrix


@dataclass(frozen=True)
class LinkMatrix:
    """Directed links between global ranks, one entry per (src, dst), summed over communicators; sorted."""

    src: np.ndarray  # global rank of the sender
    dst: np.ndarray  # global rank of the receiver
    steps: np.ndarray
    bytes: np.ndarray
    wire_s: np.ndarray
    peer_wait_s: np.ndarray  # the sender waiting for the receiver's credit (0 for receiver-measured links)
    from_sender: np.ndarray  # bool: measured on the sender's send rows only (False: a recv row stood in)

    def __len__(self) -> int:
        return self.src.size

    @property
    def bandwidth_Bps(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.wire_s > 0, self.bytes / self.wire_s, np.nan)

    @property
    def judged(self) -> np.ndarray:
        """Links with enough traffic in the window to judge their throughput."""
        return (self.steps >= MIN_STEPS) & (self.bytes >= MIN_BYTES) & (self.wire_s > 0)

    def row(self, i: int) -> dict[str, Any]:
        """One link as evidence shows it."""
        return {"src": int(self.src[i]), "dst": int(self.dst[i]), "bandwidth_Bps": float(self.bandwidth_Bps[i]),
                "steps": int(self.steps[i]), "bytes": int(self.bytes[i]), "wire_s": float(self.wire_s[i]),
                "step_latency_s": float(self.wire_s[i] / self.steps[i]) if self.steps[i] else None,
                "peer_wait_s": float(self.peer_wait_s[i]),
                "measured_by": "sender" if self.from_sender[i] else "receiver"}

    def dense(self) -> dict[str, Any]:
        """The src x dst throughput matrix over the ranks that appear in a judged link (None: no judged link)."""
        judged = self.judged
        ranks = np.union1d(self.src[judged], self.dst[judged])
        matrix = np.full((ranks.size, ranks.size), np.nan)
        matrix[np.searchsorted(ranks, self.src[judged]), np.searchsorted(ranks, self.dst[judged])] = \
            self.bandwidth_Bps[judged]
        return {"ranks": ranks, "bandwidth_Bps": matrix}


_Key = tuple[int, int, int]  # (comm, src comm rank, dst comm rank)


def link_matrix(patterns: Sequence[RankPattern]) -> LinkMatrix:
    """The job's link matrix from every pattern's link rows. Comm ranks become global ranks through the
    patterns themselves: the rank that reports rows as (comm, comm rank) is that comm rank's global rank. A
    link whose peer reported no row in the communicator (or whose comm rank two patterns claim) is left out."""
    global_of: dict[tuple[int, int], int] = {}
    claimed_twice: set[tuple[int, int]] = set()
    sends: dict[_Key, LinkStats] = {}
    recvs: dict[_Key, LinkStats] = {}
    for p in patterns:
        for k in p.links:
            if global_of.setdefault((k.comm, k.rank), p.rank) != p.rank:
                claimed_twice.add((k.comm, k.rank))
            if k.send:
                sends[(k.comm, k.rank, k.peer)] = k
            else:
                recvs[(k.comm, k.peer, k.rank)] = k
    chosen = {**{key: (k, False) for key, k in recvs.items()}, **{key: (k, True) for key, k in sends.items()}}

    totals: dict[tuple[int, int], list[Any]] = {}  # (src, dst) -> [steps, bytes, wire, wait, from sender]
    for (comm, s, d), (k, by_sender) in chosen.items():
        src, dst = global_of.get((comm, s)), global_of.get((comm, d))
        if src is None or dst is None or src == dst or {(comm, s), (comm, d)} & claimed_twice:
            continue
        acc = totals.setdefault((src, dst), [0, 0, 0.0, 0.0, True])
        acc[0] += k.steps
        acc[1] += k.bytes
        acc[2] += k.wire_s
        acc[3] += k.peer_wait_s if by_sender else 0.0
        acc[4] &= by_sender
    pairs = sorted(totals)
    cols = list(zip(*(totals[pair] for pair in pairs))) or [()] * 5
    return LinkMatrix(src=np.array([s for s, _ in pairs], dtype=np.int64),
                      dst=np.array([d for _, d in pairs], dtype=np.int64),
                      steps=np.array(cols[0], dtype=np.int64), bytes=np.array(cols[1], dtype=np.int64),
                      wire_s=np.array(cols[2], dtype=float), peer_wait_s=np.array(cols[3], dtype=float),
                      from_sender=np.array(cols[4], dtype=bool))


def _comm_share(p: RankPattern) -> float:
    return min(p.time_in(Role.COMM) / p.window_s, 1.0)


def _gbps(bw: float) -> str:
    return f"{bw / 1e9:.1f} GB/s"


def _collectives_gpu(by_rank: dict[int, RankPattern], ranks: list[int]) -> list[dict[str, Any]]:
    """The ranks' per-op GPU time (mean per call) beside the median over every rank reporting the op."""
    means: dict[str, list[float]] = {}
    for p in by_rank.values():
        for c in p.collectives_gpu:
            if c.count:
                means.setdefault(c.op, []).append(c.total_s / c.count)
    return [{"rank": r, "op": c.op, "count": c.count, "mean_s": c.total_s / c.count, "p99_s": c.p99_s,
             "peers_mean_s": float(np.median(means[c.op]))}
            for r in ranks for c in by_rank[r].collectives_gpu if c.count]


def link_findings(patterns: Sequence[RankPattern]) -> list[Finding]:
    """`slow_link` findings from the link matrix: a rank all of whose links (two or more) are slow is the
    suspect (its NIC or host), reported once; any other slow link is reported as exactly that pair."""
    m = link_matrix(patterns)
    judged = m.judged
    if np.count_nonzero(judged) < MIN_LINKS:
        return []
    bw = m.bandwidth_Bps
    median = float(np.median(bw[judged]))
    slow = judged & (bw < median / SLOW_FACTOR)
    if not slow.any():
        return []

    # Per rank: its judged links and how many of them are slow (a link counts for both of its ends).
    ends, at = np.unique(np.concatenate([m.src, m.dst]), return_inverse=True)
    n_judged = np.bincount(at, weights=np.tile(judged, 2), minlength=ends.size)
    n_normal = n_judged - np.bincount(at, weights=np.tile(slow, 2), minlength=ends.size)
    nodes = ends[(n_judged >= MIN_NODE_LINKS) & (n_normal == 0)].tolist()
    normal_of = dict(zip(ends.tolist(), n_normal.tolist()))
    by_node = np.isin(m.src, nodes) | np.isin(m.dst, nodes)
    by_rank = {p.rank: p for p in patterns}
    matrix = m.dense() if np.count_nonzero(n_judged) <= MATRIX_MAX_RANKS else None

    def finding(ranks: list[int], rows: np.ndarray, summary: str, extra: dict[str, Any]) -> Finding:
        worst = float(bw[rows].min())
        # A ring or tree collective moves at its slowest link's pace, so at the others' median throughput its
        # transfer time would shrink by (1 - worst / median). The ranks' COMM share of the window bounds the
        # transfer time from above (it also holds waiting for late peers), so the product is an upper bound.
        share = max(_comm_share(by_rank[r]) for r in ranks)
        cost = float(np.clip(share * (1.0 - worst / median), 0.0, 1.0))
        return Finding(
            kind="slow_link", ranks=ranks, function=None, component="link", score=median / worst, cost=cost,
            summary=f"{summary}; costs {cost:.0%} of step time",
            evidence={**extra, "bandwidth_Bps": worst, "peers_bandwidth_Bps": median, "comm_share": share,
                      "judged_links": int(np.count_nonzero(judged)),
                      "links": [m.row(i) for i in np.flatnonzero(rows)],
                      **({"link_matrix": matrix} if matrix is not None else {}),
                      **({"collectives_gpu": g} if (g := _collectives_gpu(by_rank, ranks)) else {})},
        )

    out = []
    for r in nodes:
        rows = judged & ((m.src == r) | (m.dst == r))
        lo, hi = float(bw[rows].min()), float(bw[rows].max())
        speeds = _gbps(lo) if _gbps(lo) == _gbps(hi) else f"{lo / 1e9:.1f}-{_gbps(hi)}"
        host = by_rank[r].host  # every rank of the matrix reported link rows
        out.append(finding([r], rows, (
            f"every link of rank {r} (on host {host}) is slow: {np.count_nonzero(rows)} links at {speeds} vs "
            f"{_gbps(median)} on the others: suspect its NIC or host, not one link"), {"rank": r, "host": host}))
    for i in np.flatnonzero(slow & ~by_node):
        src, dst = int(m.src[i]), int(m.dst[i])
        normal = [r for r in (src, dst) if normal_of[r] > 0]
        why = {2: "while both ranks' other links are normal", 1: f"while rank {normal[0]}'s other links are normal",
               0: "(too few other links of these ranks to rule out a slow node)"}[len(normal)]
        out.append(finding([src, dst], np.arange(len(m)) == i, (
            f"link {src} -> {dst} moves {_gbps(float(bw[i]))} vs {_gbps(median)} on the job's other links "
            f"{why}: a slow link"), {"src": src, "dst": dst}))
    return out
