"""attach (#19): what `rankscope diagnose --pid <2 ranks> --duration 1` costs before its window opens:
attaching on its own, compiling its BPF programs with bcc (a node's first process); attaching on its own with
the programs compiled by an earlier process (loader/bpf_cache.py: every later one); and asking the node agent
that already watches the job (`--agent`). For each: seconds from start to its "watching" line (the window
open, or the agent's answer awaited), the process's CPU time and peak RSS (its rusage), and the whole run's
wall time. One run of each a round, alternating, on the simulated job."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rankscope.sim.harness import wait_until

from .harness import AgentProc, BenchError, Context, Row, cpu_ticks_s, median, row, start_held_job

DIAGNOSE = [sys.executable, "-m", "rankscope.agent.cli", "diagnose", "--duration", "1", "--json"]
WATCHING = "rankscope: "  # the first line diagnose prints on stderr, once its window opens or the agent is asked


def _diagnose(pids: list[int], cache: Path, *extra: str) -> dict[str, float]:
    """One `diagnose` run with compiled programs kept in `cache`: seconds to its first line, to its end, and
    its CPU seconds and peak RSS (MB)."""
    t = time.monotonic()
    proc = subprocess.Popen([*DIAGNOSE, "--pid", ",".join(map(str, pids)), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, RANKSCOPE_BPF_CACHE=str(cache)))
    first = first_cpu = None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if first is None and line.startswith(WATCHING):
            first, first_cpu = time.monotonic() - t, cpu_ticks_s(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or first is None:
        raise BenchError(f"diagnose {' '.join(extra)} exited {proc.returncode}: {''.join(lines)[-1000:]}")
    return {"first_line_s": first, "cpu_to_first_line_s": first_cpu, "wall_s": time.monotonic() - t,
            "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}


def run(ctx: Context) -> tuple[list[Row], dict]:
    rounds = 1 if ctx.quick else 3
    job, hold = start_held_job(2, ctx.tmp)
    runs: dict[str, list[dict[str, float]]] = {"compiling": [], "cached": [], "agent": []}
    cached = ctx.tmp / "attach-bpf-cache"
    try:
        hold.touch()
        with AgentProc(ctx, job.pids, window=1.0, bpf_cache=cached) as agent:
            wait_until(lambda: agent.get("/v1/targets").get("window_end"), 60, "the agent's first window")
            if not ctx.quick:  # diagnose's programs (deep detail) kept, as any earlier run keeps them
                _diagnose(job.pids, cached)
            for i in range(rounds):  # alternating: drift on the machine falls on each alike
                runs["compiling"].append(_diagnose(job.pids, ctx.tmp / f"attach-bpf-cache-{i}"))  # empty
                runs["cached"].append(_diagnose(job.pids, cached))
                runs["agent"].append(_diagnose(job.pids, cached, "--agent", agent.url))
    finally:
        job.stop()

    def med(mode: str, key: str) -> float:
        return median([r[key] for r in runs[mode]])

    rows = []
    for mode, how in (("compiling", "attaching itself, compiling"), ("cached", "attaching itself, programs cached"),
                      ("agent", "through the node agent (--agent)")):
        rows += [
            row("attach", f"diagnose {how}: seconds to its window (first line)", med(mode, "first_line_s"), "s", 2.0),
            row("attach", f"diagnose {how}: CPU seconds to its window (imports and attach)",
                med(mode, "cpu_to_first_line_s"), "s", 1.0),
            row("attach", f"diagnose {how}: CPU seconds (whole run, 1 s window)", med(mode, "cpu_s"), "s"),
            row("attach", f"diagnose {how}: peak RSS", med(mode, "peak_rss_mb"), "MB", 150.0,
                f"whole run {med(mode, 'wall_s'):.1f} s"),
        ]
    return rows, {"rounds": rounds, "runs": runs}
