"""Start a test job (tests/jobs/*.py, or any torchrun script) under torchrun with faults injected, and read its
own step log: shared by the accuracy tests and scripts/bench_accuracy.py.

The job's code is left as written: inject/sitecustomize.py (on PYTHONPATH) records every optimizer step and
applies $RANKSCOPE_FAULT. Ranks are found as torchrun's children that map libtorch_cpu.so; each rank's pid
comes from its own step log.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.sim.harness import free_port, wait_until

JOBS = Path(__file__).resolve().parent
INJECT = JOBS / "inject"


@dataclass
class TorchrunJob:
    """A running torchrun job; `truth` holds one step log per rank (inject/sitecustomize.py)."""

    script: str
    ranks: int
    launcher: subprocess.Popen
    truth: Path
    log: Path
    run_id: str
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid

    def step_log(self, rank: int) -> dict | None:
        try:
            return json.loads((self.truth / f"r{rank}.json").read_text())
        except (OSError, ValueError):  # not written yet
            return None

    def steps_done(self) -> int:
        """The fewest steps any rank has logged (0 before every rank logged one)."""
        logs = [self.step_log(r) for r in range(self.ranks)]
        return min((d["steps"] for d in logs if d), default=0) if all(logs) else 0

    def step_ends(self, rank: int) -> list[float]:
        d = self.step_log(rank)
        return d["ends"] if d else []

    def step_time(self, start: float, end: float, rank: int | None = None) -> float | None:
        """The job's own step time over [start, end] (unix s): the mean duration of the steps that ended
        within it, as its log's ms/step prints it, over every rank (or one)."""
        spans = []
        for r in range(self.ranks) if rank is None else [rank]:
            ends = [t for t in self.step_ends(r) if start <= t <= end]
            if len(ends) >= 2:
                spans.append((ends[-1] - ends[0]) / (len(ends) - 1))
        return statistics.fmean(spans) if spans else None

    def wait_written(self, after: float, timeout: float = 30) -> None:
        """Until every running rank's log was rewritten after `after` (unix s)."""
        def fresh() -> bool:
            logs = [self.step_log(r) for r in range(self.ranks)]
            return all(d and d["written"] > after for d in logs)
        wait_until(fresh, timeout, "the ranks' step logs", interval=0.1)

    def go(self) -> float:
        """Starts the faults whose onset is `go` (inject/sitecustomize.py); returns when (unix s)."""
        (self.truth / "go").touch()
        return time.time()

    def alive(self) -> bool:
        return self.launcher.poll() is None

    def kill(self) -> None:
        """SIGKILL torchrun's process group and each rank's (torchrun starts every rank in its own session)."""
        for pid in (self.launcher.pid, *self.pids.values()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped rank must run to die of the group's SIGKILL
            except ProcessLookupError:
                pass
        self.launcher.wait()


def start(script: str, ranks: int, args: list[str], workdir: Path, fault: str = "",
          steady_steps: int = 20, timeout: float = 90, env: dict[str, str] | None = None) -> TorchrunJob:
    """Start `script` (a path, or a name in tests/jobs/) with `ranks` ranks under torchrun and wait until every
    rank has logged `steady_steps` steps. `fault`: $RANKSCOPE_FAULT for the ranks."""
    path = Path(script) if os.sep in script else JOBS / script
    run_id = f"{path.stem}-{secrets.token_hex(3)}"
    truth = workdir / run_id
    truth.mkdir(parents=True)
    log = workdir / f"{run_id}.log"
    child_env = dict(os.environ, **(env or {}))
    child_env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(INJECT), child_env.get("PYTHONPATH")])),
                     RANKSCOPE_TRUTH_DIR=str(truth), RANKSCOPE_FAULT=fault)
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
             "127.0.0.1", "--master-port", str(free_port()), "--rdzv-id", run_id, str(path), *args],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
    job = TorchrunJob(str(path), ranks, launcher, truth, log, run_id)
    try:
        def steady() -> bool:
            if launcher.poll() is not None:
                raise RuntimeError(f"torchrun exited {launcher.returncode}: {log.read_text(errors='replace')[-2000:]}")
            return job.steps_done() >= steady_steps
        wait_until(steady, timeout, f"every rank of {path.name} to log {steady_steps} steps", interval=0.2)
        job.pids = {r: job.step_log(r)["pid"] for r in range(ranks)}
    except BaseException:
        job.kill()
        raise
    return job


def pin(job: TorchrunJob, cpu_of_rank: dict[int, int]) -> None:
    """Pins every thread of each named rank (and its DataLoader workers' threads too: taskset -a on the rank
    only reaches its own threads) to one CPU."""
    for rank, cpu in cpu_of_rank.items():
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(job.pids[rank])], check=True,
                       capture_output=True)


def settle(job: TorchrunJob, seconds: float) -> None:
    """Let the job run `seconds` more (warm-up), failing early if it dies."""
    deadline = time.monotonic() + seconds
    wait_until(lambda: not job.alive() or time.monotonic() >= deadline, seconds + 5, "the warm-up", interval=0.2)
    if not job.alive():
        raise RuntimeError(f"{job.run_id} exited during warm-up: {job.log.read_text(errors='replace')[-2000:]}")


def until_watching(diagnose: subprocess.Popen) -> None:
    """Reads `rankscope diagnose`'s stderr (text) up to its line "rankscope: watching N processes of job J for
    D s": every rank is watched and the window is open from here on. Warnings may come before it."""
    seen = []
    while line := diagnose.stderr.readline():
        if "rankscope: watching" in line:
            return
        seen.append(line)
    raise AssertionError("diagnose ended before watching: " + "".join(seen))
