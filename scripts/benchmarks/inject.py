"""inject: how long `--inject-shim` holds a thread of the process it loads the CUPTI shim into (ptrace
interrupt, dlopen of the shim, its late-attach entry point, registers put back, release), over fresh Python
processes: ones computing in the interpreter (the thread is taken where it stands) and ones sleeping in a
system call (taken there, the call restarted)."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys

from rankscope.agent.inject.inject import inject
from rankscope.agent.inject.shim import ENTRY
from rankscope.cupti_shim.cuda_lines import LINES

from .harness import BenchError, Context, Row, row

TARGETS = {
    "computing": "print('ready', flush=True)\nn = 0\nwhile True:\n    n += sum(range(1000))\n",
    "sleeping": "import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.001)\n",
}
LIMIT_MS = 10.0  # the aim for the stop


def _shim(ctx: Context) -> str:
    """The newest line's shim, built with the caller's cache (its wheels), copied into the run's folder."""
    env = {**os.environ, "XDG_CACHE_HOME": ctx.shared_cache} if ctx.shared_cache else {
        k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    built = subprocess.run([sys.executable, "-m", "rankscope.cupti_shim.build", str(LINES[-1].major)], env=env,
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise BenchError(f"cannot build the shim: {built.stderr[-2000:]}")
    folder = ctx.tmp / "shim"
    folder.mkdir(exist_ok=True)
    return shutil.copy(built.stdout.strip(), folder)


def _held_s(script: str, shim: str) -> tuple[float, int]:
    """(seconds the thread was held, tries) for one fresh process."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise BenchError("the target process did not start")
        done = inject(proc.pid, shim, ENTRY)
        if not done.loaded or done.result != 0 or proc.poll() is not None:
            raise BenchError(f"injection into pid {proc.pid} did not complete: {done}")
        return done.stop_s, done.tries
    finally:
        proc.kill()
        proc.wait()


def run(ctx: Context) -> tuple[list[Row], dict]:
    count = 2 if ctx.quick else 20
    shim = _shim(ctx)
    held: dict[str, list[float]] = {}
    tries: dict[str, list[int]] = {}
    for name, script in TARGETS.items():
        results = [_held_s(script, shim) for _ in range(count)]
        held[name] = [s for s, _ in results]
        tries[name] = [t for _, t in results]
    rows = []
    for name, seconds in held.items():
        ms = [s * 1e3 for s in seconds]
        rows.append(row("inject", f"thread held loading the shim, {name} Python process, median of {count}",
                        statistics.median(ms), "ms", LIMIT_MS))
        rows.append(row("inject", f"the same, worst of {count}", max(ms), "ms", LIMIT_MS,
                        note=f"{max(tries[name])} tries at most"))
    details = {"held_s": held, "tries": tries, "loadavg": os.getloadavg(),
               "method": "fresh `python -c` processes; inject(pid, shim, rankscope_shim_attach): perf_counter from "
                         "the ptrace interrupt to the release (dlopen, the entry point, registers put back)"}
    return rows, details
