"""What only a view over nodes can say: every rank of one node straggles (node_fault), or a node that
served ranks of the job stopped answering (node_unreachable). Both need the cluster analyzer's patterns.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from rankscope.analyzer.differential import peers_median
from rankscope.analyzer.metrics import RankTable
from rankscope.analyzer.rules.stragglers import decidable, explain, straggling
from rankscope.analyzer.rules.wording import range_ms, rank_list
from rankscope.schema.finding import Finding, Why


@dataclass(frozen=True)
class LostRanks:
    """Ranks of one job last served by an agent that no longer answers."""

    agent: str  # the agent's URL
    host: str
    ranks: tuple[int, ...]
    last_seen: float  # unix s of the last window the agent served them in
    error: str  # why the last pull failed


def node_fault(t: RankTable) -> list[Finding]:
    """Every rank of one node (two or more) straggles while ranks of other nodes do not: the node (its power,
    cooling, PCIe switch, a host-wide resource) rather than one GPU. Needs ranks of several nodes: the cluster
    analyzer's view."""
    found = straggling(t)
    if found is None:
        return []
    rows, z, excess, work = found.rows, found.z, found.excess, found.work
    valid = decidable(t)
    hosts = np.array(list(map(attrgetter("host"), t.patterns)), dtype=object)
    slow_hosts = set(hosts[rows])
    if len(set(hosts[valid])) < 2 or slow_hosts == set(hosts[valid]):
        return []
    step = t.job_step_s
    out = []
    for host in sorted(slow_hosts):
        members = np.flatnonzero(valid & (hosts == host))
        if members.size < 2 or not np.isin(members, rows).all():
            continue
        ranks = sorted(int(t.rank[i]) for i in members)
        cost = float(np.clip(excess[members].max() / step, 0.0, 1.0))  # the slowest of the node sets the step
        out.append(Finding(
            kind="node_fault", ranks=ranks, function=None, component="host", score=float(z[members].min()),
            cost=cost, criterion="every_rank_of_node_straggles",
            why=[Why("ranks_on_node", members.size, 2, "straggling ranks, all of the node's"),
                 Why("hosts", len(set(hosts[valid])), 2, "hosts"),
                 *(w for i in sorted(members, key=lambda i: t.rank[i]) for w in explain(t, found, i)[1])],
            summary=(f"every rank on node {host} ({rank_list(ranks)}) computes "
                     f"{range_ms([float(excess[i]) for i in members])} longer per step than the ranks of other "
                     f"nodes: suspect the node, not one GPU; costs {cost:.0%} of step time"),
            evidence={"host": host, "step_time_s": step, "peers_work_s": peers_median(work),
                      "per_rank": sorted(({"rank": int(t.rank[i]), "z": float(z[i]), "excess_s": float(excess[i])}
                                          for i in members), key=lambda r: r["rank"])},
        ))
    return out


def unreachable(lost: LostRanks) -> Finding:
    ranks = sorted(lost.ranks)
    return Finding(
        kind="node_unreachable", ranks=ranks, function=None, component="host", score=0.0, cost=0.0,
        criterion="agent_not_answering", why=[Why("failed_pulls", 1, 1, "the agent's last pull")],
        summary=(f"node {lost.host} (agent {lost.agent}) stopped answering: ranks {', '.join(map(str, ranks))} "
                 f"of this job are not observed since {lost.last_seen:.0f} ({lost.error})"),
        evidence={"host": lost.host, "agent": lost.agent, "last_seen": lost.last_seen, "error": lost.error},
    )
