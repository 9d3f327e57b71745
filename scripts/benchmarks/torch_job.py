"""torch (1a): step time of the real torch DDP job (tests/torch_ddp_train.py) with the agent attached to its
running ranks, light and deep mode."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from rankscope.sim.harness import free_port, wait_until

from .harness import DETAILS, AgentProc, BenchError, Context, Row, cpu_ns, slowdown_rows, slowdown_series

TORCH_SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "torch_ddp_train.py"


class TorchJob:
    """tests/torch_ddp_train.py under torchrun (gloo, CPU), running until stopped; ranks report their steps."""

    def __init__(self, ctx: Context, ranks: int):
        self.dir = ctx.tmp / f"torch-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        self.ranks = ranks
        self.log = open(self.dir / "torchrun.log", "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
             str(free_port()), str(TORCH_SCRIPT), "--report", str(self.dir / "r{rank}.json")],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def reports(self) -> list[dict] | None:
        out = []
        for r in range(self.ranks):
            try:
                out.append(json.loads((self.dir / f"r{r}.json").read_text()))
            except (OSError, ValueError):
                return None
        return out

    def pids(self) -> list[int]:
        def ready():
            if self.proc.poll() is not None:
                raise BenchError(f"torchrun exited with {self.proc.returncode}: "
                                 f"{(self.dir / 'torchrun.log').read_text(errors='replace')[-2000:]}")
            return self.reports()
        return [d["pid"] for d in wait_until(ready, 180, "the torch ranks' first steps", interval=0.2)]

    def steps_within(self, start: float, end: float) -> list[list[float]]:
        """Per rank, the durations of its steps that started and ended within [start, end] (unix s)."""
        docs = wait_until(lambda: (d := self.reports()) and all(x["written"] > end for x in d) and d, 30,
                          "the torch ranks' reports")
        return [[dur for s, dur in d["recent"] if start <= s and s + dur <= end] for d in docs]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()


def median_step(steps_per_rank: list[list[float]]) -> float:
    """Mean over ranks of the median duration of each rank's steps."""
    for rank, steps in enumerate(steps_per_rank):
        if len(steps) < 10:
            raise BenchError(f"rank {rank} reported {len(steps)} steps in the measured interval")
    return statistics.fmean(statistics.median(steps) for steps in steps_per_rank)


def run(ctx: Context) -> tuple[list[Row], dict]:
    """The real torch DDP job: a fresh 4-rank job per phase; the agent attaches to the running ranks; step times
    from the ranks' own reports over the same interval of each phase (from SETTLE s after the first steps)."""
    ranks = 2 if ctx.quick else 4  # quick: the smoke test; two ranks start sooner
    settle, measure = (2.0, 3.0) if ctx.quick else (8.0, 15.0)

    def phase(detail: str | None) -> dict[str, float]:
        job = TorchJob(ctx, ranks)
        try:
            pids = job.pids()
            first = time.time()
            agent = AgentProc(ctx, pids, window=5, detail=detail) if detail else None
            try:
                start = max(first + settle, time.time() + 0.5)
                time.sleep(start - time.time())
                cpu_start = sum(cpu_ns(p) for p in pids)
                time.sleep(measure)
                cpu_s = (sum(cpu_ns(p) for p in pids) - cpu_start) / 1e9
                end = start + measure
                steps = job.steps_within(start, end)
                return {"step_s": median_step(steps), "cpu_s_per_step": cpu_s / sum(map(len, steps))}
            finally:
                if agent:
                    agent.stop()
        finally:
            job.stop()

    # Quick (the smoke test): light mode only, each phase being a fresh torch job; deep runs in `job` and `trace`.
    series = slowdown_series("torch", 1 if ctx.quick else 3, phase, DETAILS[:1] if ctx.quick else DETAILS)
    details = {"ranks": ranks, "levels": series, "settle_s": settle, "measured_s": measure,
               "agent": "rankscope agent --pid --detail LEVEL (window 5 s)",
               "method": "tests/torch_ddp_train.py (gloo, CPU) under torchrun; the agent attaches to the running "
                         "ranks; steps starting in the same interval of each phase, from the ranks' own reports"}
    return slowdown_rows("torch", f"torch DDP job ({ranks} ranks)", series), details
