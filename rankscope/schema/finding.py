"""A finding of the diagnosis document (docs/api.md; rankscope/schema/diagnosis.schema.json): what the
analyzer concludes, as the agent, the cluster analyzer and every reader of the document see it."""
from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, ">": operator.gt, "<=": operator.le,
                                                   "<": operator.lt}


@dataclass(frozen=True)
class Why:
    """One figure that decided a finding: the measured `value` the rule compared with `threshold` (`op`: how),
    in `unit`. `rank`: whose figure it is, where it is one rank's own (None: the job's, or the finding's)."""

    measure: str
    value: float
    threshold: float
    unit: str
    op: str = ">="
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Why.op must be one of {sorted(_OPS)}, not {self.op!r}")

    def crossed(self) -> bool:
        """Whether `value op threshold` holds: the figure is past its threshold, as the rule required."""
        return _OPS[self.op](self.value, self.threshold)

    def to_dict(self) -> dict[str, Any]:
        value = plain(self.value)
        if self.crossed() and value is not None and not _OPS[self.op](value, plain(self.threshold)):
            value = float(self.value)  # rounded to microseconds it would sit on the wrong side: kept whole
        return {"measure": self.measure, "value": value, "threshold": plain(self.threshold), "unit": self.unit,
                "op": self.op, **({"rank": int(self.rank)} if self.rank is not None else {})}


@dataclass
class Finding:
    """One diagnosis finding; its fields are extended, never renamed (the document's schema types them).

    `score` says how sure, on the scale of the rule that decided it: for the rank outliers (stragglers,
    gpu_throttle, node_fault, the timing rule's slow_link) the robust z-score of the deciding metric against
    the peers' (node_fault: its ranks' least); for a slow_link of the link matrix the peers' throughput over the
    slow link's; for launch_bound the GPU's idle share over VOID_MIN; for a regression the step's growth over the
    baseline's noise (a z-score against the job's own past); for a hang the number of ranks waiting (comm_hang:
    every running rank); 0 for node_unreachable.

    Why the rule named it:
    - `criterion`: the name of the test that fired (snake_case, e.g. `arrives_last`, `gpu_clock_drop`,
      `all_in_collective`); a finding naming several ranks gives its lead rank's (the one its score is of).
    - `why`: the figures that decided it (Why): per condition the rule required, the value it compared and the
      threshold that value crossed; `crossed()` of each holds.
    - `outranked`: the other candidate findings this one replaced or kept out, each
      {"kind", "ranks", "criterion" (None where not known), "reason"}; empty where none.
    """

    kind: str
    ranks: list[int]
    function: str | None
    component: str | None
    score: float  # how sure, on its rule's scale (above)
    cost: float  # fraction of the job's step time the finding costs, in [0, 1]
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    criterion: str = ""  # empty only in findings built before rules said why (a document of an older agent)
    why: list[Why] = field(default_factory=list)
    outranked: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**plain({
            "kind": self.kind, "ranks": self.ranks, "function": self.function, "component": self.component,
            "score": self.score, "cost": self.cost, "summary": self.summary, "evidence": self.evidence,
        }), "criterion": self.criterion, "why": [w.to_dict() for w in self.why], "outranked": plain(self.outranked)}

    def outranks(self, other: Finding, reason: str) -> None:
        """Record that this finding replaced or kept out `other` (a candidate of another rule, or of the same)."""
        self.outranked.append(outranked_entry(other.kind, other.ranks, other.criterion or None, reason))


def outranked_entry(kind: str, ranks: list[int], criterion: str | None, reason: str) -> dict[str, Any]:
    return {"kind": kind, "ranks": [int(r) for r in ranks], "criterion": criterion, "reason": reason}


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
