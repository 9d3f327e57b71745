"""latency (5): seconds from a fault's onset to the first /v1/diagnosis naming the faulty rank."""
from __future__ import annotations

import time

from .harness import AgentProc, BenchError, Context, Row, log, median, row, start_held_job


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


def run(ctx: Context) -> tuple[list[Row], dict]:
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
