"""busy (#19): the agent on a busy node: 64 watched processes issuing ~100,000 probed calls a second in total,
time-paced so that the load generator does not saturate the machine. The agent's own CPU (utime + stime of its
process) and the kernel time of its BPF programs (kernel.bpf_stats_enabled: run_time_ns of each program the
agent holds) are separate figures; memory at the start and end; every window served and every launch counted,
drops read from the agent's /metrics."""
from __future__ import annotations

import os
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from rankscope.sim.harness import wait_until

from .harness import AgentProc, BenchError, Context, Row, Storm, cpu_ticks_s, expect_armed, log, row, status_kb

BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
PROG_TYPES = {"2": "kprobe (uprobes)", "5": "tracepoint", "7": "perf_event (Python sampler)",
              "17": "raw_tracepoint", "26": "tracing"}  # enum bpf_prog_type
MSGPACK = "application/msgpack"


class BpfStats:
    """Turns kernel.bpf_stats_enabled on for its block (it costs every BPF program on the machine two clock
    reads a run) and puts the old value back."""

    def __enter__(self) -> BpfStats:
        self.old = BPF_STATS.read_text().strip()
        BPF_STATS.write_text("1")
        return self

    def __exit__(self, *exc) -> None:
        BPF_STATS.write_text(self.old)


def bpf_programs(pid: int) -> dict[str, dict[str, int]]:
    """prog_id -> {type, run_time_ns, run_cnt} of every BPF program `pid` holds a file descriptor to."""
    progs = {}
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if "prog_id" in info and "run_time_ns" in info:
            progs[info["prog_id"].strip()] = {"type": int(info["prog_type"]), "run_time_ns": int(info["run_time_ns"]),
                                              "run_cnt": int(info["run_cnt"])}
    return progs


def bpf_by_type(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Kernel ns and runs between two readings, summed by program type."""
    out: dict[str, dict[str, int]] = {}
    for pid, a in after.items():
        b = before.get(pid, {"run_time_ns": 0, "run_cnt": 0})
        kind = PROG_TYPES.get(str(a["type"]), f"type {a['type']}")
        t = out.setdefault(kind, {"run_time_ns": 0, "run_cnt": 0, "programs": 0})
        t["run_time_ns"] += a["run_time_ns"] - b["run_time_ns"]
        t["run_cnt"] += a["run_cnt"] - b["run_cnt"]
        t["programs"] += 1
    return out


def health(agent: AgentProc) -> tuple[int, dict[str, int]]:
    """(windows closed, drops by kind) from the agent's /metrics."""
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    windows = int(families["rankscope_windows"].samples[0].value)
    drops = {s.labels["kind"]: int(s.value) for s in families["rankscope_probe_drops"].samples
             if s.name.endswith("_total")}
    return windows, drops


def launches(agent: AgentProc, pids: set[int]) -> tuple[float, float, int, int]:
    """The last window's (start, end, processes of `pids` with a pattern, cuLaunchKernel calls counted),
    pulled as the cluster analyzer pulls it (msgpack)."""
    from rankscope.schema.wire import decode_patterns

    req = urllib.request.Request(agent.url + "/v1/patterns", headers={"Accept": MSGPACK})
    with urllib.request.urlopen(req, timeout=10) as r:
        patterns = [p for p in decode_patterns(r.read()) if p.pid in pids]
    counted = sum(f.count for p in patterns for name, f in p.functions.items() if name == "cuLaunchKernel")
    return (min((p.window_start for p in patterns), default=0.0), max((p.window_end for p in patterns), default=0.0),
            len(patterns), counted)


def lost_windows(pulled: list[tuple[float, float, int, int]], skipped: int) -> int:
    """Windows whose patterns were not pulled: closed between two pulls, or a gap in time between two pulled
    windows (the agent's windows follow each other end to start)."""
    gaps = sum(b[0] - a[1] > 1e-3 for a, b in zip(pulled, pulled[1:]))
    return skipped + gaps


def run(ctx: Context) -> tuple[list[Row], dict]:
    procs = 4 if ctx.quick else 64
    rate = 1_000 if ctx.quick else 1_600  # launches/s per process (a multiple of the 100 bursts/s): 102,400 in all
    seconds = 3 if ctx.quick else 120
    window = 1.0 if ctx.quick else 5.0
    lib = str(ctx.libs / "libcuda.so.1")
    with ExitStack() as stack:
        storms = [stack.enter_context(Storm(ctx, "launch", lib)) for _ in range(procs)]
        pids = [s.pids[0] for s in storms]
        agent = stack.enter_context(AgentProc(ctx, pids, window, detail="deep"))  # launches probed: deep mode
        wait_until(lambda: health(agent)[0] >= 1, window * 4 + 60, "the first window", interval=0.2)
        expect_armed(pids, "libcuda.so.1", "cuLaunchKernel", True)
        stack.enter_context(BpfStats())
        windows0, drops0 = health(agent)
        seen, skipped, pulled = windows0, 0, []  # windows whose patterns were pulled: (start, end, processes, launches)
        rss_kb = []  # the agent's RSS at each pull
        rss0, bpf0, ticks0, t0 = status_kb(agent.pid, "VmRSS"), bpf_programs(agent.pid), cpu_ticks_s(agent.pid), \
            time.monotonic()
        for s in storms:
            s.send("paced", rate, seconds)

        def pull_new() -> bool:
            """Pull the patterns of a window that closed since the last pull; whether one did."""
            nonlocal seen, skipped
            windows, _ = health(agent)
            if windows == seen:
                return False
            skipped += windows - seen - 1
            seen = windows
            pulled.append(launches(agent, set(pids)))
            rss_kb.append(status_kb(agent.pid, "VmRSS"))
            return True

        while time.monotonic() - t0 < seconds:
            pull_new()
            time.sleep(window / 2)  # a scrape of /metrics costs the agent CPU too: twice a window, not more
        storm_cpu_ns = sum(s.reply()[1] for s in storms)
        wall, done = time.monotonic() - t0, time.time()
        ticks, bpf1, rss1 = cpu_ticks_s(agent.pid) - ticks0, bpf_programs(agent.pid), status_kb(agent.pid, "VmRSS")
        windows1, drops1 = health(agent)
        wait_until(lambda: pull_new() and pulled[-1][1] >= done, window * 4 + 30, "the window after the last launch",
                   interval=0.1)
        hwm = status_kb(agent.pid, "VmHWM")
    issued = procs * rate * seconds
    counted = sum(p[3] for p in pulled)
    served = windows1 - windows0
    lost = lost_windows(pulled, skipped)
    spacing = (pulled[-1][1] - pulled[0][1]) / max(1, len(pulled) - 1)  # the window plus the agent's work on it
    short = [p[2] for p in pulled if p[2] != procs]
    half = rss_kb[len(rss_kb) // 2]
    bpf = bpf_by_type(bpf0, bpf1)
    bpf_ns = sum(t["run_time_ns"] for t in bpf.values())
    drops = {k: drops1.get(k, 0) - drops0.get(k, 0) for k in drops1}
    log(f"busy: {served} windows in {wall:.1f} s, {counted:,} of {issued:,} launches counted, drops {drops}")
    if short:
        raise BenchError(f"windows with patterns of fewer than {procs} processes: {short}")
    details = {"processes": procs, "launches_per_s_each": rate, "seconds": seconds, "window_s": window,
               "wall_s": wall, "launches_issued": issued, "launches_counted": counted, "windows_pulled": pulled,
               "windows_served": served, "windows_lost": lost, "drops": drops,
               "agent_cpu_s": ticks, "bpf_by_type": bpf, "load_generator_cpu_s": storm_cpu_ns / 1e9,
               "rss_kb_start_end": [rss0, rss1], "rss_kb_by_window": rss_kb, "vm_hwm_kb": hwm,
               "method": "agent CPU: utime+stime of its process (/proc/PID/stat) over the paced phase; BPF: "
                         "run_time_ns of the programs in the agent's fdinfo with kernel.bpf_stats_enabled (the "
                         "uprobe trap itself is charged to the launching process, not here); launches counted: "
                         "cuLaunchKernel counts of each window's patterns pulled as msgpack, as the cluster "
                         "analyzer pulls them, plus the window after the last launch"}
    what = f"{procs} processes, {procs * rate:,} launches/s"
    return [
        row("busy", f"agent process CPU (utime+stime), share of one core ({what}, deep mode)",
            ticks / wall * 100, "%", 1.0),
        row("busy", "BPF programs' kernel time (run_time_ns), share of one core", bpf_ns / 1e9 / wall * 100, "%",
            note=", ".join(f"{k} {v['run_time_ns'] / wall / 1e7:.2f}% ({v['run_cnt'] / wall:,.0f}/s)"
                           for k, v in bpf.items())),
        row("busy", "load generator CPU incl. uprobe traps, share of one core", storm_cpu_ns / 1e9 / wall * 100, "%"),
        row("busy", "agent RSS growth over the second half of the paced phase", (rss1 - half) / 1024, "MB", 1,
            f"start {rss0 / 1024:.1f}, half-way {half / 1024:.1f}, end {rss1 / 1024:.1f} MB; peak {hwm / 1024:.0f} MB"),
        row("busy", "windows lost (not pulled, or a gap between windows)", lost, "", 0,
            f"{served} closed in {wall:.0f} s, {len(pulled)} pulled, one each {spacing:.2f} s"),
        row("busy", "launches not counted", issued - counted, "", 0, f"{counted:,} of {issued:,}"),
        row("busy", "drops reported by the agent (/metrics)", sum(drops.values()), "",
            note=", ".join(f"{k} {v}" for k, v in drops.items())),
    ], details
