"""The agent's /metrics families beside the diagnosis ones: what it watches, its own health, and the last
window's per-GPU and per-collective readings (pattern_metrics.py). The cluster analyzer serves neither
GPUs nor collectives: each node's agent does, so a scrape of both does not count them twice."""
from __future__ import annotations

from prometheus_client.core import Metric

from rankscope.agent.service.pattern_metrics import collective_metrics, gpu_metrics
from rankscope.agent.service.prometheus import build_info, counter, finding_metrics, gauge, last_window
from rankscope.agent.service.snapshot import Snapshot
from rankscope.agent.session import host_name


def agent_metrics(snap: Snapshot) -> list[Metric]:
    health = snap.health
    return [
        build_info("agent"),
        gauge("rankscope_targets", "Processes watched by this agent.", sum(t.state == "running" for t in snap.targets)),
        counter("rankscope_windows", "Windows the agent closed.", health.windows),
        last_window("agent", host_name(), health.last_window),
        *finding_metrics(snap.diagnoses, snap.history.held()),
        counter("rankscope_attach_errors", "Processes found (--all) that could not be watched.", health.attach_errors),
        counter("rankscope_probe_drops", "Records the kernel side had no room for: completed collectives, Python "
                "samples, GPU activity records the CUPTI shim lost.", {(kind,): n for kind, n in health.drops.items()}, ("kind",)),
        *gpu_metrics(snap.patterns),
        *collective_metrics(snap.patterns),
    ]
