"""rankscope's benchmark suite: what the agent costs the jobs it watches, and what the analyzer costs at scale.

    scripts/bench [NAMES...] [--quick] [--json PATH]      (root: real eBPF probes on real processes)

Benchmarks (each gives figures from one run on one machine; slowdowns are ratios of alternating runs with
and without the agent, A B B A ..., summarized by the median over pairs so that drift and noise cancel):

  job       step time of the simulated 4-rank GPU job with a `rankscope agent --pid` subprocess attached, in
            light (always-on) and in deep mode (`--detail deep`), each against no agent
  launch    a launch storm (C, dlopen()ing the stand-in libcuda.so.1): ns added per probed cuLaunchKernel, and
            the slowdown of a launcher issuing 100,000 launches/s, in light mode (launches not probed) and deep
  sched     a context-switch storm (two processes pinned to one CPU ping-ponging over pipes): ns added per
            switch by the agent's scheduler tracepoints, storm not watched and watched
  agent     the agent's own CPU share of one core and peak RSS while watching 8 ranks
  payload   msgpack bytes per rank per window of real patterns of the simulated job
  latency   seconds from a fault's onset (slow-gpu:1:2@3) to the first /v1/diagnosis naming rank 1
  analyzer  diagnose() time and peak memory for 1,000 / 10,000 / 100,000 synthetic ranks on one core
  torch     step time of the real torch DDP job (tests/torch_ddp_train.py, gloo on CPU, 4 ranks under torchrun)
            with the agent attached to its running ranks, light and deep mode; listed only when that script exists

--quick runs every benchmark at a tiny size (the smoke test); its figures mean nothing.
The stand-in libraries are built into a private folder, so that probes other agents on the machine put on
the shared build never touch the benchmark's processes (checked: the first instruction byte of a probed
function is read from the process's memory before every phase, 0xCC exactly when the agent is attached).
torch's libtorch_cpu.so cannot be made private: on a shared machine, run the torch benchmark alone.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rankscope.sim.harness import free_port, http_json, maps_library, wait_until

ROOT = Path(__file__).resolve().parent.parent
HELPER_SOURCE = Path(__file__).resolve().parent / "bench_storm.c"
TORCH_SCRIPT = ROOT / "tests" / "torch_ddp_train.py"
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
    def __init__(self, quick: bool, tmp: Path):
        self.quick = quick
        self.tmp = tmp
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

    def __init__(self, ctx: Context, pids: list[int], window: float, detail: str = "auto"):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.err_path = ctx.tmp / f"agent-{uuid.uuid4().hex[:8]}.err"
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*AGENT, "agent", "--listen", self.url.removeprefix("http://"), "--pid", ",".join(map(str, pids)),
                 "--window", str(window), "--detail", detail],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

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

    def run(self, *cmd: object) -> tuple[int, int]:
        """(wall ns, CPU ns of the helper's own process)."""
        self.proc.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().split()
        if not reply or reply[0] != "done":
            raise BenchError(f"bench_storm: {' '.join(map(str, cmd))}: {' '.join(reply) or 'exited'}")
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


def slowdown_series(bench: str, pairs_per_level: int,
                    phase: Callable[[str | None], dict[str, float]]) -> dict[str, dict]:
    """For each detail level, alternating phases without (A) and with the agent at that level (B), A B B A ...;
    `phase(level or None)` measures one phase: metric -> value, lower is better ("step_s" always).
    level -> {order, metric -> {values, pair slowdowns in %, medians without and with}}."""
    out = {}
    for level in DETAILS:
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


# ------------------------------------------------------------------------------------------------ 1b: job

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


def bench_job(ctx: Context) -> tuple[list[Row], dict]:
    ranks = 4
    steps = 30 if ctx.quick else 300
    series = slowdown_series("job", 1 if ctx.quick else 3,
                             lambda detail: {"step_s": job_phase(ctx, ranks, steps, detail)})
    details = {"ranks": ranks, "steps_per_phase": steps, "agent": "rankscope agent --pid --detail LEVEL (window 5 s)",
               "levels": series}
    return slowdown_rows("job", f"sim job ({ranks} ranks)", series), details


# ------------------------------------------------------------------------------------------------ 1c: launch

RATE = 100_000  # launches/s of the paced launcher


def bench_launch(ctx: Context) -> tuple[list[Row], dict]:
    """Per detail level: launches probed in deep mode only (Probe.hot), so light mode should add nothing."""
    from rankscope.agent.detail import LEVELS
    from rankscope.agent.session import Session

    n_free = 20_000 if ctx.quick else 2_000_000
    n_work = 5_000 if ctx.quick else 300_000
    order = abba(1 if ctx.quick else 4)
    lib = str(ctx.libs / "libcuda.so.1")
    details: dict[str, Any] = {"launches_free": n_free, "launches_paced": n_work, "order": order, "levels": {},
                               "note": "CPU time of the launcher (uprobe traps are charged to it); "
                                       "cuStreamSynchronize every 1000 launches"}
    with Storm(ctx, "launch", lib) as storm:
        pid, = storm.pids
        storm.run("free", 100_000)  # warm-up
        n_spin = 2_000 if ctx.quick else 20_000
        unit_ns = storm.run("spin", n_spin, 1000)[1] / (n_spin * 1000)  # CPU ns per unit of busy work
        launch_ns = storm.run("free", n_free)[1] / n_free
        units = max(1, round((1e9 / RATE - launch_ns) / unit_ns))
        log(f"launch: {launch_ns:.0f} ns per unprobed launch; {units} work units ({unit_ns:.2f} ns each) "
            f"between launches for {RATE:,}/s")
        details.update(work_units=units, unprobed_launch_ns=launch_ns)
        for level in DETAILS:
            session = Session(detail=LEVELS[level])
            session.program.bpf  # compile and load before anything is timed  # noqa: B018
            try:
                free_cpu, work_cpu, work_wall, counted = [], [], [], []
                for i, phase in enumerate(order):
                    if phase == "B":
                        session.add(pid)
                        session.window()  # the counters start here
                    expect_armed([pid], "libcuda.so.1", "cuLaunchKernel", phase == "B" and level == "deep")
                    free_cpu.append(storm.run("free", n_free)[1])
                    w, c = storm.run("work", n_work, units)
                    work_cpu.append(c)
                    work_wall.append(w)
                    if phase == "B":
                        pats = [p for p in session.window() if p.pid == pid]
                        fn = pats[0].functions.get("cuLaunchKernel") if pats else None
                        counted.append((fn.count if fn else 0) / (n_free + n_work))
                        session.remove(pid)
                    log(f"launch: {level}: phase {i + 1}/{len(order)} {phase}: {free_cpu[-1] / n_free:.0f} ns/launch "
                        f"free-running, {n_work / (w / 1e9):,.0f} launches/s paced")
            finally:
                session.close()
            details["levels"][level] = {
                "free_cpu_ns_per_launch": [c / n_free for c in free_cpu], "paced_cpu_ns": work_cpu,
                "paced_wall_ns": work_wall, "fraction_of_launches_counted": counted,
                "added_ns_per_call": median(pair_diffs(order, [c / n_free for c in free_cpu])),
                "added_ns_per_call_paced": median(pair_diffs(order, [c / n_work for c in work_cpu])),
                "paced_slowdown_pct": [(r - 1) * 100 for r in pair_ratios(order, work_cpu)],
                "paced_wall_slowdown_pct": (median(pair_ratios(order, work_wall)) - 1) * 100,
                "paced_rate_without_agent_per_s": median([n_work / (w / 1e9) for p, w in zip(order, work_wall)
                                                          if p == "A"])}
        floor = bare_uprobe_floor(ctx, storm, lib, n_free)
    details.update(bare_uprobe_ns_per_call=floor["added_ns"], bare_uprobe=floor)
    rows = [row("launch", "ns added per probed cuLaunchKernel (deep mode)", details["levels"]["deep"]["added_ns_per_call"],
                "ns"),
            row("launch", "of which the kernel's uprobe trap alone (no-op program)", floor["added_ns"], "ns")]
    for level, d in details["levels"].items():
        rows.append(row("launch", f"launcher slowdown at {RATE:,} launches/s, agent {level} mode",
                        median(d["paced_slowdown_pct"]), "%", 2.0 if level == "light" else None,
                        spread(d["paced_slowdown_pct"])))
    return rows, details


NOOP_PROBE = "int noop(struct pt_regs *ctx) { return 0; }"


def bare_uprobe_floor(ctx: Context, storm: Storm, lib: str, n: int) -> dict:
    """What a uprobe costs with a BPF program that does nothing: the kernel's trap and return, the floor under
    any uprobe-based agent. Phases A C C A (C: the no-op uprobe on cuLaunchKernel), free-running launches."""
    from bcc import BPF

    pid = storm.pids[0]
    order = "AC" if ctx.quick else "ACCA"
    bpf = BPF(text=NOOP_PROBE)
    try:
        per_call = []
        for phase in order:
            if phase == "C":
                bpf.attach_uprobe(name=lib, sym="cuLaunchKernel", fn_name="noop", pid=pid)
            expect_armed([pid], "libcuda.so.1", "cuLaunchKernel", phase == "C")
            per_call.append(storm.run("free", n)[1] / n)
            if phase == "C":
                bpf.detach_uprobe(name=lib, sym="cuLaunchKernel", pid=pid)
    finally:
        bpf.cleanup()
    return {"order": order, "cpu_ns_per_launch": per_call,
            "added_ns": median(pair_diffs(order.replace("C", "B"), per_call))}


# ------------------------------------------------------------------------------------------------ 2: sched

# No-op programs on the same scheduler events: the floor of a classic tracepoint (what bcc's TRACEPOINT_PROBE
# uses: the kernel formats the event's record before the program runs) and of a raw tracepoint.
NOOP_SCHED = """
int noop_tp(void *ctx) { return 0; }
int noop_raw(void *ctx) { return 0; }
"""
SCHED_EVENTS = ("sched_switch", "sched_wakeup", "sched_wakeup_new")
SCHED_STATES = ("none", "noop_tp", "noop_raw", "loaded", "watched")


def bench_sched(ctx: Context) -> tuple[list[Row], dict]:
    from bcc import BPF

    from rankscope.agent.session import Session

    n = 5_000 if ctx.quick else 200_000
    rounds = 1 if ctx.quick else 4
    cpu = max(os.sched_getaffinity(0))
    lib = str(ctx.libs / "libcuda.so.1")
    per_rt: dict[str, list[float]] = {k: [] for k in SCHED_STATES}
    rate: dict[str, list[float]] = {k: [] for k in SCHED_STATES}
    accounted = []
    noop = BPF(text=NOOP_SCHED)
    session = None
    try:
        with Storm(ctx, "switch", lib, str(cpu)) as storm:
            storm.run("pingpong", n // 10)  # warm-up
            for r in range(rounds):
                for state in SCHED_STATES if r % 2 == 0 else SCHED_STATES[::-1]:
                    if state in ("loaded", "watched") and session is None:
                        session = Session()
                        session.program.bpf  # loads the program: its sched tracepoints are on from here  # noqa: B018
                    elif state not in ("loaded", "watched") and session is not None:
                        session.close()
                        session = None
                    if state == "watched":
                        for pid in storm.pids:
                            session.add(pid)
                        session.window()
                    elif state == "loaded":
                        for pid in list(session.targets):
                            session.remove(pid)
                    for ev in SCHED_EVENTS:
                        if state == "noop_tp":
                            noop.attach_tracepoint(tp=f"sched:{ev}", fn_name="noop_tp")
                        elif state == "noop_raw":
                            noop.attach_raw_tracepoint(tp=ev, fn_name="noop_raw")
                    before = sum(cpu_ns(p) for p in storm.pids)
                    wall, _ = storm.run("pingpong", n)
                    used = sum(cpu_ns(p) for p in storm.pids) - before
                    for ev in SCHED_EVENTS:
                        if state == "noop_tp":
                            noop.detach_tracepoint(f"sched:{ev}")
                        elif state == "noop_raw":
                            noop.detach_raw_tracepoint(ev)
                    per_rt[state].append(used / n)
                    rate[state].append(2 * n / (wall / 1e9))
                    if state == "watched":
                        main = [p.sched.get("main") for p in session.window() if p.pid in storm.pids]
                        accounted.append(all(t is not None and t.on_cpu_s + t.sleep_s + t.runq_s > 0 for t in main))
                    log(f"sched: round {r + 1}/{rounds} {state}: {per_rt[state][-1]:.0f} ns CPU per round trip, "
                        f"{rate[state][-1]:,.0f} switches/s")
    finally:
        if session is not None:
            session.close()
        noop.cleanup()
    if not all(accounted):
        raise BenchError("the watched storm's threads were not accounted by the scheduler probes")
    # Rounds alternate the order, so each round's differences are paired measurements; a round trip is two
    # switches (and two wakeups).
    added = {k: median([(x - y) / 2 for x, y in zip(per_rt[k], per_rt["none"])]) for k in SCHED_STATES[1:]}
    # Switches per second of CPU the storm got: what it does on a CPU of its own (immune to other tasks).
    cpu_rate = {k: 2e9 / median(v) for k, v in per_rt.items()}
    details = {"round_trips_per_phase": n, "rounds": rounds, "cpu": cpu, "cpu_ns_per_round_trip": per_rt,
               "switches_per_wall_s": rate, "switches_per_cpu_s": cpu_rate, "ns_added_per_switch": added,
               "states": {"none": "no BPF program", "noop_tp": "no-op program on the classic sched tracepoints",
                          "noop_raw": "no-op program on the raw sched tracepoints",
                          "loaded": "the agent's program loaded, the storm not watched",
                          "watched": "the storm's two processes watched"},
               "method": "two processes pinned to one CPU ping-pong a byte over pipes: a round trip is two "
                         "context switches and two wakeups; CPU time of both from /proc/PID/schedstat, so time "
                         "other tasks took on that CPU is excluded"}
    return [row("sched", "context switches/s, no agent", cpu_rate["none"], "/s"),
            row("sched", "context switches/s, agent loaded, storm not watched", cpu_rate["loaded"], "/s"),
            row("sched", "context switches/s, storm watched", cpu_rate["watched"], "/s"),
            row("sched", "ns added per switch, storm not watched", added["loaded"], "ns"),
            row("sched", "ns added per switch, storm watched", added["watched"], "ns"),
            row("sched", "ns added per switch, no-op program (classic tracepoints)", added["noop_tp"], "ns"),
            row("sched", "ns added per switch, no-op program (raw tracepoints)", added["noop_raw"], "ns")], details


# ------------------------------------------------------------------------------------------------ 3: agent

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


def bench_agent(ctx: Context) -> tuple[list[Row], dict]:
    ranks = 2 if ctx.quick else 8
    window = 1.0 if ctx.quick else 5.0
    duration = 3.0 if ctx.quick else 12.0
    job, hold = start_held_job(ranks, ctx.tmp)
    try:
        hold.touch()
        with AgentProc(ctx, job.pids, window) as agent:
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
               "rss_mb_by_kind": rss_parts,
               "method": "on-CPU ns of all agent threads (/proc/PID/task/*/schedstat) sampled every 20 ms; share "
                         "over a whole number of windows (first to last burst of window processing)"}
    return [row("agent", f"agent CPU, share of one core ({ranks} ranks, window {window:g} s)", share * 100, "%", 1.0),
            row("agent", "agent peak RSS (VmHWM)", hwm_mb, "MB", 150,
                f"anon {rss_parts['RssAnon']:.0f} MB + file-backed {rss_parts['RssFile']:.0f} MB now"),
            row("agent", "agent RSS at steady state (VmRSS)", rss_mb, "MB")], details


# ------------------------------------------------------------------------------------------------ 4: payload

def bench_payload(ctx: Context) -> tuple[list[Row], dict]:
    from rankscope.agent.session import Session
    from rankscope.schema.wire import encode_patterns

    ranks = 4
    windows = 2 if ctx.quick else 3
    window = 1.0 if ctx.quick else 5.0
    sizes, whole, collectives, biggest = [], [], [], None
    job, hold = start_held_job(ranks, ctx.tmp)
    session = Session()
    try:
        for pid in job.pids:
            session.add(pid)
        hold.touch()
        time.sleep(window)
        session.window()  # set-up calls and the first steps
        for _ in range(windows):
            time.sleep(window)
            pats = session.window()
            sizes += [len(encode_patterns([p])) for p in pats]
            biggest = max([*pats, biggest] if biggest else pats, key=lambda p: len(encode_patterns([p])))
            whole.append(len(encode_patterns(pats)) / len(pats))
            collectives += [len(p.collectives) for p in pats]
    finally:
        session.close()
        job.stop()
    if not min(collectives):
        raise BenchError("a window's pattern has no collectives: not a real training window")
    details = {"ranks": ranks, "window_s": window, "windows": windows, "bytes_per_pattern": sizes,
               "largest_pattern_bytes_by_field": wire_breakdown(biggest),
               "bytes_per_rank_in_a_window_payload": whole, "collectives_per_pattern": collectives}
    return [row("payload", "pattern bytes per rank per window (max)", max(sizes), "B", 2048),
            row("payload", "pattern bytes per rank per window (median)", median(sizes), "B")], details


def wire_breakdown(pattern) -> dict[str, int]:
    """msgpack bytes of each top-level field of a pattern's wire form (where a payload's bytes go)."""
    import msgpack

    from rankscope.schema import wire as codec

    try:
        wire = codec._pattern_to_wire(pattern)
    except AttributeError:  # the wire form's internals changed: the total is still measured
        return {}
    return {k: len(msgpack.packb(v, use_single_float=True)) for k, v in wire.items()}


# ------------------------------------------------------------------------------------------------ 5: latency

ONSET_PROBE = r"""
BPF_ARRAY(onset, u64, 1);
int on_fault(struct pt_regs *ctx) {
    u32 k = 0;
    u64 now = bpf_ktime_get_ns();
    u64 *v = onset.lookup(&k);
    if (v && *v == 0)
        *v = now;
    return 0;
}
"""


def latency_run(ctx: Context, delay: float, timeout: float) -> dict:
    """One job, fault slow-gpu:1:2@delay; the onset is when rank 1 really switched its GPU factor, seen by the
    benchmark's own uprobe on the stand-in's rsim_set_gpu_factor (CLOCK_MONOTONIC, like bpf_ktime_get_ns)."""
    import ctypes

    from bcc import BPF

    job, hold = start_held_job(4, ctx.tmp, faults=[f"slow-gpu:1:2@{delay:g}"])
    onset_bpf = None
    try:
        onset_bpf = BPF(text=ONSET_PROBE)
        onset_bpf.attach_uprobe(name=str(job.lib_dir / "libcuda.so.1"), sym="rsim_set_gpu_factor",
                                fn_name="on_fault", pid=job.pids[1])
        onset_map = onset_bpf["onset"]
        with AgentProc(ctx, job.pids, window=1) as agent:
            hold.touch()
            released = time.monotonic()
            early, onset_ns, found = [], 0, None
            while time.monotonic() - released < timeout:
                onset_ns = onset_ns or onset_map[ctypes.c_int(0)].value  # read first: a finding after it counts
                doc = agent.get("/v1/diagnosis")
                now = time.monotonic()
                named = [f for f in doc["findings"] if 1 in f["ranks"]]
                if named and not onset_ns:
                    early.append({"t_after_release_s": now - released, "kinds": [f["kind"] for f in named]})
                elif named:
                    found = (now, doc, named[0])
                    break
                time.sleep(0.1)
    finally:
        if onset_bpf is not None:
            onset_bpf.cleanup()
        job.stop()
    if not onset_ns:
        raise BenchError(f"rank 1's fault never started within {timeout:g} s")
    if found is None:
        raise BenchError(f"no diagnosis named rank 1 within {timeout:g} s of the job's start")
    now, doc, finding = found
    onset = onset_ns / 1e9
    unix_of_mono = time.time() - time.monotonic()
    return {"latency_s": now - onset, "window_end_after_onset_s": doc["window"]["end"] - (onset + unix_of_mono),
            "onset_after_release_s": onset - released, "kind": finding["kind"], "component": finding.get("component"),
            "ranks": finding["ranks"], "pre_onset_findings_naming_rank_1": early}


def bench_latency(ctx: Context) -> tuple[list[Row], dict]:
    delay = 1.0 if ctx.quick else 3.0
    runs = [latency_run(ctx, delay, timeout=60) for _ in range(1 if ctx.quick else 3)]
    for r in runs:
        log(f"latency: {r['latency_s']:.2f} s ({r['kind']}, window closed {r['window_end_after_onset_s']:.2f} s "
            f"after onset)")
    lat = [r["latency_s"] for r in runs]
    details = {"fault": f"slow-gpu:1:2@{delay:g}", "agent_window_s": 1, "poll_interval_s": 0.1, "runs": runs,
               "method": "onset: a uprobe of the benchmark's own on rsim_set_gpu_factor in rank 1 (the instant the "
                         "fault switches on); detection: the first GET /v1/diagnosis (polled every 0.1 s) with a "
                         "finding whose ranks include 1"}
    return [row("latency", "fault onset to diagnosis naming the rank (median)", median(lat), "s", 10,
                f"{len(runs)} run(s), agent --window 1"),
            row("latency", "fault onset to diagnosis naming the rank (max)", max(lat), "s")], details


# ------------------------------------------------------------------------------------------------ 6: analyzer

T0 = 1_700_000_000.0
WINDOW = 2.0
NBYTES = 100_000_000
# As tests/test_analyzer.py's simulate(): ~31 ms of own work + ~17 ms all-reduce per step, 120 launches.
HOST, LAUNCH, COPY, SYNC, TRANSFER = 0.007, 0.002, 0.0015, 0.0205, 0.017
LAUNCHES = 120
MINOR = [("cuLaunchKernelEx", "launch", 4, 8e-6), ("cuEventSynchronize", "sync", 2, 2e-5),
         ("cuCtxSynchronize", "sync", 1, 1e-5), ("cuMemcpyDtoHAsync_v2", "copy", 1, 1.2e-5),
         ("cuMemAlloc_v2", "alloc", 1, 3e-5), ("cuMemFree_v2", "alloc", 1, 1e-5),
         ("ncclBroadcast", "comm", 0.05, 2e-4)]


def _column_percentiles(d, qs):
    """np.nanpercentile(d, q, axis=0) for each q (linear interpolation), without its per-column Python loop."""
    import numpy as np

    finite = np.isfinite(d)
    k = finite.sum(axis=0)
    s = np.sort(np.where(finite, d, np.inf), axis=0)
    cols = np.arange(d.shape[1])
    out = []
    for q in qs:
        pos = q / 100 * (k - 1)
        lo = np.floor(pos).astype(int)
        hi = np.minimum(lo + 1, k - 1)
        frac = pos - lo
        out.append(s[lo, cols] * (1 - frac) + s[hi, cols] * frac)
    return out


def synthetic_patterns(n: int, straggler: int, extra_sync_s: float = 0.03, seed: int = 0, ranks_per_host: int = 8):
    """A vectorized version of tests/test_analyzer.py's simulate(): an n-rank synchronous data-parallel job over
    one 2 s window (host work, launches, copy, GPU sync, then the all-reduce that completes when the last rank
    arrived), one compute straggler, and a healthy scheduler view per rank."""
    import numpy as np

    from rankscope.schema.patterns import CollectiveRecord, FunctionStats, RankPattern, Role, ThreadTimes

    rng = np.random.default_rng(seed)
    noise = 0.02
    sync_x = np.zeros(n)
    sync_x[straggler] = extra_sync_s
    bias = 1 + rng.normal(0, noise / 2, n)
    clock = rng.normal(0, 1e-4, (n + ranks_per_host - 1) // ranks_per_host)[np.arange(n) // ranks_per_host]
    w0, w1 = T0, T0 + WINDOW
    names = ["host", "cuLaunchKernel", "cuMemcpyHtoDAsync_v2", "cuStreamSynchronize", "ncclAllReduce"]
    totals = {k: np.zeros(n) for k in names}
    calls = {k: np.zeros(n) for k in names}
    durs: dict[str, list] = {k: [] for k in names}
    enters, dones = [], []
    t = np.full(n, w0 - 0.3) + rng.uniform(0, 1e-3, n)
    while t.min() < w1:
        parts = [HOST, LAUNCH, COPY, SYNC]
        for name, base in zip(names[:4], parts):
            d = base * bias * (1 + rng.normal(0, noise, n)) + (sync_x if name == "cuStreamSynchronize" else 0)
            start, t = t, t + d
            totals[name] += np.clip(np.minimum(t, w1) - np.maximum(start, w0), 0, None)
            inside = (t > w0) & (t <= w1)
            calls[name] += inside * (LAUNCHES if name == "cuLaunchKernel" else 1)
            durs[name].append(np.where(inside, d, np.nan))
        enter = t
        done = enter.max() + TRANSFER * (1 + rng.normal(0, noise)) + rng.uniform(0, 5e-5, n)
        totals["ncclAllReduce"] += np.clip(np.minimum(done, w1) - np.maximum(enter, w0), 0, None)
        inside = (done > w0) & (done <= w1)
        calls["ncclAllReduce"] += inside
        durs["ncclAllReduce"].append(np.where(inside, done - enter, np.nan))
        enters.append(enter + clock)
        dones.append(done + clock)
        t = done

    columns = {}
    for name in names[1:]:
        d = np.stack(durs[name]) / (LAUNCHES if name == "cuLaunchKernel" else 1)
        p50, p99 = _column_percentiles(d, (50, 99))
        columns[name] = [calls[name].astype(int).tolist(), totals[name].tolist(), np.nanmax(d, axis=0).tolist(),
                         p50.tolist(), p99.tolist()]
    E, D = np.stack(enters), np.stack(dones)
    inside = (D > w0) & (D <= w1)  # a rank's completions only grow: its steps inside the window are contiguous
    hi = len(D) - np.argmax(inside[::-1], axis=0)
    lo = np.maximum(np.argmax(inside, axis=0), hi - 16)  # each rank's last 16 inside the window
    E, D, lo, hi = E.T.tolist(), D.T.tolist(), lo.tolist(), hi.tolist()
    roles = dict(zip(names[1:], (Role.LAUNCH, Role.COPY, Role.SYNC, Role.COMM)))
    steps = WINDOW / 0.048
    runq = (0.0004 * (1 + rng.normal(0, 0.1, n))).clip(0) * steps
    out = []
    for r in range(n):
        fns = {}
        for name, (c, tot, mx, p50, p99) in columns.items():
            role = roles[name]
            fns[name] = FunctionStats(name, role, c[r], tot[r], mx[r], p50[r], p99[r],
                                      NBYTES * c[r] if role == Role.COMM else 0)
        for name, role, per_step, each in MINOR:
            c = max(1, round(per_step * WINDOW / 0.048))
            fns[name] = FunctionStats(name, Role(role), c, c * each, each * 1.5, each, each * 1.4)
        a, b = lo[r], hi[r]
        recs = [CollectiveRecord("ncclAllReduce", NBYTES, e, d) for e, d in zip(E[r][a:b], D[r][a:b])]
        sched = {"main": ThreadTimes("main", 1, on_cpu_s=0.3, runq_s=float(runq[r]), sleep_s=1.5, io_s=0.0,
                                     reclaim_s=0.0, preempted=40, runq_p99_s=0.004),
                 "other": ThreadTimes("other", 3, 0.01, 0.0, 1.9, 0.0, 0.0, 1, 0.0)}
        out.append(RankPattern(job="scale", rank=r, world_size=n, pid=1000 + r, host=f"node{r // ranks_per_host}",
                               window_start=w0, window_end=w1, functions=fns, collectives=recs,
                               identity_source="nccl", sched=sched))
    return out


def analyzer_worker(n: int, cpu: int) -> dict:
    """Runs in its own process (pinned to one CPU): generate, diagnose timed, diagnose under tracemalloc."""
    import gc
    import tracemalloc

    from rankscope.analyzer.diagnosis import diagnose

    os.sched_setaffinity(0, {cpu})
    t = time.perf_counter()
    pats = synthetic_patterns(n, straggler=n // 3)
    gen_s = time.perf_counter() - t
    gc.collect()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    w, c = time.perf_counter(), time.process_time()
    docs = diagnose(pats)
    wall, cpu_s = time.perf_counter() - w, time.process_time() - c
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    findings = [(f["kind"], f["ranks"]) for f in docs["scale"]["findings"]]
    del docs
    gc.collect()
    tracemalloc.start()
    diagnose(pats)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return {"ranks": n, "generate_s": gen_s, "diagnose_wall_s": wall, "diagnose_cpu_s": cpu_s,
            "diagnose_peak_traced_mb": peak, "maxrss_before_diagnose_mb": rss_before, "maxrss_after_mb": rss_after,
            "findings": findings, "straggler_found": ("compute_straggler", [n // 3]) in [tuple(f) for f in findings]}


def bench_analyzer(ctx: Context) -> tuple[list[Row], dict]:
    sizes = [1_000] if ctx.quick else [1_000, 10_000, 100_000]
    cpu = max(os.sched_getaffinity(0))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results, rows = [], []
    for n in sizes:
        out = subprocess.run([sys.executable, __file__, "--analyzer-worker", str(n), "--cpu", str(cpu)], env=env,
                             capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise BenchError(f"analyzer worker for {n} ranks failed:\n{out.stderr[-2000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(r)
        log(f"analyzer: {n:,} ranks: diagnose {r['diagnose_cpu_s']:.2f} s CPU ({r['diagnose_wall_s']:.2f} s wall), peak +{r['diagnose_peak_traced_mb']:.0f} MB"
            f" traced, max RSS {r['maxrss_after_mb']:.0f} MB, findings {r['findings']}")
        if not r["straggler_found"]:
            raise BenchError(f"{n} ranks: diagnose did not name the injected straggler: {r['findings']}")
        limit = 5.0 if n == 100_000 else None
        rows.append(row("analyzer", f"diagnose() CPU time, {n:,} ranks, one core", r["diagnose_cpu_s"], "s", limit))
        rows.append(row("analyzer", f"diagnose() peak memory, {n:,} ranks (tracemalloc)",
                        r["diagnose_peak_traced_mb"], "MB"))
    return rows, {"cpu": cpu, "sizes": results,
                  "method": "synthetic patterns (one compute straggler) built in a subprocess pinned to one CPU; "
                            "diagnose() timed (CPU time of the process: immune to other tasks on that CPU; wall "
                            "time in the details), then run again under tracemalloc for its peak allocation; "
                            "max RSS includes the patterns themselves"}


# ------------------------------------------------------------------------------------------------ 1a: torch

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


def bench_torch(ctx: Context) -> tuple[list[Row], dict]:
    """The real torch DDP job: a fresh 4-rank job per phase; the agent attaches to the running ranks; step times
    from the ranks' own reports over the same interval of each phase (from SETTLE s after the first steps)."""
    ranks = 4
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

    series = slowdown_series("torch", 1 if ctx.quick else 3, phase)
    details = {"ranks": ranks, "levels": series, "settle_s": settle, "measured_s": measure,
               "agent": "rankscope agent --pid --detail LEVEL (window 5 s)",
               "method": "tests/torch_ddp_train.py (gloo, CPU) under torchrun; the agent attaches to the running "
                         "ranks; steps starting in the same interval of each phase, from the ranks' own reports"}
    return slowdown_rows("torch", f"torch DDP job ({ranks} ranks)", series), details


BENCHES: dict[str, Callable[[Context], tuple[list[Row], dict]]] = {
    "job": bench_job, "launch": bench_launch, "sched": bench_sched, "agent": bench_agent,
    "payload": bench_payload, "latency": bench_latency, "analyzer": bench_analyzer,
}
if TORCH_SCRIPT.exists():  # the real job (1a), once tests/torch_ddp_train.py exists
    BENCHES = {"torch": bench_torch, **BENCHES}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default all): {', '.join(BENCHES)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test; the figures mean nothing)")
    parser.add_argument("--json", default="bench-results.json", metavar="PATH",
                        help="where to write the results (default bench-results.json)")
    parser.add_argument("--analyzer-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.analyzer_worker is not None:
        print(json.dumps(analyzer_worker(args.analyzer_worker, args.cpu)))
        return 0
    unknown = [n for n in args.names if n not in BENCHES]
    if unknown:
        if "torch" in unknown and not TORCH_SCRIPT.exists():
            parser.error(f"torch: {TORCH_SCRIPT} does not exist yet")
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    if os.geteuid() != 0:
        parser.error("must run as root (eBPF probes)")
    names = args.names or list(BENCHES)

    tmp = Path(tempfile.mkdtemp(prefix="rankscope-bench-"))
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")  # private stand-ins: nobody else's probes on them
    ctx = Context(args.quick, tmp)
    doc: dict[str, Any] = {"machine": machine(), "quick": args.quick, "started": time.time(), "results": {}}
    rows: list[Row] = []
    failed = []
    try:
        for name in names:
            log(f"{name}: running")
            t = time.monotonic()
            try:
                got, details = BENCHES[name](ctx)
            except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
                log(f"{name}: FAILED: {e}")
                failed.append(name)
                got, details = [Row(name, "error", None, "", "", False)], {"error": f"{type(e).__name__}: {e}"}
            details["seconds"] = time.monotonic() - t
            rows += got
            doc["results"][name] = {"rows": [asdict(r) for r in got], "details": details}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    print(table(rows), flush=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    log(f"results written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
