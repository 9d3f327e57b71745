"""A small real PyTorch DDP job (gloo, CPU) for rankscope's tests, with faults injected on one chosen rank.

Start it with torchrun, e.g.
    python -m torch.distributed.run --nproc-per-node 3 tests/torch_ddp_train.py --report /tmp/r{rank}.json

Each rank trains a tiny MLP on synthetic batches read through a real DataLoader (num_workers=0), with
loss.backward() (DDP all-reduces the gradients through gloo) and optimizer.step(), on one thread. Reading a
batch takes --read-ms (default 6 ms, a sleep: storage latency) on every rank, so that three ranks leave room
on two shared cores and steps stay regular (~10 ms): a CPU-bound loop would measure the scheduler's noise.

Faults (also from the environment: TORCH_DDP_SLEEP_BEFORE_FORWARD=RANK:SECONDS, ...), each on one rank (or on
every rank with RANK *). A SECONDS fault given as RANK:SECONDS@PATH applies only while the file PATH exists, and
a hang's WHEN may be a path too: one running job serves several faults in turn, switched by a test.
  --sleep-before-forward RANK:SECONDS   the rank sleeps before every forward pass (compute straggler)
  --busy-before-forward RANK:SECONDS    the rank computes (spins) that long before every forward pass
  --slow-loader RANK:SECONDS            the rank's dataset sleeps in __getitem__, once per batch (input straggler)
  --stop-before-collective RANK:WHEN    at that step (for good) or, WHEN a path, while that file exists, the
                                        rank blocks in hang_before_collective(), before backward and its
                                        all-reduce (a hang)
  --sleep-in-loop RANK:WHEN             ...or sleeps in main's loop itself, before backward (a hang whose
                                        Python frame is the training loop)
  --spin-in-loop RANK:WHEN              ...or computes there, in pure Python (busy on a CPU)
  --report PATH                         the rank's own step times as JSON ("{rank}" in PATH: one file per rank,
                                        else rank 0 only), rewritten every half second and at a normal end
  --read-ms MS                          every rank's batch read time (default 6)
  --steps N                             stop after N steps (default: run until killed)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

FEATURES, HIDDEN, BATCH = 32, 64, 32
REPORT_EVERY_S = 0.5
KEEP_STEPS = 4096  # step records in the report: more than a few seconds of steps
SPIN_CHECK_EVERY = 1_000_000  # a spinning rank's iterations between two looks at its switch (~30 ms)


EVERY_RANK = -1


@dataclass(frozen=True)
class Fault:
    rank: int  # EVERY_RANK for all
    value: float | int | str  # seconds, or a hang's step or path
    switch: str | None = None  # a path: the fault applies only while that file exists


def rank_fault(spec: str | None, cast) -> Fault | None:
    """'RANK:VALUE[@PATH]' -> Fault, RANK * for every rank; None when unset."""
    if not spec:
        return None
    rank, sep, value = spec.partition(":")
    if not sep:
        raise SystemExit(f"torch_ddp_train: bad fault {spec!r}: expected RANK:VALUE")
    value, _, switch = value.partition("@")
    return Fault(EVERY_RANK if rank == "*" else int(rank), cast(value), switch or None)


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleep-before-forward", default=env("TORCH_DDP_SLEEP_BEFORE_FORWARD"), metavar="RANK:SECONDS")
    ap.add_argument("--busy-before-forward", default=env("TORCH_DDP_BUSY_BEFORE_FORWARD"), metavar="RANK:SECONDS")
    ap.add_argument("--slow-loader", default=env("TORCH_DDP_SLOW_LOADER"), metavar="RANK:SECONDS")
    ap.add_argument("--stop-before-collective", default=env("TORCH_DDP_STOP_BEFORE_COLLECTIVE"), metavar="RANK:STEP")
    ap.add_argument("--sleep-in-loop", default=env("TORCH_DDP_SLEEP_IN_LOOP"), metavar="RANK:WHEN")
    ap.add_argument("--spin-in-loop", default=env("TORCH_DDP_SPIN_IN_LOOP"), metavar="RANK:WHEN")
    ap.add_argument("--report", default=env("TORCH_DDP_REPORT"), metavar="PATH")
    ap.add_argument("--read-ms", type=float, default=float(env("TORCH_DDP_READ_MS", "6")),
                    help="every rank's simulated storage latency per batch (keeps the 2-core CPU from saturating)")
    ap.add_argument("--steps", type=int, default=int(env("TORCH_DDP_STEPS", "0")), help="0: until killed")
    args = ap.parse_args(argv)
    args.sleep_before_forward = rank_fault(args.sleep_before_forward, float)
    args.busy_before_forward = rank_fault(args.busy_before_forward, float)
    args.slow_loader = rank_fault(args.slow_loader, float)
    args.stop_before_collective = rank_fault(args.stop_before_collective, step_or_path)
    args.sleep_in_loop = rank_fault(args.sleep_in_loop, step_or_path)
    args.spin_in_loop = rank_fault(args.spin_in_loop, step_or_path)
    return args


def step_or_path(value: str) -> int | str:
    return int(value) if value.isdigit() else value


def due(when: int | str | None, step: int) -> bool:
    """Whether a hang given as a step (that step's, for good), or a file's path (while the file exists), is
    due now."""
    return when == step if isinstance(when, int) else when is not None and os.path.exists(when)


def on_rank(fault: Fault | None, rank: int):
    """The fault's value when it applies to `rank` now (its switch, if any, on), else None."""
    if fault is None or fault.rank not in (rank, EVERY_RANK):
        return None
    return fault.value if fault.switch is None or os.path.exists(fault.switch) else None


class SyntheticBatches(Dataset):
    """Index i is batch i (the DataLoader runs with batch_size=None): deterministic random features, a linear
    target. Reading one takes `delay` seconds, slept inside __getitem__ (storage latency; more on a slow
    input pipeline)."""

    def __init__(self, seed: int, delay: Callable[[], float]):
        self.seed = seed
        self.delay = delay
        self.weights = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return 1 << 40  # effectively endless

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if delay := self.delay():
            time.sleep(delay)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(BATCH, FEATURES, generator=g)
        return x, x @ self.weights


def sleep_before_forward(seconds: float) -> None:
    """The injected compute straggler: this rank starts every forward pass late; its peers wait for it."""
    time.sleep(seconds)


def busy_before_forward(seconds: float) -> None:
    """The injected CPU straggler: this rank computes longer than its peers every step (on the CPU, so a
    CPU taken by another task would stretch it further)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def hang_before_collective(step: int, when: int | str) -> None:
    """The injected hang: this rank does not reach its all-reduce while due; its peers wait there."""
    print(f"torch_ddp_train: rank {dist.get_rank()} stops before the collective of step {step}",
          file=sys.stderr, flush=True)
    while due(when, step):
        time.sleep(0.2)


class Report:
    """The rank's own measurement: each step's start, its duration (start to the next step's start) and when
    its gradients' all-reduce was done (backward returned), which lines the steps up with observed collectives."""

    def __init__(self, path: str | None, rank: int):
        if path and "{rank}" not in path and rank != 0:
            path = None
        self.path = path.replace("{rank}", str(rank)) if path else None
        self.rank = rank
        self.steps: deque[tuple[float, float, float]] = deque(maxlen=KEEP_STEPS)
        self.count = 0
        self._written = 0.0

    def step(self, start: float, duration: float, reduced: float) -> None:
        self.steps.append((start, duration, reduced))
        self.count += 1
        if self.path and time.time() - self._written >= REPORT_EVERY_S:
            self.write()

    def write(self) -> None:
        if not self.path:
            return
        durations = [d for _, d, _ in self.steps]
        doc = {"rank": self.rank, "pid": os.getpid(), "steps": self.count, "written": time.time(),
               "median_step_s": statistics.median(durations) if durations else None,
               "recent": [[round(s, 6), round(d, 7)] for s, d, _ in self.steps],  # [unix start, duration]
               "reduced": [round(r, 6) for _, _, r in self.steps]}  # per step: unix time its all-reduce was done
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(doc))  # encoded in C, not chunk by chunk in Python: see rankscope/sim/steplog.py
        os.replace(tmp, self.path)  # readers never see half a file
        self._written = time.time()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    model = DistributedDataParallel(nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                                                  nn.ReLU(), nn.Linear(HIDDEN, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    batches = SyntheticBatches(rank, lambda: args.read_ms / 1e3 + (on_rank(args.slow_loader, rank) or 0.0))
    loader = DataLoader(batches, batch_size=None, num_workers=0)  # batch_size=None: i is a batch
    stop_at = on_rank(args.stop_before_collective, rank)
    sleep_at = on_rank(args.sleep_in_loop, rank)
    spin_at = on_rank(args.spin_in_loop, rank)
    report = Report(args.report, rank)

    step = 0
    last_start = reduced = None
    try:
        for x, y in loader:
            start = time.time()
            if last_start is not None:
                report.step(last_start, start - last_start, reduced)
            last_start = start
            if args.steps and step >= args.steps:
                break
            if straggle_s := on_rank(args.sleep_before_forward, rank):
                sleep_before_forward(straggle_s)
            if busy_s := on_rank(args.busy_before_forward, rank):
                busy_before_forward(busy_s)
            loss = loss_fn(model(x), y)
            if due(stop_at, step):
                hang_before_collective(step, stop_at)
            sleeps, spins = due(sleep_at, step), due(spin_at, step)
            if sleeps or spins:  # inline, so that the rank's Python frame is this loop's
                print(f"torch_ddp_train: rank {rank} {'sleeps' if sleeps else 'spins'} in its loop at step {step}",
                      file=sys.stderr, flush=True)
                report.write()
                while sleeps:
                    time.sleep(0.2)
                    sleeps = due(sleep_at, step)
                while spins:  # pure Python in this frame; its switch looked at between runs of iterations
                    for _ in range(SPIN_CHECK_EVERY):
                        pass
                    spins = due(spin_at, step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP's hooks all-reduce the gradients (gloo) and wait for them
            reduced = time.time()
            optimizer.step()
            step += 1
    finally:
        report.write()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
