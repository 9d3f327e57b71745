"""launch (1c): what a probed cuLaunchKernel costs, and the slowdown of a launcher at 100,000 launches/s."""
from __future__ import annotations

from typing import Any

from .harness import (DETAILS, Context, Row, Storm, abba, expect_armed, log, median, pair_diffs, pair_ratios, row,
                      spread)


RATE = 100_000  # launches/s of the paced launcher


def run(ctx: Context) -> tuple[list[Row], dict]:
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
