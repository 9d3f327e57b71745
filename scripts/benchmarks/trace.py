"""trace: what a running trace capture costs the traced job, and its size. The simulated 4-rank GPU job runs
with the agent attached (light, then deep mode); phases of PHASE_S alternate without (A) and with (B) a
capture of every rank running (GET /v1/trace?seconds=PHASE_S), A B B A ...: the step-time ratio of each pair
is the capture's cost alone (the agent is attached in both). The captures' files give the events and JSON
bytes a second a rank."""
from __future__ import annotations

import io
import json
import time
import urllib.request
import zipfile

from rankscope.sim.harness import wait_until

from .harness import (DETAILS, AgentProc, BenchError, Context, Row, abba, log, median, pair_ratios, row,
                      spread)

RANKS = 4


def _step_ends(truth, rank: int) -> list[float]:
    try:
        return json.loads((truth / f"r{rank}.json").read_text())["ends"]
    except (OSError, ValueError, KeyError):  # not written yet
        return []


def _step_time(truth, start: float, end: float) -> float:
    """The job's own mean step time over [start, end] (unix s), over its ranks, from their step logs."""
    wait_until(lambda: all(max(_step_ends(truth, r), default=0) > end for r in range(RANKS)), 30,
               "the ranks' step logs", interval=0.1)
    spans = []
    for r in range(RANKS):
        ends = [t for t in _step_ends(truth, r) if start <= t <= end]
        if len(ends) < 2:
            raise BenchError(f"rank {r} logged {len(ends)} steps in a phase")
        spans.append((ends[-1] - ends[0]) / (len(ends) - 1))
    return sum(spans) / len(spans)


def _capture(agent: AgentProc, seconds: float) -> list[dict]:
    """Every rank's trace of one capture by the agent."""
    with urllib.request.urlopen(f"{agent.url}/v1/trace?seconds={seconds:g}", timeout=seconds + 60) as r:
        body = r.read()
    with zipfile.ZipFile(io.BytesIO(body)) as z:
        return [{"bytes": len(raw), "doc": json.loads(raw)} for raw in (z.read(n) for n in z.namelist())]


def run(ctx: Context) -> tuple[list[Row], dict]:
    from rankscope.sim.job import start_job

    phase_s = 2.0 if ctx.quick else 6.0
    pairs_per_level = 1 if ctx.quick else 4
    truth = ctx.tmp / "trace-truth"
    truth.mkdir()
    job = start_job(RANKS, truth_dir=truth, log_dir=ctx.tmp / "trace-logs")
    rows: list[Row] = []
    details: dict = {"ranks": RANKS, "phase_s": phase_s, "levels": {}}
    try:
        wait_until(lambda: all(len(_step_ends(truth, r)) >= 20 for r in range(RANKS)), 120, "the job's first steps")
        for level in DETAILS:
            order = abba(pairs_per_level)
            steps, sizes = [], []
            with AgentProc(ctx, job.pids, window=5, detail=level) as agent:
                wait_until(lambda: len(agent.get("/v1/diagnosis").get("ranks", [])) == RANKS, 60,
                           "the agent's first window", interval=0.2)
                for i, p in enumerate(order):
                    start = time.time()
                    if p == "B":
                        sizes += _capture(agent, phase_s)
                    else:
                        time.sleep(phase_s)  # the phase itself: the job runs, nothing else happens
                    steps.append(_step_time(truth, start, time.time()))
                    log(f"trace: {level}: phase {i + 1}/{len(order)} {p}: step {steps[-1] * 1e3:.3f} ms")
            slowdown = [(r - 1) * 100 for r in pair_ratios(order, steps)]
            seconds = sum(s["doc"]["rankscope"]["seconds"] for s in sizes)
            events = sum(sum(e["ph"] != "M" for e in s["doc"]["traceEvents"]) for s in sizes) / seconds
            kb = sum(s["bytes"] for s in sizes) / seconds / 1e3
            lost = sum(s["doc"]["rankscope"]["dropped_events"] + s["doc"]["rankscope"]["truncated_events"]
                       for s in sizes)
            details["levels"][level] = {"order": order, "step_s": steps, "pair_slowdown_pct": slowdown,
                                        "events_per_rank_s": events, "kb_per_rank_s": kb, "lost_events": lost}
            rows += [row("trace", f"sim job ({RANKS} ranks) slowdown while a capture runs, agent {level} mode",
                         median(slowdown), "%", note=spread(slowdown)),
                     row("trace", f"capture size a rank, agent {level} mode", events, "events/s",
                         note=f"{kb:.0f} KB/s of JSON; {lost} events lost")]
        rows.append(row("trace", f"sim job ({RANKS} ranks) median step, agent attached, no capture",
                        median([s for level in details["levels"].values()
                                for s, p in zip(level["step_s"], level["order"]) if p == "A"]) * 1e3, "ms"))
    finally:
        job.stop()
    return rows, details
