"""Stable verdicts for services that diagnose window after window (the agent, the cluster analyzer).

One window of a busy machine can make any rank look late once; a real fault persists. So a finding is
reported only when the same kind named the same ranks in the window before too (hysteresis), and it is
withheld while it has been seen once; the document lists it under `unconfirmed`, so nothing is hidden.
Hangs and node loss are reported at once: they are decided over their own timeout, not over one window.
A regression must hold longer (three windows): the baseline spans many windows, but one or two windows of a
busy machine can be 10% slower than it. A finding may ask for more (`confirm_windows` in its evidence: a small
straggler, within what a healthy rank does in a window or two).
`rankscope diagnose` looks once, over a longer window, and reports what it saw.
"""
from __future__ import annotations

from typing import Any

from rankscope.analyzer.rules.hangs import HANGS

AT_ONCE = HANGS | {"node_unreachable"}
CONFIRM_WINDOWS = 2  # consecutive windows a finding must hold in before it is reported...
REGRESSION_WINDOWS = 3  # ...and a regression. A healthy job wanders: a 2-rank 4 ms MLP on 2 vCPUs ran 11-16%
# slower than its best windows for two 2 s windows, then recovered, in 2 of 20 agent runs (its own log: +7-8%
# over its earlier windows' median); a lasting slowdown holds in the third window too.


def confirm_windows(evidence: dict[str, Any]) -> int:
    """The windows in a row a finding asks to hold in before it is reported, beyond the services' own rule
    (a small straggler's: rules/stragglers.py, PERSIST_WINDOWS); 1 where it asks none."""
    return int(evidence.get("confirm_windows", 1))


def _key(f: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    return f["kind"], tuple(f["ranks"])


class Confirmer:
    """Per job, the findings of its recent windows; `confirm` moves those not yet held long enough from
    `findings` to `unconfirmed` in each document (in place)."""

    def __init__(self, windows: int = CONFIRM_WINDOWS):
        self.windows = windows
        self._streak: dict[str, dict[tuple[str, tuple[int, ...]], int]] = {}  # job -> finding -> windows in a row

    def _needs(self, f: dict[str, Any]) -> int:
        own = REGRESSION_WINDOWS if f["kind"] == "regression" else confirm_windows(f.get("evidence", {}))
        return max(self.windows, own)

    def confirm(self, docs: dict[str, dict[str, Any]]) -> None:
        self._streak = {job: s for job, s in self._streak.items() if job in docs}  # jobs that ended
        for job, doc in docs.items():
            before = self._streak.get(job, {})
            now = {_key(f): before.get(_key(f), 0) + 1 for f in doc["findings"]}
            self._streak[job] = now
            held = [f for f in doc["findings"] if f["kind"] in AT_ONCE or now[_key(f)] >= self._needs(f)]
            doc["unconfirmed"] = [{"kind": f["kind"], "ranks": f["ranks"], "windows": now[_key(f)]}
                                  for f in doc["findings"] if f not in held]
            doc["findings"] = held
