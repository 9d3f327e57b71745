"""shim: what handing CUPTI's records to the agent costs, one uprobe trap per record against one per batch.

The real shim of the newest CUDA line, with its real libcupti, fed buffers of kernel records by
tests/cupti_driver.c (no GPU needed: the buffer path is the one CUPTI's buffer thread runs in a job). Per
hand-over: CPU ns per record on that thread (trap and BPF program included, the shim alone subtracted),
traps per record, records lost (given to the shim, not counted by the agent), at free-running rate. The
per-record hand-over's rate limit is lifted so that every record is paid for (at its default, 50,000/s, the
records over it are dropped)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rankscope.agent.sources.probes.cupti import KERNEL_KINDS, CuptiReader

from .harness import BenchError, Context, Row, cpu_ns, log, median, row

DRIVER_SOURCE = Path(__file__).resolve().parents[2] / "tests" / "cupti_driver.c"
RECORDS_PER_BUFFER = 1000
LAUNCH_BOUND_RATE = 10_000  # kernel records/s of a launch-bound step (~2 ms steps of ~20 kernels)
DROPPED, HANDOVERS = 1, 7  # in the driver's counters line
MODES = ("off", "per-record", "batches")  # no agent; the agent's reader with batches=False; with batches


def _line_files(ctx: Context) -> dict:
    """The newest line's shim, headers and libcupti, resolved with the caller's cache (its wheels)."""
    env = {**os.environ, "XDG_CACHE_HOME": ctx.shared_cache} if ctx.shared_cache else {
        k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    code = ("import json; from rankscope.cupti_shim.build import build_shim; from rankscope.cupti_shim.cuda_lines "
            "import LINES; l = LINES[-1]; print(json.dumps({'shim': str(build_shim(l.major)), "
            "'includes': [str(d) for d in l.include_dirs()], 'libcupti': str(l.libcupti())}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchError(f"cannot build the shim: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


class _Driver:
    """tests/cupti_driver.c holding the shim; `many N` processes one buffer of N kernel records."""

    def __init__(self, binary: Path, files: dict):
        self.proc = subprocess.Popen([str(binary), files["shim"]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "RANKSCOPE_CUPTI_LIB": files["libcupti"],
                                          "RANKSCOPE_SHIM_MAX_RATE": str(10**12)})
        self.proc.stdout.readline()

    def many(self, n: int) -> list[int]:
        """The shim's counters after one buffer: emitted, dropped, ..., handovers (cupti_driver.c)."""
        self.proc.stdin.write(f"many {n}\n")
        self.proc.stdin.flush()
        return [int(w) for w in self.proc.stdout.readline().split()[1:]]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def _measure(binary: Path, files: dict, mode: str, buffers: int) -> dict:
    driver = _Driver(binary, files)
    reader = None if mode == "off" else CuptiReader(driver.proc.pid, batches=mode == "batches")
    try:
        driver.many(RECORDS_PER_BUFFER)  # warm-up: pages touched, names cached
        before, start = cpu_ns(driver.proc.pid), time.monotonic_ns()
        for _ in range(buffers):
            stats = driver.many(RECORDS_PER_BUFFER)
        cpu, wall = cpu_ns(driver.proc.pid) - before, time.monotonic_ns() - start
        counted = sum(a.count for a in reader.activity() if a.kind in KERNEL_KINDS) if reader else 0
        lost_reported = reader.lost() if reader else 0
    finally:
        if reader:
            reader.close()
        driver.close()
    records = (buffers + 1) * RECORDS_PER_BUFFER  # the warm-up's too: the agent counted since attach
    return {"cpu_ns_per_record": cpu / (buffers * RECORDS_PER_BUFFER),
            "records_per_s": buffers * RECORDS_PER_BUFFER / (wall / 1e9),
            "traps_per_record": stats[HANDOVERS] / records,  # the counters run from the driver's start
            "lost": records - counted if reader else None, "dropped_by_shim": stats[DROPPED],
            "lost_reported": lost_reported}


def run(ctx: Context) -> tuple[list[Row], dict]:
    files = _line_files(ctx)
    binary = ctx.tmp / "cupti_driver"
    built = subprocess.run(["gcc", "-O1", "-Wall", "-o", str(binary), str(DRIVER_SOURCE),
                            *(f"-I{d}" for d in files["includes"]), "-ldl"], capture_output=True, text=True)
    if built.returncode != 0:
        raise BenchError(f"compiling {DRIVER_SOURCE.name} failed:\n{built.stderr}")
    buffers, repeats = (5, 1) if ctx.quick else (200, 3)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(repeats):
        for mode in MODES:
            runs[mode].append(_measure(binary, files, mode, buffers))
            r = runs[mode][-1]
            log(f"shim: {mode}: {r['cpu_ns_per_record']:.0f} ns/record, {r['traps_per_record']:.3f} traps/record, "
                f"{r['records_per_s']:,.0f} records/s, lost {r['lost']}")
    shim_ns = median(r["cpu_ns_per_record"] for r in runs["off"])
    rows: list[Row] = []
    details = {"records_per_buffer": RECORDS_PER_BUFFER, "buffers": buffers, "runs": runs,
               "note": "CPU of the thread processing the buffers (CUPTI's buffer thread in a job); added = "
                       "the mode's ns per record less the shim's without an agent"}
    for mode in MODES[1:]:
        added = median(r["cpu_ns_per_record"] for r in runs[mode]) - shim_ns
        traps = median(r["traps_per_record"] for r in runs[mode])
        lost = max(r["lost"] for r in runs[mode])
        rows += [row("shim", f"{mode}: ns per record handed over", added, "ns"),
                 row("shim", f"{mode}: traps/s at {LAUNCH_BOUND_RATE:,} kernels/s", traps * LAUNCH_BOUND_RATE, "/s"),
                 row("shim", f"{mode}: CPU at {LAUNCH_BOUND_RATE:,} kernels/s", added * LAUNCH_BOUND_RATE / 1e7,
                     "% of a core"),
                 row("shim", f"{mode}: records lost", lost, "records", limit=0.0 if mode == "batches"
                     else None, note=f"{median(r['records_per_s'] for r in runs[mode]):,.0f} records/s")]
    return rows, details
