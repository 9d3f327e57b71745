"""The cluster view: patterns pulled from many node agents, merged per job, diagnosed as one job, plus what
only a view over nodes can say: that a node which served ranks of a job stopped answering.

An unreachable node is reported as a finding of kind `node_unreachable` (beside the contract's kinds) naming
its last known ranks and host, with cost 0: the analyzer cannot tell a dead node from a dead agent, but if
the node is gone its peers stall and the hang rules say so with the cost.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rankscope.analyzer.baseline import Baseline
from rankscope.analyzer.diagnosis import diagnose_job
from rankscope.analyzer.rules.nodes import LostRanks, unreachable
from rankscope.analyzer.thresholds import DEFAULT_HANG_TIMEOUT_S
from rankscope.schema.finding import plain
from rankscope.schema.patterns import RankPattern


def merge(patterns: Iterable[RankPattern]) -> dict[str, list[RankPattern]]:
    """job -> patterns with one pattern per process (host, pid): an agent listed twice counts once."""
    latest: dict[tuple[str, str, int], RankPattern] = {}
    for p in patterns:
        key = (p.job, p.host, p.pid)
        if key not in latest or p.window_end > latest[key].window_end:
            latest[key] = p
    by_job: dict[str, list[RankPattern]] = {}
    for p in latest.values():
        by_job.setdefault(p.job, []).append(p)
    return by_job


def diagnose_cluster(patterns: Sequence[RankPattern], lost: Mapping[str, Sequence[LostRanks]],
                     hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                     baselines: dict[str, Baseline] | None = None) -> dict[str, dict[str, Any]]:
    """job -> diagnosis document over every node's ranks, with a `node_unreachable` finding per lost node.
    `baselines` (job -> its past, kept by the caller) as for diagnose()."""
    by_job = merge(patterns)
    docs = {}
    for job in sorted(set(by_job) | {j for j, ls in lost.items() if ls}):
        baseline = None if baselines is None else baselines.setdefault(job, Baseline())
        doc = (diagnose_job(by_job[job], hang_timeout_s, baseline) if job in by_job else
               {"job": job, "window": {"start": None, "end": None}, "step_time_s": None, "baseline": None,
                "ranks": [], "findings": []})
        found = doc["findings"] + [unreachable(x).to_dict() for x in lost.get(job, ())]
        doc["findings"] = plain(sorted(found, key=lambda f: (-f["cost"], -f["score"], f["kind"])))
        docs[job] = doc
    return docs
