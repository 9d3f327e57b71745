"""What the agent publishes after each window; HTTP handlers only ever read the latest one."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rankscope.agent.host.containers import Container
from rankscope.agent.service.history import StepHistory
from rankscope.agent.views.profile import RankProfile
from rankscope.schema.patterns import RankPattern


@dataclass(frozen=True)
class TargetView:
    pid: int
    rank: int
    world_size: int
    job: str
    libraries: list[str]
    state: str  # "running" | "exited"
    container: Container | None = None  # container id and pod UID, from its cgroup


@dataclass(frozen=True)
class AgentHealth:
    """Counts since the agent started, for /metrics."""

    windows: int = 0
    last_window: float | None = None  # unix s when the last window closed
    attach_errors: int = 0  # processes --all found that could not be watched
    drops: dict[str, int] = field(default_factory=dict)  # what the kernel side had no room for, by kind


@dataclass(frozen=True)
class Snapshot:
    window_end: float | None = None
    targets: list[TargetView] = field(default_factory=list)
    patterns: list[RankPattern] = field(default_factory=list)
    diagnoses: dict[str, dict[str, Any]] = field(default_factory=dict)  # job -> diagnosis document
    errors: list[str] = field(default_factory=list)  # processes that could not be watched, and why
    skipped: list[str] = field(default_factory=list)  # processes not watched on purpose (launchers, workers)
    profiles: list[RankProfile] = field(default_factory=list)  # each rank's Python stacks of the window, bounded
    history: StepHistory = field(default_factory=StepHistory)  # each job's windows (the page, /v1/history)
    health: AgentHealth = field(default_factory=AgentHealth)


def targets_of(patterns: list[RankPattern], libraries: dict[int, list[str]],
               containers: dict[int, Container | None]) -> list[TargetView]:
    return [
        TargetView(pid=p.pid, rank=p.rank, world_size=p.world_size, job=p.job,
                   libraries=libraries.get(p.pid, []), state=p.state, container=containers.get(p.pid))
        for p in patterns
    ]
