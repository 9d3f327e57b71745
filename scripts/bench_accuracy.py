"""The accuracy matrix: does rankscope name the right rank and cause on real PyTorch jobs of many shapes?

    scripts/bench accuracy [--repeats N] [--windows K] [--shapes A,B] [--faults X,Y] [--held-out | --tuning]
                           [--out DIR] [--json PATH] [--misses DIR] [--keep-all] [--load N]   (root)
    scripts/bench accuracy --table RESULTS.json...   (the table of earlier runs, merged; each file names the
                                                      code it ran on: see code_version)
    scripts/bench accuracy --replay DIR...   (kept windows diagnosed again by the current analyzer)

Shapes are of two sets: the tuning shapes, which the analyzer's thresholds were tuned on, and the held-out
shapes (Shape.held_out: public frameworks' training loops, never tuned on), selected with --tuning and
--held-out and tabled apart. Results and kept evidence go under --out (~/.cache/rankscope/accuracy).

Each case is a fresh torchrun job of one shape (tests/jobs/: user-style training code, faults injected from
outside the job's code by tests/jobs/inject/sitecustomize.py), or the simulated GPU job (rankscope.sim: its
GPU-side faults held to the same bar), warmed up, then diagnosed the way a user does:
`rankscope diagnose --pid <ranks> --duration 10 --json` (K times in a row with --windows K, as a user runs
it again: K runs from one fresh job, each a new window; a hang is diagnosed once), or watched by
`rankscope agent` for the cases that need time (a whole-job regression, a small straggler that must hold several
windows, a healthy job over many windows).
Every figure is checked against the job's own truth: its step log (every optimizer step's end) and the
injected fault.

Per case: the job's own step time (median), runs, fresh jobs, right verdicts (the top finding's kind and ranks; for a healthy job, no
finding), false findings (any other finding), step-time error (the document's step time against the job's own
median over the same window: median and worst), cost error (the finding's cost against the what-if share
1 - healthy step / faulty step, the healthy step measured on the same shape in the same run; for a fault
switched on in the running job (compute, loader, GC, page faults, a slow link), on the same job before it is;
for a hog, on the same pinned job before the hog
starts; for an agent case, the job's step before the onset against its step in the window that names it), the
extra time per step the finding reports for its rank against the delay injected (compute and in-process loader
faults; a regression's growth against the delay on every rank), the cost against what the fault costs the job
by its own log where it is switched on in the running job (the fault switched off and on: measured_loss), for
agent cases time to the finding, and
last what the case lacks against issue #13's bar ("met", or "15 more runs", "right 3/5", "cost -32%":
short_of_bar). A healthy job watched by the agent can still slow down (the machine's other
work): a regression named in a window where the job's own log shows it 10% slower than the median of its
earlier windows is the job's truth, listed with that figure, not a false finding.
A wrong diagnose verdict, a false finding, a step time off by more than 10% or a cost off by more than 30% keeps
its evidence in --misses: the patterns observed (diagnose --save-patterns), the document and diagnose's log (an
agent case: every window's document and patterns, and the agent's log), to analyze offline with
rankscope.analyzer; --keep-all keeps every run's, right or wrong (a corpus to try a rule change on), and
--replay diagnoses such a corpus again with the current analyzer and prints its table (an agent's run window
after window; the truth stays the one measured when the window was kept).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "jobs"))
import launch  # noqa: E402  (tests/jobs/launch.py: torchrun jobs with injected faults)

from rankscope.analyzer.baseline import MIN_WINDOWS, Baseline  # noqa: E402
from rankscope.analyzer.diagnosis import DEFAULT_HANG_TIMEOUT_S, diagnose  # noqa: E402
from rankscope.analyzer.rules.links import link_matrix  # noqa: E402
from rankscope.analyzer.stability import Confirmer  # noqa: E402
from rankscope.schema.patterns import RankPattern  # noqa: E402
from rankscope.schema.wire import decode_patterns  # noqa: E402
from rankscope.sim.harness import free_port, wait_until  # noqa: E402
from rankscope.sim.rank import GPU_S_PER_STEP  # noqa: E402

RANKSCOPE = [sys.executable, "-m", "rankscope.agent.cli"]
DEFAULT_OUT = Path.home() / ".cache" / "rankscope" / "accuracy"  # outside any checkout: results are no source
WARMUP_S = 8.0
VICTIM_CPU = 1  # pinned cases: the victim's CPU, the hog's too
OWN_REFERENCE_S = 6.0  # pinned and onset cases: the job's own step before the hog or the fault, the what-if
ONSET_SETTLE_S = 1.0  # onset cases: from switching the fault on to the diagnose window (steps of 0.4 s at most)
# Faults switched on in the running job (Fault.switched): what the fault costs the job by its own log (Run.lost),
# the fault switched off and on AB_PAIRS times for AB_PHASE_S each, the first AB_SETTLE_S of each phase not
# counted (a spin's pace follows the last 32 steps). 39 s a job. On a host the ranks oversubscribe the job lost
# 33-54% of the spin a tenth of the step (2026-12-02: mlp-3-io 4.0% of the step, mlp-4 4.9%, cnn-3 3.0%, pipe-4
# 3.3%; lm-2, a core a rank, 10.6%).
AB_PHASE_S = 3.0
AB_PAIRS = 6
AB_SETTLE_S = 0.6
DURATION_S = 10.0
HANG_TIMEOUT_S = 4.0
AGENT_WINDOW_S = 2.0  # the agent's window in the matrix (its default is 5 s)...
AGENT_WINDOW_STEPS = 15  # ...or long enough for this many of the shape's healthy steps (lm-2-long: 4.5 s)
AGENT_HEALTHY_WINDOWS = 10
FINDING_TIMEOUT_S = 40.0  # an agent case: from the onset to the fault's finding
ONSET_WINDOWS = 4  # an agent case's windows before its fault's onset
GUESSED_STEP_S = 0.05  # a shape's step where no healthy run measured it first: it scales the faults
SMALL_SHARE = 0.1  # compute-small: the rank spins this share of its own pace longer a step (tests/jobs/inject)
FAULTS_SHARE = 0.25  # pagefaults: the rank faults in fresh memory this share of its own pace longer a step
PACED = {"compute-small": SMALL_SHARE, "pagefaults": FAULTS_SHARE}  # faults sized by the rank's own pace
Injected = Callable[[float | None], float | None]  # a case's injected_s, given a window's own step
SLOW_GPU = {"compute": 1.5, "compute-small": 1.15}  # the simulated job's faults: its GPU that many times slower
# Issue #13's bar, per case: every fault case right in 19 of 20 runs, no finding in 20 healthy runs, step time
# within 5% of the job's own, cost within 30% of the injected share (the what-if where no delay is injected).
BAR_RUNS = 20
BAR_RIGHT = 19 / 20
BAR_STEP = 0.05
BAR_COST = 0.30
STEP_KEPT = 0.10  # a step time this far from the job's own keeps its evidence, as a wrong verdict does...
COST_KEPT = BAR_COST  # ...and so does a cost this far from the what-if truth
# A healthy job whose own step in a window is this much slower than the median of its earlier windows (or of its
# first MIN_WINDOWS, a young baseline's) did slow down (something outside it: the machine's other work); a
# regression named there is its truth, not false.
SLOWED_BY = 0.10


@dataclass(frozen=True)
class Shape:
    """One job shape: a script of tests/jobs/ with its arguments and rank count."""

    name: str
    script: str
    ranks: int
    args: tuple[str, ...] = ()
    base: str = ""  # faults on every rank that belong to the shape (storage latency: a host with idle CPU)
    workers: int = 0  # DataLoader worker processes: a slow loader must fall behind all of them
    fetches: int = 1  # batches read per optimizer step (each one slowed by a slow loader)
    victim: int = -1  # the rank faults hit (default: the last)
    loads: int = -1  # the rank a slow loader hits: one that loads data (default: the victim)
    note: str = ""
    sim: bool = False  # the simulated GPU job (script unused): its faults are rankscope.sim.faults specs
    faults: tuple[str, ...] = ()  # the faults the shape can take (default: all)
    # A job the analyzer's thresholds were never tuned on (a public framework's training loop): its rows are
    # the held-out measure of a rule change, reported apart from the tuning shapes'.
    held_out: bool = False
    family: str = ""  # a held-out shape's framework and training loop, as the README's table names it

    @property
    def victim_rank(self) -> int:
        return self.victim if self.victim >= 0 else self.ranks - 1

    def takes(self, fault: Fault) -> bool:
        return fault.min_ranks <= self.ranks <= fault.max_ranks and (not self.faults or fault.name in self.faults)

    def target(self, fault: str) -> int:
        return self.loads if fault == "loader" and self.loads >= 0 else self.victim_rank


# The faults a held-out shape takes: those that act in any training loop with an in-process DataLoader.
IN_PROCESS_FAULTS = ("healthy", "compute", "compute-small", "loader", "gc", "hang", "sigstop")
SHAPES = [
    Shape("mlp-2", "mlp_regression.py", 2, note="2 ranks, 1 bucket, in-process loader, CPU-bound"),
    Shape("mlp-3-io", "mlp_regression.py", 3, base="loader:*:0.008", note="3 ranks, storage latency: idle CPU"),
    Shape("mlp-4", "mlp_regression.py", 4, note="4 CPU-bound ranks on 2 cores"),
    Shape("cnn-3", "cnn_classifier.py", 3, workers=2, note="many buckets, 2 loader workers per rank, Adam"),
    Shape("lm-2", "lm_accum.py", 2, fetches=4, note="transformer, AdamW, 4 micro-batches accumulated (no_sync)"),
    Shape("lm-2-long", "lm_accum.py", 2, fetches=4, args=("--d-model", "128", "--layers", "4"),
          note="a 4-layer transformer: ~0.2 s steps (0.65 s with a slow loader), ~15-45 a window"),
    Shape("pipe-4", "pipeline_stages.py", 4, loads=1,
          note="2 stages x 2 replicas, send/recv, new_group all-reduce; stage 0 (ranks 0, 1) loads the data"),
    Shape("sim-4", "", 4, sim=True,
          faults=("healthy", "compute", "compute-small", "loader", "gc", "sigstop", "slowlink", "healthy-agent"),
          note="simulated GPU job: stand-in libcuda/libnccl, NCCL all-reduce; GPU-side faults"),
    Shape("lightning-2", "lightning_trainer.py", 2, held_out=True, faults=IN_PROCESS_FAULTS,
          family="Lightning `Trainer`, DDP",
          note="Lightning Trainer, strategy=ddp on CPU, Adam, in-process loader (Lightning's sampler)"),
    Shape("static-3", "ddp_static_graph.py", 3, held_out=True, faults=(*IN_PROCESS_FAULTS, "slowlink"),
          family="DDP `static_graph`",
          note="DDP static_graph + gradient_as_bucket_view, residual MLP, SGD + cosine schedule"),
    Shape("gpipe-2", "pipelining_gpipe.py", 2, held_out=True, family="`torch.distributed.pipelining` GPipe",
          faults=(*IN_PROCESS_FAULTS, "healthy-agent", "compute-agent"),
          note="torch.distributed.pipelining: 2 stages, ScheduleGPipe, 4 micro-batches; both stages load"),
]


@dataclass(frozen=True)
class Fault:
    name: str
    expect: str | None  # the finding kind that names it (None: healthy, no finding)
    mode: str = "diagnose"  # or "agent"
    pinned: bool = False  # the victim pinned alone to CPU 1, the other ranks to CPU 0 (a hog needs a CPU to take)
    # Switched on in the running job ($RANKSCOPE_FAULT's @go) after OWN_REFERENCE_S of its own steps, the cost's
    # what-if: one shape's jobs ran further apart than a small fault adds (lm-2: healthy jobs 103-142 ms, with a
    # tenth of the step spun 108-153 ms), so another job's step is no reference. Torch jobs only (the simulated
    # job's faults have no go).
    onset: bool = False
    injects: str = ""  # the fault it injects where the name says more (an agent case: its mode); default: name
    max_ranks: int = 64
    min_ranks: int = 2

    @property
    def injection(self) -> str:
        return self.injects or self.name

    @property
    def switched(self) -> bool:
        """Whether the bench switches the fault on in the running job (its onset `go`): an onset case, or an agent
        case, which starts its fault itself."""
        return self.onset or self.mode == "agent"


FAULTS = [
    Fault("healthy", None),
    Fault("compute", "compute_straggler", onset=True),
    # A tenth of the step: the smallest straggler the rules must still name (a 1,000-rank job loses it whole).
    Fault("compute-small", "compute_straggler", onset=True),
    # Loader and GC are switched on too: their cost's what-if is the job's own step before. Another healthy job
    # of the shape is none: cnn-3's healthy jobs ran 62-90 ms steps on this machine, so one of its GC storms
    # read +40% against the 73 ms of one healthy batch and about +20% against the 62 ms of the next.
    Fault("loader", "input_straggler", onset=True),
    # A rank that faults in fresh memory a quarter of its own pace longer each step (the injector's `pagein`, timed
    # as compute-small's spin is: a MB faults in 0.55 ms on one host, 1.4 ms on another): a fifth of the step, within
    # the ranks' usual spread of page faults (rules/stragglers.py, FAULTS_SPREAD) but steadily the late one, so
    # a straggler, named for its page faults.
    Fault("pagefaults", "compute_straggler", onset=True),
    Fault("gc", "python_gc", onset=True),
    Fault("hang", "noncomm_hang"),
    Fault("sigstop", "noncomm_hang"),
    # Two ranks on two cores, a core each. (With more ranks some share a core; a victim of its own core beside
    # a job that leaves CPU idle, mlp-3-io's, sleeps more than it runs and loses nothing to a hog.)
    Fault("hog", "cpu_contention", pinned=True, max_ranks=2),
    # The victim's traffic shaped to 100 Mbit/s each way (tests/jobs/launch.py: SlowLink). Two ranks have one
    # link each way, both the victim's: nothing to compare it with. A fixed rate is a fault only where the job's
    # links run faster: on a slower host cnn-3's healthy links moved 13-17 MB/s (small sends, CPU-bound), the
    # cap is 12.5, and its job did not slow down at all.
    # Both slow links are switched on in the running job too (its link shaped from then on: SlowLink.at_start):
    # a job of separate torchruns in network namespaces is no job of the healthy case's one torchrun, whose
    # step was the what-if before (mlp-3-io's slow link read +21% to +71% against it, batch to batch).
    Fault("slowlink", "slow_link", min_ranks=3, onset=True),
    # The victim's traffic shaped to a quarter of the pace the shape's healthy links kept on this host (their
    # median, measured by the batch's healthy case first: slow_link_rate), as the simulated job's slow link
    # moves at a quarter of its peers': a NIC that came up at 25G among 100G ones.
    Fault("slowlink-4x", "slow_link", min_ranks=3, injects="slowlink", onset=True),
    Fault("healthy-agent", None, mode="agent"),
    Fault("regression", "regression", mode="agent"),
    # The same small straggler switched on under the agent (after 4 windows): one window's rules miss many on a
    # busy host, and a healthy rank is as late now and then (rules/stragglers.py, SMALL_LATE); the agent names
    # it once seen in SMALL_WINDOWS of twice as many windows.
    Fault("compute-small-agent", "compute_straggler", mode="agent", injects="compute-small"),
    # The compute fault switched on under the agent: a pipeline stage with no peer is told only by its own past
    # (rules/regression.py, grown_stage), which one `diagnose` window does not have.
    Fault("compute-agent", "compute_straggler", mode="agent", injects="compute"),
]


@dataclass
class Run:
    shape: str
    fault: str
    right: bool
    false: list[str]  # "kind[ranks]" of findings other than the expected one
    findings: list[str]
    step_s: float | None = None  # the document's
    truth_step_s: float | None = None  # the job's own
    cost: float | None = None
    truth_cost: float | None = None
    # The issue's own measure, where the fault is one known delay a step (injected_s): that delay's share
    # of the faulty step. The what-if above is stricter: on a host the job oversubscribes, the others' waiting
    # lends the straggler CPU and the job loses less than that. Not where every rank spins it on such a host
    # (spins_contend): there the job loses more than the delay, and the what-if alone is the truth.
    injected_cost: float | None = None
    # The finding's "N ms longer per step than its peers" (its first rank's excess_s), and the delay injected
    # a step: the number a user reads first, checked against the job's truth.
    extra_s: float | None = None
    injected_s: float | None = None
    to_finding_s: float | None = None
    # The fault as the job felt it: an agent case's own step in the windows wholly after the onset against its
    # step before, a diagnose case's step in the window against its reference (window_slowed), less 1. A rank
    # that spins a tenth of the step can cost its job nothing (it had that much slack: cnn-3's rank 2 waits
    # longest of its three), and so can a slow link whose transfers hide behind a CPU-bound step (cnn-3 on a
    # slower host: 124-141 ms steps with the link slowed, 127-141 without), so a miss is read beside its cost.
    job_slowed: float | None = None
    # What the fault costs the job by its own log, the fault switched off and on (measured_loss): the truth
    # the cost answers to ("costs N% of step time": what the job would gain without it). Faults switched on in
    # the running job only (Fault.switched; not the simulated job's).
    lost: float | None = None
    error: str = ""
    job: str = ""  # the job's run id: runs of one job are its consecutive diagnose windows
    # A diagnose window's link pace: the median throughput of the links that set it (analyzer/rules/links.py's
    # pacing links; None: none moved enough to tell). A healthy window's scales slowlink-4x.
    links_Bps: float | None = None
    # The CPUs of the machine it ran on (2: every run before this was recorded ran on a 2-core machine).
    cores: int = 2

    @classmethod
    def of(cls, saved: dict[str, Any]) -> Run:
        """A run as save() or Evidence wrote it (less the derived errors)."""
        return cls(**{k: v for k, v in saved.items() if k not in DERIVED})

    @property
    def step_err(self) -> float | None:
        if self.step_s is None or not self.truth_step_s:
            return None
        return self.step_s / self.truth_step_s - 1

    @property
    def cost_err(self) -> float | None:
        if self.cost is None or not self.truth_cost:
            return None
        return self.cost / self.truth_cost - 1

    @property
    def spins_contend(self) -> bool:
        """The delay is spun on every rank (a regression) of a job with more ranks than the machine has cores:
        each rank's spin holds a core its peers' compute needs, so the job loses more than the delay (in file
        18: mlp-4, four ranks on two cores, 1.49 delays a step; cnn-3 1.31, pipe-4 1.41; mlp-2, a core a
        rank, 1.07), and only the job's own step log tells what it lost."""
        shape = next((s for s in SHAPES if s.name == self.shape), None)
        return self.fault == "regression" and shape is not None and shape.ranks > self.cores

    @property
    def injected_err(self) -> float | None:
        if self.cost is None or not self.injected_cost or self.spins_contend:
            return None
        return self.cost / self.injected_cost - 1

    @property
    def extra_err(self) -> float | None:
        if self.extra_s is None or not self.injected_s:
            return None
        return self.extra_s / self.injected_s - 1

    @property
    def lost_err(self) -> float | None:
        if self.cost is None or not self.lost or self.lost <= 0:
            return None
        return self.cost / self.lost - 1


DERIVED = ("step_err", "cost_err", "injected_err", "extra_err", "lost_err")  # Run's properties, saved beside its fields


@dataclass(frozen=True)
class Evidence:
    """Where runs keep their patterns and documents: the wrong ones (a wrong verdict, a false finding, a step
    time or cost off by more than STEP_KEPT or COST_KEPT), or `every` one."""

    dir: Path
    every: bool = False

    def wanted(self, run: Run) -> bool:
        off = abs(run.step_err or 0.0) > STEP_KEPT or abs(run.cost_err or 0.0) > COST_KEPT
        return self.every or not run.right or bool(run.false) or off

    def path(self, name: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.dir / name


def log(msg: str) -> None:
    print(f"[accuracy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def added_s(healthy_step: float) -> float:
    """Seconds a faulty rank adds per step: half the healthy step, within 20-300 ms."""
    return min(max(0.02, 0.5 * healthy_step), 0.3)


def injected_s(shape: Shape, fault: str, healthy_step: float | None, step: float | None) -> float | None:
    """Where the fault is a known delay each step, that delay in a window whose step (the job's own) is `step`
    (None where it is not one: a loader behind worker processes, a GC storm; or where the delay is scaled to
    an unknown `healthy_step`); a slower simulated GPU's is its kernels' extra time a step."""
    if fault in PACED and not shape.sim:  # a share of its own pace longer: of the step, that share
        return PACED[fault] / (1 + PACED[fault]) * step if step else None
    if fault in SLOW_GPU and shape.sim:
        return (SLOW_GPU[fault] - 1) * GPU_S_PER_STEP  # its kernels run that much longer a step
    if healthy_step is None:
        return None
    if fault == "compute" and not shape.sim:
        return added_s(healthy_step)  # the rank spins that long before optimizer.step
    if fault == "loader" and not shape.workers:
        return added_s(healthy_step) * (1 if shape.sim else shape.fetches)  # slept in each batch's fetch
    if fault == "regression":
        return added_s(healthy_step)  # every rank spins that long a step after the onset
    return None


def score_figures(run: Run, doc: dict, healthy_step: float, injected: Injected) -> None:
    """A right verdict's cost against the what-if (the job's step against `healthy_step`) and against the
    `injected` delay's share of the faulty step (the issue's own measure), and its extra time per step against
    that delay."""
    finding = doc["findings"][0]
    run.cost = finding["cost"]
    run.truth_cost = max(1 - healthy_step / run.truth_step_s, 0.0)
    run.injected_s = injected(run.truth_step_s)
    run.injected_cost = None if run.injected_s is None else min(run.injected_s / run.truth_step_s, 1.0)
    per_rank = finding["evidence"].get("per_rank")
    run.extra_s = per_rank[0]["excess_s"] if run.injected_s and per_rank else None


def window_slowed(run: Run, fault: Fault, healthy_step: float | None) -> None:
    """A faulty diagnose window's Run.job_slowed, right or wrong: the job's step in it against the what-if."""
    if fault.expect and healthy_step and run.truth_step_s:
        run.job_slowed = run.truth_step_s / healthy_step - 1


def slowed_windows(truth: dict[str, Any] | None) -> dict[int, float]:
    """The windows of an agent run in which the job, by its own step log, ran SLOWED_BY slower than the median
    of its earlier windows or of its first MIN_WINDOWS after the one the agent attached in (what the agent's
    baseline is first made of: a lasting slowdown the agent names once it held is otherwise measured against
    windows it already slowed; lm-2 ran 80-86 ms, then 92-106 ms for six windows, named +16% in the sixth,
    +3% over the median of all before it; and its attach window ran 476 ms, the next 271, 174, 182), each
    with how much slower."""
    steps = (truth or {}).get("windows_s", [])
    out = {}
    for i in range(1, len(steps)):
        earlier = [x for x in steps[:i] if x]
        if not steps[i] or not earlier:
            continue
        first = earlier[1:1 + MIN_WINDOWS] or earlier
        slower = steps[i] / min(statistics.median(earlier), statistics.median(first)) - 1
        if slower >= SLOWED_BY:
            out[i] = slower
    return out


def borne_out(by_window: list[list[dict]], truth: dict[str, Any] | None) -> tuple[list[dict], list[str]]:
    """A healthy agent run's findings less the regressions its job's own log bears out (slowed_windows): what
    is left to score, and those as labels ("regression[0, 1] (the job's log: +25%)"). A regression held
    through the deep windows it raised ("held") is the earlier window's finding again, scored there; one the
    agent first reported in a deep window (confirmed there, unconfirmed before) is scored in the window it
    was measured in (measured_in): skipped, it went unscored, false or not (cnn-3: confirmed in window 8,
    measured in 7, where the job's log ran +11%)."""
    slowed = slowed_windows(truth)
    left, shown = [], []
    reported = set()
    for i, findings in enumerate(by_window):
        for f in findings:
            if f.get("held") and label(f) in reported:
                continue
            reported.add(label(f))
            at = measured_in(f, i, by_window)
            if f["kind"] == "regression" and at in slowed:
                shown.append(f"{label(f)} (the job's log: {slowed[at]:+.0%})")
            else:
                left.append(f)
    return left, shown


def scored_findings(fault: Fault, by_window: list[list[dict]], truth: dict[str, Any] | None
                    ) -> tuple[list[dict], list[str]]:
    """An agent run's findings to score, and those its job's own log bears out (borne_out), unless the fault is
    the regression: a job that slowed down is slower than its baseline whatever else is wrong with it (mlp-2
    with a small straggler: every rank's backward 0.7-1.1 ms longer a step after the onset, the job's log +20%)."""
    if fault.expect == "regression":
        return [f for fs in by_window for f in fs], []
    return borne_out(by_window, truth)


def measured_in(found: dict, window: int, by_window: list[list[dict]]) -> int:
    """The window whose patterns `found`, reported in `window`, was measured in: that window, or for a
    regression held through the deep windows it raised ("held"), the last window before them. The deep
    windows' own steps are slower (their probes cost the job time: pipe-4 +9%), so scoring a held finding's
    step there read -9% for a step right to 1% where it was measured."""
    if found.get("held"):
        while window > 0 and any(f.get("held") for f in by_window[window]):
            window -= 1
    return window


def job_slowed(truth: dict[str, Any] | None, onset_window: int) -> float | None:
    """The job's own slowdown after a fault's onset (Run.job_slowed): the mean of its steps in the windows
    after `onset_window` (the first one may have begun before the onset) against its step before."""
    after = [s for s in (truth or {}).get("windows_s", [])[onset_window + 1:] if s]
    before = (truth or {}).get("before_s")
    return statistics.fmean(after) / before - 1 if after and before else None


def score_found(run: Run, found: dict, window: int, truth: dict[str, Any], injected: Injected) -> None:
    """A fault an agent named in window `window` of the run: its step time against the job's in that window,
    its cost against the what-if 1 - step before the onset / step in that window, and the delay it reports
    against the delay injected (run.injected_s): a regression's growth per step of the part it names ("...
    grew by N ms per step", injected on every rank), a straggler's extra time per step."""
    before, after = truth["before_s"], truth["windows_s"][window]
    if not before or not after:
        return
    run.step_s, run.truth_step_s = found["evidence"]["step_time_s"], after
    run.cost, run.truth_cost = found["cost"], max(1 - before / after, 0.0)
    run.injected_s = injected(after)
    run.injected_cost = None if run.injected_s is None else min(run.injected_s / after, 1.0)
    per_rank = found["evidence"].get("per_rank")
    run.extra_s = per_rank[0]["excess_s"] if per_rank else found["evidence"].get("function_growth_s")


def fault_spec(shape: Shape, fault: Fault, healthy_step: float) -> str:
    """$RANKSCOPE_FAULT for the case: delays scaled to the shape's healthy step time."""
    v = shape.target(fault.injection)
    extra = added_s(healthy_step)
    if shape.sim:  # GPU-side equivalents: a slower GPU, input stall, a slower link
        return {**{f: f"slow-gpu:{v}:{x}" for f, x in SLOW_GPU.items()},
                "loader": f"input-stall:{v}:{extra:.4f}", "gc": f"gc:{v}",
                "slowlink": f"slow-link:{v}:4"}.get(fault.injection, "")
    onset = "@go" if fault.switched else ""
    spec = {
        "compute": f"compute:{v}:{extra:.4f}{onset}",
        "compute-small": f"spin:{v}:{SMALL_SHARE}{onset}",
        # A batch fetch must outlast every worker's share of the step to make the rank wait for it.
        "loader": f"loader:{v}:{extra + shape.workers * (healthy_step + extra):.4f}{onset}",
        "gc": f"gc:{v}:0.3{onset}",
        "pagefaults": f"pagein:{v}:{FAULTS_SHARE}{onset}",
        "hang": f"hang:{v}:0@go",
        "regression": f"compute:*:{extra:.4f}@go",
    }.get(fault.injection, "")
    return ",".join(filter(None, [shape.base, spec]))  # the injector adds a kind's values up


def hog_on(cpu: int) -> subprocess.Popen:
    """A busy process pinned to `cpu`, in a session of its own: a noisy neighbour. The kernel shares a CPU
    between sessions' autogroups first, so it weighs as much as the job's torchrun session on that CPU; its
    nice -5 orders it only within its own session (sched_autogroup_enabled=1 here, as on most distributions)."""
    return subprocess.Popen(["taskset", "-c", str(cpu), "nice", "-n", "-5", sys.executable, "-c", "while True: pass"],
                            start_new_session=True)


# A neighbour of the jobs on a loaded machine: busy, then idle, for random spells of 0.2-2 s each (another
# job's bursts, a build, a test suite), unpinned at the jobs' priority. Seeded per process: runs repeat.
NEIGHBOUR = """
import random, sys, time
rnd = random.Random(int(sys.argv[1]))
while True:
    end = time.monotonic() + rnd.uniform(0.2, 2.0)
    while time.monotonic() < end:
        pass
    time.sleep(rnd.uniform(0.2, 2.0))
"""


@contextlib.contextmanager
def neighbours(n: int) -> Iterator[None]:
    """`n` neighbour processes for as long as the matrix runs."""
    procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(i)], start_new_session=True) for i in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def label(f: dict) -> str:
    return f"{f['kind']}{f['ranks']}"


def score(shape: Shape, fault: Fault, findings: list[dict]) -> tuple[bool, list[str]]:
    expect = None if fault.expect is None else (fault.expect, [shape.target(fault.injection)])
    if fault.expect == "regression":
        expect = ("regression", None)
    hits = [f for f in findings if expect and f["kind"] == expect[0] and (expect[1] is None or f["ranks"] == expect[1])]
    right = (not findings) if expect is None else bool(findings) and findings[0] in hits
    return right, [label(f) for f in findings if f not in hits]


def score_agent(shape: Shape, fault: Fault, findings: list[dict], found: dict | None) -> tuple[bool, list[str]]:
    """An agent run's verdict over every finding its windows reported: on a healthy job, none; with a fault,
    `found` (the first finding of the fault's kind after its onset) names it, and every finding of another kind
    is false."""
    if fault.expect is None:
        return score(shape, fault, findings)
    right, false = score(shape, fault, [found] if found else [])
    return right, false + [label(f) for f in findings if f is not found and f["kind"] != fault.expect]


def diagnose_case(shape: Shape, fault: Fault, job: launch.TorchrunJob | launch.SimRun,
                  healthy_step: float | None, injected: Injected, misses: Evidence, window: int = 0,
                  lost: float | None = None) -> Run:
    pids = ",".join(str(job.pids[r]) for r in range(shape.ranks))
    hog = hog_on(VICTIM_CPU) if fault.name == "hog" else None
    saved = job.truth.parent / f"{job.run_id}-{window}.msgpack"
    try:
        extra = ["--hang-timeout", str(HANG_TIMEOUT_S)] if fault.expect == "noncomm_hang" else []
        proc = subprocess.Popen([*RANKSCOPE, "diagnose", "--pid", pids, "--duration", str(DURATION_S), "--json",
                                 "--save-patterns", str(saved), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        attaching = launch.until_watching(proc)
        if fault.name == "hang":
            job.go()
        elif fault.name == "sigstop":
            os.kill(job.pids[shape.victim_rank], signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
        err = attaching + err  # the log kept with a run: all of it
    finally:
        if hog:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()
    if proc.returncode:
        raise RuntimeError(f"diagnose exited {proc.returncode}: {err.strip()[-500:]}")
    doc = json.loads(out)
    right, false = score(shape, fault, doc["findings"])
    run = Run(shape.name, fault.name, right, false, [label(f) for f in doc["findings"]], step_s=doc["step_time_s"],
              job=job.run_id, links_Bps=link_pace(decode_patterns(saved.read_bytes())), lost=lost)
    if fault.expect not in ("noncomm_hang",):
        w = doc["window"]
        job.wait_written(w["end"])
        run.truth_step_s = job.step_time(w["start"], w["end"])
        window_slowed(run, fault, healthy_step)
        if doc["findings"] and right and fault.expect and healthy_step and run.truth_step_s:
            score_figures(run, doc, healthy_step, injected)
    if misses.wanted(run):
        name = f"{shape.name}-{fault.name}-{job.run_id}-{window}"
        shutil.copyfile(saved, misses.path(f"{name}.msgpack"))
        misses.path(f"{name}.json").write_text(json.dumps({"run": asdict(run), "document": doc, "log": err}, indent=1))
    return run


def agent_case(shape: Shape, fault: Fault, job: launch.TorchrunJob | launch.SimRun, tmp: Path, misses: Evidence,
               healthy_step: float | None, injected: Injected, lost: float | None = None) -> Run:
    """The agent over the job, window after window; a wrong verdict keeps every window's document and patterns
    and the agent's log in `misses`."""
    port = free_port()
    pids = ",".join(str(job.pids[r]) for r in range(shape.ranks))
    with open(tmp / f"agent-{job.run_id}.log", "wb") as agent_log:
        agent = subprocess.Popen([*RANKSCOPE, "agent", "--pid", pids, "--listen", f"127.0.0.1:{port}",
                                  "--window", f"{max(AGENT_WINDOW_S, AGENT_WINDOW_STEPS * (healthy_step or 0)):.1f}"],
                                 stdout=agent_log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"

    def window() -> dict | None:  # the next window's document
        try:
            with urllib.request.urlopen(f"{url}/diagnosis?job={job.run_id}", timeout=5) as r:
                doc = json.loads(r.read())
        except OSError:
            return None
        return doc if doc.get("job") == job.run_id and (doc["window"]["end"] or 0) > seen[-1] else None

    def next_window() -> dict:
        doc = wait_until(window, 30, "the agent's next window", interval=0.2)
        seen.append(doc["window"]["end"])
        docs.append(doc)
        # The job's own step in the window, read now: its log keeps only its last steps (4,096: 16 s of mlp-2's)
        job.wait_written(doc["window"]["end"])
        truth["windows_s"].append(job.step_time(doc["window"]["start"], doc["window"]["end"]))
        request = urllib.request.Request(f"{url}/patterns", headers={"Accept": "application/msgpack"})
        with urllib.request.urlopen(request, timeout=5) as r:  # the window's (or, rarely, the next one's)
            patterns.append(r.read())
        return doc

    seen = [0.0]
    docs: list[dict] = []
    patterns: list[bytes] = []
    # The job's own steps: in each window and, for a regression, before the onset from the first window's
    # start. What a regression's figures and a healthy run's findings are checked against, kept beside the
    # run's documents for --replay.
    truth: dict[str, Any] = {"windows_s": []}
    try:
        for _ in range(AGENT_HEALTHY_WINDOWS if fault.expect is None else ONSET_WINDOWS):
            next_window()
        if fault.expect is None:
            left, shown = scored_findings(fault, [d["findings"] for d in docs], truth)
            right, false = score_agent(shape, fault, left, None)
            steps = [d["step_time_s"] for d in docs if d["step_time_s"]]
            own = [s for s in truth["windows_s"] if s]
            run = Run(shape.name, fault.name, right, false, [label(f) for f in left] + shown,
                      step_s=statistics.fmean(steps) if steps else None,
                      truth_step_s=statistics.fmean(own) if own else None, job=job.run_id)
        else:
            onset = job.go()
            job.wait_written(onset)
            truth["before_s"] = job.step_time(docs[0]["window"]["start"], onset)
            found = None
            while time.time() - onset < FINDING_TIMEOUT_S and found is None:
                doc = next_window()
                found = next((f for f in doc["findings"] if f["kind"] == fault.expect), None)
            findings, shown = scored_findings(fault, [d["findings"] for d in docs], truth)
            right, false = score_agent(shape, fault, findings, found)
            run = Run(shape.name, fault.name, right, false, [label(f) for f in findings] + shown,
                      to_finding_s=time.time() - onset if found else None, job=job.run_id,
                      job_slowed=job_slowed(truth, ONSET_WINDOWS), lost=lost)
            if found:
                window = measured_in(found, len(docs) - 1, [d["findings"] for d in docs])
                score_found(run, found, window, truth, injected)
        if misses.wanted(run):
            name = f"{shape.name}-{fault.name}-{job.run_id}"
            for i, raw in enumerate(patterns):
                misses.path(f"{name}-{i}.msgpack").write_bytes(raw)
            misses.path(f"{name}.json").write_text(json.dumps({"run": asdict(run), "documents": docs, "truth": truth},
                                                              indent=1))
            shutil.copyfile(tmp / f"agent-{job.run_id}.log", misses.path(f"{name}.log"))
        return run
    finally:
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def link_pace(patterns: list[RankPattern]) -> float | None:
    """Run.links_Bps of a window's patterns."""
    m = link_matrix(patterns)
    return float(np.median(m.bandwidth_Bps[m.pacing])) if m.pacing.any() else None


def slow_link_rate(healthy_pace_Bps: float) -> str:
    """slowlink-4x's cap (tc's syntax, each way): a quarter of the healthy links' pace."""
    return f"{int(healthy_pace_Bps * 8 / 4 / 1000)}kbit"


def slow_link(shape: Shape, fault: Fault, healthy_pace_Bps: float | None) -> launch.SlowLink | None:
    """The case's shaped link, if it has one."""
    if fault.injection != "slowlink":
        return None
    if fault.name == "slowlink":
        return launch.SlowLink(shape.victim_rank, at_start=not fault.onset)
    if healthy_pace_Bps is None:
        raise RuntimeError("slowlink-4x is scaled to the shape's healthy links: run its healthy case first")
    return launch.SlowLink(shape.victim_rank, slow_link_rate(healthy_pace_Bps), not fault.onset)


def switch(job: launch.TorchrunJob, fault: Fault) -> Callable[[bool], None]:
    """How the case's fault is switched on and off in the running job: its link's shaping, or its `go` file
    (inject/sitecustomize.py checks it every step)."""
    if fault.injection == "slowlink":
        return job.shape_link
    return lambda on: job.go() if on else (job.truth / "go").unlink(missing_ok=True)


def measured_loss(job: launch.TorchrunJob, fault_on: Callable[[bool], None]) -> float | None:
    """Run.lost: the fault switched off and on (`fault_on`), AB_PAIRS times, each on phase's step against the
    mean of the off phases either side (a host's pace drifts over the 39 s), 1 - off/on, their median; the
    fault left off. Read phase by phase: a rank's log keeps its last 4,096 steps (16 s of mlp-2's)."""
    steps: list[float | None] = []
    for phase in range(2 * AB_PAIRS + 1):
        fault_on(bool(phase % 2))
        start = time.time()
        launch.settle(job, AB_PHASE_S)
        end = time.time()
        job.wait_written(end)
        steps.append(job.step_time(start + AB_SETTLE_S, end))
    losses = [1 - (before + after) / 2 / on for before, on, after in zip(steps[::2], steps[1::2], steps[2::2])
              if before and on and after]
    return statistics.median(losses) if losses else None


def run_case(shape: Shape, fault: Fault, tmp: Path, healthy_step: float | None, misses: Evidence,
             windows: int = 1, healthy_pace_Bps: float | None = None) -> list[Run]:
    """One fresh job of the shape with the fault: its agent run, or `windows` diagnose runs in a row (a hang
    ends the job's steps: diagnosed once). `healthy_pace_Bps`: the shape's healthy links' pace (slowlink-4x)."""
    scale = healthy_step or GUESSED_STEP_S  # the step the fault's delay is scaled to
    spec = fault_spec(shape, fault, scale)
    if shape.sim:
        job = launch.start_sim(shape.ranks, spec.split(",") if spec else [], tmp)
    else:
        job = launch.start(shape.script, shape.ranks, list(shape.args), tmp, fault=spec,
                           slow_link=slow_link(shape, fault, healthy_pace_Bps))
    try:
        if fault.pinned:
            launch.pin(job, {r: VICTIM_CPU if r == shape.victim_rank else 0 for r in range(shape.ranks)})
        launch.settle(job, WARMUP_S)
        onset = fault.onset and not shape.sim
        if fault.pinned or onset:  # the what-if: this job as it is, without the fault, measured before it (a
            # hog's pinned: an unpinned healthy job is slower, lm-2-long's ranks on a core each ran 0.24 s
            # steps, unpinned 0.31)
            start = time.time()
            launch.settle(job, OWN_REFERENCE_S)
            end = time.time()
            job.wait_written(end)
            healthy_step = job.step_time(start, end) or healthy_step
        fault_on = None if shape.sim else switch(job, fault)  # the simulated job's faults have no switch
        lost = measured_loss(job, fault_on) if fault_on and fault.switched and fault.expect is not None else None
        injected = partial(injected_s, shape, fault.injection, scale)
        if fault.mode == "agent":
            return [agent_case(shape, fault, job, tmp, misses, healthy_step, injected, lost)]
        if onset and fault_on:
            fault_on(True)
            launch.settle(job, ONSET_SETTLE_S)
        once = fault.expect == "noncomm_hang"
        return [diagnose_case(shape, fault, job, healthy_step, injected, misses, w, lost)
                for w in range(1 if once else windows)]
    finally:
        job.kill()


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for key in dict.fromkeys((r.shape, r.fault) for r in runs):
        rs = [r for r in runs if (r.shape, r.fault) == key]
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        step = [abs(r.step_err) for r in rs if r.step_err is not None]
        cost = [r.cost_err for r in rs if r.cost_err is not None]
        injected = [r.injected_err for r in rs if r.injected_err is not None]
        extra = [r.extra_err for r in rs if r.extra_err is not None]
        lost = [r.lost_err for r in rs if r.lost_err is not None]
        ttf = [r.to_finding_s for r in rs if r.to_finding_s is not None]
        truth = [r.truth_step_s for r in rs if r.truth_step_s]
        rows.append({"shape": key[0], "fault": key[1], "held_out": is_held_out(key[0]), "runs": len(rs),
                     "jobs": len({r.job for r in rs}),
                     "truth_step_s": med(truth),
                     "right": sum(r.right for r in rs), "step_err_worst": max(step) if step else None,
                     "false": sum(len(r.false) for r in rs), "errors": sum(bool(r.error) for r in rs),
                     "step_err": med(step), "cost_err": med(cost), "injected_err": med(injected),
                     "extra_err": med(extra), "lost_err": med(lost),
                     "lost": med([r.lost for r in rs if r.lost is not None]),
                     "to_finding_s": med(ttf),
                     "job_slowed": med([r.job_slowed for r in rs if r.job_slowed is not None]),
                     "missed_slowed": [r.job_slowed for r in rs if not r.right and r.job_slowed is not None],
                     "seen": sorted({", ".join(r.findings) or "-" for r in rs})})
        rows[-1]["bar"] = short_of_bar(rows[-1])
    return rows


FAULT_EXPECTS = {f.name: f.expect for f in FAULTS}


def is_held_out(shape: str) -> bool:
    """Whether the shape named `shape` is held out (an unknown one, a batch's from before a rename, is not)."""
    return any(s.name == shape and s.held_out for s in SHAPES)


def selected(names: str, held_out: bool | None) -> list[Shape]:
    """The shapes named in `names` (comma-separated) of the held-out set (True), the tuning set (False), or
    both (None)."""
    wanted = set(names.split(","))
    return [s for s in SHAPES if s.name in wanted and (held_out is None or s.held_out == held_out)]


def of_set(runs: list[Run], held_out: bool | None) -> list[Run]:
    """The runs of the held-out shapes (True), of the tuning shapes (False), or all (None)."""
    return runs if held_out is None else [r for r in runs if is_held_out(r.shape) == held_out]


def short_of_bar(row: dict[str, Any]) -> str:
    """What a summarized case lacks against the bar (BAR_*), or "met": the table's last column, so a session
    reads what its matrix still owes without recounting. A case that can fail must be right in BAR_RIGHT of
    its runs, a healthy one in all; a false finding beside a right verdict is short too."""
    expect = FAULT_EXPECTS.get(row["fault"])
    short = []
    if row["runs"] < BAR_RUNS:
        short.append(f"{BAR_RUNS - row['runs']} more runs")
    if row["right"] < (BAR_RIGHT * row["runs"] if expect else row["runs"]):
        short.append(f"right {row['right']}/{row['runs']}")
    if row["false"]:
        short.append(f"{row['false']} false")
    if row["step_err_worst"] is not None and row["step_err_worst"] > BAR_STEP:
        short.append(f"step {row['step_err_worst']:.0%}")
    cost = row["injected_err"] if row.get("injected_err") is not None else row["cost_err"]
    if cost is not None and abs(cost) > BAR_COST:
        short.append(f"cost {cost:+.0%}")
    return "; ".join(short) or "met"


def replay(dirs: list[Path]) -> list[Run]:
    """The windows kept in `dirs` (--misses, --keep-all), diagnosed again by the current analyzer: a rule change
    tried on real jobs' windows before it lands. A cost is scored against the reference the kept run was scored
    against, else the shape's healthy step in the corpus. An agent's run is replayed window after window, as
    the agent analyzes them."""
    shapes, faults = {s.name: s for s in SHAPES}, {f.name: f for f in FAULTS}
    corpus = [(path, json.loads(path.read_text())) for path in sorted(p for d in dirs for p in d.glob("*.json"))]
    # A kept run scored without a reference (its batch ran no healthy case first: slow links, say) gets the
    # shape's healthy step: the median of the corpus's healthy diagnose windows.
    healthy_runs: dict[str, list[float]] = {}
    for _, kept in corpus:
        if kept["run"]["fault"] == "healthy" and kept["run"]["truth_step_s"]:
            healthy_runs.setdefault(kept["run"]["shape"], []).append(kept["run"]["truth_step_s"])
    healthy_step = {shape: statistics.median(steps) for shape, steps in healthy_runs.items()}
    runs = []
    for path, kept in corpus:
        shape, fault = shapes.get(kept["run"]["shape"]), faults.get(kept["run"]["fault"])
        if shape is None or fault is None:
            continue
        run = Run.of(kept["run"])
        if fault.mode == "agent":
            windows = sorted(path.parent.glob(f"{path.stem}-*.msgpack"), key=lambda w: int(w.stem.rsplit("-", 1)[1]))
            if windows:
                runs.append(replay_agent(shape, fault, run, windows, kept.get("truth")))
            continue
        saved = path.with_suffix(".msgpack")
        if not saved.exists():
            continue
        # The reference the kept run was scored against, where it had one (a right verdict then).
        healthy = (1 - run.truth_cost) * run.truth_step_s if run.truth_cost is not None and run.truth_step_s else None
        if healthy is None and not fault.pinned:  # a hog's reference is its own job's, pinned before the hog
            healthy = healthy_step.get(shape.name)
        injected = kept_injected(shape, fault, run, healthy)
        run.cost = run.injected_cost = run.extra_s = run.injected_s = None
        window_slowed(run, fault, healthy)
        timeout = HANG_TIMEOUT_S if fault.expect == "noncomm_hang" else DEFAULT_HANG_TIMEOUT_S
        doc = next(iter(diagnose(decode_patterns(saved.read_bytes()), timeout).values()))
        run.right, run.false = score(shape, fault, doc["findings"])
        run.findings, run.step_s = [label(f) for f in doc["findings"]], doc["step_time_s"]
        if doc["findings"] and run.right and healthy and run.truth_step_s:
            score_figures(run, doc, healthy, injected)
        runs.append(run)
    return runs


def kept_injected(shape: Shape, fault: Fault, run: Run, healthy: float | None) -> Injected:
    """A kept run's injected delay: the one it was scored against where it was, else the case's (scaled to
    `healthy`, its batch's healthy step)."""
    kept = run.injected_s
    if kept is None and fault.injection == "pagefaults":  # sized in megabytes before 2026-12-04, timed since: a
        return lambda _step: None  # kept run's share is the one it recorded, if any
    return partial(injected_s, shape, fault.injection, healthy) if kept is None else lambda _step: kept


def replay_agent(shape: Shape, fault: Fault, run: Run, windows: list[Path], truth: dict[str, Any] | None) -> Run:
    """An agent's kept run diagnosed again: its windows in order, each against the job's baseline so far, each
    finding reported once it held (as rankscope.agent.daemon does), scored as agent_case scores it; a
    regression's figures too where the run kept its truth (the job's own steps), and a healthy run's
    regressions against it (borne_out), and its step as agent_case reads it."""
    baselines: dict[str, Baseline] = {}
    confirmer = Confirmer()
    by_window: list[list[dict]] = []
    steps: list[float] = []
    found, found_in = None, -1  # the first finding of the fault's kind, and the window that reported it
    for i, w in enumerate(windows):
        docs = diagnose(decode_patterns(w.read_bytes()), DEFAULT_HANG_TIMEOUT_S, baselines)
        confirmer.confirm(docs)
        by_window.append([f for doc in docs.values() for f in doc["findings"]])
        steps += [doc["step_time_s"] for doc in docs.values() if doc["step_time_s"]]
        if found is None:
            found, found_in = next((f for f in by_window[-1] if f["kind"] == fault.expect), None), i
    findings, shown = scored_findings(fault, by_window, truth)
    run.right, run.false = score_agent(shape, fault, findings, found)
    run.findings = [label(f) for f in findings] + shown
    if fault.expect is None:
        run.step_s = statistics.fmean(steps) if steps else None
    else:
        injected = kept_injected(shape, fault, run, None)
        run.step_s = run.truth_step_s = run.cost = run.truth_cost = run.injected_cost = run.extra_s = None
        run.job_slowed = job_slowed(truth, ONSET_WINDOWS)
        if found and truth and found_in < len(truth["windows_s"]):
            score_found(run, found, measured_in(found, found_in, by_window), truth, injected)
    return run


def table(rows: list[dict[str, Any]]) -> str:
    """The rows' table, the tuning shapes' and the held-out shapes' apart (a section each, with its tally):
    a rule change reads right only if it holds on jobs its thresholds were not tuned on."""
    sections = []
    for held_out, title in ((False, "tuning shapes"), (True, "held-out shapes")):
        if part := [r for r in rows if is_held_out(r["shape"]) == held_out]:
            sections.append(f"### {title}: {tally(part)}\n\n{cases_table(part)}")
    return "\n\n".join(sections)


def tally(rows: list[dict[str, Any]]) -> str:
    """A section's line: right verdicts on faulty jobs, healthy runs with no finding, false findings."""
    healthy = [r for r in rows if FAULT_EXPECTS.get(r["fault"]) is None]
    faulty = [r for r in rows if r not in healthy]
    count = lambda rs, key: sum(r[key] for r in rs)  # noqa: E731
    return (f"right {count(faulty, 'right')}/{count(faulty, 'runs')} faulty runs, "
            f"{count(healthy, 'right')}/{count(healthy, 'runs')} healthy runs clean, "
            f"{count(rows, 'false')} false findings, {count(rows, 'errors')} runs failed")


def cases_table(rows: list[dict[str, Any]]) -> str:
    pct = lambda x: "-" if x is None else f"{x:+.0%}"  # noqa: E731
    lines = ["| shape | fault | step | right | jobs | false findings | step-time error (worst) | cost error | "
             "extra time vs injected | cost vs the job's loss (its loss) | time to finding | job slowed (missed) | "
             "seen | bar |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttf = "-" if r["to_finding_s"] is None else f"{r['to_finding_s']:.1f} s"
        step = "-" if r["step_err"] is None else f"{r['step_err']:.0%} ({r['step_err_worst']:.0%})"
        truth = "-" if r.get("truth_step_s") is None else f"{r['truth_step_s'] * 1e3:.0f} ms"
        cost = pct(r["cost_err"]) + (f" ({pct(r['injected_err'])} of injected)" if r.get("injected_err") is not None
                                     else "")
        missed = ", ".join(pct(x) for x in r.get("missed_slowed", []))
        slowed = pct(r.get("job_slowed")) + (f" ({missed})" if missed else "")
        lost = pct(r.get("lost_err")) + ("" if r.get("lost") is None else f" ({r['lost']:.1%})")
        lines.append(f"| {r['shape']} | {r['fault']} | {truth} | {r['right']}/{r['runs']} | {r['jobs']} | "
                     f"{r['false']} | {step} | {cost} | {pct(r.get('extra_err'))} | {lost} | {ttf} | {slowed} | "
                     f"{'; '.join(r['seen'])[:80]} | {r['bar']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20, help="fresh jobs per case")
    ap.add_argument("--windows", type=int, default=1, help="diagnose runs per job (hangs: 1)")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    ap.add_argument("--faults", default=",".join(f.name for f in FAULTS))
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--held-out", dest="held_out", action="store_const", const=True,
                       help="only the held-out shapes (jobs the analyzer was not tuned on); with --table and "
                            "--replay, only their runs")
    which.add_argument("--tuning", dest="held_out", action="store_const", const=False,
                       help="only the shapes the analyzer's thresholds were tuned on")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="where a live matrix's results and kept evidence go (default: %(default)s)")
    ap.add_argument("--json", help="where the runs go (a replay's too; a live matrix's default: "
                                   "OUT/accuracy-results.json)")
    ap.add_argument("--misses", help="where wrong verdicts keep their patterns and document "
                                     "(default: OUT/accuracy-misses)")
    ap.add_argument("--keep-all", action="store_true", help="keep every run's patterns and document in --misses")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of earlier runs' JSON files instead")
    ap.add_argument("--replay", nargs="+", metavar="DIR", type=Path,
                    help="diagnose the windows kept in DIR again with the current analyzer (those of --shapes and "
                         "--faults); print their table (and save their runs with --json)")
    ap.add_argument("--healthy-from", nargs="+", default=[], metavar="JSON",
                    help="earlier batches (this machine's) whose healthy runs scale this one's faults, as if run first")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="a loaded machine: N busy processes beside the jobs, on and off at random (see neighbours)")
    args = ap.parse_args(argv)
    if missing := [f for f in [*(args.table or []), *args.healthy_from] if not Path(f).is_file()]:
        print(f"bench_accuracy: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.table:
        print(table(summarize(of_set(merged(args.table), args.held_out))))
        return 0
    if args.replay:
        missing = [str(d) for d in args.replay if not d.is_dir()]
        if missing:
            print(f"bench_accuracy: no such folder: {', '.join(missing)}", file=sys.stderr)
            return 2
        wanted_shapes, wanted_faults = set(args.shapes.split(",")), set(args.faults.split(","))
        runs = in_matrix_order([r for r in of_set(replay(args.replay), args.held_out)
                                if r.shape in wanted_shapes and r.fault in wanted_faults])
        if args.json:  # a matrix of the current analyzer from windows captured earlier: it merges with live batches
            shapes = [s for s in SHAPES if any(r.shape == s.name for r in runs)]
            save(Path(args.json), shapes, runs, code_version(), replayed=[str(d) for d in args.replay])
        print(table(summarize(runs)))
        return 0
    if os.geteuid() != 0:
        print("bench_accuracy: needs root (eBPF)", file=sys.stderr)
        return 2
    # Stopped with SIGTERM, the cleanups still run: a hog pinned at nice -5 left behind ran for 18 minutes
    # under the next matrix.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    shapes = selected(args.shapes, args.held_out)
    faults = [f for f in FAULTS if f.name in args.faults.split(",")]
    results = Path(args.json) if args.json else args.out / "accuracy-results.json"
    misses = Evidence(Path(args.misses) if args.misses else args.out / "accuracy-misses", args.keep_all)
    results.parent.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    references = References.of(merged(args.healthy_from) if args.healthy_from else [])
    code = code_version()  # once, at the start: the checkout may change under a long matrix
    with tempfile.TemporaryDirectory(prefix="rankscope-accuracy-") as tmp, neighbours(args.load):
        for repeat in range(args.repeats):
            for shape in shapes:
                # The healthy run comes first: its step time scales the faults and is the cost's reference.
                for fault in sorted(filter(shape.takes, faults), key=lambda f: f.name != "healthy"):
                    try:
                        case = run_case(shape, fault, Path(tmp), references.step(shape.name),
                                        misses, args.windows,
                                        references.pace(shape.name))
                    except Exception as e:  # noqa: BLE001  (a case that could not run is reported, not fatal)
                        case = [Run(shape.name, fault.name, False, [], [], error=f"{type(e).__name__}: {e}"[:300])]
                    for run in case:
                        run.cores = os.cpu_count() or run.cores
                        references.add(run)
                        runs.append(run)
                        log(f"{repeat + 1}/{args.repeats} {shape.name} {fault.name}: "
                            f"{'right' if run.right else 'WRONG'} {run.findings or '-'} step {run.step_s} vs "
                            f"{run.truth_step_s} cost {run.cost} vs {run.truth_cost} {run.error}")
                    save(results, shapes, runs, code)
    print(table(summarize(runs)))
    return 0


@dataclass
class References:
    """shape -> its healthy runs' steps, and their link paces (Run.links_Bps): what a batch's faults are scaled
    to, the batch's own healthy runs added as they come. From earlier batches on this machine (--healthy-from),
    a batch without the healthy case still scales its faults to the shape's step: a regression's delay on a
    guessed 50 ms step was a third of lm-2's step on one machine and 7% of its 175 ms on a slower one, where the
    agent missed it."""

    steps: dict[str, list[float]] = field(default_factory=dict)
    paces: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, runs: list[Run]) -> References:
        refs = cls()
        for run in runs:
            refs.add(run)
        return refs

    def add(self, run: Run) -> None:
        """A healthy run's figures (any other run's are no reference)."""
        if run.fault == "healthy" and run.truth_step_s:
            self.steps.setdefault(run.shape, []).append(run.truth_step_s)
        if run.fault == "healthy" and run.links_Bps:
            self.paces.setdefault(run.shape, []).append(run.links_Bps)

    def step(self, shape: str) -> float | None:
        return statistics.median(self.steps[shape]) if self.steps.get(shape) else None

    def pace(self, shape: str) -> float | None:
        return statistics.median(self.paces[shape]) if self.paces.get(shape) else None


def code_version() -> str:
    """What decided these verdicts: the git trees of rankscope/ (probes to analysis) and tests/jobs/ (the jobs and
    their injected faults), "+dirty" if either differs from HEAD. A tree's hash moves only when a file under it
    does, so batches run sessions apart, with only docs committed between, merge into one matrix (--table)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    try:
        trees = [git("rev-parse", "--short=10", f"HEAD:{tree}").strip() for tree in ("rankscope", "tests/jobs")]
        dirty = git("status", "--porcelain", "--", "rankscope", "tests/jobs").strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"  # not a git checkout: the version cannot be told
    return "-".join(trees) + ("+dirty" if dirty else "")


def merged(paths: list[str]) -> list[Run]:
    """Earlier batches' runs, for one table, in the matrix's order of shapes and faults (a batch's cases beside
    the same shape's of another batch); one that mixes code versions says so (its rows are not one matrix)."""
    saved = [json.loads(Path(p).read_text()) for p in paths]
    versions = sorted({s.get("code", "unknown") for s in saved})
    if len(versions) > 1:
        print(f"bench_accuracy: these batches ran on {len(versions)} code versions: {', '.join(versions)}",
              file=sys.stderr)
    return in_matrix_order([Run.of(r) for s in saved for r in s["runs"]])


def in_matrix_order(runs: list[Run]) -> list[Run]:
    """Runs of several batches or folders sorted in the matrix's order of shapes and faults (stable)."""
    shapes = {s.name: i for i, s in enumerate(SHAPES)}
    faults = {f.name: i for i, f in enumerate(FAULTS)}
    return sorted(runs, key=lambda r: (shapes.get(r.shape, len(shapes)), faults.get(r.fault, len(faults))))


def save(path: Path, shapes: list[Shape], runs: list[Run], code: str, replayed: list[str] | None = None) -> None:
    """The results so far (rewritten after every case: a matrix cut short keeps what it measured). `replayed`:
    the kept folders a replay diagnosed again; `code` is then the analyzer's that decided the verdicts, while
    the windows' patterns came from the probes and jobs of the batches that kept them."""
    doc = {"code": code, "shapes": [asdict(s) for s in shapes], "rows": summarize(runs),
           "runs": [asdict(r) | {k: getattr(r, k) for k in DERIVED} for r in runs]}
    path.write_text(json.dumps(doc | ({"replayed": replayed} if replayed else {}), indent=1))


if __name__ == "__main__":
    sys.exit(main())
