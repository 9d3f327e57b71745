"""Prometheus exposition (prometheus_client) of diagnosis documents, with low-cardinality labels only:
job, rank and finding kind; function and kernel names never become labels."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "exposition", "gauge"]


def gauge(name: str, documentation: str, samples: Mapping[tuple[str, ...], float] | float,
          labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    """A gauge family: one value, or label values -> value."""
    if not labels:
        return GaugeMetricFamily(name, documentation, value=float(samples))  # type: ignore[arg-type]
    g = GaugeMetricFamily(name, documentation, labels=list(labels))
    for values, v in samples.items():  # type: ignore[union-attr]
        g.add_metric(list(values), v)
    return g


def diagnosis_metrics(diagnoses: Mapping[str, Mapping[str, Any]]) -> list[GaugeMetricFamily]:
    steps = {(job, str(r["rank"])): r["step_time_s"] for job, doc in diagnoses.items()
             for r in doc["ranks"] if r.get("step_time_s") is not None}
    costs: dict[tuple[str, ...], float] = {}
    for job, doc in diagnoses.items():
        for f in doc["findings"]:  # two findings of one kind: the job pays the larger
            costs[(job, f["kind"])] = max(costs.get((job, f["kind"]), 0.0), f["cost"])
    return [
        gauge("rankscope_step_time_seconds", "Step time of each rank in the last window.", steps, ("job", "rank")),
        gauge("rankscope_finding_cost", "Fraction of step time a finding costs the job (absent when not found).",
              costs, ("job", "kind")),
    ]


class _Once(Collector):
    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def exposition(diagnoses: Mapping[str, Mapping[str, Any]], extra: Iterable[Metric] = ()) -> bytes:
    """The text exposition of one scrape: built from the current snapshot, so nothing stale lingers."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Once([*extra, *diagnosis_metrics(diagnoses)]))
    return generate_latest(registry)
