"""Prometheus exposition (prometheus_client) of diagnosis documents, with low-cardinality labels only:
job, rank, finding kind and a fixed set of phases; function and kernel names never become labels.
Base units (seconds), `_total` counters, `_ratio` fractions; `rankscope_finding_cost` stays beside its
`_ratio` name (docs/api.md: metric names are extended, never renamed)."""
from __future__ import annotations

import platform
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import rankscope

__all__ = ["CONTENT_TYPE_LATEST", "counter", "exposition", "gauge"]

# A rank's step split into parts that add up to it (the page's stacked bar): phase -> how, from a `ranks` entry.
PHASES = {
    "gpu_wait": lambda r: r["sync_s"],  # waiting for its own GPU work
    "comm": lambda r: r["comm_s"],  # in collectives: waiting for peers and transfer
    "data_loading": lambda r: r.get("input_s") or 0.0,  # host time in data-loading Python functions
    "host": lambda r: r["host_s"] - (r.get("input_s") or 0.0),  # the rest of the time outside probed calls
    "python_gc": lambda r: r.get("gc_s") or 0.0,
    "other_cuda": lambda r: max(0.0, r["step_time_s"] - r["sync_s"] - r["comm_s"] - r["host_s"] - (r.get("gc_s") or 0.0)),
}


def _family(kind: type[Metric], name: str, documentation: str, samples: Mapping[tuple[str, ...], float] | float,
            labels: tuple[str, ...]) -> Any:
    if not labels:
        return kind(name, documentation, value=float(samples))  # type: ignore[arg-type, call-arg]
    family = kind(name, documentation, labels=list(labels))  # type: ignore[call-arg]
    for values, v in samples.items():  # type: ignore[union-attr]
        family.add_metric(list(values), v)
    return family


def gauge(name: str, documentation: str, samples: Mapping[tuple[str, ...], float] | float,
          labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    """A gauge family: one value, or label values -> value."""
    return _family(GaugeMetricFamily, name, documentation, samples, labels)


def counter(name: str, documentation: str, samples: Mapping[tuple[str, ...], float] | float,
            labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    """A counter family (`name` without `_total`, which the exposition adds)."""
    return _family(CounterMetricFamily, name, documentation, samples, labels)


def build_info(component: str) -> GaugeMetricFamily:
    version = rankscope.version()  # read once, not on every scrape
    return gauge("rankscope_build_info", "Always 1: the running rankscope.",
                 {(version, component, platform.python_version()): 1}, ("version", "component", "python"))


def diagnosis_metrics(diagnoses: Mapping[str, Mapping[str, Any]]) -> list[GaugeMetricFamily]:
    ranks = [(job, r) for job, doc in diagnoses.items() for r in doc["ranks"] if r.get("step_time_s") is not None]
    steps = {(job, str(r["rank"])): r["step_time_s"] for job, r in ranks}
    phases = {(job, str(r["rank"]), phase): part(r) for job, r in ranks
              if all(r.get(k) is not None for k in ("sync_s", "comm_s", "host_s")) for phase, part in PHASES.items()}
    runq = {(job, str(r["rank"])): r["runq_s"] for job, r in ranks if r.get("runq_s") is not None}
    costs: dict[tuple[str, ...], float] = {}
    for job, doc in diagnoses.items():
        for f in doc["findings"]:  # two findings of one kind: the job pays the larger
            costs[(job, f["kind"])] = max(costs.get((job, f["kind"]), 0.0), f["cost"])
    job_steps = {(job,): doc["step_time_s"] for job, doc in diagnoses.items() if doc.get("step_time_s") is not None}
    baselines = {(job,): doc["baseline"]["step_time_s"] for job, doc in diagnoses.items() if doc.get("baseline")}
    return [
        gauge("rankscope_step_time_seconds", "Step time of each rank in the last window.", steps, ("job", "rank")),
        gauge("rankscope_step_phase_seconds", "Seconds per step of each rank in each phase (they add up to the "
              "step time): gpu_wait, comm, data_loading, host, python_gc, other_cuda.", phases,
              ("job", "rank", "phase")),
        gauge("rankscope_run_queue_seconds", "Seconds per step the rank's main thread was runnable but waited "
              "for a CPU.", runq, ("job", "rank")),
        gauge("rankscope_job_step_time_seconds", "The job's step time in the last window (median over ranks).",
              job_steps, ("job",)),
        gauge("rankscope_job_baseline_step_time_seconds", "The job's baseline step time (its best recent windows).",
              baselines, ("job",)),
        gauge("rankscope_finding_cost_ratio", "Fraction of step time a finding costs the job (absent when not "
              "found).", costs, ("job", "kind")),
        gauge("rankscope_finding_cost", "Deprecated name of rankscope_finding_cost_ratio.", costs, ("job", "kind")),
    ]


def finding_metrics(diagnoses: Mapping[str, Mapping[str, Any]],
                    held: Mapping[tuple[str, tuple[str, tuple[int, ...]]], int]) -> list[GaugeMetricFamily]:
    """Each reported finding's named ranks with their node, and how many windows in a row it has been
    reported (`held`: history.StepHistory.held): what an alert routes by and waits for."""
    windows: dict[tuple[str, ...], float] = {}
    for job, doc in diagnoses.items():
        nodes = {r["rank"]: r.get("host") or "" for r in doc["ranks"]}
        for f in doc["findings"]:
            n = held.get((job, (f["kind"], tuple(f["ranks"]))), 1)
            for rank in f["ranks"]:
                key = (job, f["kind"], str(rank), nodes.get(rank, ""))
                windows[key] = max(windows.get(key, 0), n)
    return [gauge("rankscope_finding_held_windows", "Windows in a row a finding has been reported, for each rank "
                  "it names and that rank's node (absent when not found).", windows, ("job", "kind", "rank", "node"))]


def last_window(component: str, node: str, at: float | None) -> GaugeMetricFamily:
    return gauge("rankscope_last_window_timestamp_seconds", "Unix time the last window closed (absent before the "
                 "first): an agent or analyzer whose windows stopped lags behind time().",
                 {(component, node): at} if at is not None else {}, ("component", "node"))


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
