"""What every benchmark shares: rows of figures, the run's context, the agent and the load generator as
subprocesses, the alternating-phase statistics (A B B A ...), /proc readers, and the output table."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.sim.harness import free_port, http_json, maps_library, terminate, wait_until

SCRIPTS = Path(__file__).resolve().parent.parent
HELPER_SOURCE = SCRIPTS / "bench_storm.c"
AGENT = [sys.executable, "-m", "rankscope.agent.cli"]
INT3 = 0xCC


class BenchError(RuntimeError):
    """A benchmark could not measure what it should (not a missed target)."""


@dataclass
class Row:
    bench: str
    figure: str
    value: float | None
    unit: str
    target: str = ""
    met: bool | None = None
    note: str = ""


def row(bench: str, figure: str, value: float | None, unit: str, limit: float | None = None, note: str = "") -> Row:
    if limit is None:
        return Row(bench, figure, value, unit, note=note)
    met = None if value is None else value <= limit
    return Row(bench, figure, value, unit, f"<= {limit:g} {unit}", met, note)


def spread(values: list[float], unit: str = "%") -> str:
    """The range of per-pair figures: how much to trust a median of few noisy pairs."""
    return f"pairs {min(values):+.2f}..{max(values):+.2f} {unit}"


class Context:
    def __init__(self, quick: bool, tmp: Path, shared_cache: str = ""):
        self.quick = quick
        self.tmp = tmp
        self.shared_cache = shared_cache  # the caller's XDG_CACHE_HOME ("" for ~/.cache): downloads kept there
        self._helper: Path | None = None
        self._libs: Path | None = None

    @property
    def libs(self) -> Path:
        """The stand-ins, built into the benchmark's private cache (XDG_CACHE_HOME set by main)."""
        if self._libs is None:
            from rankscope.sim.build import build_libraries
            self._libs = build_libraries()
        return self._libs

    @property
    def helper(self) -> Path:
        if self._helper is None:
            out = self.tmp / "bench_storm"
            cmd = ["gcc", "-O2", "-Wall", "-Wextra", "-o", str(out), str(HELPER_SOURCE), "-ldl"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise BenchError(f"compiling {HELPER_SOURCE.name} failed:\n{r.stderr}")
            self._helper = out
        return self._helper


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ helpers

def probe_armed(pid: int, library: str, symbol: str) -> bool:
    """Whether a uprobe is armed on `symbol` in `pid`: its first instruction byte reads 0xCC (int3)."""
    from rankscope.agent.host.symbols import SymbolError, code_byte

    try:
        return code_byte(pid, library, symbol) == INT3
    except SymbolError as e:
        raise BenchError(str(e)) from e


def expect_armed(pids: list[int], library: str, symbol: str, armed: bool) -> None:
    for pid in pids:
        if probe_armed(pid, library, symbol) != armed:
            raise BenchError(f"pid {pid}: {symbol} is {'not ' if armed else ''}probed, expected the opposite "
                             f"(another tracer on the benchmark's private libraries?)")


class AgentProc:
    """`rankscope agent --pid ...` in a subprocess; attached to every PID once it serves HTTP."""

    def __init__(self, ctx: Context, pids: list[int], window: float, detail: str = "auto",
                 bpf_cache: Path | None = None):
        """`bpf_cache`: the compiled programs' directory (loader/bpf_cache.py), else the benchmark run's own."""
        self.url = f"http://127.0.0.1:{free_port()}"
        self.err_path = ctx.tmp / f"agent-{uuid.uuid4().hex[:8]}.err"
        env = dict(os.environ, RANKSCOPE_BPF_CACHE=str(bpf_cache)) if bpf_cache else None
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*AGENT, "agent", "--listen", self.url.removeprefix("http://"), "--pid", ",".join(map(str, pids)),
                 "--window", str(window), "--detail", detail],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            wait_until(self._up, 120, "the agent to serve", interval=0.1)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise BenchError(f"the agent exited with status {self.proc.returncode}: "
                             f"{self.err_path.read_text(errors='replace').strip()[-2000:]}")
        try:
            return http_json(f"{self.url}/v1/targets", timeout=2) is not None
        except (OSError, ValueError):
            return False

    def get(self, path: str) -> Any:
        return http_json(self.url + path)

    def stop(self) -> None:
        terminate(self.proc, 30)

    def __enter__(self) -> AgentProc:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_held_job(ranks: int, tmp: Path, **kwargs):
    """A simulated job whose ranks have mapped the stand-ins and wait for the hold file; (job, hold file)."""
    from rankscope.sim.job import start_job

    hold = tmp / f"hold-{uuid.uuid4().hex[:8]}"
    job = start_job(ranks, hold_file=hold, **kwargs)
    try:
        wait_until(lambda: all(maps_library(p, "libnccl.so.2") for p in job.pids), 60, "ranks to load the stand-ins")
    except BaseException:
        job.stop()
        raise
    return job, hold


class Storm:
    """The C load generator (bench_storm.c), driven one command at a time over its stdin."""

    def __init__(self, ctx: Context, *args: str):
        self.proc = subprocess.Popen([str(ctx.helper), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        ready = self.proc.stdout.readline().split()
        if not ready or ready[0] != "ready":
            self.close()
            raise BenchError(f"bench_storm {' '.join(args)} did not start")
        self.pids = [int(x) for x in ready[1:]]
        self._cmd = ""

    def run(self, *cmd: object) -> tuple[int, int]:
        """(wall ns, CPU ns of the helper's own process)."""
        self.send(*cmd)
        return self.reply()

    def send(self, *cmd: object) -> None:
        """Start a command without waiting for it (several storms at once); reply() waits."""
        self._cmd = " ".join(map(str, cmd))
        self.proc.stdin.write(self._cmd + "\n")
        self.proc.stdin.flush()

    def reply(self) -> tuple[int, int]:
        reply = self.proc.stdout.readline().split()
        if not reply or reply[0] != "done":
            raise BenchError(f"bench_storm: {self._cmd}: {' '.join(reply) or 'exited'}")
        return int(reply[1]), int(reply[2])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Storm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def abba(pairs: int) -> str:
    """A B B A A B B A ...: each consecutive two is a pair, and B is as often first as second."""
    return "".join("AB" if i % 2 == 0 else "BA" for i in range(pairs))


def pairs(order: str, values: list[float]) -> list[tuple[float, float]]:
    """(A, B) of each consecutive pair of phases."""
    return [(values[i], values[i + 1]) if order[i] == "A" else (values[i + 1], values[i])
            for i in range(0, len(order) - 1, 2)]


def pair_ratios(order: str, values: list[float]) -> list[float]:
    return [b / a for a, b in pairs(order, values)]


def pair_diffs(order: str, values: list[float]) -> list[float]:
    return [b - a for a, b in pairs(order, values)]


def median(xs) -> float:
    return float(statistics.median(xs))


DETAILS = ("light", "deep")  # the agent's levels, each measured against no agent


def slowdown_series(bench: str, pairs_per_level: int, phase: Callable[[str | None], dict[str, float]],
                    levels: tuple[str, ...] = DETAILS) -> dict[str, dict]:
    """For each detail level, alternating phases without (A) and with the agent at that level (B), A B B A ...;
    `phase(level or None)` measures one phase: metric -> value, lower is better ("step_s" always).
    level -> {order, metric -> {values, pair slowdowns in %, medians without and with}}."""
    out = {}
    for level in levels:
        order = abba(pairs_per_level)
        measured: list[dict[str, float]] = []
        for i, p in enumerate(order):
            measured.append(phase(level if p == "B" else None))
            log(f"{bench}: {level}: phase {i + 1}/{len(order)} {p}: "
                + ", ".join(f"{metric} {v * 1e3:.3f} ms" for metric, v in measured[-1].items()))
        out[level] = {"order": order}
        for metric in measured[0]:
            values = [m[metric] for m in measured]
            out[level][metric] = {
                "values": values, "pair_slowdown_pct": [(r - 1) * 100 for r in pair_ratios(order, values)],
                "median_without": median([v for p, v in zip(order, values) if p == "A"]),
                "median_with": median([v for p, v in zip(order, values) if p == "B"])}
    return out


# Metrics a phase may measure besides the step time, and how the table names their slowdown.
METRIC_FIGURES = {"cpu_s_per_step": "on-CPU time per rank-step"}  # agent work in the job's threads: traps, samples


def slowdown_rows(bench: str, what: str, series: dict[str, dict]) -> list[Row]:
    rows = [row(bench, f"{what} slowdown, agent {level} mode", median(s["step_s"]["pair_slowdown_pct"]), "%",
                0.3 if level == "light" else None, spread(s["step_s"]["pair_slowdown_pct"]))
            for level, s in series.items()]
    for metric, figure in METRIC_FIGURES.items():
        rows += [row(bench, f"{what} {figure}, agent {level} mode", median(s[metric]["pair_slowdown_pct"]), "%",
                     note=spread(s[metric]["pair_slowdown_pct"]))
                 for level, s in series.items() if metric in s]
    return rows + [row(bench, f"{what} median step without agent",
                       median([s["step_s"]["median_without"] for s in series.values()]) * 1e3, "ms")]


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every live thread of `pid` (/proc/PID/task/*/schedstat)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def cpu_ticks_s(pid: int) -> float:
    """utime + stime of `pid` in seconds (/proc/PID/stat, clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise BenchError(f"no {key} in /proc/{pid}/status")


# ------------------------------------------------------------------------------------------------ output

def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    a = abs(value)
    if a >= 1000:
        return f"{value:,.0f}"
    for bound, digits in ((100, 0), (10, 1), (1, 2), (0.01, 3)):
        if a >= bound:
            return f"{value:.{digits}f}"
    return f"{value:.4f}"


def table(rows: list[Row]) -> str:
    header = ("benchmark", "figure", "value", "target", "met", "note")
    lines = [(r.bench, r.figure, f"{fmt(r.value)} {r.unit}".strip(), r.target or "-",
              "-" if r.met is None else ("yes" if r.met else "NO"), r.note) for r in rows]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) if i != 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines]
    return "\n".join(line.rstrip() for line in out)


def machine() -> dict:
    info = {"host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                     None)
    except OSError:
        pass
    return info
