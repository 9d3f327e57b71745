"""analyzer (6): diagnose() time and peak memory for 1,000 / 10,000 / 100,000 synthetic ranks on one core.

    python -m benchmarks.analyzer N CPU     (from scripts/: one worker, what run() starts for each size)
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from .harness import SCRIPTS, BenchError, Context, Row, log, row


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

    from rankscope.agent.service.collector import WindowCollector
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
    # A running cluster analyzer's every later window: warm, the collector paused as it pauses it.
    with WindowCollector(full_every=1 << 30).paused():
        c = time.process_time()
        diagnose(pats)
        steady_cpu_s = time.process_time() - c
    tracemalloc.start()
    diagnose(pats)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return {"ranks": n, "generate_s": gen_s, "diagnose_wall_s": wall, "diagnose_cpu_s": cpu_s,
            "steady_diagnose_cpu_s": steady_cpu_s,
            "diagnose_peak_traced_mb": peak, "maxrss_before_diagnose_mb": rss_before, "maxrss_after_mb": rss_after,
            "findings": findings, "straggler_found": ("compute_straggler", [n // 3]) in [tuple(f) for f in findings]}


def run(ctx: Context) -> tuple[list[Row], dict]:
    sizes = [1_000] if ctx.quick else [1_000, 10_000, 100_000]
    cpu = max(os.sched_getaffinity(0))
    # The worker is this module run with -m: scripts/ (where the package lies) goes first on its path.
    path = [str(SCRIPTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(path))
    results, rows = [], []
    for n in sizes:
        out = subprocess.run([sys.executable, "-m", "benchmarks.analyzer", str(n), str(cpu)], env=env,
                             capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise BenchError(f"analyzer worker for {n} ranks failed:\n{out.stderr[-2000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(r)
        log(f"analyzer: {n:,} ranks: diagnose {r['diagnose_cpu_s']:.2f} s CPU ({r['diagnose_wall_s']:.2f} s wall), "
            f"a running analyzer's window {r['steady_diagnose_cpu_s']:.2f} s, peak +{r['diagnose_peak_traced_mb']:.0f} MB"
            f" traced, max RSS {r['maxrss_after_mb']:.0f} MB, findings {r['findings']}")
        if not r["straggler_found"]:
            raise BenchError(f"{n} ranks: diagnose did not name the injected straggler: {r['findings']}")
        limit = 1.0 if n == 100_000 else None  # #19
        rows.append(row("analyzer", f"diagnose() CPU time, {n:,} ranks, one core: a running analyzer's window",
                        r["steady_diagnose_cpu_s"], "s", limit))
        rows.append(row("analyzer", f"diagnose() CPU time, {n:,} ranks, one core: a process's first call",
                        r["diagnose_cpu_s"], "s"))
        rows.append(row("analyzer", f"diagnose() peak memory, {n:,} ranks (tracemalloc)",
                        r["diagnose_peak_traced_mb"], "MB"))
    return rows, {"cpu": cpu, "sizes": results,
                  "method": "synthetic patterns (one compute straggler) built in a subprocess pinned to one CPU; "
                            "diagnose() timed (CPU time of the process: immune to other tasks on that CPU; wall "
                            "time in the details), its first call and a later one with the garbage collector "
                            "paused as the cluster analyzer pauses it (agent/service/collector.py), then run "
                            "again under tracemalloc for its peak allocation; "
                            "max RSS includes the patterns themselves"}


if __name__ == "__main__":
    print(json.dumps(analyzer_worker(int(sys.argv[1]), int(sys.argv[2]))))
