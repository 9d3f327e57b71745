"""attach: what a one-shot command on a 2-rank job costs, from the command to its exit: `diagnose --pid <2 ranks>
--duration 1` compiling its BPF programs with bcc (a node's first process), with the programs compiled by an
earlier process (loader/bpf_cache.py: every later one), and asking the node agent that already watches the
job (`--agent`); `profile`, `trace` (1 s each) and `dump` with the programs cached. For each: the whole
run's wall time, the process's CPU time and peak RSS (its rusage), and as a second figure the seconds and
CPU to its first line (the window open, or the agent asked). One run of each a round, alternating, on the
simulated job."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rankscope.sim.harness import wait_until

from .harness import AgentProc, BenchError, Context, Row, cpu_ticks_s, median, row, start_held_job

CLI = [sys.executable, "-m", "rankscope.agent.cli"]
WATCHING = "rankscope: "  # a command's first line on stderr, once its window opens or the agent is asked


@dataclass(frozen=True)
class Mode:
    what: str  # as the rows name it
    args: tuple[str, ...]  # the command's, before --pid
    cache: str  # "cached", "empty": the node's compiled programs, or none yet
    wall_s: float | None = None  # targets, whole run
    cpu_s: float | None = None
    rss_mb: float | None = None


TARGET_WALL_S, TARGET_CPU_S, TARGET_RSS_MB = 2.0, 1.0, 120.0  # a cached node's whole run
MODES = {
    "compiling": Mode("diagnose attaching itself, compiling", ("diagnose", "--duration", "1", "--json"), "empty",
                      wall_s=3.0),
    "cached": Mode("diagnose attaching itself, programs cached", ("diagnose", "--duration", "1", "--json"), "cached",
                   TARGET_WALL_S, TARGET_CPU_S, TARGET_RSS_MB),
    "agent": Mode("diagnose through the node agent (--agent)", ("diagnose", "--duration", "1", "--json", "--agent"),
                  "cached", TARGET_WALL_S, TARGET_CPU_S, TARGET_RSS_MB),
    "profile": Mode("profile (1 s), programs cached", ("profile", "--duration", "1"), "cached",
                    TARGET_WALL_S, TARGET_CPU_S, TARGET_RSS_MB),
    "trace": Mode("trace (1 s), programs cached", ("trace", "--duration", "1"), "cached",
                  TARGET_WALL_S, TARGET_CPU_S, TARGET_RSS_MB),
    "dump": Mode("dump", ("dump", "--json"), "cached", 1.0, TARGET_CPU_S, TARGET_RSS_MB),
}


def _run(args: list[str], cache: Path) -> dict[str, float | None]:
    """One command run with compiled programs kept in `cache`: seconds and CPU to its first line (None: it
    printed none), its whole run's seconds, CPU seconds and peak RSS (MB)."""
    t = time.monotonic()
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, RANKSCOPE_BPF_CACHE=str(cache)))
    first = first_cpu = None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if first is None and line.startswith(WATCHING):
            first, first_cpu = time.monotonic() - t, cpu_ticks_s(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(args)} exited {proc.returncode}: {''.join(lines)[-1000:]}")
    return {"first_line_s": first, "cpu_to_first_line_s": first_cpu, "wall_s": wall,
            "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}


def _command(mode: Mode, pids: list[int], tmp: Path, agent_url: str) -> list[str]:
    args = list(mode.args) + ([agent_url] if mode.args[-1] == "--agent" else [])
    if mode.args[0] in ("profile", "trace"):
        args += ["-o", str(tmp / f"attach-{mode.args[0]}")]
    return [*args, "--pid", ",".join(map(str, pids))]


def run(ctx: Context) -> tuple[list[Row], dict]:
    rounds = 1 if ctx.quick else 5
    job, hold = start_held_job(2, ctx.tmp)
    runs: dict[str, list[dict[str, float | None]]] = {name: [] for name in MODES}
    cached = ctx.tmp / "attach-bpf-cache"
    try:
        hold.touch()
        with AgentProc(ctx, job.pids, window=1.0, bpf_cache=cached) as agent:
            wait_until(lambda: agent.get("/v1/targets").get("window_end"), 60, "the agent's first window")
            for name in ("cached", "profile", "trace"):  # their programs kept, as any earlier run keeps them
                _run(_command(MODES[name], job.pids, ctx.tmp, agent.url), cached)
            for i in range(rounds):  # alternating: drift on the machine falls on each alike
                for name, mode in MODES.items():
                    cache = cached if mode.cache == "cached" else ctx.tmp / f"attach-bpf-cache-{name}-{i}"
                    runs[name].append(_run(_command(mode, job.pids, ctx.tmp, agent.url), cache))
    finally:
        job.stop()
    return [r for name, mode in MODES.items() for r in _rows(mode, runs[name])], {"rounds": rounds, "runs": runs}


def _rows(mode: Mode, runs: list[dict[str, float | None]]) -> list[Row]:
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return median(values) if values else None

    rows = [row("attach", f"{mode.what}: seconds, whole run", med("wall_s"), "s", mode.wall_s),
            row("attach", f"{mode.what}: CPU seconds, whole run", med("cpu_s"), "s", mode.cpu_s),
            row("attach", f"{mode.what}: peak RSS", med("peak_rss_mb"), "MB", mode.rss_mb)]
    if med("first_line_s") is not None:
        rows.append(row("attach", f"{mode.what}: seconds to its window (first line)", med("first_line_s"), "s",
                        note=f"CPU {med('cpu_to_first_line_s'):.2f} s"))
    return rows
