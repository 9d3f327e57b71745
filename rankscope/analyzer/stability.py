"""Stable verdicts for services that diagnose window after window (the agent, the cluster analyzer).

One window of a busy machine can make any rank look late once; a real fault persists. So a finding is
reported only when the same kind named the same ranks in the window before too (hysteresis), over HOLD_S
seconds at least (short windows need more of them), and it is withheld until then; the document lists it
under `unconfirmed`, so nothing is hidden.
Hangs and node loss are reported at once: they are decided over their own timeout, not over one window.
A regression must hold longer (three windows): the baseline spans many windows, but one or two windows of a
busy machine can be 10% slower than it. A finding seen often but not in a row (4 of the last 8 windows) is
reported too, but for a regression or a slow link, and a finding may ask for that alone (`confirm_windows` in
its evidence: a small straggler, as large as what a healthy rank does in a window or two), and for the span it
is counted in (`confirm_span`: a steady straggler, most of the last few windows).
`rankscope diagnose` looks once, over a longer window, and reports what it saw.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from rankscope.analyzer.rules.hangs import HANGS
from rankscope.analyzer.thresholds import CONFIRM_WINDOWS, HISTORY, HOLD_S, OFTEN, REGRESSION_WINDOWS, SPAN

AT_ONCE = HANGS | {"node_unreachable"}
IN_ROW = {"regression", "slow_link"}  # kinds reported only in a row, never from windows seen on and off


def confirm_windows(evidence: dict[str, Any]) -> int:
    """The windows a finding asks to be seen in, of the last SPAN times as many (or of `confirm_span`), before
    it is reported (a small straggler's: rules/stragglers.py, SMALL_WINDOWS); 1 where it asks none (the
    services' own rule)."""
    return int(evidence.get("confirm_windows", 1))


def confirm_span(evidence: dict[str, Any]) -> int:
    """The last windows a finding's `confirm_windows` are counted in: SPAN times as many unless it says
    (`confirm_span`: a steady straggler's, most of a few, rules/stragglers.py STEADY_SPAN)."""
    return int(evidence.get("confirm_span", SPAN * max(confirm_windows(evidence), OFTEN)))


Key = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class _Window:
    keys: set[Key]  # the findings of the window
    start: float  # unix s; NaN where the document says not (windows alone decide then)
    end: float

    @staticmethod
    def of(doc: dict[str, Any]) -> _Window:
        bounds = doc.get("window") or {}
        start, end = (math.nan if bounds.get(k) is None else float(bounds[k]) for k in ("start", "end"))
        return _Window({_key(f) for f in doc["findings"]}, start, end)


def _key(f: dict[str, Any]) -> Key:
    return f["kind"], tuple(f["ranks"])


class Confirmer:
    """Per job, the findings of its recent windows; `confirm` moves those not yet held long enough from
    `findings` to `unconfirmed` in each document (in place)."""

    def __init__(self, windows: int = CONFIRM_WINDOWS):
        self.windows = windows
        self._seen: dict[str, deque[_Window]] = {}  # job -> its last HISTORY windows

    def _held(self, f: dict[str, Any], seen: deque[_Window]) -> tuple[bool, int]:
        """Whether `f` held long enough: in a row over HOLD_S (unless it asks for more), or often (OFTEN of
        the last SPAN * OFTEN windows, or as many as it asks); and in how many windows it was seen (in a row,
        or of that span where it asks for more)."""
        evidence = f.get("evidence", {})
        key, asks = _key(f), confirm_windows(evidence)
        often = max(asks, OFTEN)
        windows = list(seen)
        times = sum(key in window.keys for window in windows[-confirm_span(evidence):])
        in_row = next((i for i, window in enumerate(reversed(windows)) if key not in window.keys), len(windows))
        regression = f["kind"] == "regression"
        row = max(self.windows, REGRESSION_WINDOWS if regression else 1)
        span = sum(w.end - w.start for w in windows[len(windows) - in_row:])  # observed, gaps left out
        held = asks == 1 and in_row >= row and not span < HOLD_S  # NaN: the windows' count alone
        return (times >= often and f["kind"] not in IN_ROW) or held, times if asks > 1 else in_row

    def confirm(self, docs: dict[str, dict[str, Any]]) -> None:
        self._seen = {job: s for job, s in self._seen.items() if job in docs}  # jobs that ended
        for job, doc in docs.items():
            seen = self._seen.setdefault(job, deque(maxlen=HISTORY))
            seen.append(_Window.of(doc))
            held, unconfirmed = [], []
            for f in doc["findings"]:
                ok, times = (True, 1) if f["kind"] in AT_ONCE else self._held(f, seen)
                if ok:
                    held.append(f)
                else:
                    unconfirmed.append({"kind": f["kind"], "ranks": f["ranks"], "windows": times,
                                        **{k: f[k] for k in ("criterion", "why") if k in f}})
            doc["unconfirmed"], doc["findings"] = unconfirmed, held
