"""trace: what a running trace capture costs the traced job, and its size. The simulated 4-rank GPU job runs
with the agent attached (light, then deep mode); phases of PHASE_S alternate without (A) and with (B) a
capture of every rank running (GET /v1/trace?seconds=PHASE_S), A B B A ...: the step-time ratio of each pair
is the capture's cost alone (the agent is attached in both), and so is the pair's ratio of the ranks' on-CPU
time per step (the handlers' ring-buffer writes are charged to the job's threads; it moves less with a busy
machine's load than wall time does). The captures' files give the events and JSON bytes a second a rank."""
from __future__ import annotations

import io
import json
import threading
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor

from rankscope.sim.harness import wait_until

from .harness import (DETAILS, AgentProc, BenchError, Context, Row, Storm, abba, cpu_ns, log, median, pair_diffs,
                      pair_ratios, row, spread)

RANKS = 4
SPIN = 2_000  # busy-work units (~1 ns each) between two launches of the per-event storm: ~300,000 launches/s, so
# the uprobe program's 2 MiB stream (read every 50 ms) never fills


def _step_ends(truth, rank: int) -> list[float]:
    try:
        return json.loads((truth / f"r{rank}.json").read_text())["ends"]
    except (OSError, ValueError, KeyError):  # not written yet
        return []


def _steps(truth, start: float, end: float) -> tuple[float, int]:
    """The job's own mean step time over [start, end] (unix s), over its ranks, and the steps its ranks ended
    in it, from their step logs."""
    wait_until(lambda: all(max(_step_ends(truth, r), default=0) > end for r in range(RANKS)), 30,
               "the ranks' step logs", interval=0.1)
    spans, count = [], 0
    for r in range(RANKS):
        ends = [t for t in _step_ends(truth, r) if start <= t <= end]
        if len(ends) < 2:
            raise BenchError(f"rank {r} logged {len(ends)} steps in a phase")
        spans.append((ends[-1] - ends[0]) / (len(ends) - 1))
        count += len(ends)
    return sum(spans) / len(spans), count


def _capture(agent: AgentProc, seconds: float) -> list[dict]:
    """Every rank's trace of one capture by the agent."""
    with urllib.request.urlopen(f"{agent.url}/v1/trace?seconds={seconds:g}", timeout=seconds + 60) as r:
        body = r.read()
    with zipfile.ZipFile(io.BytesIO(body)) as z:
        return [{"bytes": len(raw), "doc": json.loads(raw)} for raw in (z.read(n) for n in z.namelist())]


def per_event(ctx: Context) -> dict:
    """CPU ns a traced event adds to the call that emits it: the launch storm (bench_storm.c) paced by SPIN,
    watched in deep detail (each cuLaunchKernel probed), without (A) and with (B) a capture running,
    A B B A ...; in B every launch is an event (an instant) of the capture."""
    from rankscope.agent.detail import LEVELS
    from rankscope.agent.session import Session
    from rankscope.agent.trace_capture import capture

    n = 20_000 if ctx.quick else 400_000
    order = abba(1 if ctx.quick else 4)
    cpu, events, lost = [], [], []
    with Storm(ctx, "launch", str(ctx.libs / "libcuda.so.1")) as storm:
        pid, = storm.pids
        session = Session(detail=LEVELS["deep"])
        try:
            session.add(pid)
            session.window()
            storm.run("work", n // 10, SPIN)  # warm-up
            for i, phase in enumerate(order):
                if phase == "A":
                    cpu.append(storm.run("work", n, SPIN)[1] / n)
                else:
                    stop = threading.Event()
                    with ThreadPoolExecutor(1) as pool:
                        capturing = pool.submit(capture, session.trace_streams(), [pid], 60, stop)
                        wait_until(lambda: all(s.running for s in session.trace_streams()) or capturing.done(), 30,
                                   "the capture to start", interval=0.01)
                        cpu.append(storm.run("work", n, SPIN)[1] / n)
                        stop.set()
                        cap = capturing.result()
                    events.append(len(cap.events[pid]) / n)
                    lost.append(cap.lost)
                log(f"trace: per event: phase {i + 1}/{len(order)} {phase}: {cpu[-1]:.0f} CPU ns a launch")
        finally:
            session.close()
    return {"launches_per_phase": n, "order": order, "cpu_ns_per_launch": cpu, "events_per_launch": events,
            "lost": lost, "added_ns": median(pair_diffs(order, cpu))}


def run(ctx: Context) -> tuple[list[Row], dict]:
    from rankscope.sim.job import start_job

    phase_s = 1.0 if ctx.quick else 3.0  # short phases, many pairs: a busy machine's load drifts over seconds
    pairs_per_level = 1 if ctx.quick else 8
    truth = ctx.tmp / "trace-truth"
    truth.mkdir()
    job = start_job(RANKS, truth_dir=truth, log_dir=ctx.tmp / "trace-logs")
    rows: list[Row] = []
    details: dict = {"ranks": RANKS, "phase_s": phase_s, "levels": {}}
    try:
        wait_until(lambda: all(len(_step_ends(truth, r)) >= 20 for r in range(RANKS)), 120, "the job's first steps")
        for level in DETAILS[:1] if ctx.quick else DETAILS:  # quick: the smoke test, one agent start
            order = abba(pairs_per_level)
            steps, cpu_steps, agent_cpu, sizes = [], [], [], []
            with AgentProc(ctx, job.pids, window=5, detail=level) as agent:
                wait_until(lambda: len(agent.get("/v1/diagnosis").get("ranks", [])) == RANKS, 60,
                           "the agent's first window", interval=0.2)
                for i, p in enumerate(order):
                    start, cpu, own = time.time(), sum(cpu_ns(pid) for pid in job.pids), cpu_ns(agent.pid)
                    if p == "B":
                        sizes += _capture(agent, phase_s)
                    else:
                        time.sleep(phase_s)  # the phase itself: the job runs, nothing else happens
                    cpu, end = sum(cpu_ns(pid) for pid in job.pids) - cpu, time.time()
                    agent_cpu.append((cpu_ns(agent.pid) - own) / 1e9 / (end - start))
                    step_s, count = _steps(truth, start, end)
                    steps.append(step_s)
                    cpu_steps.append(cpu / 1e9 / count)
                    log(f"trace: {level}: phase {i + 1}/{len(order)} {p}: step {step_s * 1e3:.3f} ms, "
                        f"{cpu_steps[-1] * 1e3:.3f} ms on CPU a rank-step")
            slowdown = [(r - 1) * 100 for r in pair_ratios(order, steps)]
            cpu_slowdown = [(r - 1) * 100 for r in pair_ratios(order, cpu_steps)]
            seconds = sum(s["doc"]["rankscope"]["seconds"] for s in sizes)
            events = sum(sum(e["ph"] != "M" for e in s["doc"]["traceEvents"]) for s in sizes) / seconds
            kb = sum(s["bytes"] for s in sizes) / seconds / 1e3
            lost = sum(s["doc"]["rankscope"]["dropped_events"] + s["doc"]["rankscope"]["truncated_events"]
                       for s in sizes)
            details["levels"][level] = {"order": order, "step_s": steps, "pair_slowdown_pct": slowdown,
                                        "cpu_s_per_rank_step": cpu_steps, "pair_cpu_pct": cpu_slowdown,
                                        "agent_core_share": agent_cpu,
                                        "events_per_rank_s": events, "kb_per_rank_s": kb, "lost_events": lost}
            rows += [row("trace", f"sim job ({RANKS} ranks) slowdown while a capture runs, agent {level} mode",
                         median(slowdown), "%", note=spread(slowdown)),
                     row("trace", f"sim job on-CPU time per rank-step while a capture runs, agent {level} mode",
                         median(cpu_slowdown), "%", note=spread(cpu_slowdown)),
                     row("trace", f"agent CPU share of one core capturing / not, {level} mode",
                         median([c for c, p in zip(agent_cpu, order) if p == "B"]) * 100, "%",
                         note=f"not capturing: {median([c for c, p in zip(agent_cpu, order) if p == 'A']) * 100:.1f} %"),
                     row("trace", f"capture size a rank, agent {level} mode", events, "events/s",
                         note=f"{kb:.0f} KB/s of JSON; {lost} events lost")]
        rows.append(row("trace", f"sim job ({RANKS} ranks) median step, agent attached, no capture",
                        median([s for level in details["levels"].values()
                                for s, p in zip(level["step_s"], level["order"]) if p == "A"]) * 1e3, "ms"))
    finally:
        job.stop()
    details["per_event"] = ev = per_event(ctx)
    rows.append(row("trace", "CPU ns a traced event adds to its call (probed cuLaunchKernel, deep mode)",
                    ev["added_ns"], "ns", note=f"{median(ev['events_per_launch']):.2f} events a launch captured, "
                                               f"{sum(ev['lost'])} lost"))
    return rows, details
