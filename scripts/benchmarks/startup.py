"""startup (#19): what starting the agent costs a CPU-bound job on a busy node. A 2-rank torch DDP job
(tests/torch_ddp_train.py, gloo: both vCPUs busy) runs throughout; its step time over the first WINDOW s after
`rankscope agent --pid` starts is compared with the step time over the WINDOW s just before (no agent), for the
node's first agent (compiling its BPF programs with bcc) and for a later one (its programs from the node's
cache, loader/bpf_cache.py). Also the agent's own CPU seconds over that interval. One job; phases A B A C ..."""
from __future__ import annotations

import time

from .harness import AgentProc, Context, Row, cpu_ns, log, median, row, spread
from .torch_job import TorchJob, median_step

MODES = {"compiling": "an agent compiling its programs (a node's first)",
         "cached": "an agent loading them from the node's cache"}


def _phase(ctx: Context, job: TorchJob, pids: list[int], window: float, cache=None) -> dict[str, float]:
    """The job's median step over `window` s from now; with `cache`, an agent started now, kept there."""
    start = time.time()
    agent = AgentProc(ctx, pids, window=5.0, bpf_cache=cache) if cache else None
    try:
        time.sleep(max(0.0, start + window - time.time()))
        agent_cpu_s = cpu_ns(agent.pid) / 1e9 if agent else 0.0
    finally:
        if agent:
            agent.stop()  # its detach falls after the interval, and before the next phase
    return {"step_s": median_step(job.steps_within(start, start + window)), "agent_cpu_s": agent_cpu_s}


def run(ctx: Context) -> tuple[list[Row], dict]:
    window = 3.0 if ctx.quick else 10.0
    rounds = 1 if ctx.quick else 3
    warm = ctx.tmp / "startup-bpf-cache"
    job = TorchJob(ctx, 2)
    measured: dict[str, list[tuple[dict, dict]]] = {mode: [] for mode in MODES}
    try:
        pids = job.pids()
        AgentProc(ctx, pids, window=5.0, bpf_cache=warm).stop()  # fills the cache; also the job's settling time
        for i in range(rounds):
            for mode in MODES:
                before = _phase(ctx, job, pids, window)
                cache = ctx.tmp / f"startup-bpf-cache-empty-{i}" if mode == "compiling" else warm
                after = _phase(ctx, job, pids, window, cache)
                measured[mode].append((before, after))
                log(f"startup: {mode} {i + 1}/{rounds}: step {before['step_s'] * 1e3:.2f} -> "
                    f"{after['step_s'] * 1e3:.2f} ms, agent CPU {after['agent_cpu_s']:.2f} s")
    finally:
        job.stop()
    rows = []
    for mode, what in MODES.items():
        slowdowns = [(a["step_s"] / b["step_s"] - 1) * 100 for b, a in measured[mode]]
        rows += [row("startup", f"2-rank torch job's step-time slowdown, first {window:g} s of {what}",
                     median(slowdowns), "%", note=spread(slowdowns)),
                 row("startup", f"agent CPU seconds, first {window:g} s of {what}",
                     median([a["agent_cpu_s"] for _, a in measured[mode]]), "s")]
    rows.append(row("startup", "2-rank torch job's median step without agent",
                    median([b["step_s"] for pairs in measured.values() for b, _ in pairs]) * 1e3, "ms"))
    return rows, {"window_s": window, "rounds": rounds, "phases": measured,
                  "method": "one 2-rank torch job (tests/torch_ddp_train.py) throughout; each mode's phase is the "
                            "job's median step over the window after the agent starts, against the window before"}
