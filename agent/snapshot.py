"""What the agent publishes after each window; HTTP handlers only ever read the latest one."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rankscope.analyzer.patterns import RankPattern


@dataclass(frozen=True)
class TargetView:
    pid: int
    rank: int
    world_size: int
    job: str
    libraries: list[str]
    state: str  # "running" | "exited"


@dataclass(frozen=True)
class Snapshot:
    window_end: float | None = None
    targets: list[TargetView] = field(default_factory=list)
    patterns: list[RankPattern] = field(default_factory=list)
    diagnoses: dict[str, dict[str, Any]] = field(default_factory=dict)  # job -> diagnosis document
    errors: list[str] = field(default_factory=list)  # processes that could not be watched, and why


def targets_of(patterns: list[RankPattern], libraries: dict[int, list[str]]) -> list[TargetView]:
    return [
        TargetView(pid=p.pid, rank=p.rank, world_size=p.world_size, job=p.job,
                   libraries=libraries.get(p.pid, []), state=p.state)
        for p in patterns
    ]
