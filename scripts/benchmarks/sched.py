"""sched (2): ns the agent's scheduler tracepoints add per context switch, the storm not watched and watched."""
from __future__ import annotations

import os

from .harness import BenchError, Context, Row, Storm, cpu_ns, log, median, row


# No-op programs on the same scheduler events: the floor of a classic tracepoint (what bcc's TRACEPOINT_PROBE
# uses: the kernel formats the event's record before the program runs) and of a raw tracepoint.
NOOP_SCHED = """
int noop_tp(void *ctx) { return 0; }
int noop_raw(void *ctx) { return 0; }
"""
SCHED_EVENTS = ("sched_switch", "sched_wakeup", "sched_wakeup_new")
SCHED_STATES = ("none", "noop_tp", "noop_raw", "loaded", "watched")


def run(ctx: Context) -> tuple[list[Row], dict]:
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
