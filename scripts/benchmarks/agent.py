"""agent (3): the agent's own CPU share of one core and its peak RSS while watching 8 ranks: the node's first
agent, which compiles its BPF programs, then one that finds them compiled (loader/bpf_cache.py)."""
from __future__ import annotations

import statistics
import time

from rankscope.sim.harness import wait_until

from .harness import AgentProc, BenchError, Context, Row, cpu_ns, cpu_ticks_s, row, start_held_job, status_kb


def aligned_share(samples: list[tuple[float, int]]) -> tuple[float, float, int]:
    """CPU share over a whole number of agent windows: from the start of the first burst of CPU (a window
    closing) to the start of the last one. (share, seconds spanned, windows); the whole span without bursts.
    A burst is a sample interval using clearly more CPU than the agent's baseline between windows."""
    steps = [b[1] - a[1] for a, b in zip(samples, samples[1:])]
    threshold = max(200_000, 4 * statistics.median(steps) + 100_000) if steps else 0
    starts = [i for i in range(len(steps)) if steps[i] > threshold and (i == 0 or steps[i - 1] <= threshold)]
    if len(starts) >= 2:
        a, b = samples[starts[0]], samples[starts[-1]]
        windows = len(starts) - 1
    else:
        a, b = samples[0], samples[-1]
        windows = 0
    span = b[0] - a[0]
    return (b[1] - a[1]) / 1e9 / span, span, windows


def run(ctx: Context) -> tuple[list[Row], dict]:
    ranks = 2 if ctx.quick else 8
    window = 1.0 if ctx.quick else 5.0
    duration = 3.0 if ctx.quick else 12.0
    job, hold = start_held_job(ranks, ctx.tmp)
    cache = ctx.tmp / "agent-bpf-cache"  # empty: the first agent compiles its programs, the second finds them
    try:
        hold.touch()
        with AgentProc(ctx, job.pids, window, bpf_cache=cache) as agent:
            wait_until(lambda: agent.get("/v1/diagnosis")["window"]["end"], window * 4 + 30, "the first window",
                       interval=0.5)
            compiling_hwm_mb = status_kb(agent.pid, "VmHWM") / 1024
        with AgentProc(ctx, job.pids, window, bpf_cache=cache) as agent:
            wait_until(lambda: agent.get("/v1/diagnosis")["window"]["end"], window * 4 + 30, "the first window",
                       interval=0.5)
            time.sleep(1.0)
            samples = []
            t0, ticks0 = time.monotonic(), cpu_ticks_s(agent.pid)
            while time.monotonic() - t0 < duration:
                samples.append((time.monotonic(), cpu_ns(agent.pid)))
                time.sleep(0.02)
            ticks_share = (cpu_ticks_s(agent.pid) - ticks0) / (time.monotonic() - t0)
            hwm_mb, rss_mb = status_kb(agent.pid, "VmHWM") / 1024, status_kb(agent.pid, "VmRSS") / 1024
            rss_parts = {k: status_kb(agent.pid, k) / 1024 for k in ("RssAnon", "RssFile", "RssShmem")}
            targets = agent.get("/v1/targets")["targets"]
            running = sum(t["state"] == "running" for t in targets)
            if running != ranks:
                raise BenchError(f"the agent watches {running} running ranks, expected {ranks}")
    finally:
        job.stop()
    share, span, windows = aligned_share(samples)
    whole = (samples[-1][1] - samples[0][1]) / 1e9 / (samples[-1][0] - samples[0][0])
    details = {"ranks": ranks, "window_s": window, "measured_s": duration, "aligned_span_s": span,
               "aligned_windows": windows, "cpu_share_whole_span_pct": whole * 100,
               "cpu_share_utime_stime_pct": ticks_share * 100, "vm_rss_mb": rss_mb, "vm_hwm_mb": hwm_mb,
               "vm_hwm_mb_compiling": compiling_hwm_mb,
               "rss_mb_by_kind": rss_parts,
               "method": "on-CPU ns of all agent threads (/proc/PID/task/*/schedstat) sampled every 20 ms; share "
                         "over a whole number of windows (first to last burst of window processing)"}
    return [row("agent", f"agent CPU, share of one core ({ranks} ranks, window {window:g} s)", share * 100, "%", 1.0),
            row("agent", "agent peak RSS (VmHWM), its programs from the node's cache", hwm_mb, "MB", 150,
                f"anon {rss_parts['RssAnon']:.0f} MB + file-backed {rss_parts['RssFile']:.0f} MB now"),
            row("agent", "agent peak RSS (VmHWM), compiling its programs (a node's first agent)", compiling_hwm_mb,
                "MB"),
            row("agent", "agent RSS at steady state (VmRSS)", rss_mb, "MB")], details
