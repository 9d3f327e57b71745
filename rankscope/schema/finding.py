"""A finding of the diagnosis document (docs/api.md; rankscope/schema/diagnosis.schema.json): what the
analyzer concludes, as the agent, the cluster analyzer and every reader of the document see it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Finding:
    """One diagnosis finding; its fields are extended, never renamed (the document's schema types them)."""

    kind: str
    ranks: list[int]
    function: str | None
    component: str | None
    score: float  # how sure: the robust z-score of the deciding metric
    cost: float  # fraction of the job's step time the finding costs, in [0, 1]
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return plain({
            "kind": self.kind, "ranks": self.ranks, "function": self.function, "component": self.component,
            "score": self.score, "cost": self.cost, "summary": self.summary, "evidence": self.evidence,
        })


def plain(x: Any) -> Any:
    """Plain JSON types: numpy scalars to Python numbers, non-finite floats to None, times rounded to us."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [plain(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return round(float(x), 6) if math.isfinite(x) else None
    return x
