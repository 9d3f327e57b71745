"""Slow links: the C4-style src x dst link matrix, and the finding that tells a slow link (one pair of ranks)
from a slow node (every link of one rank: its NIC or host); and, without a matrix, a rank that finishes its
collectives last at a lower bandwidth while it computes like its peers (slow_link, from collective timing).

Two sources measure a link's throughput:
- NCCL's profiler plugin: each rank reports, per (communicator, peer, direction), the bytes its proxy thread
  moved and the time those network steps took. A directed link src -> dst (global ranks) is judged on the
  sender's own send row: its time is posted-until-completed on the wire. The receiver's recv row also counts
  the sender being late, so it stands in only where the sender's pattern lacks the link (a pattern keeps at
  most MAX_LINKS rows).
- The kernel's TCP accounting (gloo, NCCL's socket transport): each rank reports its busiest connections,
  the bytes it sent, how long the connection had data to send, and how much of that time the receiver's
  window or the sender's buffer held it: only a flow the network held is judged (NETWORK_LIMITED_SHARE). A
  connection's far end is the pattern whose connection has the two addresses reversed. Plugin rows take
  precedence over a pair they both cover.

Links are compared within their role: the pair of peer groups (analyzer/peers.py) their ends belong to, or
within a group (any). Pipeline stages pass activations between stages and all-reduce within them, and the two
differ by design.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import Any

import numpy as np

from rankscope.analyzer.differential import Alignment, peer_deviation, peers_median
from rankscope.analyzer.metrics import HOST_COLLECTIVES, HOST_P2P, RankTable
from rankscope.analyzer.peers import peer_groups
from rankscope.analyzer.rules.stragglers import decidable
from rankscope.analyzer.rules.wording import range_ms, rank_list
from rankscope.analyzer.thresholds import (EXACT_ROLE_LINKS, FAST_TCP_WIRE_S, LINK_BANDWIDTH,
                                           LINK_BANDWIDTH_BESIDE_STRAGGLER, LINK_MIN_LATENESS, MATRIX_MAX_RANKS,
                                           MIN_BYTES, MIN_LINKS, MIN_NODE_LINKS, MIN_RANKS, MIN_STEPS,
                                           MIN_TCP_SEND_BYTES, MIN_TCP_WIRE_S, NETWORK_LIMITED_SHARE, SLOW_FACTOR,
                                           TCP_SLOW_FACTOR, TCP_SLOW_FACTOR_IN_GROUP, Z_FLOOR, Z_MIN)
from rankscope.schema.finding import Finding, Why
from rankscope.schema.patterns import LinkStats, RankPattern, Role

@dataclass(frozen=True)
class TcpLimits:
    """Per link of a LinkMatrix, the kernel's limit accounting of its TCP connections, summed over them; NaN where
    unknown (NCCL's rows, an agent that did not report it)."""

    sndbuf_s: np.ndarray  # of the link's wire time, held by the sender's buffer
    retrans: np.ndarray  # segments retransmitted
    srtt_s: np.ndarray  # the smoothed round trip, its connections' largest
    min_rtt_s: np.ndarray  # the minimum round trip, its connections' smallest

    def busy_share(self, wire_s: np.ndarray, rwnd_s: np.ndarray) -> np.ndarray:
        """The share of the time with data to send that neither end held: wire time is busy and send-buffer
        limited time, `rwnd_s` the receiver-window-limited time beside it (NaN: unknown, or no such time)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return (wire_s - self.sndbuf_s) / (wire_s + rwnd_s)

    def row(self, i: int, wire_s: float, rwnd_s: float) -> dict[str, Any]:
        """What evidence shows of link i's limits ({} where unknown)."""
        total = wire_s + rwnd_s
        if not np.isfinite(self.sndbuf_s[i]) or total <= 0:
            return {}
        return {"busy_share": (wire_s - self.sndbuf_s[i]) / total, "rwnd_limited_share": rwnd_s / total,
                "sndbuf_limited_share": self.sndbuf_s[i] / total, "retrans": int(self.retrans[i]),
                "srtt_s": float(self.srtt_s[i]), "min_rtt_s": float(self.min_rtt_s[i])}


@dataclass(frozen=True)
class LinkMatrix:
    """Directed links between global ranks, one entry per (src, dst), summed over communicators; sorted."""

    src: np.ndarray  # global rank of the sender
    dst: np.ndarray  # global rank of the receiver
    steps: np.ndarray  # network steps (NCCL) or send calls (TCP)
    bytes: np.ndarray
    wire_s: np.ndarray
    peer_wait_s: np.ndarray  # the sender waiting for the receiver's credit (0 for receiver-measured links)
    from_sender: np.ndarray  # bool: measured on the sender's send rows only (False: a recv row stood in)
    tcp: np.ndarray  # bool: measured by the kernel's TCP accounting (False: NCCL's profiler plugin)
    limits: TcpLimits

    def __len__(self) -> int:
        return self.src.size

    @property
    def bandwidth_Bps(self) -> np.ndarray:
        """Bytes over wire time; a floor for TCP links too fast to time (see FAST_TCP_WIRE_S)."""
        wire = np.where(self._too_fast_to_time, FAST_TCP_WIRE_S, self.wire_s)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(wire > 0, self.bytes / wire, np.nan)

    @property
    def judged(self) -> np.ndarray:
        """Links with enough traffic in the window to judge their throughput, held by the network."""
        return self._bulk & (self.wire_s > 0) & ~self._too_fast_to_time & self.network_limited

    @property
    def network_limited(self) -> np.ndarray:
        """Links whose pace is the network's: busy for NETWORK_LIMITED_SHARE of their time with data to send, or
        not known otherwise (NCCL's rows; an agent without the limit accounting: judged as before)."""
        with np.errstate(invalid="ignore"):
            return ~(self.limits.busy_share(self.wire_s, self.peer_wait_s) < NETWORK_LIMITED_SHARE)

    @property
    def pacing(self) -> np.ndarray:
        """Links that set the pace a role's links are compared with: the judged ones, and TCP links that moved
        as much too fast to time; not those an end held (their pace is not the network's)."""
        return self._bulk & ((self.wire_s > 0) | self._too_fast_to_time) & self.network_limited

    @property
    def _too_fast_to_time(self) -> np.ndarray:
        """TCP links with less wire time than the kernel's ticks time well (MIN_TCP_WIRE_S)."""
        return self.tcp & (self.wire_s < MIN_TCP_WIRE_S)

    @property
    def _bulk(self) -> np.ndarray:
        """Enough steps and bytes, in sends large enough to be bound by bandwidth (TCP)."""
        return (self.steps >= MIN_STEPS) & (self.bytes >= MIN_BYTES) & \
            ~(self.tcp & (self.bytes < MIN_TCP_SEND_BYTES * self.steps))

    def row(self, i: int) -> dict[str, Any]:
        """One link as evidence shows it."""
        return {"src": int(self.src[i]), "dst": int(self.dst[i]), "bandwidth_Bps": float(self.bandwidth_Bps[i]),
                "steps": int(self.steps[i]), "bytes": int(self.bytes[i]), "wire_s": float(self.wire_s[i]),
                "step_latency_s": float(self.wire_s[i] / self.steps[i]) if self.steps[i] else None,
                "peer_wait_s": float(self.peer_wait_s[i]),
                "measured_by": "sender" if self.from_sender[i] else "receiver",
                "source": "tcp" if self.tcp[i] else "nccl_profiler",
                **self.limits.row(i, self.wire_s[i], self.peer_wait_s[i])}

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
    for p in compress(patterns, map(attrgetter("links"), patterns)):  # most patterns have none: skipped in C
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
        acc = totals.setdefault((src, dst), [0, 0, 0.0, 0.0, True, False])
        acc[0] += k.steps
        acc[1] += k.bytes
        acc[2] += k.wire_s
        acc[3] += k.peer_wait_s if by_sender else 0.0
        acc[4] &= by_sender
    tcp, tcp_limits = _tcp_links(patterns)
    for pair, acc in tcp.items():
        totals.setdefault(pair, acc)
    pairs = sorted(totals)
    cols = list(zip(*(totals[pair] for pair in pairs))) or [()] * 6
    unknown = [np.nan] * 4
    limits = np.array([tcp_limits.get(pair, unknown) if totals[pair][5] else unknown for pair in pairs],
                      dtype=float).reshape(len(pairs), 4)
    return LinkMatrix(src=np.array([s for s, _ in pairs], dtype=np.int64),
                      dst=np.array([d for _, d in pairs], dtype=np.int64),
                      steps=np.array(cols[0], dtype=np.int64), bytes=np.array(cols[1], dtype=np.int64),
                      wire_s=np.array(cols[2], dtype=float), peer_wait_s=np.array(cols[3], dtype=float),
                      from_sender=np.array(cols[4], dtype=bool), tcp=np.array(cols[5], dtype=bool),
                      limits=TcpLimits(*limits.T))


def _tcp_links(patterns: Sequence[RankPattern]
               ) -> tuple[dict[tuple[int, int], list[Any]], dict[tuple[int, int], list[float]]]:
    """(src, dst) -> [sends, bytes, wire, peer wait, True, True] from the patterns' TCP connections, and (src,
    dst) -> [send-buffer time, retransmits, largest srtt, smallest min RTT] where every connection of the pair
    reported them. A connection's peer is the rank whose connection has its two ends reversed; an address two
    ranks claim (two hosts behind one NAT) places nothing."""
    patterns = list(compress(patterns, map(attrgetter("tcp"), patterns)))  # most have none: skipped in C
    owner: dict[str, int] = {}
    twice: set[str] = set()
    for p in patterns:
        for f in p.tcp:
            if owner.setdefault(f.local, p.rank) != p.rank:
                twice.add(f.local)
    totals: dict[tuple[int, int], list[Any]] = {}
    limits: dict[tuple[int, int], list[float]] = {}
    for p in patterns:
        for f in p.tcp:
            dst = owner.get(f.remote)
            if dst is None or dst == p.rank or f.sent == 0 or {f.local, f.remote} & twice:
                continue
            acc = totals.setdefault((p.rank, dst), [0, 0, 0.0, 0.0, True, True])
            acc[0] += f.sends
            acc[1] += f.sent
            acc[2] += f.wire_s
            acc[3] += f.peer_wait_s
            lim = limits.setdefault((p.rank, dst), [0.0, 0, 0.0, np.inf])
            if f.sndbuf_s is None or f.retrans is None or f.min_rtt_s is None:
                lim[0] = np.nan  # one connection unknown: the pair's limits unknown
            else:
                lim[0] += f.sndbuf_s
                lim[1] += f.retrans
                lim[2] = max(lim[2], f.srtt_s)
                lim[3] = min(lim[3], f.min_rtt_s)
    return totals, {pair: lim if np.isfinite(lim[0]) else [np.nan] * 4 for pair, lim in limits.items()}


WITHIN = -2  # the "group pair" of a link within one peer group, whichever group


@dataclass(frozen=True)
class LinkRoles:
    """Per link, a role id: links measured the same way between the same two peer groups share one, and so do
    the links within a group, whichever group: the all-reduces of every pipeline stage move gradients at the
    link's pace, while activations between stages move at the reading stage's. A stage of two ranks has only
    its pair's two links to compare, and both touch a slow rank of the pair."""

    id: np.ndarray
    between: np.ndarray  # bool: the link joins two peer groups (pipeline stages)
    group: np.ndarray  # the peer group a link within one joins (-1: between two, or unknown)

    @classmethod
    def of(cls, m: LinkMatrix, patterns: Sequence[RankPattern]) -> LinkRoles:
        group_of = {}
        for g, rows in enumerate(peer_groups(patterns)):
            group_of.update((patterns[i].rank, g) for i in rows)
        ends = [(group_of.get(int(s), -1), group_of.get(int(d), -1)) for s, d in zip(m.src, m.dst)]
        keys = [((WITHIN, WITHIN) if gs == gd >= 0 else (gs, gd), bool(t)) for (gs, gd), t in zip(ends, m.tcp)]
        ids = {key: i for i, key in enumerate(sorted(set(keys)))}
        return cls(np.array([ids[key] for key in keys], dtype=np.intp),
                   np.fromiter((gs != gd for gs, gd in ends), bool, len(ends)),
                   np.fromiter((gs if gs == gd else -1 for gs, gd in ends), np.intp, len(ends)))


def _role_medians(pacing: np.ndarray, role: np.ndarray, bw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per link: the median throughput of its role's pacing links (NaN: none), and how many there are."""
    median, count = np.full(role.size, np.nan), np.zeros(role.size, np.int64)
    for r in np.unique(role[pacing]):
        of_role = role == r
        median[of_role] = np.median(bw[pacing & of_role])
        count[of_role] = np.count_nonzero(pacing & of_role)
    return median, count


def _slow_factor(m: LinkMatrix) -> np.ndarray:
    return np.where(m.tcp, TCP_SLOW_FACTOR, SLOW_FACTOR)


def _slow_nodes(m: LinkMatrix, judged: np.ndarray, pacing: np.ndarray, roles: LinkRoles, bw: np.ndarray
                ) -> dict[int, tuple[float, list[Why]]]:
    """rank -> (the throughput its links fell short of, the figures that found them slow: a finding's why),
    for each rank with MIN_NODE_LINKS judged links or more,
    every one slower than its slow factor below the median of its role's pacing links that do not touch the rank:
    those of its own peer group where there are any (TCP_SLOW_FACTOR_IN_GROUP), else the role's others.

    Leaving the rank's own links out matters in small jobs: in a ring of three, two of the three links touch
    the slow rank, and a median over all of them is theirs. In a role of many links one rank's few barely
    move the median, so there the role's median stands in: one pass over 100,000 ranks' links.
    A link between two suspects is the worse one's: its neighbour is judged again without it (a pass per
    such chain, usually one). In a ring of four, the rank sending to a slow rank has that link and one more,
    and TCP over loopback runs at the pace its ends get a CPU: both its links can fall below the bar, and it
    would be a second suspect beside the slow rank."""
    found: dict[int, tuple[float, list[Why]]] = {}
    judged, pacing = judged.copy(), pacing.copy()
    while True:
        suspects = _slow_node_pass(m, judged, pacing, roles, bw)
        if not suspects:
            return found
        surer = {r: (share, r) for r, (_, share, _) in suspects.items()}  # ties by rank: the surest always stays
        waits = {max(int(src), int(dst), key=surer.__getitem__)  # a suspect sharing a link with a surer one
                 for src, dst in zip(m.src[judged], m.dst[judged]) if src in suspects and dst in suspects}
        kept = [r for r in suspects if r not in waits]
        found.update((r, (suspects[r][0], suspects[r][2])) for r in kept)
        gone = np.isin(m.src, kept) | np.isin(m.dst, kept)
        judged &= ~gone
        pacing &= ~gone


def _slow_node_pass(m: LinkMatrix, judged: np.ndarray, pacing: np.ndarray, roles: LinkRoles, bw: np.ndarray
                    ) -> dict[int, tuple[float, float, list[Why]]]:
    """One pass of _slow_nodes: rank -> (the throughput its links fell short of, the median share of it
    they reached: the lower, the surer). A link between pipeline stages moves at the reading stage's pace, so
    it only clears a rank (at or above its reference), never accuses one: the stage a slow rank holds up
    reads slowly from every sender. Third in the tuple: the figures that found its links slow (the finding's
    why)."""
    role = roles.id
    median, count = _role_medians(pacing, role, bw)
    end_rank = np.concatenate([m.src, m.dst])  # each link once per end
    link = np.tile(np.arange(len(m)), 2)
    reference = median[link]
    factor = _slow_factor(m)[link]
    sends_slow: dict[int, bool] = {}  # _sends_between_slow per rank: each of its links asks the same
    for k in np.flatnonzero(judged[link] & (count[link] <= EXACT_ROLE_LINKS)):
        r, g = end_rank[k], roles.group[link[k]]
        others = _untouched(m, pacing, role, link[k], r)
        in_group = others & (roles.group == g) if g >= 0 else np.zeros_like(others)
        if in_group.any():  # the rank's own group's other links: the same collectives, the same pace
            reference[k] = np.median(bw[in_group])
            if m.tcp[link[k]]:
                factor[k] = TCP_SLOW_FACTOR_IN_GROUP
        else:
            reference[k] = np.median(bw[others]) if others.any() else np.nan
            if m.tcp[link[k]]:
                if r not in sends_slow:
                    sends_slow[r] = _sends_between_slow(m, pacing, roles, bw, r)
                if sends_slow[r]:
                    factor[k] = TCP_SLOW_FACTOR_IN_GROUP
    within = judged[link] & ~roles.between[link]
    with np.errstate(invalid="ignore"):
        slow = within & (bw[link] < reference / factor)  # no reference: not slow
        clears = pacing[link] & roles.between[link] & (bw[link] >= reference)
    ends, at = np.unique(end_rank, return_inverse=True)
    n_within = np.bincount(at, weights=within, minlength=ends.size)
    n_slow = np.bincount(at, weights=slow, minlength=ends.size)
    cleared = np.bincount(at, weights=clears, minlength=ends.size) > 0
    out = {}
    for e in np.flatnonzero((n_within >= MIN_NODE_LINKS) & (n_slow == n_within) & ~cleared):
        mine = (at == e) & slow
        why = [Why("slow_links", n_slow[e], MIN_NODE_LINKS, "links, every judged link of the rank")]
        why += [_slowdown(m, link[k], reference[k], bw[link[k]], factor[k]) for k in np.flatnonzero(mine)]
        out[int(ends[e])] = (float(np.median(reference[mine])), float(np.median(bw[link[mine]] / reference[mine])),
                             why)
    return out


def _slowdown(m: LinkMatrix, i: int, reference: float, bw: float, factor: float) -> Why:
    """Link i's figure: how many times slower than the `reference` it is held to, against its slow factor."""
    return Why("link_slowdown", reference / bw, factor, f"times slower than its peers' links: {m.src[i]} -> {m.dst[i]}",
               ">")


def _sends_between_slow(m: LinkMatrix, pacing: np.ndarray, roles: LinkRoles, bw: np.ndarray, r: int) -> bool:
    """Whether rank r sends to other peer groups, and every such TCP link runs below 1/TCP_SLOW_FACTOR_IN_GROUP
    of its role's links that do not touch r: its group peers' sends of the same tensors to the same stage.
    Alone this says little (a stage's sends wait for the reading stage: a healthy rank's sends can run at a
    fraction of its stage peer's); it says which end of a stage of two's one slow pair is the slow one."""
    mine = np.flatnonzero(pacing & roles.between & m.tcp & (m.src == r))
    if not mine.size:
        return False
    for i in mine:
        others = _untouched(m, pacing, roles.id, i, r)
        if not others.any() or bw[i] >= np.median(bw[others]) / TCP_SLOW_FACTOR_IN_GROUP:
            return False
    return True


def _untouched(m: LinkMatrix, pacing: np.ndarray, role: np.ndarray, i: int, r: int) -> np.ndarray:
    """The pacing links of link i's role that do not touch rank r: what r's link is held to."""
    return pacing & (role == role[i]) & (m.src != r) & (m.dst != r)


def _comm_share(p: RankPattern) -> float:
    return min(p.time_in(Role.COMM) / p.window_s, 1.0)


def _exposed_share(p: RankPattern) -> float:
    """The share of the window the rank's training thread waited for its host collectives to complete (DDP's
    reducer at the end of backward: Role.EXPOSED); 1 (no bound) where that is unknown: for collectives that
    run on the GPU (NCCL: the reducer's host wait only queues the streams), and beside point-to-point
    transfers (a pipeline stage's training thread waits in those too)."""
    names = p.functions
    if (Role.EXPOSED not in names.roles or not any(map(HOST_COLLECTIVES.match, names))
            or any(map(HOST_P2P.match, names))):
        return 1.0
    return min(p.time_in(Role.EXPOSED) / p.window_s, 1.0)


def _rate(bw: float) -> str:
    return f"{bw / 1e9:.1f} GB/s" if bw >= 1e9 else f"{bw / 1e6:.0f} MB/s"


def _rates(lo: float, hi: float) -> str:
    """"4.0-6.0 GB/s"; one figure when both round alike."""
    a, b = _rate(lo), _rate(hi)
    if a == b:
        return a
    return f"{a.split()[0]}-{b}" if a.split()[1] == b.split()[1] else f"{a}-{b}"


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


def link_findings(patterns: Sequence[RankPattern], stragglers: Collection[int] = ()) -> list[Finding]:
    """`slow_link` findings from the link matrix: a rank all of whose links (two or more) are slow is the
    suspect (its NIC or host), reported once; any other slow link is reported as exactly that pair.
    `stragglers`: ranks already found slow for their own reasons; their links are not judged. TCP moves bytes
    at the pace the ends' CPUs allow (a straggler busy on a shared core slows its neighbours' loopback links
    several-fold), and NCCL's at the pace a late rank posts its receives and sends (a straggler's ring links
    run at a fraction of its peers' pace)."""
    m = link_matrix(patterns)
    unjudged = np.isin(m.src, list(stragglers)) | np.isin(m.dst, list(stragglers))
    judged, pacing = m.judged & ~unjudged, m.pacing & ~unjudged
    if np.count_nonzero(pacing) < MIN_LINKS:
        return []
    bw = m.bandwidth_Bps
    roles = LinkRoles.of(m, patterns)
    nodes = _slow_nodes(m, judged, pacing, roles, bw)
    median, count = _role_medians(pacing, roles.id, bw)
    with np.errstate(invalid="ignore"):
        slow = judged & (count >= MIN_LINKS) & (bw < median / _slow_factor(m))
    if not slow.any() and not nodes:
        return []

    # Per rank: its judged links that are not slow (a link counts for both of its ends).
    ends, at = np.unique(np.concatenate([m.src, m.dst]), return_inverse=True)
    n_judged = np.bincount(at, weights=np.tile(judged, 2), minlength=ends.size)
    normal_of = dict(zip(ends.tolist(), (n_judged - np.bincount(at, weights=np.tile(slow, 2),
                                                                 minlength=ends.size)).tolist()))
    by_node = np.isin(m.src, list(nodes)) | np.isin(m.dst, list(nodes))
    by_rank = {p.rank: p for p in patterns}
    window_s = float(np.median([p.window_s for p in patterns]))
    matrix = m.dense() if np.count_nonzero(n_judged) <= MATRIX_MAX_RANKS else None

    def finding(ranks: list[int], rows: np.ndarray, reference: float, summary: str, extra: dict[str, Any],
                criterion: str, why: list[Why]) -> Finding:
        worst = float(bw[rows].min())
        # A ring or tree collective moves at its slowest link's pace, so at the others' median throughput its
        # transfer time would shrink by (1 - worst / reference). The ranks' COMM share of the window bounds the
        # transfer time from above (it also holds waiting for late peers), so the product is an upper bound.
        # So is the time the link had data to send beyond what its bytes need at the reference throughput,
        # and the tighter one where DDP's buckets all-reduce during the backward pass: COMM then spans the
        # whole step on every rank, and its bound reads several times the true cost. Tighter still where the
        # training thread's wait for its collectives is measured: only the transfer backward did not hide
        # delays the step.
        share = max(_comm_share(by_rank[r]) for r in ranks)
        exposed = max(_exposed_share(by_rank[r]) for r in ranks)
        extra_s = float(np.max(m.wire_s[rows] - m.bytes[rows] / reference))
        cost = float(np.clip(min(min(share, exposed) * (1.0 - worst / reference), extra_s / window_s), 0.0, 1.0))
        busy = m.limits.busy_share(m.wire_s, m.peer_wait_s)[rows]
        limited = bool(np.isfinite(busy).all())  # the kernel's limit accounting of every link named
        if limited:
            why = [*why, Why("network_limited_share", float(busy.min()), NETWORK_LIMITED_SHARE,
                             "share of time with data to send")]
        return Finding(
            kind="slow_link", ranks=ranks, function=None, component="link", score=reference / worst, cost=cost,
            criterion=criterion, why=why, summary=f"{summary}; costs {cost:.0%} of step time",
            evidence={**extra, "bandwidth_Bps": worst, "peers_bandwidth_Bps": reference, "comm_share": share,
                      **({"exposed_comm_share": exposed} if exposed < 1.0 else {}),
                      "extra_wire_s": extra_s,
                      **({"network_limited": True} if limited else {}),
                      "judged_links": int(np.count_nonzero(judged)),
                      "links": [m.row(i) for i in np.flatnonzero(rows)],
                      **({"link_matrix": matrix} if matrix is not None else {}),
                      **({"collectives_gpu": g} if (g := _collectives_gpu(by_rank, ranks)) else {})},
        )

    out = []
    for r, (reference, figures) in sorted(nodes.items()):
        rows = judged & ((m.src == r) | (m.dst == r))
        speeds = _rates(float(bw[rows].min()), float(bw[rows].max()))
        host = by_rank[r].host if r in by_rank else "?"
        out.append(finding([r], rows, reference, (
            f"every link of rank {r} (on host {host}) is slow: {np.count_nonzero(rows)} links at {speeds} vs "
            f"{_rate(reference)} on the others: suspect its NIC or host, not one link"), {"rank": r, "host": host},
            "link_matrix_slow_rank", figures))
    for i in np.flatnonzero(slow & ~by_node):
        src, dst = int(m.src[i]), int(m.dst[i])
        normal = [r for r in (src, dst) if normal_of[r] > 0]
        why = {2: "while both ranks' other links are normal", 1: f"while rank {normal[0]}'s other links are normal",
               0: "(too few other links of these ranks to rule out a slow node)"}[len(normal)]
        out.append(finding([src, dst], np.arange(len(m)) == i, float(median[i]), (
            f"link {src} -> {dst} moves {_rate(float(bw[i]))} vs {_rate(float(median[i]))} on the job's other "
            f"links {why}: a slow link"), {"src": src, "dst": dst}, "link_matrix_slow",
            [Why("role_links", count[i], MIN_LINKS, "judged links of its role"),
             _slowdown(m, i, float(median[i]), float(bw[i]), float(_slow_factor(m)[i]))]))
    return out


def _late_finish_why(rank: int, z: float, late: float, bandwidth: float, share: float) -> list[Why]:
    """The figures slow_link named a rank by: its finish lateness (`late`: beyond its peers', a share of the step)
    and its bandwidth against its peers' (`bandwidth`; NaN: unknown, which does not clear it)."""
    return [Why("finish_late_z", z, Z_MIN, "robust z", ">=", rank),
            Why("finish_late_excess", late, LINK_MIN_LATENESS, "share of step", ">=", rank),
            *([Why("bandwidth_share", bandwidth, share, "of the peers' bandwidth", "<=", rank)]
              if np.isfinite(bandwidth) else [])]


def slow_link(t: RankTable, a: Alignment, stragglers: Collection[int] = ()) -> list[Finding]:
    """Ranks that finish collectives last (a finish-lateness outlier) while their compute is normal.

    Per-rank COMM totals cannot show this (the slow rank's late finish makes it arrive late next time, and
    its peers wait that long), so the decision rests on the alignment of collective instants.
    `stragglers`: ranks already found to compute slowly; their lateness is not the link's.
    """
    valid = decidable(t)
    if valid is None or a.instances == 0:
        return []
    step = t.job_step_s
    late = np.where(valid, a.finish_late_s, np.nan)
    if np.count_nonzero(np.isfinite(late)) < MIN_RANKS:
        return []
    z, excess = peer_deviation(late, Z_FLOOR * step)
    peers_late = peers_median(late)
    with np.errstate(divide="ignore", invalid="ignore"):
        bandwidth = np.where(a.transfer_s > 0, a.bytes / a.transfer_s, np.nan)
    peers_bw = peers_median(np.where(valid, bandwidth, np.nan))
    with np.errstate(invalid="ignore"):
        # A slow link moves the bytes slower: a rank that finishes late at the peers' bandwidth was only
        # descheduled at the end (CPU-bound ranks sharing cores finish late at their peers' bandwidth).
        share = LINK_BANDWIDTH_BESIDE_STRAGGLER if len(stragglers) else LINK_BANDWIDTH
        slower = ~(bandwidth > share * peers_bw)  # unknown bandwidth does not clear a rank
        flagged = np.flatnonzero((z >= Z_MIN) & (excess >= LINK_MIN_LATENESS * step) & slower
                                 & ~np.isin(t.rank, list(stragglers)))
    if flagged.size == 0:
        return []

    why = {int(t.rank[i]): _late_finish_why(int(t.rank[i]), z[i], excess[i] / step, bandwidth[i] / peers_bw, share)
           for i in flagged}
    per_rank = [{
        "rank": int(t.rank[i]), "z": float(z[i]), "finish_lateness_s": float(late[i]),
        "excess_s": float(excess[i]), "arrival_lateness_s": float(a.arrival_late_s[i]),
        "bytes_per_collective": float(a.bytes[i]), "bandwidth_Bps": float(bandwidth[i]),
    } for i in flagged]
    per_rank.sort(key=lambda r: r["rank"])
    ranks = [r["rank"] for r in per_rank]
    worst = max(per_rank, key=lambda r: r["excess_s"])
    lead = max(per_rank, key=lambda r: r["z"])["rank"]  # the rank the score is of
    cost = float(np.clip(worst["excess_s"] / step, 0.0, 1.0))
    bw = ""
    if np.isfinite(worst["bandwidth_Bps"]) and np.isfinite(peers_bw):
        bw = (f" ({worst['bytes_per_collective'] / 1e6:.0f} MB at {worst['bandwidth_Bps'] / 1e9:.1f} GB/s "
              f"vs {peers_bw / 1e9:.1f} GB/s on the other ranks)")
    return [Finding(
        kind="slow_link", ranks=ranks, function=a.op, component="link",
        score=max(r["z"] for r in per_rank), cost=cost,
        criterion="late_finish_low_bandwidth" if len(why[lead]) > 2 else "late_finish_bandwidth_unknown",
        why=[w for r in ranks for w in why[r]],
        summary=(f"{rank_list(ranks)} {'finishes' if len(ranks) == 1 else 'finish'} {a.op} "
                 f"{range_ms([r['excess_s'] for r in per_rank])} after {'its' if len(ranks) == 1 else 'their'} "
                 f"peers{bw} while {'its' if len(ranks) == 1 else 'their'} compute is normal: a slow link; "
                 f"costs {cost:.0%} of step time"),
        evidence={"step_time_s": step, "op": a.op, "instances": a.instances,
                  "lateness_s": worst["finish_lateness_s"], "peers_lateness_s": peers_late,
                  "bytes_per_collective": worst["bytes_per_collective"], "bandwidth_Bps": worst["bandwidth_Bps"],
                  "peers_bandwidth_Bps": peers_bw, "per_rank": per_rank},
    )]
