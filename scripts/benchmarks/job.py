"""job (1b): step time of the simulated 4-rank GPU job, the agent attached in light and in deep mode."""
from __future__ import annotations

import statistics

from .harness import AgentProc, BenchError, Context, Row, expect_armed, slowdown_rows, slowdown_series, start_held_job


def job_phase(ctx: Context, ranks: int, steps: int, detail: str | None) -> float:
    """Mean over ranks of each rank's median step time, the agent (at `detail`) attached before the first
    step, or no agent (None)."""
    job, hold = start_held_job(ranks, ctx.tmp, steps=steps)
    try:
        agent = AgentProc(ctx, job.pids, window=5, detail=detail) if detail else None
        try:
            expect_armed(job.pids, "libcuda.so.1", "cuStreamSynchronize", agent is not None)
            hold.touch()
            job.wait(timeout=steps * 1.0 + 120)
            times = job.step_times()
        finally:
            if agent:
                agent.stop()
        codes = job.returncodes()
        if any(codes) or None in times:
            raise BenchError(f"ranks exited with {codes}: {job.errors(0)[-500:]}")
    finally:
        job.stop()
    return statistics.fmean(times)


def run(ctx: Context) -> tuple[list[Row], dict]:
    ranks = 4
    steps = 30 if ctx.quick else 300
    series = slowdown_series("job", 1 if ctx.quick else 3,
                             lambda detail: {"step_s": job_phase(ctx, ranks, steps, detail)})
    details = {"ranks": ranks, "steps_per_phase": steps, "agent": "rankscope agent --pid --detail LEVEL (window 5 s)",
               "levels": series}
    return slowdown_rows("job", f"sim job ({ranks} ranks)", series), details
