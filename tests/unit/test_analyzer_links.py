"""The link matrix and its slow_link findings on synthetic NCCL profiler plugin rows and TCP connections
(analyzer/rules/links.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from test_analyzer import findings, simulate

from rankscope.analyzer.diagnosis import find
from rankscope.analyzer.rules.links import LinkRoles, link_findings, link_matrix
from rankscope.schema.patterns import (CollectiveColumns, CollectiveGpu, CollectiveRecord, FunctionColumns,
                                       FunctionStats, LinkStats, RankPattern, Role, TcpFlow)

COMM = 0x5EED_CAFE
GBPS = 20e9  # a healthy link
STEP_BYTES = 4 << 20
STEPS = 64


def ring(patterns: list[RankPattern], members: list[int], slow: dict[tuple[int, int], float] | None = None,
         comm: int = COMM, steps: int = STEPS) -> list[RankPattern]:
    """Adds a ring communicator over `members` (global ranks, in comm-rank order) to the patterns: each member
    sends to the next and receives from the previous; `slow` maps a global (src, dst) to its GB/s."""
    by_rank = {p.rank: p for p in patterns}
    n = len(members)
    for c, g in enumerate(members):
        for peer, send in (((c + 1) % n, True), ((c - 1) % n, False)):
            pair = (g, members[peer]) if send else (members[peer], g)
            bw = (slow or {}).get(pair, GBPS / 1e9) * 1e9
            nbytes = steps * STEP_BYTES
            by_rank[g].links.append(LinkStats(comm=comm, rank=c, peer=peer, send=send, steps=steps, bytes=nbytes,
                                              wire_s=nbytes / bw, peer_wait_s=0.001 if send else 0.0))
    return patterns


def job(n: int = 8, **kw) -> list[RankPattern]:
    return simulate(n, seed=11, **kw)


def test_healthy_ring_has_no_link_finding_and_a_full_matrix():
    ps = ring(job(), list(range(8)))
    m = link_matrix(ps)
    assert list(zip(m.src.tolist(), m.dst.tolist())) == [(r, (r + 1) % 8) for r in range(8)]
    assert m.from_sender.all() and m.bandwidth_Bps == pytest.approx([GBPS] * 8)
    assert link_findings(ps) == []
    assert findings(ps) == []


def test_one_slow_link_is_exactly_that_pair():
    ps = ring(job(), list(range(8)), slow={(3, 4): 5.0})
    f, = link_findings(ps)
    assert (f.kind, f.ranks, f.component) == ("slow_link", [3, 4], "link")
    ev = f.evidence
    assert (ev["src"], ev["dst"]) == (3, 4)
    assert ev["bandwidth_Bps"] == pytest.approx(5e9) and ev["peers_bandwidth_Bps"] == pytest.approx(GBPS)
    assert [(r["src"], r["dst"], r["measured_by"]) for r in ev["links"]] == [(3, 4, "sender")]
    assert f.score == pytest.approx(4.0)
    assert "link 3 -> 4 moves 5.0 GB/s vs 20.0 GB/s" in f.summary and "both ranks' other links are normal" in f.summary
    # Cost: the ranks' COMM share of the window x the transfer time the link would save at the median pace,
    # or, if less, the link's time on the wire beyond what its bytes need at that pace, over the window.
    share, window = ev["comm_share"], ps[0].window_s
    assert 0.2 < share < 0.6 and ev["extra_wire_s"] == pytest.approx(STEPS * STEP_BYTES * (1 / 5e9 - 1 / GBPS))
    assert f.cost == pytest.approx(min(share * 0.75, ev["extra_wire_s"] / window))
    matrix = ev["link_matrix"]
    assert matrix["ranks"].tolist() == list(range(8)) and matrix["bandwidth_Bps"][3, 4] == pytest.approx(5e9)


def test_slow_node_is_one_finding_not_two_links():
    ps = ring(job(), list(range(8)), slow={(4, 5): 4.0, (5, 6): 6.0})
    f, = link_findings(ps)
    assert (f.kind, f.ranks, f.evidence["host"]) == ("slow_link", [5], "node1")
    assert sorted((r["src"], r["dst"]) for r in f.evidence["links"]) == [(4, 5), (5, 6)]
    assert "every link of rank 5 (on host node1) is slow: 2 links at 4.0-6.0 GB/s" in f.summary
    assert "NIC or host" in f.summary and f.score == pytest.approx(5.0)


def test_sub_communicator_maps_comm_ranks_to_global_ranks():
    ps = job()
    ring(ps, list(range(8)))  # the world communicator, healthy
    ring(ps, [6, 2, 7, 0], slow={(2, 7): 3.0}, comm=0xABC)  # comm rank 1 -> 2 is global 2 -> 7
    f, = link_findings(ps)
    assert f.ranks == [2, 7] and (f.evidence["src"], f.evidence["dst"]) == (2, 7)
    m = link_matrix(ps)
    # 8 world links + 4 of the sub-ring, 7 -> 0 in both
    assert len(m) == 11 and {(6, 2), (2, 7), (7, 0), (0, 6)} <= set(zip(m.src.tolist(), m.dst.tolist()))


def test_both_communicators_over_one_pair_add_up():
    ps = ring(ring(job(3), [0, 1, 2]), [0, 1, 2], comm=0xABC, slow={(1, 2): 10.0})
    m = link_matrix(ps)
    i = list(zip(m.src.tolist(), m.dst.tolist())).index((1, 2))
    assert m.steps[i] == 2 * STEPS and m.bandwidth_Bps[i] == pytest.approx(2 / (1 / 20e9 + 1 / 10e9))


def test_receiver_row_stands_in_when_the_sender_lacks_the_link():
    ps = ring(job(), list(range(8)), slow={(3, 4): 5.0})
    ps[3].links = [k for k in ps[3].links if not k.send]  # rank 3 kept only its recv row (MAX_LINKS cap)
    f, = link_findings(ps)
    assert f.ranks == [3, 4] and f.evidence["links"][0]["measured_by"] == "receiver"


def test_a_peer_without_rows_in_the_communicator_is_left_out():
    ps = ring(job(), list(range(8)), slow={(3, 4): 5.0})
    ps[4].links = []  # comm rank 4 is unknown: neither 3 -> 4 nor 4 -> 5 can be placed
    assert link_findings(ps) == []
    assert len(link_matrix(ps)) == 6


@pytest.mark.parametrize("steps", [1, 7])
def test_too_few_steps_are_not_judged(steps):
    ps = ring(job(), list(range(8)), slow={(3, 4): 2.0}, steps=steps)
    assert not link_matrix(ps).judged.any() and link_findings(ps) == []


def test_two_links_are_too_few_to_judge():
    ps = ring(job(2), [0, 1], slow={(0, 1): 2.0})
    assert link_findings(ps) == []


def test_mild_slowdown_is_not_flagged():
    ps = ring(job(), list(range(8)), slow={(3, 4): 14.0})  # 20 / 14 = 1.43 < 1.5
    assert link_findings(ps) == []


def test_collectives_gpu_time_in_evidence():
    ps = ring(job(), list(range(8)), slow={(3, 4): 5.0})
    for p in ps:
        p.collectives_gpu = [CollectiveGpu("ncclAllReduce", 40, 40 * (0.030 if p.rank in (3, 4) else 0.017), 0.035)]
    f, = link_findings(ps)
    rows = f.evidence["collectives_gpu"]
    assert [(r["rank"], r["op"]) for r in rows] == [(3, "ncclAllReduce"), (4, "ncclAllReduce")]
    assert rows[0]["mean_s"] == pytest.approx(0.030) and rows[0]["peers_mean_s"] == pytest.approx(0.017)


def test_matrix_finding_replaces_the_timing_based_one_end_to_end():
    # Rank 5 finishes every all-reduce late: the timing rule alone says slow_link [5]...
    timing, = find(job(link_extra={5: 0.015}))
    assert (timing.kind, timing.ranks, timing.evidence.get("op")) == ("slow_link", [5], "ncclAllReduce")
    # ...and with the plugin's rows the matrix names the node, reported once.
    ps = ring(job(link_extra={5: 0.015}), list(range(8)), slow={(4, 5): 4.0, (5, 6): 4.0})
    fs = find(ps)
    assert [(f.kind, f.ranks) for f in fs] == [("slow_link", [5])]
    assert fs[0].evidence["host"] == "node1" and "op" not in fs[0].evidence


def test_the_receiver_of_a_slow_nodes_link_is_not_a_second_slow_link():
    # Rank 6 receives over the slow rank 5's link and finishes its all-reduces last: the timing rule alone
    # names it; the matrix's node finding explains it.
    ps = ring(job(link_extra={6: 0.015}), list(range(8)), slow={(4, 5): 4.0, (5, 6): 4.0})
    assert [(f.kind, f.ranks) for f in find(ps)] == [("slow_link", [5])]


def test_timing_finding_outside_the_matrix_finding_stays():
    # The matrix names link 0 -> 1; rank 5's late finishes are not explained by it and stay reported.
    ps = ring(job(link_extra={5: 0.015}), list(range(8)), slow={(0, 1): 4.0})
    fs = find(ps)
    assert sorted((f.ranks, "src" in f.evidence) for f in fs) == [([0, 1], True), ([5], False)]


def test_a_slow_node_and_an_unrelated_slow_link_in_the_diagnosis_document():
    ps = ring(job(), list(range(8)), slow={(4, 5): 4.0, (5, 6): 4.0, (0, 1): 8.0})
    fs = findings(ps)  # strict JSON: the dense matrix's empty cells are null
    assert [(f["kind"], f["ranks"], f["component"]) for f in fs] == [("slow_link", [5], "link"),
                                                                    ("slow_link", [0, 1], "link")]
    matrix = fs[1]["evidence"]["link_matrix"]
    assert matrix["bandwidth_Bps"][0][1] == pytest.approx(8e9) and matrix["bandwidth_Bps"][1][0] is None
    assert fs[0]["cost"] > fs[1]["cost"] > 0


# --- links measured by the kernel's TCP accounting (gloo) ---------------------------------------------
MBPS = 40e6  # a healthy loopback gloo link on a busy 2-core host


@dataclass(frozen=True)
class Limits:
    """A connection's limit accounting: receiver-window- and send-buffer-limited time as shares of its wire
    time (busy and send-buffer-limited), and its retransmits."""

    rwnd: float = 0.0
    sndbuf: float = 0.0
    retrans: int = 0
SENT = 200 << 20


def connect(patterns: list[RankPattern], src: int, dst: int, mbps: float = MBPS / 1e6, sent: int = SENT,
            limits: Limits | None = None) -> None:
    """One TCP connection src -> dst carrying `sent` bytes at `mbps` MB/s, as both ends' patterns see it; with
    `limits`, the kernel's limit accounting as shares of its wire time (an agent without it: None)."""
    by_rank = {p.rank: p for p in patterns}
    a, b = f"127.0.0.1:{41000 + 100 * src + dst}", f"127.0.0.1:{52000 + 100 * dst + src}"
    wire = sent / (mbps * 1e6)
    accounting = {} if limits is None else {
        "sndbuf_s": limits.sndbuf * wire, "retrans": limits.retrans, "min_rtt_s": 4e-6}
    by_rank[src].tcp.append(TcpFlow(local=a, remote=b, sends=800, sent=sent, received=0, wire_s=wire,
                                    peer_wait_s=0.01 if limits is None else limits.rwnd * wire, srtt_s=5e-5,
                                    **accounting))
    by_rank[dst].tcp.append(TcpFlow(local=b, remote=a, sends=800, sent=0, received=sent, wire_s=0.0,
                                    peer_wait_s=0.0, srtt_s=5e-5))


def tcp_ring(patterns: list[RankPattern], slow_rank: int | None = None, mbps: float = 10.0,
             slow_limits: Limits | None = None, limits: Limits | None = None) -> list[RankPattern]:
    """gloo's ring all-reduce: each rank sends to the next; both links of `slow_rank` move `mbps` MB/s, with
    `slow_limits` as their limit accounting, the others with `limits`."""
    n = len(patterns)
    for r in range(n):
        dst = (r + 1) % n
        slow = slow_rank in (r, dst)
        connect(patterns, r, dst, mbps if slow else MBPS / 1e6, limits=slow_limits if slow else limits)
    return patterns


def test_tcp_links_are_placed_by_their_reversed_addresses():
    m = link_matrix(tcp_ring(job(3)))
    assert list(zip(m.src.tolist(), m.dst.tolist())) == [(0, 1), (1, 2), (2, 0)]
    assert m.tcp.all() and m.judged.all() and m.bandwidth_Bps == pytest.approx([MBPS] * 3)
    assert link_findings(tcp_ring(job(3))) == [] and link_findings(tcp_ring(job(4))) == []


@pytest.mark.parametrize("n", [3, 4])
def test_a_slow_rank_in_a_small_tcp_ring_is_the_node(n):
    # With three ranks two of the three links touch the slow rank: each link is compared with the links
    # that do not touch the rank, not with a median the slow links make.
    fs = link_findings(tcp_ring(job(n), slow_rank=n - 1))
    assert [(f.kind, f.ranks) for f in fs] == [("slow_link", [n - 1])]
    f = fs[0]
    assert f.evidence["bandwidth_Bps"] == pytest.approx(10e6) and f.evidence["peers_bandwidth_Bps"] == pytest.approx(MBPS)
    assert {r["source"] for r in f.evidence["links"]} == {"tcp"}
    assert f"every link of rank {n - 1}" in f.summary and "10 MB/s vs 40 MB/s" in f.summary


@pytest.mark.parametrize("held", [Limits(rwnd=3.0), Limits(sndbuf=0.7), Limits(rwnd=0.6, sndbuf=0.3)])
def test_a_slow_tcp_flow_an_end_held_is_not_a_slow_link(held):
    # The receiver not reading (its window full) or the sender's own buffer: the network idled, whatever the rate.
    fs = link_findings(tcp_ring(job(4), slow_rank=3, slow_limits=held, limits=Limits()))
    assert fs == []


@pytest.mark.parametrize("busy", [Limits(), Limits(rwnd=0.3, sndbuf=0.2, retrans=40)])
def test_a_slow_tcp_flow_the_network_held_is_still_the_slow_node(busy):
    fs = link_findings(tcp_ring(job(4), slow_rank=3, slow_limits=busy, limits=Limits()))
    assert [(f.kind, f.ranks) for f in fs] == [("slow_link", [3])]
    f = fs[0]
    assert f.evidence["network_limited"] is True
    shares = [(r["busy_share"], r["rwnd_limited_share"], r["sndbuf_limited_share"]) for r in f.evidence["links"]]
    total = 1 + busy.rwnd
    assert shares == [pytest.approx(((1 - busy.sndbuf) / total, busy.rwnd / total, busy.sndbuf / total))] * 2
    assert {r["retrans"] for r in f.evidence["links"]} == {busy.retrans}
    [share] = [w for w in f.why if w.measure == "network_limited_share"]
    assert share.value == pytest.approx((1 - busy.sndbuf) / total) and share.crossed()


def test_links_without_limit_accounting_are_judged_as_before_beside_those_with_it():
    # An older agent's patterns: the slow rank's flows carry no accounting, the others' do.
    fs = link_findings(tcp_ring(job(4), slow_rank=3, slow_limits=None, limits=Limits(rwnd=3.0)))
    assert [(f.kind, f.ranks) for f in fs] == []  # the healthy links an end held set no pace: too few left
    fs = link_findings(tcp_ring(job(4), slow_rank=3, slow_limits=None, limits=Limits()))
    assert [(f.kind, f.ranks) for f in fs] == [("slow_link", [3])]
    assert "network_limited" not in fs[0].evidence and "busy_share" not in fs[0].evidence["links"][0]


def test_the_cost_of_a_slow_link_under_overlapped_buckets_is_its_extra_time_on_the_wire():
    # cnn-3, rank 2 behind a 100 Mbit/s link: DDP's buckets all-reduce during the backward pass on two gloo
    # threads, so COMM spans the window (step 70 ms against 56 healthy: a true cost of 0.21). The slow links
    # moved 73 MB in 5.8 s of a 10 s window; at the others' 45 MB/s they would have taken 1.6 s: 0.42.
    ps = job(3)
    sent = int(0.58 * ps[0].window_s * 12.5e6)  # busy 58% of the window at 12.5 MB/s
    for src, dst, mbps in ((0, 2, 12.5), (2, 1, 13.0), (1, 0, 45.0)):
        connect(ps, src, dst, mbps, sent=sent)
    for p in ps:
        p.functions = FunctionColumns.of({n: replace(f, total_s=p.window_s) if f.role == Role.COMM else f
                                          for n, f in p.functions.items()})
    f, = link_findings(ps)
    assert f.ranks == [2] and f.evidence["comm_share"] == pytest.approx(1.0)
    assert f.cost == pytest.approx(f.evidence["extra_wire_s"] / ps[0].window_s) and f.cost < 1 - 12.5 / 45


def ddp_over_gloo(ps: list[RankPattern], exposed_share: float, *extra: FunctionStats) -> list[RankPattern]:
    """Each rank's collectives as gloo's, busy the whole window on its worker threads, and DDP's reducer waiting
    for them `exposed_share` of the window on the training thread."""
    for p in ps:
        w = p.window_s
        p.functions = FunctionColumns.of({f.name: f for f in (
            FunctionStats("gloo_allreduce", Role.COMM, 600, w, 0.01, 0.005, 0.009),
            FunctionStats("Reducer_finalize_backward", Role.EXPOSED, 100, exposed_share * w, 0.01, 0.005, 0.009),
            *extra)})
    return ps


def slow_rank_2(ps: list[RankPattern]) -> list[RankPattern]:
    sent = int(0.58 * ps[0].window_s * 12.5e6)
    for src, dst, mbps in ((0, 2, 12.5), (2, 1, 13.0), (1, 0, 45.0)):
        connect(ps, src, dst, mbps, sent=sent)
    return ps


def test_the_cost_of_a_slow_link_is_bounded_by_the_wait_backward_did_not_hide():
    # cnn-3, rank 2's links at a quarter of their pace: the training thread waited 87 ms of a 245 ms step for
    # DDP's all-reduces after backward (36 ms healthy); the step grew 67 ms. COMM and the wire's extra time
    # both read ~0.5; the exposed wait x (1 - slow / reference pace) reads what the link costs.
    f, = link_findings(ddp_over_gloo(slow_rank_2(job(3)), 87 / 245))
    assert f.ranks == [2] and f.evidence["exposed_comm_share"] == pytest.approx(87 / 245)
    assert f.cost == pytest.approx(87 / 245 * (1 - 12.5 / 45))
    assert f.cost < f.evidence["extra_wire_s"] / job(3)[0].window_s
    # With point-to-point transfers the training thread waits in those too: no such bound.
    send = FunctionStats("gloo_send", Role.COMM, 100, 0.5, 0.01, 0.005, 0.009)
    f, = link_findings(ddp_over_gloo(slow_rank_2(job(3)), 87 / 245, send))
    assert "exposed_comm_share" not in f.evidence and f.cost > 87 / 245


def test_the_exposed_wait_does_not_bound_a_slow_link_of_gpu_collectives():
    # NCCL: the reducer's host wait only queues the GPU streams behind the all-reduce: near zero, no bound.
    ps = slow_rank_2(job(3))
    for p in ps:
        p.functions = p.functions.with_function(
            FunctionStats("Reducer_finalize_backward", Role.EXPOSED, 100, 1e-4, 1e-6, 1e-6, 1e-6))
    f, = link_findings(ps)
    assert "exposed_comm_share" not in f.evidence and f.cost > 0.01


def test_the_neighbour_of_a_slow_rank_is_not_a_second_suspect():
    # mlp-4 with rank 3 behind a 100 Mbit/s link (MB/s as measured): rank 0 sends to rank 3, and its other
    # link, from rank 1, ran at the pace loopback TCP gets a CPU. Each of rank 0's links is slow against the
    # two that do not touch it, one of which is rank 3's; its link to rank 3 is rank 3's, the surer suspect.
    ps = job(4)
    for src, dst, mbps in ((0, 3, 12.3), (3, 2, 12.5), (2, 1, 336), (1, 0, 46)):
        connect(ps, src, dst, mbps)
    assert [(f.kind, f.ranks) for f in link_findings(ps)] == [("slow_link", [3])]


def test_tcp_links_of_a_straggler_are_not_judged():
    # mlp-3-io, GC storm on rank 2: the CPU it holds slowed rank 0's loopback links to 80-115 MB/s beside
    # 577 MB/s on the third link (2 -> 1): every link of rank 0 "slow" against the one link that does not
    # touch it. Links touching the straggler are its CPU's pace, not a NIC's: left out, nothing is judged.
    ps = job(3)
    connect(ps, 0, 1, 100)
    connect(ps, 1, 2, 80)
    connect(ps, 2, 0, 577)
    assert [f.ranks for f in link_findings(ps)] == [[1]]
    assert link_findings(ps, stragglers={2}) == []


def pipeline(stage_of: dict[int, int]) -> list[RankPattern]:
    """Patterns of two pipeline stages: a stage-1 rank's collectives carry other payloads than stage 0's."""
    ps = job(len(stage_of))
    for p in ps:
        if stage_of[p.rank]:
            p.collectives = CollectiveColumns.of(CollectiveRecord(c.op, c.bytes * 2, c.enter, c.done)
                                                 for c in p.collectives)
    return ps


def test_links_between_pipeline_stages_are_not_compared_with_those_within():
    # Activations go stage 0 -> 1 at the pace stage 1 reads them: four times slower than the all-reduces
    # within each stage, by design. Compared with each other, every link is normal.
    ps = pipeline({0: 0, 1: 0, 2: 1, 3: 1})
    for src, dst, mbps in ((0, 1, 40), (1, 0, 40), (2, 3, 40), (3, 2, 40), (0, 2, 10), (1, 3, 10), (2, 0, 10),
                           (3, 1, 10)):
        connect(ps, src, dst, mbps)
    roles = LinkRoles.of(link_matrix(ps), ps)
    assert len(set(roles.id.tolist())) == 3 and roles.between.sum() == 4  # within either stage; 0 -> 1; 1 -> 0
    assert link_findings(ps) == []


def test_a_slow_rank_of_a_two_rank_stage_is_the_node():
    # pipe-4 with rank 3 behind a 100 Mbit/s link (MB/s as measured): stage 1's all-reduce pair (2, 3) runs at
    # a sixth of stage 0's (0, 1). Between stages, rank 2 sends at 57 MB/s, rank 3 at 9; what stage 1 reads
    # arrives slowly at both (it is held up by the pair), so those links accuse no one.
    ps = pipeline({0: 0, 1: 0, 2: 1, 3: 1})
    for src, dst, mbps in ((0, 1, 65), (1, 0, 84), (2, 3, 11.9), (3, 2, 10.7), (0, 2, 10.1), (1, 3, 5.6),
                           (2, 0, 56.6), (3, 1, 9.3)):
        connect(ps, src, dst, mbps)
    assert [(f.kind, f.ranks) for f in link_findings(ps)] == [("slow_link", [3])]


def test_nccl_plugin_rows_take_precedence_over_tcp_on_a_pair():
    ps = tcp_ring(ring(job(3), [0, 1, 2]), slow_rank=2)
    m = link_matrix(ps)
    assert len(m) == 3 and not m.tcp.any()
    assert link_findings(ps) == []  # the plugin's rows say every link runs at 20 GB/s


def test_an_address_two_ranks_claim_places_no_link():
    ps = tcp_ring(job(3))
    ps[2].tcp.append(TcpFlow(local=ps[0].tcp[0].local, remote="10.1.1.1:1", sends=1, sent=1, received=0,
                             wire_s=0.0, peer_wait_s=0.0, srtt_s=0.0))
    m = link_matrix(ps)
    assert list(zip(m.src.tolist(), m.dst.tolist())) == [(1, 2), (2, 0)]


def test_tcp_links_with_a_few_ticks_of_wire_time_are_not_judged():
    ps = tcp_ring(job(3), slow_rank=2)
    for p in ps:
        p.tcp = [TcpFlow(f.local, f.remote, f.sends, f.sent, f.received, min(f.wire_s, 0.04), f.peer_wait_s,
                         f.srtt_s) for f in p.tcp]
    assert not link_matrix(ps).judged.any() and link_findings(ps) == []


def test_a_tcp_link_too_fast_to_time_still_sets_the_pace():
    # The accuracy test's ring of three, rank 2 behind 100 Mbit/s: 70 MB each way through it took ~5.8 s, and
    # the third link moved the same 70 MB in 44 ms, too little to time. It is the pace, at 70 MB / 0.1 s.
    ps = job(3)
    for src, dst, mbps in ((0, 2, 11.8), (2, 1, 12.2), (1, 0, 1590.0)):
        connect(ps, src, dst, mbps, sent=70_000_000)
    m = link_matrix(ps)
    assert m.judged.tolist() == [True, False, True] and m.pacing.all()
    f, = link_findings(ps)
    assert f.ranks == [2] and f.evidence["peers_bandwidth_Bps"] == pytest.approx(700e6)


def test_a_tcp_link_too_fast_to_time_is_never_the_slow_one():
    # 2 MB in 40 ms: its floor (2 MB / 0.1 s) is under half its peers' 40 MB/s, but it was not slow.
    ps = job(3)
    for src, dst, mbps, sent in ((0, 1, 50.0, 2_000_000), (1, 2, 40.0, SENT), (2, 0, 40.0, SENT)):
        connect(ps, src, dst, mbps, sent=sent)
    assert link_matrix(ps).judged.tolist() == [False, True, True] and link_findings(ps) == []


def test_tcp_links_of_small_sends_are_not_judged():
    # A small model's gradients, 1.4 KB a send: round trips and CPU starvation, not bandwidth, set the pace.
    ps = tcp_ring(job(3), slow_rank=2)
    for p in ps:
        p.tcp = [TcpFlow(f.local, f.remote, f.sent // 1400, f.sent, f.received, f.wire_s, f.peer_wait_s, f.srtt_s)
                 for f in p.tcp]
    assert not link_matrix(ps).judged.any() and link_findings(ps) == []


def test_a_rank_with_its_tcp_links_under_half_its_groups_pace_is_slow():
    # The links of one peer group carry the same collectives: in the accuracy matrix's healthy windows each rank
    # kept a link at 0.74 of its group's others or faster; a rate-limited rank's both fell to 0.26-0.41.
    assert link_findings(tcp_ring(job(3), slow_rank=2, mbps=MBPS / 1e6 / 1.8)) == []
    found = link_findings(tcp_ring(job(3), slow_rank=2, mbps=MBPS / 1e6 / 2.2))
    assert [(f.kind, f.ranks) for f in found] == [("slow_link", [2])]
