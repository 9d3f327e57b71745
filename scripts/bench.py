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
  agent     the agent's own CPU share of one core and peak RSS while watching 8 ranks: the node's first agent
            (compiling its BPF programs) and a later one (its programs from the node's cache)
  detach    seconds a session's close() takes on one rank in deep detail, uprobes as uprobe_multi links against
            perf events (the older kernels' way), alternating in one run
  payload   msgpack bytes per rank per window of real patterns of the simulated job
  latency   seconds from a fault's onset (slow-gpu:1:2@3) to the first /v1/diagnosis naming rank 1
  analyzer  diagnose() time and peak memory for 1,000 / 10,000 / 100,000 synthetic ranks on one core
  inject    how long loading the CUPTI shim into a running process (--inject-shim) holds its thread: 20
            fresh Python processes computing, 20 sleeping; median and worst
  trace     step time of the simulated 4-rank GPU job while a trace capture (GET /v1/trace) runs against
            without one, the agent attached in both, light and deep mode; the captures' events and bytes a second
  cluster   the cluster analyzer pulling 12,500 simulated agents of 8 ranks (100 jobs of 1,000 ranks) over
            loopback each 5 s window and diagnosing them: CPU per window (pull, diagnose), RSS; one analyzer
            and 3 replicas sharing the jobs
  busy      a busy node: 64 watched processes issuing 102,400 probed cuLaunchKernel a second in all, time-paced
            (bursts every 10 ms), for 2 minutes, the agent in deep mode: the agent process's CPU share of one
            core and, apart, its BPF programs' kernel time (kernel.bpf_stats_enabled, on for the run only);
            RSS at start and end, windows served, launches counted, drops reported in /metrics
  shim      handing CUPTI's records to the agent (the real shim and libcupti, fed kernel records by
            tests/cupti_driver.c): ns per record on CUPTI's buffer thread, uprobe traps per record and records
            lost, one trap per record against one per batch
  attach    a one-shot command on a 2-rank job, from the command to its exit (wall, CPU, peak RSS; and the
            seconds to its window): `diagnose --duration 1` attaching itself (compiling its programs, or finding
            them in the node's cache) and through the node agent (`--agent`); `profile`, `trace`, `dump`
  torch     step time of the real torch DDP job (tests/torch_ddp_train.py, gloo on CPU, 4 ranks under torchrun)
            with the agent attached to its running ranks, light and deep mode; listed only when that script exists
  startup   step time of a 2-rank torch DDP job (both CPUs busy) over the first seconds after the agent starts,
            against the seconds before: the node's first agent (compiling) and a later one (programs cached)

--quick runs every benchmark at a tiny size (the smoke test); its figures mean nothing.
The stand-in libraries are built into a private folder, so that probes other agents on the machine put on
the shared build never touch the benchmark's processes (checked: the first instruction byte of a probed
function is read from the process's memory before every phase, 0xCC exactly when the agent is attached).
torch's libtorch_cpu.so cannot be made private: on a shared machine, run the torch benchmark alone.

This file is the command line. Each benchmark is a module of scripts/benchmarks/ whose run(ctx) gives its rows
and details; what they share (rows, the context, the agent and the load generator as subprocesses, the A/B
statistics, the table) is scripts/benchmarks/harness.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import (agent, analyzer, attach, busy, cluster, detach, inject, job, latency, launch, payload,
                        sched, shim, startup, torch_job, trace)
from benchmarks.harness import Context, Row, log, machine, table

BENCHES: dict[str, Callable[[Context], tuple[list[Row], dict]]] = {
    "job": job.run, "launch": launch.run, "sched": sched.run, "agent": agent.run, "detach": detach.run,
    "payload": payload.run, "latency": latency.run, "analyzer": analyzer.run, "inject": inject.run,
    "trace": trace.run, "cluster": cluster.run, "busy": busy.run, "attach": attach.run, "shim": shim.run,
}
if torch_job.TORCH_SCRIPT.exists():  # the real job (1a), once tests/torch_ddp_train.py exists
    BENCHES = {"torch": torch_job.run, **BENCHES, "startup": startup.run}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default all): {', '.join(BENCHES)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test; the figures mean nothing)")
    parser.add_argument("--json", default="bench-results.json", metavar="PATH",
                        help="where to write the results (default bench-results.json)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHES]
    if unknown:
        if "torch" in unknown and not torch_job.TORCH_SCRIPT.exists():
            parser.error(f"torch: {torch_job.TORCH_SCRIPT} does not exist yet")
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    if os.geteuid() != 0:
        parser.error("must run as root (eBPF probes)")
    names = args.names or list(BENCHES)

    tmp = Path(tempfile.mkdtemp(prefix="rankscope-bench-"))
    shared_cache = os.environ.get("XDG_CACHE_HOME", "")  # NVIDIA's wheels (the shims' headers): downloaded once
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")  # private stand-ins: nobody else's probes on them
    # Compiled BPF programs (loader/bpf_cache.py): the run's own, so the first benchmark to attach compiles, as
    # on a fresh node, whatever the machine's cache holds. `agent` and `attach` measure both ways themselves.
    os.environ["RANKSCOPE_BPF_CACHE"] = str(tmp / "bpf-cache")
    ctx = Context(args.quick, tmp, shared_cache)
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
