"""Cumulative counters -> what a window added. The kernel's maps only ever add (a reset would race with the
probes and lose what they counted meanwhile), so every reader keeps its last reading per key and reports the
difference."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rankscope.agent.loader import histograms

K = TypeVar("K")
# One key's counters, in a fixed order: integers and log2 histograms (slot counts).
Reading = tuple[int | Sequence[int], ...]


def _minus(now: Reading, before: Reading | None) -> tuple:
    """`now` - `before` field by field (a histogram by histograms.minus: a list); no `before` counts from zero."""
    if before is None:
        before = tuple(0 if isinstance(x, int) else () for x in now)
    return tuple(x - y if isinstance(x, int) else histograms.minus(x, y) for x, y in zip(now, before))


@dataclass
class Deltas(Generic[K]):
    """The last cumulative reading of each key, and what each new reading added to it."""

    _last: dict[K, Reading] = field(default_factory=dict, init=False, repr=False)

    def step(self, key: K, now: Reading) -> tuple:
        """What `key` added since its previous reading (all of `now` at first sight); other keys are kept."""
        before, self._last[key] = self._last.get(key), now
        return _minus(now, before)

    def read(self, now: Iterable[tuple[K, Reading]], first: Mapping[K, Reading] | None = None) -> list[tuple]:
        """What each key of `now` added since the previous read, in order; keys not in `now` are forgotten.
        `first`: where a key not seen before starts from (zero if absent). A key listed twice is compared
        with the previous read both times, and its last reading is kept."""
        items, first = list(now), first or {}
        out = [_minus(reading, self._last.get(key, first.get(key))) for key, reading in items]
        self._last = dict(items)
        return out
