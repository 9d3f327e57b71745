"""Fault injection and step truth for the test jobs in tests/jobs/, without touching the jobs' own code.

Python imports this module at start-up when its folder is on PYTHONPATH (every rank torchrun starts, and
DataLoader workers, inherit it). It acts only in a training rank (RANK set) and hooks torch.optim globally
once torch.optim.optimizer is imported:

- Truth: every optimizer step's end is written to $RANKSCOPE_TRUTH_DIR/r<RANK>.json (rankscope.sim.steplog,
  shared with the simulated GPU job): the job's own step log, which rankscope's figures are checked against.
- Faults: $RANKSCOPE_FAULT = KIND:RANK:VALUE[@ONSET][,...], RANK `*` for every rank; ONSET is seconds
  from the rank's first step, or a switch's name (`go`, ...): while the file $RANKSCOPE_TRUTH_DIR/NAME
  exists (a test starts the fault once rankscope is attached, and stops it by removing the file: one job
  serves several faults in turn). A kind given twice for a rank adds up from each one's onset (a shape's
  own storage latency, then a slow loader injected on top of it):
    compute:R:S   the rank computes S seconds longer each step (spins on its CPU before optimizer.step)
    spin:R:F      ...F times its own pace longer: the median of its last PACE_STEPS steps, less their spins (a
                  tenth stays a tenth of the step when the host slows the job; the spin is F/(1+F) of the step)
    loader:R:S    every batch fetch sleeps S seconds (in the main process or in the DataLoader's workers)
    gc:R:M        the rank keeps M million objects alive and runs a full garbage collection each step
    pagein:R:F    the rank faults in fresh memory for F times its own pace each step (maps a MB, touches every
                  page, unmaps it, again until that long has passed: what glibc's malloc does to memory it hands
                  back to the OS between steps). Timed, not sized: a MB faults in 0.55 ms on one host and 1.4 ms
                  on another, and a fixed size was a different fault on each
    hang:R:0      the rank blocks before its next collective (in optimizer.step), for good or while switched on
  SIGSTOP, a CPU hog and a slow link are injected from outside (scripts/bench_accuracy.py).
"""
from __future__ import annotations

import atexit
import gc
import importlib.abc
import importlib.util
import mmap
import os
import statistics
import sys
import time
from collections import deque

from rankscope.sim.steplog import StepLog

PACE_STEPS = 32  # spin's and pagein's pace: the median of this many steps (a second or three of the test jobs')
FAULT_CHUNK = 2**20  # pagein maps this much fresh memory at a time, faults it in page by page, unmaps it


def _faults_here(rank: int) -> dict[str, list[tuple[float, str]]]:
    """kind -> [(value, onset)] of the faults of $RANKSCOPE_FAULT (comma-separated) that apply to this rank."""
    out: dict[str, list[tuple[float, str]]] = {}
    for spec in filter(None, os.environ.get("RANKSCOPE_FAULT", "").split(",")):
        spec, _, onset = spec.partition("@")
        kind, who, value = spec.split(":")
        if who == "*" or int(who) == rank:
            out.setdefault(kind, []).append((float(value), onset or "0"))
    return out


class _Rank:
    """One training rank's hooks: the step log and the fault, applied from its onset on."""

    def __init__(self, rank: int, faults: dict[str, list[tuple[float, str]]]):
        self.rank = rank
        self.faults = faults
        self.first: float | None = None
        self.heap: list = []
        self.directory = os.environ.get("RANKSCOPE_TRUTH_DIR")
        self.log = StepLog(self.directory, rank)
        self.spun = 0.0  # this step's spin and faulting (compute, spin, pagein), the steps' durations without it
        self.paces: deque[float] = deque(maxlen=PACE_STEPS)

    def active(self, kind: str) -> float | None:
        """The sum of the values of `kind` whose onset has come; None while none has."""
        on = [value for value, onset in self.faults.get(kind, ()) if self._began(onset)]
        return sum(on) if on else None

    def _began(self, onset: str) -> bool:
        try:
            seconds = float(onset)
        except ValueError:  # a switch: on while its file exists
            return self.directory is not None and os.path.exists(os.path.join(self.directory, onset))
        return not seconds or (self.first is not None and time.time() - self.first >= seconds)

    def before_step(self, *_args) -> None:
        if self.first is None:
            self.first = time.time()
        pace = self._pace()
        start = time.perf_counter()
        end = start + (self.active("compute") or 0.0) + (self.active("spin") or 0.0) * pace
        while time.perf_counter() < end:
            pass
        end += (self.active("pagein") or 0.0) * pace
        while time.perf_counter() < end:
            with mmap.mmap(-1, FAULT_CHUNK) as fresh:
                for page in range(0, FAULT_CHUNK, mmap.PAGESIZE):
                    fresh[page] = 1
                    if time.perf_counter() >= end:  # a page's fault (2-6 us) past it at most
                        break
        self.spun = time.perf_counter() - start
        if (millions := self.active("gc")) is not None:
            if not self.heap:  # long-lived objects in reference cycles: each full collection walks them all
                self.heap = [[i] for i in range(int(millions * 1e6))]
                for a, b in zip(self.heap[::2], self.heap[1::2]):
                    a.append(b)
                    b.append(a)
            gc.collect()
        if self.active("hang") is not None:
            print(f"inject: rank {self.rank} blocks before its next collective", file=sys.stderr, flush=True)
            self.log.write()
            while self.active("hang") is not None:
                time.sleep(0.2)

    def _pace(self) -> float:
        return statistics.median(self.paces) if self.paces else 0.0

    def after_step(self, *_args) -> None:
        self.log.step_ended()
        if len(self.log.ends) > 1:
            self.paces.append(self.log.ends[-1] - self.log.ends[-2] - self.spun)

    def slow_fetch(self, fetch):
        """Wraps a DataLoader fetcher's fetch: the batch takes `loader` seconds longer to read."""
        def fetch_slowly(*args, **kwargs):
            if (delay := self.active("loader")) is not None:
                time.sleep(delay)
            return fetch(*args, **kwargs)
        return fetch_slowly


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `then(module)` right after `name` is imported (torch imports its submodules lazily)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        sys.meta_path.remove(self)
        self.then(module)


def _install() -> None:
    if "RANK" not in os.environ:  # torchrun itself, or any other Python
        return
    rank = _Rank(int(os.environ["RANK"]), _faults_here(int(os.environ["RANK"])))
    atexit.register(rank.log.write)

    def hook_optim(module) -> None:
        module.register_optimizer_step_pre_hook(lambda *a: rank.before_step(*a))
        module.register_optimizer_step_post_hook(lambda *a: rank.after_step(*a))

    def hook_fetch(module) -> None:
        for cls in (module._MapDatasetFetcher, module._IterableDatasetFetcher):
            cls.fetch = rank.slow_fetch(cls.fetch)

    sys.meta_path.insert(0, _AfterImport("torch.optim.optimizer", hook_optim))
    sys.meta_path.insert(0, _AfterImport("torch.utils.data._utils.fetch", hook_fetch))


_install()
