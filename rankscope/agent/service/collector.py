"""Python's garbage collector in the cluster analyzer. A window of 100,000 ranks leaves ~2M objects alive (the
patterns and their diagnosis) and allocates as many again: left to itself, the collector ran a full pass over
all of them several times a window, ~0.5 s each, most of a window's CPU. The window's objects hold no
reference cycles (freed by reference counts when the next window replaces them), so the collector is paused
while a window is pulled and diagnosed, what then lives is frozen (never scanned again), and every
`full_every` windows it is unfrozen and collected once, so a cycle some library made is reclaimed after all.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


class WindowCollector:
    def __init__(self, full_every: int):
        self.full_every = full_every
        self.windows = 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No collection while the body runs; afterwards the survivors frozen, or all collected once."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            self.windows += 1
            if self.windows % self.full_every == 0:
                gc.unfreeze()
                gc.collect()
            gc.freeze()
            if enabled:
                gc.enable()
